"""`PrefillProblem.write_indices`: a launch reads each sequence's initial state from its row
of ``indices`` and writes its final state to its row of ``write_indices`` (a spare row),
so the rows it read stay as they were and its caller commits by remapping rows.

The pool holds random states in the rows read and in the rows no sequence names, and NaN
in the spare rows (so an element left unwritten shows); a random guard row lies just before
it in memory (where a store to row -1 would land). After one launch each spare row written
holds its sequence's final state (float64 reference), the rows read, every row neither read
nor written and the guard row are bit-identical to before, a spare row of write index -1
stays NaN, o matches the reference, the rows read are saved as read (``saved_states``), and
the non-finite flags of clean inputs stay zero. Through the decode kernel, the chunked state
pass (one piece, and pieces with carry rows), a sequence of read index -1 (zeros), fp32 and
bf16 inputs, on the torch backend and the Triton backend (interpreted on the CPU without
CUDA, compiled on a GPU).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import run_problem
from kernels.triton_kernels import config
from triton_cases import Case, Inputs, make_inputs, problem_of, reference, rel_err, same_bits

HAS_CUDA = torch.cuda.is_available()
BACKENDS = [
    pytest.param("torch", "cpu", id="torch"),
    pytest.param("triton", "cpu", id="triton-interpreted",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs where there is no CUDA")),
    pytest.param("triton", "cuda", id="triton-cuda",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]),
]
# (case, the sequences whose write index is -1). In a case of several sequences `make_inputs`
# gives sequence N // 2 the read index -1: it reads zeros and still writes its spare row.
CASES: dict[str, tuple[Case, tuple[int, ...]]] = {
    "decode": (Case((1, 1, 1, 1), gate="lower_bound"), ()),
    "decode bf16, k first": (Case((1, 1, 1), gate="lower_bound", dtype=torch.bfloat16, pool_dtype=torch.bfloat16,
                                  v_first=False), ()),
    "chunked and decode": (Case((67, 1, 130, 1), gate="softplus"), ()),
    "chunked and decode bf16, two write nothing": (Case((1, 130, 67), gate="softplus", dtype=torch.bfloat16,
                                                        pool_dtype=torch.bfloat16), (0, 2)),
}
OTHER_ROWS = 2  # rows no sequence names, random


def spare_pool(case: Case, device: str, seed: int) -> tuple[Inputs, torch.Tensor, torch.Tensor]:
    """``case``'s inputs on a pool of N rows read (random; `make_inputs`), N spare rows
    (NaN) and `OTHER_ROWS` random rows no sequence names; the write indices [N] int64
    (sequence n writes to the n-th spare row, in a seeded random order of them); and the
    guard row: a random row just before the pool in memory (the pool is a view of a
    buffer one row longer)."""
    N = len(case.lengths)
    inp = make_inputs(replace(case, extra_slots=N + OTHER_ROWS), device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    read = set(inp.indices.tolist())
    free = [i for i in torch.randperm(inp.pool.shape[0], generator=gen).tolist() if i not in read]
    spare, other = free[:N], free[N:]
    inp.pool[other] = (0.5 * torch.randn(len(other), *inp.pool.shape[1:], generator=gen)).to(inp.pool)
    inp.pool[spare] = float("nan")
    buf = torch.cat([(0.5 * torch.randn(1, *inp.pool.shape[1:], generator=gen)).to(inp.pool), inp.pool])
    inp.pool = buf[1:]
    return inp, torch.tensor(spare, dtype=torch.int64, device=device), buf[0]


def launch_to_spare_rows(case: Case, backend: str, device: str, no_write: tuple[int, ...], seed: int = 41) -> None:
    """Launch ``case`` with write indices on its spare pool (-1 for the sequences
    ``no_write``) and assert every check above."""
    inp, write_indices, guard = spare_pool(case, device, seed)
    write_indices[list(no_write)] = -1
    N = len(case.lengths)
    before, guard_before = inp.pool.clone(), guard.clone()
    o_ref, final_ref, _ = reference(inp, case)
    flags = torch.zeros(N + 1, dtype=torch.int32, device=device)
    saved = torch.full((N, *inp.pool.shape[1:]), float("nan"), dtype=inp.pool.dtype, device=device)
    problem = problem_of(case, inp, nonfinite=flags, saved_states=saved)
    o, _ = run_problem(replace(problem, write_indices=write_indices), backend)

    tol = 1e-4 if case.dtype == torch.float32 else 5e-3
    read, written = inp.indices.tolist(), write_indices.tolist()
    assert -1 in read or N == 1
    for n, row in enumerate(written):
        if row < 0:
            continue
        got = inp.pool[row].float()
        assert not torch.isnan(got).any(), f"sequence {n}: its spare row {row} is not fully written"
        err = rel_err(got if case.v_first else got.transpose(-1, -2), final_ref[n])
        assert err <= tol, f"sequence {n}: final state rel L2 error {err:.3e} > {tol:.0e}"
    for row in range(inp.pool.shape[0]):
        if row not in written:
            what = "read" if row in read else "neither read nor written"
            assert same_bits(inp.pool[row], before[row]), f"pool row {row} ({what}) was modified"
    assert same_bits(guard, guard_before), "the memory before the pool was modified"
    for n, row in enumerate(read):
        if row >= 0:
            assert same_bits(saved[n], before[row]), f"sequence {n}: its saved row is not its row as read"
    err = rel_err(o, o_ref)
    assert err <= tol, f"o: rel L2 error {err:.3e} > {tol:.0e}"
    assert flags.tolist() == [0] * (N + 1), flags.tolist()


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_final_states_go_to_the_write_rows(name: str, backend: str, device: str) -> None:
    case, no_write = CASES[name]
    launch_to_spare_rows(case, backend, device, no_write)


@pytest.mark.parametrize("backend, device", [p for p in BACKENDS if p.values[0] == "triton"])
def test_final_states_go_to_the_write_rows_across_pieces(backend: str, device: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk per piece: the last segment of each sequence, after carry rows, writes the spare row."""
    case = Case((130, 1, 67), gate="lower_bound")
    monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", case.HV)
    launch_to_spare_rows(case, backend, device, ())
