"""`PrefillProblem.o_out`: the launch writes o where its caller says (a client's region)
instead of into a tensor of its own, every element (the destination is poisoned first),
bit for bit what it writes otherwise, through the chunked and decode paths and both
output stages, on the Triton and torch backends.

Interpreted on the CPU without CUDA (CI), compiled on a GPU.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from kernels import run_problem
from triton_cases import Case, make_inputs, problem_of, same_bits

CASES = {
    "chunked and decode": Case((130, 1, 70, 1), gate="softplus"),
    "decode, bf16": Case((1, 1, 1), gate="lower_bound", dtype=torch.bfloat16),
}


def run(case: Case, device: str, backend: str, o_out: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """o and the pool after one launch of ``case`` (fresh inputs, the same each call)."""
    inp = make_inputs(case, device, seed=21)
    problem = problem_of(case, inp, o_out=o_out)
    o, _ = run_problem(problem, backend)
    return o, inp.pool


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_o_is_written_where_the_caller_says(device: str, name: str, backend: str, output_path: str) -> None:
    if backend == "torch" and (device != "cpu" or output_path == "split"):
        pytest.skip("the torch backend is tested on the CPU, once")
    case = CASES[name]
    own, pool = run(case, device, backend, None)
    out = torch.full_like(own, float("nan"))
    o, pool_out = run(case, device, backend, out)
    assert o.data_ptr() == out.data_ptr(), "the launch returned another tensor than o_out"
    assert same_bits(out, own), "o written into o_out differs from the launch's own o"
    assert same_bits(pool_out, pool), "the final states differ when o goes to o_out"
