"""State checkpoints of one prefill: which positions, into which tensors (checked once).

A checkpoint asks for the state of a sequence after a prefix of its tokens, the initial
state included, written by the same launch that runs the prefill. A position (in the
packed token axis) must be a chunk end of its sequence n: ``cu_seqlens[n] + 64 j`` with
j >= 1 and at most the sequence's end, or exactly ``cu_seqlens[n + 1]``. The kernels keep
only the state between chunks, so these are the states they have without a second pass.

Each checkpoint has its own target tensor, one pool row's shape ([HV, V, K], or
[HV, K, V] when not V-first) in the pool's dtype and on its device; the targets may live
anywhere in memory (a caller's cache entries, say) but share one set of strides, so the
kernels address each by its base alone. A [C, HV, ., .] tensor gives its rows. A problem
may carry, instead of its targets, a provider of them (`PrefillProblem.checkpoint_provider`)
that its backend asks once, when it first needs them (`checkpoint_targets`).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Optional, Sequence, Union

import torch

from .problem import CHUNK_SIZE, PrefillProblem

Targets = Union[torch.Tensor, Sequence[torch.Tensor]]


def check_checkpoints(
    tokens: Optional[torch.Tensor], states: Optional[Targets], bounds: tuple[int, ...], pool: torch.Tensor,
) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """Validate ``tokens`` (int64 [C]) and ``states`` (C targets, see the module docstring:
    a sequence of [*pool.shape[1:]] tensors or one [C, *pool.shape[1:]] tensor) against the
    packed sequences ``bounds``; returns the positions as host ints and the targets
    (``((), ())`` when neither is given)."""
    if tokens is None and states is None:
        return (), ()
    if tokens is None or states is None:
        raise ValueError("checkpoint_tokens and checkpoint_states must be given together")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
        got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"checkpoint_tokens must be a 1-D int64 tensor, got {got}")
    targets = _targets(states, tokens.numel(), pool)
    positions = tuple(int(t) for t in tokens.tolist())
    if len(set(positions)) != len(positions):
        raise ValueError(f"checkpoint_tokens repeats a position: {list(positions)[:16]}")
    bad = [t for t in positions if not _is_chunk_end(t, bounds)]
    if bad:
        raise ValueError(
            f"checkpoint_tokens must each be cu_seqlens[n] + 64 j (j >= 1) or cu_seqlens[n + 1] of "
            f"one sequence n; not so: {bad[:8]} (cu_seqlens {list(bounds)[:17]})"
        )
    return positions, targets


def checkpoint_targets(p: PrefillProblem) -> tuple[torch.Tensor, ...]:
    """The targets of ``p``'s checkpoints, one per position (see the module docstring):
    ``p.checkpoint_states``, or what ``p.checkpoint_provider`` returns, called here and
    checked as a caller's targets are (ValueError naming what does not fit); the provider is
    never called for a problem without checkpoints. A backend calls this once, when it
    first needs the targets."""
    if p.checkpoint_provider is None or not p.checkpoint_tokens:
        return p.checkpoint_states
    return _targets(p.checkpoint_provider(), len(p.checkpoint_tokens), p.pool)


def _targets(states: Targets, count: int, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``states`` as ``count`` targets of one pool row's shape, dtype, device and one stride
    set; ValueError naming what does not fit."""
    row = tuple(pool.shape[1:])
    if isinstance(states, torch.Tensor):
        if tuple(states.shape) != (count, *row):
            raise ValueError(f"checkpoint_states must have shape {(count, *row)} (one pool-layout state per "
                             f"checkpoint), got {tuple(states.shape)}")
        targets = tuple(states.unbind(0))
    else:
        targets = tuple(states)
        if len(targets) != count or any(not isinstance(t, torch.Tensor) or tuple(t.shape) != row for t in targets):
            got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in targets]
            raise ValueError(f"checkpoint_states must be {count} tensors of shape {row} (one pool-layout state per "
                             f"checkpoint), got {got[:8]}")
    for t in targets:
        if t.dtype != pool.dtype or t.device != pool.device:
            raise ValueError(f"checkpoint_states must be {pool.dtype} on {pool.device} as the pool, "
                             f"got {t.dtype} on {t.device}")
    strides = sorted({t.stride() for t in targets})
    if len(strides) > 1:
        raise ValueError(f"checkpoint_states must share one set of strides, got {strides}")
    return targets


def _is_chunk_end(t: int, bounds: tuple[int, ...]) -> bool:
    if not bounds[0] < t <= bounds[-1]:
        return False
    n = bisect_left(bounds, t) - 1  # bounds[n] < t <= bounds[n + 1]
    return t == bounds[n + 1] or (t - bounds[n]) % CHUNK_SIZE == 0
