"""The kernels' non-finite flags (`PrefillProblem.nonfinite`), which the server's
transaction reads instead of scanning o and the states again: one NaN in a sequence's v
(it reaches o and the state) or in its q (o only) flags exactly that sequence, through
every path that stores o or a state: chunked with o fused into the state pass or from
the output stage (which sets the unattributed flag [N]), decode, a sequence named -1,
pieces with carry rows, and the torch backend. A clean launch flags nothing.

Interpreted on the CPU without CUDA (CI), compiled on a GPU; the last test only there,
at serving shapes.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from kernels import run_problem
from kernels.triton_kernels import config
from triton_cases import Case, make_inputs, problem_of

LENGTHS = (130, 1, 64, 200)  # multi-chunk, decode, named -1 (N // 2), multi-chunk


def flags_after(case: Case, device: str, poison: Optional[tuple[str, int]], backend: str = "triton",
                seed: int = 31) -> list[int]:
    """The flags [N + 1] after one launch of ``case``, with one NaN in ``poison`` =
    (input name, sequence) at a token inside that sequence (None: clean inputs)."""
    inp = make_inputs(case, device, seed)
    bounds = inp.cu_seqlens.tolist()
    if poison is not None:
        name, n = poison
        token = (bounds[n] + bounds[n + 1]) // 2
        getattr(inp, name)[0, token, 0, 1] = float("nan")
    flags = torch.zeros(len(case.lengths) + 1, dtype=torch.int32, device=device)
    problem = problem_of(case, inp, nonfinite=flags)
    run_problem(problem, backend)
    return flags.tolist()


def one_hot(n: int, size: int) -> list[int]:
    return [int(i == n) for i in range(size)]


def test_a_clean_launch_flags_nothing(device: str, output_path: str) -> None:
    case = Case(LENGTHS, gate="lower_bound")
    assert flags_after(case, device, None) == [0] * (len(LENGTHS) + 1)


@pytest.mark.parametrize("n", [0, 1, 2], ids=["chunked", "decode", "named -1"])
def test_a_nan_in_v_flags_its_sequence(device: str, output_path: str, n: int) -> None:
    """v reaches the state: the state pass (or the decode step) flags the sequence itself;
    the split output stage may add the unattributed flag."""
    N = len(LENGTHS)
    flags = flags_after(Case(LENGTHS, gate="lower_bound"), device, ("v", n))
    assert flags[:N] == one_hot(n, N), flags
    assert flags[N] == (output_path == "split" and LENGTHS[n] > 1), flags


@pytest.mark.parametrize("n", [0, 1], ids=["chunked", "decode"])
def test_a_nan_in_q_flags_its_sequence_through_o(device: str, output_path: str, n: int) -> None:
    """q reaches o only: flagged by whichever stage stores o (the output stage: [N])."""
    N = len(LENGTHS)
    flags = flags_after(Case(LENGTHS, gate="lower_bound"), device, ("q", n))
    if output_path == "split" and LENGTHS[n] > 1:
        assert flags == [0] * N + [1], flags
    else:
        assert flags == one_hot(n, N + 1), flags


def test_flags_across_pieces(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences cut into pieces: the segment that stores a carry row flags its sequence too."""
    case = Case(LENGTHS, gate="lower_bound")
    monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", case.HV)
    assert flags_after(case, device, ("v", 3))[:len(LENGTHS)] == one_hot(3, len(LENGTHS))
    assert flags_after(case, device, None) == [0] * (len(LENGTHS) + 1)


@pytest.mark.parametrize("name, n", [(None, 0), ("v", 0), ("q", 3), ("v", 1)])
def test_the_torch_backend_flags_the_same_sequences(name: Optional[str], n: int) -> None:
    """The CPU backend flags exactly, per sequence (it never sets [N])."""
    N = len(LENGTHS)
    flags = flags_after(Case(LENGTHS, gate="lower_bound"), "cpu", None if name is None else (name, n), backend="torch")
    assert flags == (one_hot(n, N + 1) if name else [0] * (N + 1)), flags


@pytest.mark.parametrize("lengths, name, n", [((1, 1, 1, 1), None, 0), ((1, 1, 1, 1), "v", 2), ((1, 1, 1, 1), "q", 1),
                                             ((70,), None, 0), ((70,), "v", 0), ((70,), "q", 0)])
def test_the_torch_backend_flags_a_decode_step_and_a_lone_sequence(lengths: tuple[int, ...], name: Optional[str],
                                                                   n: int) -> None:
    """One token per sequence takes the torch backend's recurrent step, one sequence its
    own reading of o's flag: flagged the same."""
    flags = flags_after(Case(lengths, gate="lower_bound"), "cpu", None if name is None else (name, n), backend="torch")
    assert flags == (one_hot(n, len(lengths) + 1) if name else [0] * (len(lengths) + 1)), flags


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["v", "q"])
def test_flags_at_serving_shapes(output_path: str, name: str) -> None:
    lengths = (4096, 1, 777, 300)
    case = Case(lengths, H=32, HV=32, K=128, V=128, gate="lower_bound", dtype=torch.bfloat16)
    N = len(lengths)
    assert flags_after(case, "cuda", None) == [0] * (N + 1)
    flags = flags_after(case, "cuda", (name, 2))
    if name == "q" and output_path == "split":
        assert flags == [0] * N + [1], flags
    else:
        assert flags[:N] == one_hot(2, N), flags
