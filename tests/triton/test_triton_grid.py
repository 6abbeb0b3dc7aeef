"""The Triton backend against the float64 per-token reference on small shapes.

Runs under the Triton interpreter on CPU (CI) and compiled on a GPU. Every case checks
o fully written, final states of the named pool rows, and that rows no sequence names
(NaN-poisoned) stay bit-identical; see triton_cases.check_case.
"""
from __future__ import annotations

import pytest
import torch

from triton_cases import Case, check_case, make_inputs, reference, rel_err, run_triton

FP32_TOL = 1e-4
BF16_TOL = 1e-2
VARLEN = (1, 5, 64, 70, 130)  # 1 token (decode kernel), < 64, = 64, > 64, > 128


@pytest.mark.parametrize("gate", ["given", "softplus", "lower_bound"])
def test_varlen_gates(device: str, output_path: str, gate: str) -> None:
    check_case(Case(VARLEN, gate=gate), device, seed=1, tol=FP32_TOL)


def test_real_scale_gates(device: str) -> None:
    """exp(A_log) up to 200 and raw gates x3: per-token log decays in the hundreds, chunk
    cumsums far below -88 (naive factoring overflows)."""
    check_case(Case((130, 70), K=32, V=32, gate="real_scale"), device, seed=2, tol=FP32_TOL)


def test_gva(device: str) -> None:
    check_case(Case((70, 1, 33), H=2, HV=4, K=32, V=16, gate="lower_bound"), device, seed=3, tol=FP32_TOL)


@pytest.mark.parametrize("l2norm,sigmoid", [(False, False), (False, True), (True, False)])
def test_l2norm_and_sigmoid_off(device: str, l2norm: bool, sigmoid: bool) -> None:
    check_case(Case((70, 1, 9), gate="given", l2norm=l2norm, sigmoid=sigmoid), device, seed=4, tol=FP32_TOL)


def test_allow_neg_eigval(device: str) -> None:
    check_case(Case((1, 100), neg_eigval=True), device, seed=5, tol=FP32_TOL)


def test_bf16_inputs(device: str, output_path: str) -> None:
    check_case(Case(VARLEN, dtype=torch.bfloat16, gate="lower_bound"), device, seed=6, tol=BF16_TOL)


def test_fp16_inputs(device: str) -> None:
    check_case(Case((1, 70), dtype=torch.float16), device, seed=7, tol=BF16_TOL)


def test_bf16_pool(device: str) -> None:
    check_case(Case((1, 5, 70), pool_dtype=torch.bfloat16), device, seed=8, tol=BF16_TOL)


def test_state_k_first(device: str) -> None:
    check_case(Case((1, 5, 70), v_first=False, K=16, V=32), device, seed=9, tol=FP32_TOL)


@pytest.mark.parametrize("v_first", [True, False])
def test_intermediate_states(device: str, output_path: str, v_first: bool) -> None:
    """h: the state before each chunk, a 1-token sequence counting one chunk (its initial state)."""
    check_case(Case((70, 1, 64, 130), v_first=v_first, intermediate=True), device, seed=10, tol=FP32_TOL)


def test_non_power_of_two_dims(device: str) -> None:
    check_case(Case((1, 70), K=20, V=24), device, seed=11, tol=FP32_TOL)


def test_all_zero_slots_and_decode_only(device: str) -> None:
    check_case(Case((1, 1, 1, 1), extra_slots=1), device, seed=12, tol=FP32_TOL)
    check_case(Case((9, 70), zero_slot=False, extra_slots=0), device, seed=13, tol=FP32_TOL)


def test_continuation(device: str) -> None:
    """One call over 150 tokens == 100 tokens then 50 on the same slot, then a decode step
    (the state crosses call boundaries through the pool only)."""
    case = Case((151,), zero_slot=False)
    whole = make_inputs(case, device, seed=14)
    ref_o, ref_final, _ = reference(whole, case)
    parts = []
    for a, b in ((0, 100), (100, 150), (150, 151)):
        part = make_inputs(Case((b - a,), zero_slot=False), device, seed=14)
        for name in ("q", "k", "v", "g", "beta"):
            setattr(part, name, getattr(whole, name)[:, a:b].contiguous())
        part.pool, part.indices, part.gate_kwargs = whole.pool, whole.indices, whole.gate_kwargs
        parts.append(run_triton(case, part)[0])
    o = torch.cat(parts, dim=1)
    assert rel_err(o[0], ref_o) <= FP32_TOL
    slot = whole.indices.item()
    assert rel_err(whole.pool[slot], ref_final[0]) <= FP32_TOL
