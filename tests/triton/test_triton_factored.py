"""A's k-side decays from block and in-block factors (`intra.chunk_matrices(FACTORED=True)`,
the default) against the pairwise exponents and the float64 reference, on every gate and
input dtype that changes which code runs (SAFE or pairwise diagonal blocks, fp16 or tf32
solve, fp32 products)."""
from __future__ import annotations

import pytest
import torch

from kernels.triton_kernels import config
from triton_cases import Case, check_case, make_inputs, reference_errors

CASES = [
    Case((130, 70, 200), gate="lower_bound", dtype=torch.bfloat16),  # SAFE, fp16 solve
    Case((97, 64, 3), gate="softplus", dtype=torch.float16, H=1, HV=2),  # pairwise diagonals, GVA
    Case((150, 41), gate="given", sigmoid=False),  # fp32 inputs, tf32-free products
]


@pytest.mark.parametrize("case", CASES, ids=["lower_bound-bf16", "softplus-fp16-gva", "given-fp32"])
def test_factored_decays_as_accurate_as_pairwise_exponents(device: str, monkeypatch: pytest.MonkeyPatch,
                                                          case: Case) -> None:
    """A's k side from block and in-block decay factors, on the SAFE path (diagonal blocks in
    the product) and the pairwise one: as close to the float64 reference as the unfactored
    exponents (the two differ only by rounding, which tf32 products then amplify)."""
    errors = {}
    for factored in (False, True):
        monkeypatch.setattr(config, "FACTORED_A", factored)
        errors[factored] = reference_errors(case, make_inputs(case, device, seed=5))
    tol = 1e-4 if case.dtype == torch.float32 else 5e-3
    for fast, exact in zip(errors[True].values(), errors[False].values()):
        assert fast <= tol and fast <= 1.5 * exact + 2e-4, errors


def test_factored_decays_with_real_scale_gates(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gates large enough that in-block suffixes underflow exp (softplus, exp(A_log) up to
    200): the factored path still meets the reference."""
    monkeypatch.setattr(config, "FACTORED_A", True)
    check_case(Case((200, 70), gate="real_scale"), device, seed=11, tol=1e-4)
