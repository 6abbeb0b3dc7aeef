"""The checks of a prefill's checkpoints (`service.core.inputs.Checkpoint`) and where they
fall in its packed tokens.

A checkpoint's ``offset`` counts its slot's tokens in the request's layer: ``before`` (the
slot's count before this request) plus the tokens into the sequence. It must lie inside the
sequence on its chunk grid, ``before + 64 j`` (j >= 1), or be the sequence's end
``before + length``: the states the kernels hold between chunks (`kernels.checkpoints`).
Keys are 1..128 characters and appear once per request. Every refusal is a 400 naming the
field (``sequences[i].checkpoints[j].offset``), raised before anything changes.
"""
from __future__ import annotations

from typing import Sequence

from kernels.problem import CHUNK_SIZE
from state_store import key_problem

from ..errors import InvalidRequest, PrefixCacheOff
from .inputs import PrefillInputs

Planned = tuple[int, str, int]
"""One checkpoint of a request: its position in the request's packed tokens (a chunk end
of its sequence, as `kernels.checkpoints` wants it), its key and its offset."""


def check_checkpoint_keys(x: PrefillInputs, cache_enabled: bool) -> None:
    """One list per sequence, every key valid and used once in the request; with no
    prefix cache, no checkpoints at all (PrefixCacheOff, 409)."""
    if not x.checkpoints:
        return
    if len(x.checkpoints) != len(x.lengths):
        raise InvalidRequest(f"{len(x.checkpoints)} checkpoint lists for {len(x.lengths)} sequences",
                             field="sequences")
    if any(x.checkpoints) and not cache_enabled:
        raise PrefixCacheOff("this server keeps no prefix cache (--prefix-cache-mb 0): checkpoints cannot be "
                             "stored", field="sequences")
    seen: dict[str, str] = {}
    for i, marks in enumerate(x.checkpoints):
        for j, mark in enumerate(marks):
            where = f"sequences[{i}].checkpoints[{j}]"
            if (why := key_problem(mark.key)) is not None:
                raise InvalidRequest(why, field=f"{where}.key")
            if mark.key in seen:
                raise InvalidRequest(f"key {mark.key!r} is stored by {seen[mark.key]} already; a request names "
                                     "each key once", field=f"{where}.key")
            seen[mark.key] = where


def plan_checkpoints(x: PrefillInputs, before: Sequence[int]) -> list[Planned]:
    """Each checkpoint's packed position, key and offset, sequence by sequence; ``before[n]``
    is sequence n's slot's tokens in the layer before this request. InvalidRequest (400)
    for an offset that is not an integer, not inside its sequence, off its chunk grid, or
    repeated within the sequence."""
    planned: list[Planned] = []
    start = 0
    for i, (marks, length, base) in enumerate(zip(x.checkpoint_list(), x.lengths, before)):
        taken: set[int] = set()
        for j, mark in enumerate(marks):
            field = f"sequences[{i}].checkpoints[{j}].offset"
            offset = mark.offset
            if not isinstance(offset, int) or isinstance(offset, bool):
                raise InvalidRequest(f"offset must be an integer, got {offset!r}", field=field)
            into = offset - base
            if not 0 < into <= length or (into % CHUNK_SIZE and into != length):
                raise InvalidRequest(
                    f"offset {offset} is not a checkpoint of this sequence: its slot holds {base} token(s) before "
                    f"it and it has {length}, so an offset must be {base} + a multiple of {CHUNK_SIZE} up to "
                    f"{base + length}, or {base + length}", field=field)
            if offset in taken:
                raise InvalidRequest(f"offset {offset} appears twice in sequence {i}", field=field)
            taken.add(offset)
            planned.append((start + into, mark.key, offset))
        start += length
    return planned
