"""The fp16 triangular solve (unit-norm keys, sigmoid betas, bounded decays): as accurate
as the tf32 solve against the float64 reference, also where L's entries are largest."""
from __future__ import annotations

import pytest
import torch

from kernels.triton_kernels import config
from triton_cases import Case, make_inputs, reference, reference_errors, rel_err, run_triton

CASE = Case((130, 70, 200), gate="lower_bound", dtype=torch.bfloat16)


def _errors(device: str, monkeypatch: pytest.MonkeyPatch, fp16_solve: bool, same_keys: bool) -> dict[str, float]:
    monkeypatch.setattr(config, "FP16_SOLVE", fp16_solve)
    inp = make_inputs(CASE, device, seed=21)
    if same_keys:  # every key one vector, betas near 1, decays near 0: |L| entries near 1
        inp.k[:] = inp.k[:, :1]
        inp.beta[:] = 6.0
        inp.gate_kwargs["dt_bias"] = inp.gate_kwargs["dt_bias"] - 20.0
    return reference_errors(CASE, inp)


@pytest.mark.parametrize("same_keys", [False, True])
def test_fp16_solve_as_accurate_as_tf32(device: str, monkeypatch: pytest.MonkeyPatch, same_keys: bool) -> None:
    fast = _errors(device, monkeypatch, True, same_keys)
    exact = _errors(device, monkeypatch, False, same_keys)
    for name in fast:
        assert fast[name] <= 5e-3, (name, fast, exact)
        assert fast[name] <= 1.5 * exact[name] + 2e-4, (name, fast, exact)


@pytest.mark.parametrize("fp16_solve", [True, False], ids=["fp16", "tf32"])
def test_diagonal_block_levels_equal_full_levels(device: str, monkeypatch: pytest.MonkeyPatch,
                                                  fp16_solve: bool) -> None:
    """The solve's first three levels on the [4, 16, 16] diagonal blocks alone give the
    full [64, 64] levels' result, and both meet the reference."""
    monkeypatch.setattr(config, "FP16_SOLVE", fp16_solve)
    outs = {}
    for diag16 in (False, True):
        monkeypatch.setattr(config, "SOLVE_DIAG16", diag16)
        inp = make_inputs(CASE, device, seed=4)
        ref_o, _, _ = reference(inp, CASE)
        o, _ = run_triton(CASE, inp)
        assert rel_err(o[0], ref_o) <= 5e-3
        outs[diag16] = o.float()
    assert rel_err(outs[True], outs[False]) < 1e-4
