"""The Triton backend: runs a `PrefillProblem` on CUDA (or the Triton interpreter).

The pipeline (`run_triton`), one launcher per stage beside its kernel in
`kernels.triton_kernels`:

    decode  single-token sequences: one recurrent step each          (`recurrent.launch_decode`)
    intra   per chunk: A_qk, A_kk, the solve -> T diag(beta), norms   (`intra.launch_intra`; the
            bounded gate with 16-bit inputs: `intra_bounded`, with `LaunchConfig.bounded_intra`)
    wy      per chunk: the WY factors w, u, kg, qg                     (`wy.launch_wy`)
    state   per sequence: the chunk-to-chunk state pass, and o         (`state.launch_state`)
    output  per chunk, when o is not computed in the state pass        (`output.launch_output`)

With ``p.input_checks`` the kernels that load the raw inputs check them as they do: decode
all five, intra q, k, g and beta, wy v (`triton_kernels.checks`).

Batches of few sequence-heads run in pieces (`triton_plan`): on CUDA the state pass of each
piece runs on a high-priority side stream while the parallel stages of the next pieces run
on the caller's stream. The decode and state stages read initial states from the pool
rows named by ``p.indices`` and write final states to those named by ``p.write_indices``
(``p.indices`` when None) themselves, and checkpoints to their targets.

Precision: no intermediate is bf16 (each bf16 rounding on the way to o costs about as much
error as rounding o itself, which would break the 5e-3 accuracy target). States, u and the
gate sums are fp32. For 16-bit inputs w, kg, qg and A_qk are stored in fp16 (an 11-bit
significand, as tf32's) and multiplied in fp16, and so are the triangular solve and
T diag(beta) where their entries are provably bounded (`LaunchConfig.fp16_solve`); other
products run in tf32. fp32 inputs keep fp32 throughout; their products run as three tf32
products of high and low parts ("tf32x3", about fp32's accuracy, on tensor cores) unless
`LaunchConfig.fp32_products` asks for fp32 FMAs ("ieee").
"""
from __future__ import annotations

from functools import cache, lru_cache
from typing import Callable, Optional

import torch

from .checkpoints import checkpoint_targets
from .problem import PrefillProblem, save_initial_states
from .triton_kernels import LaunchConfig, select_config
from .triton_kernels.config import fuse_output, piece_chunks, state_launch
from .triton_kernels.gate import GATE_GIVEN, GATE_LOWER_BOUND, GATE_SOFTPLUS
from .triton_kernels.inputs import StageInputs, StateTargets
from .triton_kernels.intra import IntraOutputs, launch_intra
from .triton_kernels.intra_bounded import bounded_intra_applies, launch_intra_bounded
from .triton_kernels.output import launch_output
from .triton_kernels.recurrent import launch_decode
from .triton_kernels.state import launch_state
from .triton_kernels.wy import WyOutputs, launch_wy
from .cuda_streams import on_stream
from .triton_plan import LaunchPlan, Piece, checkpoint_addresses, checkpoint_chunks, launch_plan
from .triton_toolchain import configure_toolchain


def _gate_mode(p: PrefillProblem) -> int:
    if p.lower_bound is not None:
        return GATE_LOWER_BOUND
    return GATE_SOFTPLUS if p.A_log is not None else GATE_GIVEN


def stage_inputs(p: PrefillProblem, cfg: LaunchConfig) -> StageInputs:
    """The contiguous inputs, flags, product settings and input checks of ``p`` under ``cfg``."""
    q, k, v, g, beta = (x.contiguous() for x in (p.q, p.k, p.v, p.g, p.beta))
    gate = _gate_mode(p)
    fp32_inputs = torch.float32 in (q.dtype, k.dtype, v.dtype)
    mat = torch.float16 if cfg.fp16_operands and not fp32_inputs else torch.float32
    return StageInputs(
        q=q, k=k, v=v, g=g, beta=beta,
        a_log=p.A_log.contiguous() if p.A_log is not None else q,
        dt_bias=p.dt_bias.contiguous() if p.dt_bias is not None else q,
        scale=p.scale, lower_bound=0.0 if p.lower_bound is None else p.lower_bound, gate=gate,
        has_a_log=p.A_log is not None, has_dt_bias=p.dt_bias is not None, l2norm=p.use_qk_l2norm,
        beta_sigmoid=p.use_beta_sigmoid, neg_eigval=p.allow_neg_eigval,
        dot_prec=cfg.fp32_products if fp32_inputs else "tf32", mat=mat,
        # bounded entries (see intra.solve_unit_lower): unit-norm keys, sigmoid betas, decays <= 1
        fp16_solve=(mat == torch.float16 and cfg.fp16_solve and p.use_qk_l2norm and p.use_beta_sigmoid
                    and gate != GATE_GIVEN),
        checks=p.input_checks,
    )


def _state_strides(p: PrefillProblem, x: torch.Tensor) -> tuple[int, int, int, int]:
    """(row, head, key, value) element strides of a pool-layout state tensor."""
    s = x.stride()
    return (s[0], s[1], s[3], s[2]) if p.state_v_first else (s[0], s[1], s[2], s[3])


def _target_strides(p: PrefillProblem, targets: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
    """(head, key, value) element strides shared by the checkpoint ``targets`` (zeros: none)."""
    if not targets:
        return 0, 0, 0
    s = targets[0].stride()
    return (s[0], s[2], s[1]) if p.state_v_first else (s[0], s[1], s[2])


def state_targets(p: PrefillProblem, num_chunks: int, h: Optional[torch.Tensor], ckpt_chunks: list[int],
                  saved: Optional[torch.Tensor] = None, table_stream: Optional[torch.cuda.Stream] = None,
                  stages_on_table_stream: bool = False) -> StateTargets:
    """The pool, h (or None), checkpoints (after the chunks ``ckpt_chunks``, h indices of
    the ``num_chunks``; their targets asked for here, `checkpoint_targets`), non-finite
    flags and the decode kernel's copies of the rows it reads (``saved``) of ``p`` as the
    state stages address them. ``table_stream``: a stream the checkpoints' address table is
    uploaded on, so that the copy overlaps the parallel stages queued on the current
    stream instead of sitting between them and the state stages; the current stream waits
    for it unless ``stages_on_table_stream`` (the state stages run there: `_run_pieces`'s
    side stream). None: uploaded on the current stream."""
    K, V = p.q.shape[2], p.v.shape[2]
    targets = checkpoint_targets(p)
    addrs = None
    if targets and table_stream is None:
        addrs = checkpoint_addresses(num_chunks, ckpt_chunks, targets, p.q.device)
    elif targets:
        current = torch.cuda.current_stream(p.q.device)
        with on_stream(table_stream):
            addrs = checkpoint_addresses(num_chunks, ckpt_chunks, targets, p.q.device)
        if not stages_on_table_stream:
            current.wait_stream(table_stream)
            addrs.record_stream(current)  # read there: not reused before the state stages are done
    return StateTargets(
        pool=p.pool, indices=p.indices, write_indices=p.indices if p.write_indices is None else p.write_indices,
        pool_strides=_state_strides(p, p.pool),
        h=h, h_strides=(1, K) if p.state_v_first else (V, 1),
        ckpt_addrs=addrs, ckpt_strides=_target_strides(p, targets), flags=p.nonfinite, saved=saved,
    )


def _plan(bounds: tuple[int, ...], chunks_per_piece: int, device: torch.device, ckpt_chunks: list[int],
          max_levels: int) -> tuple[LaunchPlan, bool]:
    """The launch plan, and whether its segments end at the checkpoints (after the chunks
    ``ckpt_chunks``; stored after each segment's loop): when that takes at most
    ``max_levels`` state launches per piece (`LaunchConfig.state_ckpt_levels`)."""
    if ckpt_chunks and max_levels > 0:
        plan = launch_plan(bounds, chunks_per_piece, device, tuple(sorted(set(ckpt_chunks))))
        if plan.max_levels <= max_levels:
            return plan, True
    return launch_plan(bounds, chunks_per_piece, device), False


@lru_cache(maxsize=8)
def _state_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority side stream the state passes of one device run on (one per
    device, kept for the process: creating streams per call would cost more than it saves)."""
    _, high = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device=device, priority=high)


def _run_pieces(pieces: tuple[Piece, ...], device: torch.device, parallel: Callable[[int, int], None],
                sequential: Callable[[Piece], None]) -> None:
    """Run ``parallel(c0, c1)`` (the per-chunk stages over chunk rows [c0, c1)) and then
    ``sequential(piece)`` (state pass, output) for each piece. On CUDA with two or
    more pieces the sequential parts go to the side stream, each after its piece's parallel
    part, and the caller's stream waits for the last of them before it goes on."""
    if device.type != "cuda" or len(pieces) < 2:
        for pc in pieces:
            parallel(pc.c0, pc.c1)
            sequential(pc)
        return
    main = torch.cuda.current_stream(device)
    side = _state_stream(device)
    side.wait_stream(main)
    for pc in pieces:
        parallel(pc.c0, pc.c1)
        ready = torch.cuda.Event()
        ready.record(main)
        with on_stream(side):
            side.wait_event(ready)
            sequential(pc)
    main.wait_stream(side)


def run_triton(
    p: PrefillProblem, config: Optional[LaunchConfig] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``p``: returns o [T, HV, V] in v's dtype and, with output_intermediate_states,
    h [NT, HV, V, K] fp32 ([NT, HV, K, V] when not state_v_first). Final states go into
    ``p.pool`` rows in place, checkpoints into their targets. ``config`` overrides the
    shape-chosen launch config (bench)."""
    K, V = p.q.shape[2], p.v.shape[2]
    cfg = config or select_config(K, V, interpret=p.q.device.type != "cuda")  # CPU tensors: the interpreter
    configure_toolchain(p.q.device)  # before the first compile
    x = stage_inputs(p, cfg)
    n_multi = sum(1 for a, b in zip(p.bounds[:-1], p.bounds[1:]) if b - a > 1)
    if p.saved_states is not None and n_multi > 0:  # the chunked stages do not keep the rows they read
        save_initial_states(p)
    ckpt_chunks = checkpoint_chunks(p.bounds, p.checkpoint_tokens) if p.checkpoint_tokens else []
    plan, at_end = _plan(p.bounds, piece_chunks(cfg, x.HV, n_multi), x.device, ckpt_chunks, cfg.state_ckpt_levels)
    NT = plan.num_chunks
    o = torch.empty_like(x.v) if p.o_out is None else p.o_out
    h = None
    if p.output_intermediate_states:
        shape = (NT, x.HV, V, K) if p.state_v_first else (NT, x.HV, K, V)
        h = torch.empty(shape, dtype=torch.float32, device=x.device)
    fused = fuse_output(cfg, n_multi * x.HV)

    @cache
    def state_targets_once() -> StateTargets:
        """`state_targets`, built at first use: with no single-token sequence that is after
        the first piece's parallel stages are queued (at the end of its `parallel`, on the
        caller's stream), so the host work of the checkpoint targets (a provider's, then the
        address table) overlaps them instead of holding up the first launch. The table goes up
        on the side stream (not in a graph's capture, nor for a decode launch, which reads it at
        once), so its copy overlaps the parallel stages."""
        side = (x.device.type == "cuda" and plan.decs.shape[0] == 0 and ckpt_chunks
                and not torch.cuda.is_current_stream_capturing())
        st = state_targets(p, NT, h, ckpt_chunks, p.saved_states if n_multi == 0 else None,
                           _state_stream(x.device) if side else None, stages_on_table_stream=len(plan.pieces) >= 2)
        if not fused and h is None and plan.chunks.shape[0] > 0:  # the output stage's scratch states
            st = st.with_h(torch.empty(NT, x.HV, K, V, dtype=torch.float32, device=x.device), (V, 1))
        return st

    if plan.decs.shape[0] > 0:
        launch_decode(x, plan.decs, o, state_targets_once(), cfg)
    if plan.chunks.shape[0] == 0:
        return o, h

    intra = IntraOutputs.alloc(x)
    carry = torch.empty(max(plan.num_carry, 1), x.HV, K, V, dtype=torch.float32, device=x.device)
    wy = WyOutputs.alloc(x, NT)
    launch = state_launch(cfg, n_multi * x.HV, K, V, x.mat.itemsize)
    v_new = None if fused else torch.empty_like(wy.u)

    intra_stage = launch_intra_bounded if cfg.bounded_intra and bounded_intra_applies(x) else launch_intra

    def parallel(c0: int, c1: int) -> None:
        intra_stage(x, plan.chunks[c0:c1], intra, cfg)
        launch_wy(x, plan.chunks[c0:c1], intra.tb, intra.rqk, wy, cfg)
        state_targets_once()  # after the first piece's stages, on the caller's stream (a provider allocates there)

    def sequential(pc: Piece) -> None:
        st = state_targets_once()
        for s0, s1 in pc.launches():  # levels of segments, in order (one without checkpoint cuts)
            launch_state(x, plan.segs[s0:s1], wy, intra.aqk, o, v_new, st, carry, launch, cfg.state_ckpt_prefetch,
                         at_end=at_end)
        if v_new is not None:
            launch_output(x, plan.chunks[pc.c0:pc.c1], wy.qg, st, v_new, intra.aqk, o, cfg)

    _run_pieces(plan.pieces, x.device, parallel, sequential)
    return o, h
