"""The Triton backend: runs a `PrefillProblem` on CUDA (or the Triton interpreter).

Sequences of two or more tokens take the chunked path: the intra-chunk matrices, the
solve and the WY factors (the `intra` and `wy` kernels), then the state pass, which also computes o (or, by config, leaves
that to a separate parallel output kernel). Batches of few sequence-heads run in pieces
(`triton_plan`): on CUDA the state pass of each piece runs on a high-priority side stream
while the parallel stages of the next pieces run on the caller's stream. Single-token
sequences take the recurrent decode kernel. Both paths read initial states from, and write
final states to, the pool rows named by ``p.indices`` inside the kernels themselves.

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

import os
from functools import lru_cache
from typing import Callable, Optional

import torch

from .problem import CHUNK_SIZE, PrefillProblem
from .triton_kernels import (
    LaunchConfig,
    chunk_intra_kernel,
    chunk_output_kernel,
    chunk_state_kernel,
    chunk_wy_kernel,
    recurrent_step_kernel,
    select_config,
)
from .triton_kernels.config import fuse_output, piece_chunks, state_launch
from .triton_plan import LaunchPlan, launch_plan
from .triton_kernels.gate import GATE_GIVEN, GATE_LOWER_BOUND, GATE_SOFTPLUS, LOG_DECAY_FLOOR


def _gate_mode(p: PrefillProblem) -> int:
    if p.lower_bound is not None:
        return GATE_LOWER_BOUND
    return GATE_SOFTPLUS if p.A_log is not None else GATE_GIVEN


def _pool_strides(p: PrefillProblem) -> tuple[int, int, int, int]:
    """(slot, head, key, value) element strides of the pool."""
    s = p.pool.stride()
    return (s[0], s[1], s[3], s[2]) if p.state_v_first else (s[0], s[1], s[2], s[3])


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@lru_cache(maxsize=8)
def _state_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority side stream the state passes of one device run on (one per
    device, kept for the process: creating streams per call would cost more than it saves)."""
    _, high = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device=device, priority=high)


def _run_pieces(plan: LaunchPlan, device: torch.device, parallel: Callable[[int, int], None],
                sequential: Callable[[int, int, int, int], None]) -> None:
    """Run ``parallel(c0, c1)`` (intra + WY over chunk rows [c0, c1)) and then
    ``sequential(c0, c1, s0, s1)`` (state pass, output) for each piece. On CUDA with two or
    more pieces the sequential parts go to the side stream, each after its piece's parallel
    part, and the caller's stream waits for the last of them before it goes on."""
    if device.type != "cuda" or len(plan.pieces) < 2:
        for pc in plan.pieces:
            parallel(pc.c0, pc.c1)
            sequential(pc.c0, pc.c1, pc.s0, pc.s1)
        return
    main = torch.cuda.current_stream(device)
    side = _state_stream(device)
    side.wait_stream(main)
    for pc in plan.pieces:
        parallel(pc.c0, pc.c1)
        ready = torch.cuda.Event()
        ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            sequential(pc.c0, pc.c1, pc.s0, pc.s1)
    main.wait_stream(side)


def run_triton(
    p: PrefillProblem, config: Optional[LaunchConfig] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``p``: returns o [T, HV, V] in v's dtype and, with output_intermediate_states,
    h [NT, HV, V, K] fp32 ([NT, HV, K, V] when not state_v_first). Final states go into
    ``p.pool`` rows in place. ``config`` overrides the shape-chosen launch config (bench)."""
    q, k, v, g, beta = (x.contiguous() for x in (p.q, p.k, p.v, p.g, p.beta))
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    device = q.device
    cfg = config or select_config(K, V, os.environ.get("TRITON_INTERPRET") == "1")
    n_multi = sum(1 for a, b in zip(p.bounds[:-1], p.bounds[1:]) if b - a > 1)
    plan = launch_plan(p.bounds, piece_chunks(cfg, HV, n_multi), device)
    NT = plan.num_chunks
    f32 = torch.float32

    o = torch.empty_like(v)
    h = None
    if p.output_intermediate_states:
        h = torch.empty((NT, HV, V, K) if p.state_v_first else (NT, HV, K, V), dtype=f32, device=device)
    s_hk, s_hv = (1, K) if p.state_v_first else (V, 1)
    pool_strides = _pool_strides(p)
    gate = _gate_mode(p)
    a_log = p.A_log.contiguous() if p.A_log is not None else q
    dt_bias = p.dt_bias.contiguous() if p.dt_bias is not None else q
    lower_bound = 0.0 if p.lower_bound is None else p.lower_bound
    fp32_inputs = f32 in (q.dtype, k.dtype, v.dtype)
    dot_prec = cfg.fp32_products if fp32_inputs else "tf32"
    mat = torch.float16 if cfg.fp16_operands and not fp32_inputs else f32
    # bounded entries (see intra.solve_unit_lower): unit-norm keys, sigmoid betas, decays <= 1
    fp16_solve = (mat == torch.float16 and cfg.fp16_solve and p.use_qk_l2norm and p.use_beta_sigmoid
                  and gate != GATE_GIVEN)
    flags = dict(
        GATE=gate, HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
        USE_L2NORM=p.use_qk_l2norm, BETA_SIGMOID=p.use_beta_sigmoid, NEG_EIGVAL=p.allow_neg_eigval,
    )

    if plan.decs.shape[0] > 0:
        nv = -(-V // cfg.rec_bv)
        recurrent_step_kernel[(plan.decs.shape[0] * nv, HV)](
            q, k, v, g, beta, a_log, dt_bias, o, p.pool, p.indices, h if h is not None else o,
            plan.decs, p.scale, lower_bound, *pool_strides, s_hk, s_hv,
            H=H, HV=HV, K=K, V=V, BK=max(16, _next_pow2(K)), BV=cfg.rec_bv, **flags,
            STORE_H=h is not None, num_warps=cfg.rec_warps,
        )
    if plan.chunks.shape[0] == 0:
        return o, h

    aqk = torch.empty(T, HV, CHUNK_SIZE, dtype=mat, device=device)
    tb = torch.empty(T, HV, CHUNK_SIZE, dtype=torch.float16 if fp16_solve else f32, device=device)
    rqk = torch.empty(T, HV, 2, dtype=f32, device=device)
    w = torch.empty(T, HV, K, dtype=mat, device=device)
    kg, qg = torch.empty_like(w), torch.empty_like(w)
    u = torch.empty(T, HV, V, dtype=f32, device=device)
    gexp = torch.empty(NT, HV, K, dtype=f32, device=device)
    carry = torch.empty(max(plan.num_carry, 1), HV, K, V, dtype=f32, device=device)
    fused = fuse_output(cfg, n_multi * HV)
    if fused:
        v_new, states, hk, hv = u, h if h is not None else o, s_hk, s_hv
    else:
        v_new = torch.empty_like(u)
        if h is None:  # scratch states for the output stage, [NT, HV, K, V]
            states, hk, hv = torch.empty(NT, HV, K, V, dtype=f32, device=device), V, 1
        else:
            states, hk, hv = h, s_hk, s_hv
    state_bv, state_warps, state_stages = state_launch(cfg, n_multi * HV, K, V, mat.itemsize)

    def parallel(c0: int, c1: int) -> None:
        chunks = plan.chunks[c0:c1]
        intra = dict(BK=cfg.intra_bk, BKD=cfg.intra_bkd, **flags, SAFE=gate == GATE_LOWER_BOUND, DOT_PREC=dot_prec,
                     FLOOR=LOG_DECAY_FLOOR, FP16_SOLVE=fp16_solve, DIAG16=cfg.solve_diag16, FACTORED=cfg.factored_a,
                     num_warps=cfg.intra_warps, num_stages=cfg.intra_stages)
        chunk_intra_kernel[(c1 - c0, HV)](
            q, k, g, beta, a_log, dt_bias, tb, aqk, rqk, chunks, p.scale, lower_bound, H=H, HV=HV, K=K, **intra,
        )
        chunk_wy_kernel[(c1 - c0, HV)](
            q, k, v, g, a_log, dt_bias, tb, rqk, w, u, kg, qg, gexp, chunks, lower_bound,
            H=H, HV=HV, K=K, V=V, BK=cfg.wy_bk, BV=cfg.wy_bv, GATE=gate,
            HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
            DOT_PREC=dot_prec, FLOOR=LOG_DECAY_FLOOR, BLOCK_SCAN=cfg.wy_block_scan,
            num_warps=cfg.wy_warps, num_stages=cfg.wy_stages,
        )

    def sequential(c0: int, c1: int, s0: int, s1: int) -> None:
        nv = -(-V // state_bv)
        chunk_state_kernel[((s1 - s0) * HV * nv,)](
            w, u, kg, gexp, qg, aqk, o, v_new, states, p.pool, p.indices, plan.segs[s0:s1], carry,
            *pool_strides, hk, hv, HV=HV, K=K, V=V, BK=max(16, _next_pow2(K)), BV=state_bv,
            FUSE_OUT=fused, STORE_H=not fused or h is not None, DOT_PREC=dot_prec,
            num_warps=state_warps, num_stages=state_stages,
        )
        if not fused:
            nv = -(-V // cfg.out_bv)
            chunk_output_kernel[((c1 - c0) * nv, HV)](
                qg, states, v_new, aqk, o, plan.chunks[c0:c1], hk, hv,
                HV=HV, K=K, V=V, BK=cfg.out_bk, BV=cfg.out_bv, DOT_PREC=dot_prec,
                num_warps=cfg.out_warps, num_stages=cfg.out_stages,
            )

    _run_pieces(plan, device, parallel, sequential)
    return o, h
