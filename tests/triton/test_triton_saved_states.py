"""`PrefillProblem.saved_states`: a launch copies the pool rows it reads (a launch
transaction's copy) before it writes them. A decode step on the Triton backend stores each
row from the decode kernel as it loads it; a launch with a chunked sequence, and the torch
backend, copy them first. Either way each named sequence's saved row equals its row before
the launch bit for bit (bf16 and fp32 pools, both layouts; a sequence named -1 writes no
row, so its saved row means nothing), and the launch's o and final states still match the
float64 reference.

Interpreted on the CPU without CUDA (CI), compiled on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from kernels import run_problem
from triton_cases import Case, initial_states, make_inputs, problem_of, reference, rel_err, same_bits

CASES = {
    "decode": Case((1, 1, 1, 1), gate="lower_bound"),
    "decode bf16 pool, k first": Case((1, 1, 1), gate="lower_bound", dtype=torch.bfloat16,
                                      pool_dtype=torch.bfloat16, v_first=False),
    "chunked and decode": Case((70, 1, 1, 130), gate="softplus"),
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_rows_read_are_saved_before_they_are_written(device: str, name: str, backend: str) -> None:
    case = CASES[name]
    if backend == "torch" and device != "cpu":
        pytest.skip("the torch backend's copy is tested on the CPU")
    inp = make_inputs(case, device, seed=7)
    before = inp.pool.clone()
    N = len(case.lengths)
    saved = torch.full((N, *inp.pool.shape[1:]), float("nan"), dtype=inp.pool.dtype, device=device)
    o_ref, final_ref, _ = reference(inp, case)
    problem = problem_of(case, inp, saved_states=saved)
    o, _ = run_problem(problem, backend)
    rows = inp.indices.tolist()
    assert -1 in rows
    for n, row in enumerate(rows):
        if row >= 0:
            assert same_bits(saved[n], before[row]), f"sequence {n}: its saved row is not its row before the launch"
            assert not same_bits(inp.pool[row], before[row]), f"sequence {n}: its row was not written"
    tol = 1e-4 if torch.float32 == case.dtype == case.pool_dtype else 5e-3
    assert rel_err(o, o_ref) < tol
    finals = initial_states(inp, case.v_first)  # the rows now: the final states
    named = [n for n, row in enumerate(rows) if row >= 0]
    assert rel_err(finals[named], final_ref[named]) < tol
