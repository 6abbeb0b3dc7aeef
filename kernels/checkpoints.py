"""State checkpoints of one prefill: which positions, into which tensor (checked once).

A checkpoint asks for the state of a sequence after a prefix of its tokens, the initial
state included, written by the same launch that runs the prefill. A position (in the
packed token axis) must be a chunk end of its sequence n: ``cu_seqlens[n] + 64 j`` with
j >= 1 and at most the sequence's end, or exactly ``cu_seqlens[n + 1]``. The kernels keep
only the state between chunks, so these are the states they have without a second pass.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Optional

import torch

from .problem import CHUNK_SIZE


def check_checkpoints(
    tokens: Optional[torch.Tensor], states: Optional[torch.Tensor], bounds: tuple[int, ...],
    pool: torch.Tensor,
) -> tuple[tuple[int, ...], Optional[torch.Tensor]]:
    """Validate ``tokens`` (int64 [C]) and ``states`` ([C, *pool.shape[1:]], the pool's
    dtype and device) against the packed sequences ``bounds``; returns the positions as
    host ints and the states tensor (``((), None)`` when neither is given)."""
    if tokens is None and states is None:
        return (), None
    if tokens is None or states is None:
        raise ValueError("checkpoint_tokens and checkpoint_states must be given together")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
        got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"checkpoint_tokens must be a 1-D int64 tensor, got {got}")
    want = (tokens.numel(), *pool.shape[1:])
    if not isinstance(states, torch.Tensor) or tuple(states.shape) != want:
        got = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
        raise ValueError(f"checkpoint_states must have shape {want} (one pool-layout state per checkpoint), got {got}")
    if states.dtype != pool.dtype or states.device != pool.device:
        raise ValueError(f"checkpoint_states must be {pool.dtype} on {pool.device} as the pool, "
                         f"got {states.dtype} on {states.device}")
    positions = tuple(int(t) for t in tokens.tolist())
    if len(set(positions)) != len(positions):
        raise ValueError(f"checkpoint_tokens repeats a position: {list(positions)[:16]}")
    bad = [t for t in positions if not _is_chunk_end(t, bounds)]
    if bad:
        raise ValueError(
            f"checkpoint_tokens must each be cu_seqlens[n] + 64 j (j >= 1) or cu_seqlens[n + 1] of "
            f"one sequence n; not so: {bad[:8]} (cu_seqlens {list(bounds)[:17]})"
        )
    return positions, states


def _is_chunk_end(t: int, bounds: tuple[int, ...]) -> bool:
    if not bounds[0] < t <= bounds[-1]:
        return False
    n = bisect_left(bounds, t) - 1  # bounds[n] < t <= bounds[n + 1]
    return t == bounds[n + 1] or (t - bounds[n]) % CHUNK_SIZE == 0
