"""Batches cut into pieces (kernels.triton_plan): the state pass of each piece carries
states across piece boundaries through carry rows, and on CUDA runs on a side stream.

A piece of one or two chunks cuts every multi-chunk sequence, so each test crosses many
boundaries: first segments from the pool or zeros, middle segments carry to carry, last
segments back to the pool (or nowhere, for index -1).
"""
from __future__ import annotations

import pytest
import torch

from kernels.triton_kernels import config
from kernels.triton_plan import SEG_COLS, piece_rows
from triton_cases import Case, check_case, make_inputs, run_triton, same_bits

FP32_TOL = 1e-4
LENGTHS = (130, 1, 5, 200, 64, 70)


def _set_piece_chunks(monkeypatch: pytest.MonkeyPatch, chunks: int, HV: int) -> None:
    monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", chunks * HV)


@pytest.mark.parametrize("chunks_per_piece", [1, 2])
def test_pieces_match_reference(device: str, monkeypatch: pytest.MonkeyPatch, chunks_per_piece: int) -> None:
    case = Case(LENGTHS, gate="lower_bound")
    _set_piece_chunks(monkeypatch, chunks_per_piece, case.HV)
    check_case(case, device, seed=11, tol=FP32_TOL)


def test_pieces_with_intermediate_states_and_split_output(device: str, output_path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(LENGTHS, gate="softplus", intermediate=True)
    _set_piece_chunks(monkeypatch, 1, case.HV)
    check_case(case, device, seed=12, tol=FP32_TOL)


def test_pieces_bit_identical_to_one_piece(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """States cross piece boundaries in fp32 with no rounding, so o and every pool row
    equal the one-piece run bit for bit (a bf16 pool included)."""
    case = Case(LENGTHS, gate="lower_bound", dtype=torch.bfloat16, pool_dtype=torch.bfloat16)
    results = []
    for chunks in (0, 1):
        _set_piece_chunks(monkeypatch, chunks, case.HV)
        inp = make_inputs(case, device, seed=13)
        o, _ = run_triton(case, inp)
        results.append((o, inp.pool))
    (o1, pool1), (o2, pool2) = results
    assert same_bits(o1, o2)
    assert same_bits(pool1, pool2)


CUTS = {"no cuts": (), "cuts": (0, 1, 6, 7, 12, 14, 19)}  # h indices: interior, sequence ends, a 1-token one


@pytest.mark.parametrize("cuts", list(CUTS))
@pytest.mark.parametrize("piece_chunks", [0, 1, 2, 3, 7])
def test_plan_covers_every_chunk_once_and_chains_carries(piece_chunks: int, cuts: str) -> None:
    bounds = (0, 130, 131, 400, 464, 465, 1000)
    chunks, segs, decs, pieces, num_carry, num_chunks = piece_rows(bounds, piece_chunks, CUTS[cuts])
    rows = [chunks[i:i + 3] for i in range(0, len(chunks), 3)]
    seg_rows = [segs[i:i + SEG_COLS] for i in range(0, len(segs), SEG_COLS)]
    # every token of every multi-token sequence in exactly one chunk, chunks in order
    covered = [t for a, b, _ in rows for t in range(a, b)]
    multi = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1]
    assert covered == [t for a, b in multi for t in range(a, b)]
    assert decs == [1, 130, 3, 4, 464, 10]  # (sequence, token, h index) of the 1-token ones
    # pieces tile both tables and respect the size limit
    assert pieces[0].c0 == 0 and pieces[-1].c1 == len(rows) and pieces[-1].s1 == len(seg_rows)
    for p, nxt in zip(pieces, pieces[1:]):
        assert p.c1 == nxt.c0 and p.s1 == nxt.s0
    if piece_chunks > 0:
        assert all(p.c1 - p.c0 <= piece_chunks for p in pieces)
    else:
        assert len(pieces) == 1
    # segments of one sequence are contiguous in tokens and chain load <- previous store
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        mine = [s for s in seg_rows if s[0] == n]
        if b - a == 1:
            assert mine == []
            continue
        assert mine[0][1] == a and mine[-1][2] == b and mine[0][4] == -1 and mine[-1][5] == -1
        for s, nxt in zip(mine, mine[1:]):
            assert s[2] == nxt[1] and s[5] >= 0 and nxt[4] == s[5]
            assert s[5] < num_carry
    assert num_chunks == len(rows) + len(decs) // 3
    # each cut chunk ends a segment; a piece's levels hold one segment per sequence, in order
    ends = {s[3] + -(-(s[2] - s[1]) // 64) - 1 for s in seg_rows}
    assert {c for c in CUTS[cuts] if c in {r[2] for r in rows}} <= ends
    for p in pieces:
        assert p.levels[0] == p.s0 and list(p.levels) == sorted(set(p.levels))
        seen: dict[int, int] = {}
        for level, (l0, l1) in enumerate(p.launches()):
            names = [seg_rows[r][0] for r in range(l0, l1)]
            assert len(names) == len(set(names)) and names == sorted(names)
            for n in names:
                assert seen.get(n, -1) == level - 1  # levels 0, 1, ... of the piece, in order
                seen[n] = level


def test_plan_ends_segments_at_checkpoints_up_to_the_level_limit() -> None:
    """`LaunchConfig.state_ckpt_levels`: checkpoints cut the segments when that takes at most
    that many state launches per piece; denser ones leave the plan uncut (stored in the loop)."""
    from kernels.triton_backend import _plan

    bounds = (0, 1024, 2048)  # 16 chunks each
    every_4 = [3, 7, 11, 15, 19, 23, 27, 31]  # 4 levels
    plan, at_end = _plan(bounds, 0, torch.device("cpu"), every_4, 4)
    assert at_end and plan.max_levels == 4 and [len(pc.levels) for pc in plan.pieces] == [4]
    plan, at_end = _plan(bounds, 0, torch.device("cpu"), list(range(32)), 4)  # every chunk: 16 levels
    assert not at_end and plan.max_levels == 1
    plan, at_end = _plan(bounds, 0, torch.device("cpu"), every_4, 0)
    assert not at_end and plan.max_levels == 1
