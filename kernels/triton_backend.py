"""The Triton backend: runs a `PrefillProblem` on CUDA (or the Triton interpreter).

Sequences of two or more tokens take the chunked path: the intra-chunk kernel (A and the
solve), the WY kernel, then the state pass, which also computes o (or, by config, leaves
that to a separate parallel output kernel). Single-token sequences take the recurrent
decode kernel. Both paths read initial states from, and write final states to, the pool
rows named by ``p.indices`` inside the kernels themselves.

Intermediates are fp32 whatever the input dtype: each bf16 rounding on the way to o costs
about as much error as rounding o itself, which would break the 5e-3 accuracy target.
Products run in tf32 for 16-bit inputs and in full fp32 ("ieee") for fp32 inputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

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
from .triton_kernels.config import fuse_output, state_block_v
from .triton_kernels.gate import GATE_GIVEN, GATE_LOWER_BOUND, GATE_SOFTPLUS, LOG_DECAY_FLOOR


@dataclass(frozen=True)
class LaunchPlan:
    """Device index tables for one varlen layout (int64).

    chunks: [NTc, 3] (first token, end token, h index) for each chunk of each sequence of
    >= 2 tokens; seqs: [Nc, 4] (sequence id, first token, end token, h index of its first
    chunk) for those sequences; decs: [N1, 3] (sequence id, token, h index) for the
    single-token ones. num_chunks: NT over all sequences (a 1-token sequence counts one).
    """

    chunks: torch.Tensor
    seqs: torch.Tensor
    decs: torch.Tensor
    num_chunks: int


@lru_cache(maxsize=64)
def launch_plan(bounds: tuple[int, ...], device: torch.device) -> LaunchPlan:
    """The index tables for packed sequences with offsets ``bounds``, built on the host and
    copied to ``device`` once (cached: serving repeats layouts)."""
    chunks: list[int] = []
    seqs: list[int] = []
    decs: list[int] = []
    hoff = 0
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if b - a == 1:
            decs += [n, a, hoff]
            hoff += 1
            continue
        seqs += [n, a, b, hoff]
        for t in range(a, b, CHUNK_SIZE):
            chunks += [t, min(t + CHUNK_SIZE, b), hoff]
            hoff += 1
    packed = torch.tensor(chunks + seqs + decs, dtype=torch.int64).to(device)
    nc, ns = len(chunks), len(seqs)
    return LaunchPlan(
        chunks=packed[:nc].view(-1, 3),
        seqs=packed[nc:nc + ns].view(-1, 4),
        decs=packed[nc + ns:].view(-1, 3),
        num_chunks=hoff,
    )


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
    plan = launch_plan(p.bounds, device)
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
    dot_prec = "ieee" if fp32_inputs else "tf32"
    mat = torch.float16 if cfg.fp16_operands and not fp32_inputs else f32
    flags = dict(
        GATE=gate, HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
        USE_L2NORM=p.use_qk_l2norm, BETA_SIGMOID=p.use_beta_sigmoid, NEG_EIGVAL=p.allow_neg_eigval,
    )

    n_chunks, n_seqs = plan.chunks.shape[0], plan.seqs.shape[0]
    if n_chunks > 0:
        tb = torch.empty(T, HV, CHUNK_SIZE, dtype=f32, device=device)
        aqk = torch.empty(T, HV, CHUNK_SIZE, dtype=mat, device=device)
        rqk = torch.empty(T, HV, 2, dtype=f32, device=device)
        chunk_intra_kernel[(n_chunks, HV)](
            q, k, g, beta, a_log, dt_bias, tb, aqk, rqk, plan.chunks, p.scale, lower_bound,
            H=H, HV=HV, K=K, BK=cfg.intra_bk, BKD=cfg.intra_bkd, **flags,
            SAFE=gate == GATE_LOWER_BOUND, DOT_PREC=dot_prec, FLOOR=LOG_DECAY_FLOOR,
            num_warps=cfg.intra_warps,
        )
        w = torch.empty(T, HV, K, dtype=mat, device=device)
        kg, qg = torch.empty_like(w), torch.empty_like(w)
        u = torch.empty(T, HV, V, dtype=f32, device=device)
        gexp = torch.empty(NT, HV, K, dtype=f32, device=device)
        chunk_wy_kernel[(n_chunks, HV)](
            q, k, v, g, a_log, dt_bias, tb, rqk, w, u, kg, qg, gexp, plan.chunks, lower_bound,
            H=H, HV=HV, K=K, V=V, BK=cfg.wy_bk, BV=cfg.wy_bv, GATE=gate,
            HAS_A_LOG=p.A_log is not None, HAS_DT_BIAS=p.dt_bias is not None,
            DOT_PREC=dot_prec, FLOOR=LOG_DECAY_FLOOR, num_warps=cfg.wy_warps,
        )
        fused = fuse_output(cfg, n_seqs * HV)
        if fused:
            v_new, states, hk, hv = u, h if h is not None else o, s_hk, s_hv
        else:
            v_new = torch.empty_like(u)
            if h is None:  # scratch states for the output stage, [NT, HV, K, V]
                states, hk, hv = torch.empty(NT, HV, K, V, dtype=f32, device=device), V, 1
            else:
                states, hk, hv = h, s_hk, s_hv
        state_bv = state_block_v(cfg, n_seqs * HV, K, V)
        nv = -(-V // state_bv)
        chunk_state_kernel[(n_seqs * HV * nv,)](
            w, u, kg, gexp, qg, aqk, o, v_new, states, p.pool, p.indices, plan.seqs,
            *pool_strides, hk, hv, HV=HV, K=K, V=V, BK=max(16, _next_pow2(K)), BV=state_bv,
            FUSE_OUT=fused, STORE_H=not fused or h is not None, DOT_PREC=dot_prec,
            num_warps=cfg.state_warps, num_stages=cfg.state_stages,
        )
        if not fused:
            nv = -(-V // cfg.out_bv)
            chunk_output_kernel[(n_chunks * nv, HV)](
                qg, states, v_new, aqk, o, plan.chunks, hk, hv,
                HV=HV, K=K, V=V, BK=cfg.out_bk, BV=cfg.out_bv, DOT_PREC=dot_prec,
                num_warps=cfg.out_warps, num_stages=cfg.out_stages,
            )

    if plan.decs.shape[0] > 0:
        nv = -(-V // cfg.rec_bv)
        recurrent_step_kernel[(plan.decs.shape[0] * nv, HV)](
            q, k, v, g, beta, a_log, dt_bias, o, p.pool, p.indices, h if h is not None else o,
            plan.decs, p.scale, lower_bound, *pool_strides, s_hk, s_hv,
            H=H, HV=HV, K=K, V=V, BK=max(16, _next_pow2(K)), BV=cfg.rec_bv, **flags,
            STORE_H=h is not None, num_warps=cfg.rec_warps,
        )
    return o, h
