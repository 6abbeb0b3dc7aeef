"""Public entry points: `chunk_kda` (SGLang's serving contract), `kda_prefill`, and
`run_problem` for callers that build and check their `PrefillProblem` themselves.

`chunk_kda` and `kda_prefill` validate their arguments into a `PrefillProblem`
(`build_problem`) and hand it to one backend through `run_problem`.

All three are forward only and run under `torch.no_grad`: inputs that require grad are
accepted on every backend (the Triton kernels read raw pointers, the torch backend writes
with ``out=``), and no output requires grad.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch

from .backends import resolve_backend
from .checkpoints import Targets, check_checkpoints
from .problem import FLOAT_INPUTS, POOL_DTYPES, PrefillProblem, head_dims_error, lower_bound_error, packed_problem

POOL_REQUIRED = "KDA prefill requires an indexed initial-state pool"
G_BETA_SHORT = "g and beta must cover every q token"
TRAINING_KNOBS = (
    "kda_prefill is the inference forward path: cp_context, and disable_recompute "
    "are training-side knobs it does not implement"
)


def _reject_training_knobs(knobs: dict[str, Any]) -> None:
    """Raise NotImplementedError for the training knobs, TypeError for anything unknown."""
    unknown = sorted(set(knobs) - {"cp_context", "disable_recompute"})
    if unknown:
        raise TypeError(f"chunk_kda got unexpected keyword argument(s): {', '.join(unknown)}")
    if knobs.get("cp_context") is not None or knobs.get("disable_recompute", False):
        raise NotImplementedError(TRAINING_KNOBS)


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def _check_rank(name: str, x: torch.Tensor, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {_shape(x)}")


def _packed_bounds(
    B: int, T: int, cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor]
) -> tuple[int, ...]:
    """The sequence bounds as a host tuple, checked against B and T: from ``cu_seqlens_cpu``
    when given (nothing read back from the device), else from ``cu_seqlens`` (one copy to the
    host: a synchronization when it is on a GPU), else B sequences of T tokens."""
    if T == 0 or B == 0:
        raise ValueError(f"q has no tokens: shape [B, T] = [{B}, {T}]")
    if cu_seqlens is None and cu_seqlens_cpu is None:
        return tuple(range(0, B * T + 1, T))
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got q of batch {B}")
    for name, given in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if given is None:
            continue
        if not isinstance(given, torch.Tensor) or given.dim() != 1 or given.numel() < 2:
            raise ValueError(f"{name} must be a 1-D tensor of N + 1 >= 2 offsets, got {given!r}")
        if given.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {given.dtype}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be on the host, got a tensor on {cu_seqlens_cpu.device}")
        if cu_seqlens is not None and cu_seqlens.numel() != cu_seqlens_cpu.numel():
            raise ValueError(f"cu_seqlens_cpu must hold cu_seqlens' {cu_seqlens.numel()} offsets, "
                             f"got {cu_seqlens_cpu.numel()}")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    bounds = tuple(host.tolist())
    if cu_seqlens_cpu is not None and cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        # both on the host: comparing them costs no synchronization (on a GPU, the caller's promise)
        if tuple(cu_seqlens.tolist()) != bounds:
            raise ValueError(f"cu_seqlens_cpu must hold the same offsets as cu_seqlens, got cu_seqlens_cpu "
                             f"{list(bounds)[:17]} and cu_seqlens {cu_seqlens.tolist()[:17]}")
    if bounds[0] != 0 or bounds[-1] != T or not all(map(operator.lt, bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, increase strictly (no empty sequence) and end at T={T}, "
            f"got {list(bounds)}"
        )
    return bounds


def _check_indices(indices: torch.Tensor, n_seq: int, num_slots: int, read_values: bool,
                   device: torch.device) -> torch.Tensor:
    """``indices`` checked: shape, dtype and device (the host or ``device``) always; with
    ``read_values`` also each value in -1..num_slots-1 and no slot twice (the values come to
    the host: a synchronization when they are on a GPU). Returns them as contiguous int64
    (the Triton kernels read them at ``indices + n``: a strided view would name other rows)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.numel() != n_seq:
        shape = _shape(indices) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"initial_state_indices must have shape ({n_seq},), one per sequence, got {shape}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"initial_state_indices must be int32 or int64, got {indices.dtype}")
    if indices.device.type != "cpu" and indices.device != device:
        raise ValueError(f"initial_state_indices is on {indices.device}, q on {device} (give them on q's device "
                         f"or the host)")
    if read_values:
        host = indices.tolist()
        bad = [i for i in host if i < -1 or i >= num_slots]
        if bad:
            raise ValueError(
                f"initial_state_indices out of range for a pool of {num_slots} slots: {bad[:8]}"
            )
        live = [i for i in host if i >= 0]
        if len(set(live)) != len(live):
            raise ValueError(f"initial_state_indices repeats a slot: {host}")
    return indices.to(torch.int64).contiguous()


def build_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float],
    pool: torch.Tensor,
    indices: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float],
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    output_intermediate_states: bool,
    checkpoint_tokens: Optional[torch.Tensor] = None,
    checkpoint_states: Optional[Targets] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
) -> PrefillProblem:
    """Validate public arguments (batched layout [B, T, ...]) into a packed PrefillProblem.
    With ``cu_seqlens_cpu`` nothing is read back from the device: the sequence bounds come
    from it, and the values of ``indices`` are the caller's promise (shape and dtype checked)."""
    B, T, HV, K, V = _check_inputs(q, k, v, g, beta)
    _check_pool(pool, (HV, V, K) if state_v_first else (HV, K, V), state_v_first, q.device)
    _check_gate(A_log, dt_bias, lower_bound, HV, K, q.device)
    _check_scale(scale)
    device = q.device

    bounds = _packed_bounds(B, T, cu_seqlens, cu_seqlens_cpu)
    n_seq = len(bounds) - 1
    trusted = cu_seqlens_cpu is not None and isinstance(indices, torch.Tensor) and indices.device.type != "cpu"
    idx = _check_indices(indices, n_seq, pool.shape[0], read_values=not trusted, device=device).to(device)
    if pool.shape[0] == 0:  # every index is -1 (checked above, or the caller's promise): nothing to read or write
        raise ValueError(f"initial_state has no slot: got a pool of shape {_shape(pool)}")
    positions, ckpt = check_checkpoints(checkpoint_tokens, checkpoint_states, bounds, pool)

    def packed(x: torch.Tensor) -> torch.Tensor:
        """[B, T', ...] -> [B * T, ...]: one view when T' = T and B = 1 (the serving call)."""
        if B == 1:
            return x[0] if x.shape[1] == T else x[0, :T]
        return (x if x.shape[1] == T else x[:, :T]).flatten(0, 1)

    return packed_problem(
        packed(q), packed(k), packed(v), packed(g), packed(beta), bounds=bounds, pool=pool,
        indices=idx, scale=scale, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, output_intermediate_states=output_intermediate_states,
        checkpoint_tokens=positions, checkpoint_states=ckpt,
    )


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(B, T, HV, K, V) of the batched inputs q, k [B, T, H, K], v [B, T, HV, V], g [B,
    T', HV, K], beta [B, T', HV] (T' >= T; HV a multiple of H), float dtypes on q's device;
    ValueError naming the first that is not."""
    _check_rank("q", q, 4)
    _check_rank("k", k, 4)
    _check_rank("v", v, 4)
    _check_rank("g", g, 4)
    _check_rank("beta", beta, 3)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {_shape(q)}, got {_shape(k)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T} as in q, got {_shape(v)}")
    if H < 1 or HV < 1:
        raise ValueError(f"q/k and v must each have at least one head, got H={H} (q {_shape(q)}) and "
                         f"HV={HV} (v {_shape(v)})")
    if HV % H != 0:
        raise ValueError(f"v's heads HV={HV} must be a multiple of q/k's heads H={H} (GVA)")
    if why := head_dims_error(K, V):
        raise ValueError(why)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype not in FLOAT_INPUTS:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if g.shape[0] != B or g.shape[2:] != (HV, K) or beta.shape[0] != B or beta.shape[2] != HV:
        raise ValueError(
            f"g must be [B, T', HV, K] and beta [B, T', HV] with B={B}, HV={HV}, K={K}, "
            f"got g {_shape(g)}, beta {_shape(beta)}"
        )
    if g.shape[1] < T or beta.shape[1] < T:
        raise ValueError(G_BETA_SHORT)
    return B, T, HV, K, V


def _check_pool(pool: torch.Tensor, want: tuple[int, int, int], state_v_first: bool, device: torch.device) -> None:
    """ValueError unless ``pool`` is [S, *want] (the state's dims in its layout), float32 or
    bfloat16, on ``device``, no two of its elements in one place of memory."""
    if not isinstance(pool, torch.Tensor):
        raise ValueError(f"initial_state must be a torch.Tensor, the pool [num_slots, HV, V, K], "
                         f"got {type(pool).__name__}")
    if pool.dim() != 4:
        raise ValueError(f"initial_state must be the pool [num_slots, HV, V, K], got shape {_shape(pool)}")
    if tuple(pool.shape[1:]) != want:
        layout = "[num_slots, HV, V, K]" if state_v_first else "[num_slots, HV, K, V]"
        raise ValueError(f"initial_state must be {layout} = [S, {', '.join(map(str, want))}], got {_shape(pool)}")
    if pool.dtype not in POOL_DTYPES:
        raise ValueError(f"initial_state must be float32 or bfloat16, got {pool.dtype}")
    if pool.device != device:
        raise ValueError(f"initial_state is on {pool.device}, q on {device}")
    if _may_overlap(pool):
        raise ValueError(f"initial_state must not overlap itself (an expanded view, say): shape {_shape(pool)}, "
                         f"strides {pool.stride()}; rows written in place would share memory")


def _may_overlap(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` may share memory: False when, dims ordered by stride,
    each stride exceeds the reach of the dims before it (the sufficient condition; every
    dense layout and every slice of one meets it)."""
    reach = 0
    for stride, size in sorted((s, n) for s, n in zip(x.stride(), x.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _describe(x: Any) -> str:
    return f"{_shape(x)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_gate(A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], lower_bound: Optional[float],
                HV: int, K: int, device: torch.device) -> None:
    """ValueError unless the gate's parameters fit: A_log a float tensor [HV], dt_bias a
    float tensor [HV, K] or [HV * K] (only with A_log or lower_bound: without either g is
    the log decay and dt_bias would be ignored), both on ``device``, a valid lower bound."""
    for name, x, shapes in (("A_log", A_log, ((HV,),)), ("dt_bias", dt_bias, ((HV, K), (HV * K,)))):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():  # both backends convert to fp32
            want = " or ".join(map(str, shapes))
            raise ValueError(f"{name} must be a float tensor of shape {want}, got {_describe(x)}")
        if tuple(x.shape) not in shapes:
            raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {_shape(x)}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, q on {device}")
    if dt_bias is not None and A_log is None and lower_bound is None:
        raise ValueError("dt_bias needs A_log or lower_bound (without either, g is taken as the log decay "
                         "and dt_bias would be ignored)")
    if lower_bound is not None and (why := lower_bound_error(lower_bound)):
        raise ValueError(why)


def _check_scale(scale: Optional[float]) -> None:
    """ValueError unless ``scale`` is None or a finite number."""
    if scale is None:
        return
    try:
        value = float(scale)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"scale must be a finite number or None, got {_describe(scale)}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite number, got {value}")


def run_problem(
    problem: PrefillProblem, backend: Optional[str] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a `PrefillProblem` its caller built (`kernels.problem.packed_problem`) and checked
    against the contract itself: no check is repeated here, no host synchronization added.

    ``backend``: "torch", "triton" or None (the default for the inputs' device). Returns
    o [T, HV, V] in v's dtype and, with ``output_intermediate_states``, h [NT, HV, V, K]
    (fp32; [NT, HV, K, V] when not v-first); final states are written into the pool rows.
    Runs under `torch.no_grad`, entered only when grad mode is on: a caller that keeps it
    off (the service's launch threads) pays for no context (microseconds of a small launch).
    """
    run = resolve_backend(backend, problem.q.device)
    if not torch.is_grad_enabled():
        return run(problem)
    with torch.no_grad():
        return run(problem)


@torch.no_grad()
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    initial_state_indices: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    output_intermediate_states: bool = False,
    *,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = True,
    backend: Optional[str] = None,
    checkpoint_tokens: Optional[torch.Tensor] = None,
    checkpoint_states: Optional[Targets] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    **training_knobs: Any,
):
    """KDA chunked prefill in place on an indexed state pool (SGLang's contract).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T', HV, K]; beta: [B, T', HV], T' >= T
    (trimmed to T). B > 1 without cu_seqlens: B equal-length sequences; with cu_seqlens
    ([N + 1], int32/int64) B must be 1. initial_state: the pool [S, HV, V, K] (or
    [S, HV, K, V] with ``state_v_first=False``), fp32 or bf16; initial_state_indices [N]:
    each sequence's slot, -1 for a zero state and no write-back. Final states are written
    back in place; no other slot is touched.

    Returns o [B, T, HV, V] in v's dtype, or ``(o, h)`` with ``output_intermediate_states``,
    h [1, NT, HV, V, K] (fp32; [1, NT, HV, K, V] when not v-first): the state before each chunk.

    Checkpoints: ``checkpoint_tokens`` (int64 [C], positions in the packed token axis) and
    ``checkpoint_states`` (the caller's targets: one output tensor [C, HV, V, K], [C, HV, K, V]
    when not v-first, or a sequence of C tensors [HV, V, K] / [HV, K, V] anywhere in memory
    sharing one set of strides; the pool's dtype and device). Each position must be
    ``cu_seqlens[n] + 64 j`` with j >= 1, at most the end of its sequence n, or exactly that
    end ``cu_seqlens[n + 1]``; positions are distinct. Target c receives the state of its
    sequence after the tokens before ``checkpoint_tokens[c]`` (its initial state included),
    written by the same launch: no second pass, no per-chunk state tensor. Other memory is
    not touched.

    ``cu_seqlens_cpu``: the same offsets as ``cu_seqlens`` on the host (int32/int64 [N + 1],
    as fla and SGLang pass them; ``cu_seqlens`` itself may then be omitted). With it
    nothing is read back from the device: the bounds are
    taken from it, and the values of ``initial_state_indices`` on a GPU are not checked
    (their shape and dtype are: the caller promises each is -1 or a distinct slot of the
    pool), so a call with ``cu_seqlens`` and ``cu_seqlens_cpu`` both given, after one
    eager call of the same layout (its launch tables are cached), can be captured in a CUDA
    graph. Checkpoint positions are always read on the host. When ``cu_seqlens`` is on the
    host too, the two must hold the same offsets.

    Refused with a ValueError naming the argument, before anything is written: an empty
    sequence (cu_seqlens must increase strictly), a pool with no slot or whose elements
    overlap in memory (an expanded view), no head in q/k or v, indices on a device other
    than q's or the host, A_log / dt_bias that are not float tensors of shape [HV] /
    [HV, K] or [HV * K] on q's device, dt_bias without A_log or lower_bound (g is then the
    log decay and dt_bias would be ignored), a scale that is not finite. Any strides of the
    inputs, the pool and the indices are accepted.
    """
    _reject_training_knobs(training_knobs)
    if initial_state is None or initial_state_indices is None:
        raise ValueError(POOL_REQUIRED)
    problem = build_problem(
        q, k, v, g, beta, scale=scale, pool=initial_state, indices=initial_state_indices,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_qk_l2norm=use_qk_l2norm_in_kernel, use_beta_sigmoid=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        output_intermediate_states=output_intermediate_states,
        checkpoint_tokens=checkpoint_tokens, checkpoint_states=checkpoint_states, cu_seqlens_cpu=cu_seqlens_cpu,
    )
    o, h = run_problem(problem, backend)
    o = o.reshape(v.shape)
    if output_intermediate_states:
        return o, h.unsqueeze(0)
    return o


@torch.no_grad()
def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    *,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = True,
    backend: Optional[str] = None,
    cp_context: Any = None,
    disable_recompute: bool = False,
    checkpoint_tokens: Optional[torch.Tensor] = None,
    checkpoint_states: Optional[Targets] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA prefill, functional form: returns ``(o, final_state)``.

    Same tensors as `chunk_kda`; initial_state is [N, HV, V, K] (one per sequence, fp32 or
    bf16; not modified) or None for zeros. final_state: [N, HV, V, K] in initial_state's
    dtype (fp32 when None). Checkpoints as in `chunk_kda`, ``checkpoint_states`` in the
    final states' dtype.
    """
    _reject_training_knobs({"cp_context": cp_context, "disable_recompute": disable_recompute})
    # the shapes read here (to size the states) are checked first; chunk_kda checks the rest
    _check_rank("q", q, 4)
    _check_rank("v", v, 4)
    B, T, H, K = q.shape
    if cu_seqlens is None:
        n_seq = B
    elif not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor of N + 1 >= 2 offsets, got {cu_seqlens!r}")
    else:
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise ValueError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
    if initial_state is None:
        HV, V = v.shape[2], v.shape[3]
        shape = (n_seq, HV, V, K) if state_v_first else (n_seq, HV, K, V)
        states = torch.zeros(shape, dtype=torch.float32, device=q.device)
    else:
        if initial_state.dim() != 4 or initial_state.shape[0] != n_seq:
            raise ValueError(
                f"initial_state must be [N={n_seq}, HV, V, K], one per sequence, got {_shape(initial_state)}"
            )
        states = initial_state.clone()
    indices = torch.arange(n_seq, dtype=torch.int64, device=q.device)
    o = chunk_kda(
        q, k, v, g, beta, scale, states, indices, use_qk_l2norm_in_kernel, cu_seqlens,
        A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, backend=backend,
        checkpoint_tokens=checkpoint_tokens, checkpoint_states=checkpoint_states,
    )
    return o, states
