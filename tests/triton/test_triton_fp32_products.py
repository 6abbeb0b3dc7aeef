"""fp32 inputs with their products as three tf32 tensor-core products (``tf32x3``,
`LaunchConfig.fp32_products`) against the float64 reference at fp32's tolerance, beside
the full-precision FMA products (``ieee``): every gate, both output paths, GVA, a
sequence-head count that takes the wide state blocks, and head dims that pad. On the GPU
these tell whether tf32x3 keeps fp32 accuracy; the interpreter (no CUDA) computes every
product in fp32 whatever the setting, so there the cases run once, with the default."""
from __future__ import annotations

import pytest
import torch

from kernels.triton_kernels import config
from triton_cases import Case, check_case

CASES = {
    "lower_bound": Case((300, 64, 1, 130), H=4, HV=4, K=64, V=64, gate="lower_bound"),
    "softplus-gva": Case((200, 70), H=1, HV=2, K=32, V=48, gate="softplus"),
    "given-no-sigmoid": Case((150, 41), gate="given", sigmoid=False),
    "real_scale": Case((129, 3), gate="real_scale"),
    "intermediate-k-first": Case((100, 65), gate="softplus", v_first=False, intermediate=True),
}


@pytest.mark.parametrize("products", ["ieee", "tf32x3"] if torch.cuda.is_available() else [config.FP32_PRODUCTS])
@pytest.mark.parametrize("name", list(CASES))
def test_fp32_products_meet_fp32_tolerance(device: str, monkeypatch: pytest.MonkeyPatch, output_path: str,
                                          products: str, name: str) -> None:
    monkeypatch.setattr(config, "FP32_PRODUCTS", products)
    check_case(CASES[name], device, seed=90 + len(name), tol=1e-4)
