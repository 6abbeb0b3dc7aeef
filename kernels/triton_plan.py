"""Host-side launch tables of the Triton backend: chunks, state-pass segments and pieces.

A batch's chunks (64 tokens of one sequence, for every sequence of two or more tokens) are
cut, in order, into *pieces* of at most ``piece_chunks`` chunks. The parallel stages (intra,
WY) run piece by piece; the sequential state pass of piece p runs on a second stream as
soon as piece p's WY factors exist, so it overlaps the parallel stages of pieces p+1, ...
instead of following all of them (the state pass alone keeps a GPU mostly idle: one
program per (sequence, head, V block), each a chain of dependent chunk steps).

A sequence cut by a piece boundary becomes several *segments*, one per piece. Its state
travels between them through a carry buffer row: the first segment starts from the pool
row (or zeros for index -1), the middle ones read and write the carry row, and the last one
writes the pool row (nothing for -1). Segments of one sequence run in piece order because
the state passes run in order on one stream.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache

import torch

from .problem import CHUNK_SIZE

# Columns of the segment table.
SEG_COLS = 6  # sequence id, first token, end token, h index of first chunk, load carry, store carry


@dataclass(frozen=True)
class Piece:
    """Row ranges of one piece in the chunk table [c0, c1) and the segment table [s0, s1).
    ``levels``: the segment rows where each of the piece's state launches starts (the first
    is s0). A sequence cut at checkpoints has one segment per level, so its segments run in
    order, each launch after the one before; a piece without cuts has one level."""

    c0: int
    c1: int
    s0: int
    s1: int
    levels: tuple[int, ...]

    def launches(self) -> list[tuple[int, int]]:
        """Segment row ranges [a, b) of the piece's state launches, in order."""
        ends = (*self.levels[1:], self.s1)
        return list(zip(self.levels, ends))


@dataclass(frozen=True)
class LaunchPlan:
    """Device index tables for one varlen layout (int64).

    chunks: [NTc, 3] (first token, end token, h index) for each chunk of each sequence of
    >= 2 tokens; segs: [Ns, 6] state-pass segments (sequence id, first token, end token,
    h index of its first chunk, carry row to load or -1 (then the pool row), carry row to
    store or -1 (then the pool row)); decs: [N1, 3] (sequence id, token, h index) for the
    single-token sequences. pieces: the cut of both tables; num_carry: carry rows needed;
    num_chunks: NT over all sequences (a 1-token sequence counts one).
    """

    chunks: torch.Tensor
    segs: torch.Tensor
    decs: torch.Tensor
    pieces: tuple[Piece, ...]
    num_carry: int
    num_chunks: int

    @property
    def max_levels(self) -> int:
        """The most state launches one piece takes (1 without checkpoint cuts)."""
        return max((len(pc.levels) for pc in self.pieces), default=1)


def piece_rows(bounds: tuple[int, ...], piece_chunks: int, cuts: tuple[int, ...] = ()
               ) -> tuple[list[int], list[int], list[int], list[Piece], int, int]:
    """The flat host tables of `LaunchPlan` (chunks, segs, decs as flat int lists), the
    pieces, the carry rows and NT, for packed sequences with offsets ``bounds``.
    ``piece_chunks`` <= 0 means one piece. ``cuts``: sorted h indices of chunks a segment
    must end after (checkpoints, stored at segment ends: `state.chunk_state_kernel`)."""
    limit = piece_chunks if piece_chunks > 0 else 1 << 62
    chunks: list[int] = []
    segs: list[int] = []
    decs: list[int] = []
    pieces: list[Piece] = []
    levels: list[list[int]] = []  # the open piece's segment rows, by level
    hoff = num_carry = 0
    c0 = 0

    def close() -> None:
        nonlocal c0
        nc = len(chunks) // 3
        if nc > c0:
            s0, starts = len(segs) // SEG_COLS, []
            for rows in levels:
                starts.append(len(segs) // SEG_COLS)
                segs.extend(rows)
            pieces.append(Piece(c0, nc, s0, len(segs) // SEG_COLS, tuple(starts)))
        levels.clear()
        c0 = nc

    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b - a == 1:
            decs += [n, a, hoff]
            hoff += 1
            continue
        n_chunks = -(-(b - a) // CHUNK_SIZE)
        done, carry, load, level = 0, -1, -1, 0
        while done < n_chunks:
            room = limit - (len(chunks) // 3 - c0)
            take = min(n_chunks - done, room)
            i = bisect_left(cuts, hoff + done)
            if i < len(cuts) and cuts[i] < hoff + done + take - 1:  # a checkpoint inside: end there
                take = cuts[i] - hoff - done + 1
            if done + take < n_chunks and carry < 0:
                carry, num_carry = num_carry, num_carry + 1
            store = carry if done + take < n_chunks else -1
            first = a + done * CHUNK_SIZE
            for t in range(first, first + take * CHUNK_SIZE, CHUNK_SIZE):
                chunks += [t, min(t + CHUNK_SIZE, b), hoff + (t - a) // CHUNK_SIZE]
            if len(levels) <= level:
                levels.append([])
            levels[level] += [n, first, min(first + take * CHUNK_SIZE, b), hoff + done, load, store]
            load = store
            done += take
            level += 1
            if len(chunks) // 3 - c0 >= limit:
                close()
                level = 0
        hoff += n_chunks
    close()
    return chunks, segs, decs, pieces, num_carry, hoff


@lru_cache(maxsize=64)
def launch_plan(bounds: tuple[int, ...], piece_chunks: int, device: torch.device, cuts: tuple[int, ...] = ()
                ) -> LaunchPlan:
    """The tables for ``bounds`` (segments ending after the chunks ``cuts``: `piece_rows`),
    built on the host and copied to ``device`` once (cached: serving repeats layouts)."""
    chunks, segs, decs, pieces, num_carry, num_chunks = piece_rows(bounds, piece_chunks, cuts)
    packed = torch.tensor(chunks + segs + decs, dtype=torch.int64).to(device)
    nc, ns = len(chunks), len(segs)
    return LaunchPlan(
        chunks=packed[:nc].view(-1, 3),
        segs=packed[nc:nc + ns].view(-1, SEG_COLS),
        decs=packed[nc + ns:].view(-1, 3),
        pieces=tuple(pieces),
        num_carry=num_carry,
        num_chunks=num_chunks,
    )


def checkpoint_chunks(bounds: tuple[int, ...], positions: tuple[int, ...]) -> list[int]:
    """For each packed checkpoint position (a chunk end of its sequence: ``bounds[n] + 64 j``
    or ``bounds[n + 1]``; `kernels.checkpoints` checks them), the h index of the chunk it
    ends, as `piece_rows` numbers chunks (sequences in order, a 1-token sequence one chunk)."""
    first = [0]
    for a, b in zip(bounds[:-1], bounds[1:]):
        first.append(first[-1] + -(-(b - a) // CHUNK_SIZE))
    out = []
    for pos in positions:
        n = bisect_left(bounds, pos) - 1  # bounds[n] < pos <= bounds[n + 1]
        out.append(first[n] + (pos - bounds[n] - 1) // CHUNK_SIZE)
    return out


def checkpoint_addresses(num_chunks: int, chunk_rows: list[int], targets: tuple[torch.Tensor, ...],
                         device: torch.device) -> torch.Tensor:
    """[NT] int64 (``num_chunks``): for each chunk (h index) the address of the target that
    takes the state after it (``targets[c]`` after chunk ``chunk_rows[c]``:
    `checkpoint_chunks`), 0 for none."""
    addrs = [0] * num_chunks
    for row, target in zip(chunk_rows, targets):
        addrs[row] = target.data_ptr()
    host = torch.frombuffer(array("q", addrs), dtype=torch.int64)  # a third of torch.tensor(list)'s host time
    if device.type != "cuda":
        return host.to(device)
    # pinned and asynchronous: a copy from pageable memory would wait for the stream's queued work
    return host.pin_memory().to(device, non_blocking=True)
