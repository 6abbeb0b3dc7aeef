"""`PrefillProblem.input_checks`: the kernels that read the raw inputs anyway (the WY stage
for chunked sequences, the decode kernel for single-token ones) flag a NaN or Inf in q, k,
v, g or beta, and a positive given log decay, as they load them: the check a prepared
prefill reads instead of scanning its inputs in a pass of their own.

One bad value at a random place (token, head, channel) of each input is found through
both paths (chunked and decode in one launch, GVA heads, bf16 inputs); clean inputs set
nothing; a positive log decay fails, while positive raw gate values under a fused gate do
not; checking changes no output bit. The torch backend meets the same contract.

Interpreted on the CPU without CUDA (CI), compiled on a GPU.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from kernels import run_problem
from triton_cases import Case, Inputs, make_inputs, problem_of, same_bits

CASES = {
    "chunked and decode": Case((130, 1, 70, 1), gate="softplus"),
    "GVA, bf16, lower bound": Case((1, 65, 1), H=1, HV=2, gate="lower_bound", dtype=torch.bfloat16),
    "decode only, log decay given": Case((1, 1, 1), gate="given"),
}


INPUTS = ("q", "k", "v", "g", "beta")


def launch(case: Case, inp: Inputs, backend: str, checked: bool = True) -> tuple[int, torch.Tensor]:
    """The input check after one launch of ``inp`` (zero before it; -1 unchecked), and o."""
    device = inp.q.device
    checks = torch.zeros(1, dtype=torch.int32, device=device) if checked else None
    problem = problem_of(case, inp, input_checks=checks)
    o, _ = run_problem(problem, backend)
    return (-1 if checks is None else int(checks)), o


def put(inp: Inputs, name: str, value: float, seed: int, token: Optional[int] = None) -> None:
    """``value`` into input ``name`` at a random place (at ``token`` when given)."""
    t = getattr(inp, name)[0]
    gen = torch.Generator().manual_seed(seed)
    where = [int(torch.randint(n, (1,), generator=gen)) for n in t.shape]
    if token is not None:
        where[0] = token
    t[tuple(where)] = value


def skip_unless(backend: str, device: str) -> None:
    if backend == "torch" and device != "cpu":
        pytest.skip("the torch backend's checks are tested on the CPU")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_clean_inputs_set_no_check(device: str, name: str, backend: str) -> None:
    skip_unless(backend, device)
    check, _ = launch(CASES[name], make_inputs(CASES[name], device, seed=3), backend)
    assert check == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("tensor", INPUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_one_nonfinite_value_in_any_input_fails_the_check(device: str, name: str, tensor: str, value: float,
                                                          backend: str) -> None:
    skip_unless(backend, device)
    case = CASES[name]
    for token, seed in ((0, 11), (sum(case.lengths) - 1, 12), (None, 13)):  # both paths' tokens, and anywhere
        inp = make_inputs(case, device, seed=seed)
        put(inp, tensor, value, seed, token)
        check, _ = launch(case, inp, backend)
        assert check == 1, f"{value} in {tensor} (token {token}) was not flagged"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("token", [0, 40, None])  # a decode token, a chunked one, anywhere
def test_a_positive_log_decay_fails_the_check(device: str, backend: str, token: Optional[int]) -> None:
    skip_unless(backend, device)
    case = Case((1, 90, 1), gate="given")
    inp = make_inputs(case, device, seed=5)
    put(inp, "g", 0.25, seed=1, token=token)
    check, _ = launch(case, inp, backend)
    assert check == 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_positive_raw_gates_are_not_log_decays(device: str, backend: str) -> None:
    skip_unless(backend, device)
    case = Case((1, 90, 1), gate="lower_bound")
    inp = make_inputs(case, device, seed=6)
    inp.g.abs_()  # raw gate values, every one positive: the gate maps them to decays < 0
    check, _ = launch(case, inp, backend)
    assert check == 0


@pytest.mark.parametrize("name", list(CASES))
def test_checking_changes_no_output(device: str, name: str) -> None:
    case = CASES[name]
    results = []
    for checked in (False, True):
        inp = make_inputs(case, device, seed=8)
        o = torch.full_like(inp.v[0], float("nan"))
        _, out = launch(case, inp, "triton", checked)
        o.copy_(out)
        results.append((o, inp.pool))
    assert same_bits(results[0][0], results[1][0]), "o differs when the inputs are checked"
    assert same_bits(results[0][1], results[1][1]), "the final states differ when the inputs are checked"


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("tensor", INPUTS)
def test_both_intra_kernels_check_the_inputs(device: str, monkeypatch: pytest.MonkeyPatch, bounded: bool,
                                             tensor: str) -> None:
    """The bounded gate's intra kernel (`intra_bounded`, bf16 with the lower bound) and the
    general one each find a NaN in a chunked sequence's q, k, g or beta (v: the WY stage)."""
    from kernels.triton_backend import stage_inputs
    from kernels.triton_kernels import config, select_config
    from kernels.triton_kernels.intra_bounded import bounded_intra_applies

    monkeypatch.setattr(config, "BOUNDED_INTRA", bounded)
    case = Case((96, 70), H=1, HV=2, gate="lower_bound", dtype=torch.bfloat16, zero_slot=False)
    inp = make_inputs(case, device, seed=17)
    problem = problem_of(case, inp)
    cfg = select_config(case.K, case.V, interpret=device == "cpu")
    assert cfg.bounded_intra == bounded and bounded_intra_applies(stage_inputs(problem, cfg))
    put(inp, tensor, float("nan"), seed=4, token=100)
    check, _ = launch(case, inp, "triton")
    assert check == 1
