"""The validated, backend-neutral description of one prefill launch, and the contract a
launch must meet (what the public entry points and the service's validation check).

`kernels.api` checks the public arguments and builds a `PrefillProblem` with
`packed_problem`; the service checks requests against its pool (`service.core.validation`,
with the limits and checks defined here) and builds the problem of a launch the same way.
Every backend takes one and returns outputs, writing final states into the pool in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

CHUNK_SIZE = 64
MAX_HEAD_DIM = 256
FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)  # q, k, v, g, beta
POOL_DTYPES = (torch.float32, torch.bfloat16)  # the state pool
LOWER_BOUND_RANGE = (-5.0, 0.0)  # [lo, hi): the lower-bound gate's L


def lower_bound_error(value: float) -> Optional[str]:
    """Why ``value`` is not a lower bound L of the gate (L in [-5, 0)), or None when it is."""
    lo, hi = LOWER_BOUND_RANGE
    if not (math.isfinite(float(value)) and lo <= float(value) < hi):
        return f"lower_bound must lie in [{lo:g}, {hi:g}), got {value}"
    return None


def head_dims_error(K: int, V: int) -> Optional[str]:
    """Why head dims K, V cannot run (each in 1..`MAX_HEAD_DIM`), or None when they can."""
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM or K < 1 or V < 1:
        return f"head dims must be in 1..{MAX_HEAD_DIM}, got K={K}, V={V}"
    return None


# Returns the targets of a problem's checkpoints (see `PrefillProblem.checkpoint_provider`).
CheckpointProvider = Callable[[], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class PrefillProblem:
    """One varlen launch over packed sequences.

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (raw when a gate is fused, else the log
    decay); beta: [T, HV]. Inputs may be fp32, bf16 or fp16; arithmetic is fp32.
    bounds: the host offsets [0, ..., T] of the N sequences (the backends build their launch
    tables from them; no device copy of them is made per launch).
    pool: [S, HV, V, K] (``state_v_first``) or [S, HV, K, V], fp32 or bf16, updated in place.
    indices: [N] int64 on the device: sequence n reads and (without write_indices) writes
    ``pool[indices[n]]``; -1 means a zero initial state and no write-back.
    write_indices: [N] int64 on the device, or None (then ``indices``): sequence n writes its
    final state to ``pool[write_indices[n]]`` (-1: no write) and still reads its initial
    state from ``pool[indices[n]]`` (-1: zeros), so a launch can leave the rows it reads
    untouched (its caller commits by remapping rows). A row of write_indices must not be
    read by another sequence of the launch, and no two sequences write one row (the
    caller's promise; nothing checks it). Checkpoints, saved_states (the rows as read),
    nonfinite, o and o_out are unaffected.
    A_log: [HV] or None; dt_bias: [HV, K] or None; lower_bound: float or None.
    checkpoint_tokens: packed token positions (host ints), each a chunk end of its sequence
    (``bounds[n] + 64 j``, j >= 1, or ``bounds[n + 1]``), distinct; checkpoint_states: one
    target per position, each one pool row's shape, dtype and device, all with the same
    strides, anywhere in memory (`kernels.checkpoints`), receiving the state after it.
    checkpoint_provider: None, or in place of checkpoint_states (then empty) a zero-argument
    callable returning those targets: a backend calls it once, when it first needs them
    (`kernels.checkpoints.checkpoint_targets`, which checks what it returns), so a caller's
    host work to find them (placing cache entries) runs while the launch's first stages do;
    never when there is no checkpoint.
    nonfinite: [N + 1] int32 on the device, zeros (None: not checked): the backend sets [n]
    to 1 when sequence n's final state or its tokens of o (as stored, in their dtypes) hold
    a NaN or Inf; a backend may set [N] instead of [n] for o (which sequence is then found
    by a pass over o). From the same launch: no second read of o or of the states.
    saved_states: None, or [N, ...] with a pool row's shape and dtype per sequence (any
    row stride, a pool row's strides inside): receives sequence n's initial state as read,
    its pool row before the launch writes it (unspecified for a sequence of index -1,
    whose row is not written), before the launch writes any pool row: a launch
    transaction's copy (`save_initial_states`, or the Triton decode kernel as it reads the
    rows: no second read of them).
    input_checks: [1] int32 on the device, zero (None: not checked): the backend sets it to
    1 when a value of q, k, v, g or beta that the launch reads is a NaN or Inf, or, when g
    is the log decay (no gate), > 0. From the kernels that read the inputs anyway: no pass
    of its own. The launch still runs: its caller rolls it back when the check fails (and
    finds which input failed with a pass of its own, on that path alone).
    o_out: None, or [T, HV, V] contiguous in v's dtype on the device: where the launch
    writes o (and what it returns as o) instead of a tensor of its own.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    bounds: tuple[int, ...]
    pool: torch.Tensor
    indices: torch.Tensor
    state_v_first: bool
    scale: float
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    lower_bound: Optional[float]
    use_qk_l2norm: bool
    use_beta_sigmoid: bool
    allow_neg_eigval: bool
    output_intermediate_states: bool
    checkpoint_tokens: tuple[int, ...] = ()
    checkpoint_states: tuple[torch.Tensor, ...] = ()
    nonfinite: Optional[torch.Tensor] = None
    checkpoint_provider: Optional[CheckpointProvider] = None
    saved_states: Optional[torch.Tensor] = None
    input_checks: Optional[torch.Tensor] = None
    o_out: Optional[torch.Tensor] = None
    write_indices: Optional[torch.Tensor] = None

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    @property
    def num_chunks(self) -> int:
        """NT: chunks over all sequences, ceil(length / 64) each (a 1-token sequence is one)."""
        return sum((n + CHUNK_SIZE - 1) // CHUNK_SIZE for n in self.lengths)


def packed_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    bounds: Sequence[int],
    pool: torch.Tensor,
    indices: torch.Tensor,
    scale: Optional[float],
    A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    allow_neg_eigval: bool,
    state_v_first: bool = True,
    output_intermediate_states: bool = False,
    checkpoint_tokens: tuple[int, ...] = (),
    checkpoint_states: Sequence[torch.Tensor] = (),
    nonfinite: Optional[torch.Tensor] = None,
    checkpoint_provider: Optional[CheckpointProvider] = None,
    saved_states: Optional[torch.Tensor] = None,
    input_checks: Optional[torch.Tensor] = None,
    o_out: Optional[torch.Tensor] = None,
    write_indices: Optional[torch.Tensor] = None,
) -> PrefillProblem:
    """The problem of packed inputs its caller has checked against the contract above
    (shapes as `PrefillProblem` gives them, all on one device; nothing is checked here).

    ``bounds``: the host offsets [0, ..., T] of the N sequences; ``indices``: [N] int64 pool rows
    on that device; ``scale`` None means K ** -0.5; dt_bias [HV, K] or [HV * K];
    checkpoints as `PrefillProblem` holds them (`kernels.checkpoints` checks them; their
    targets given, or ``checkpoint_provider`` to produce them when the launch needs them);
    ``nonfinite``: the [N + 1] int32 zeros that receive the non-finite flags, or None;
    ``saved_states``: where the launch copies the rows it reads, or None;
    ``input_checks``: the [1] int32 zero that receives the input check, or None;
    ``o_out``: where o goes, or None;
    ``write_indices``: [N] int64 pool rows on that device that receive the final states
    instead of ``indices``' (-1: no write), or None.
    """
    HV, K = v.shape[1], q.shape[2]
    bounds = tuple(bounds)
    return PrefillProblem(
        q=q, k=k, v=v, g=g, beta=beta, bounds=bounds, pool=pool, indices=indices,
        state_v_first=state_v_first, scale=float(K ** -0.5 if scale is None else scale),
        A_log=A_log, dt_bias=None if dt_bias is None else dt_bias.reshape(HV, K),
        lower_bound=None if lower_bound is None else float(lower_bound),
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval, output_intermediate_states=output_intermediate_states,
        checkpoint_tokens=checkpoint_tokens, checkpoint_states=tuple(checkpoint_states), nonfinite=nonfinite,
        checkpoint_provider=checkpoint_provider, saved_states=saved_states, input_checks=input_checks,
        o_out=o_out, write_indices=write_indices,
    )


def save_initial_states(p: PrefillProblem) -> None:
    """Copy each sequence's pool row as read (``p.indices``) into ``p.saved_states`` (queued
    on the current stream, no synchronization; a sequence of index -1 receives row 0's)."""
    assert p.saved_states is not None
    torch.index_select(p.pool, 0, p.indices.clamp(min=0), out=p.saved_states)


# A backend runs a problem: returns o [T, HV, V] in v's dtype and, when
# output_intermediate_states, h [NT, HV, V, K] (or [NT, HV, K, V]) in fp32: the state
# before each chunk; final states are written into pool rows in place (those of
# write_indices when given, else of indices), and the state after each checkpoint
# position into its target (checkpoint_states, or the checkpoint_provider's, asked once);
# the flags into nonfinite, the input check into input_checks.
Backend = Callable[[PrefillProblem], tuple[torch.Tensor, Optional[torch.Tensor]]]
