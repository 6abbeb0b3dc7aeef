"""Single-token sequences (decode): the per-token recurrence, in place on the pool.

    S = diag(exp(g)) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q

One program per (sequence, value head, V block); the [K, BV] state slice is read from
``pool[indices[seq]]`` (index -1: zeros) and the new state written to
``pool[write_indices[seq]]`` (index -1: no write; the same row unless the problem has
`PrefillProblem.write_indices`); with SAVE, the row as read is also stored into
``saved[seq]`` first (a launch transaction's copy of the rows it reads, taken by the kernel
that reads them: `StateTargets.saved`); with CHECKPOINT, the new state also goes to the
checkpoint row its chunk names (`state.store_checkpoint`); with FLAG, a NaN or Inf in its
o or its new state (as stored) sets ``flags[sequence]``; with CHECK, its raw inputs are
checked as they are loaded (`checks.nan_where_bad`, `checks.flag_if_nan`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import LaunchConfig
from .gate import activate_beta, gate_params, log_decay
from .inputs import StageInputs, StateTargets
from .checks import flag_if_nan, flag_nonfinite, nan_where_bad
from .state import store_checkpoint


@triton.jit
def recurrent_step_kernel(
    q, k, v, g, beta, a_log, dt_bias, o, pool, indices, write_indices, h, decs, ckpt_addrs, flags, saved, checks,
    scale, lower_bound,
    s_slot, s_head, s_pk, s_pv, s_hk, s_hv, c_head, c_k, c_v, s_saved,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    STORE_H: tl.constexpr, CHECKPOINT: tl.constexpr, FLAG: tl.constexpr, SAVE: tl.constexpr,
    CHECK: tl.constexpr,
):
    """Grid (N1 * cdiv(V, BV), HV). decs: [N1, 3] int64 (sequence id, token, h index).

    q, k: [T, H, K]; v, o: [T, HV, V]; g: [T, HV, K]; beta: [T, HV]; pool strides as in
    the state pass; indices, write_indices: [N] int64, the rows read and written (-1:
    zeros, no write; always given, ``indices`` itself when the rows written are the rows
    read); h (when STORE_H): [NT, HV, .., ..] fp32, receives the initial state;
    ckpt_addrs (CHECKPOINT) and flags [N + 1] int32 (FLAG) as in `StateTargets`; saved
    (SAVE): [N, HV, ., .] in the pool's dtype, its rows ``s_saved`` apart, the pool's
    strides inside a row; checks (CHECK): the launch's input check, [1] int32.
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v = tl.program_id(0) % NV
    i_n = tl.program_id(0) // NV
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    seq = tl.load(decs + i_n * 3)
    t = tl.load(decs + i_n * 3 + 1)
    i_g = tl.load(decs + i_n * 3 + 2)
    slot = tl.load(indices + seq)
    dst = tl.load(write_indices + seq)  # loaded with the row read, not at the store

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + (t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_b = tl.load(beta + t * HV + i_hv).to(tl.float32)
    b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    if CHECK:  # the raw values, as loaded (0 where masked)
        bad = nan_where_bad(b_q, False) + nan_where_bad(b_k, False) + nan_where_bad(b_g, GATE == 0)
        flag_if_nan(checks, tl.sum(bad, axis=0) + tl.sum(nan_where_bad(b_v, False), axis=0)
                    + nan_where_bad(b_b, False))
    if USE_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    bias, a = gate_params(a_log, dt_bias, i_hv, o_k, m_k, K, HAS_A_LOG, HAS_DT_BIAS)
    b_g = log_decay(b_g, bias, a, lower_bound, GATE)
    b_b = activate_beta(b_b, BETA_SIGMOID, NEG_EIGVAL)

    p_pool = pool + slot * s_slot + i_hv * s_head + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    m_live = m_kv & (slot + o_k * 0 >= 0)[:, None]  # slot -1: zeros
    b_raw = tl.load(p_pool, mask=m_live, other=0.0)  # [BK, BV] math layout, the pool's dtype
    if SAVE:  # before this program's store below; no other program writes this row's slice
        p_saved = saved + seq * s_saved + i_hv * s_head + o_k[:, None] * s_pk + o_v[None, :] * s_pv
        tl.store(p_saved, b_raw, mask=m_live)
    b_s = b_raw.to(tl.float32)
    if STORE_H:
        p_h = h + (i_g * HV + i_hv) * (K * V) + o_k[:, None] * s_hk + o_v[None, :] * s_hv
        tl.store(p_h, b_s, mask=m_kv)
    b_s = b_s * tl.where(m_k, tl.exp(b_g), 0.0)[:, None]
    b_d = b_b * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    b_s = b_s + b_k[:, None] * b_d[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0).to(o.dtype.element_ty)
    tl.store(o + (t * HV + i_hv) * V + o_v, b_o, mask=m_v)
    b_final = b_s.to(pool.dtype.element_ty)
    p_dst = pool + dst * s_slot + i_hv * s_head + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    tl.store(p_dst, b_final, mask=m_kv & (dst + o_k * 0 >= 0)[:, None])  # dst -1: no write
    if FLAG:
        flag_nonfinite(flags + seq, b_o, m_v)
        flag_nonfinite(flags + seq, b_final, m_kv)
    if CHECKPOINT:
        store_checkpoint(tl.load(ckpt_addrs + i_g), i_hv, b_s, o_k, o_v, K, V, c_k, c_v, c_head, pool)


def launch_decode(x: StageInputs, decs: torch.Tensor, o: torch.Tensor, st: StateTargets, cfg: LaunchConfig) -> None:
    """One recurrent step for each single-token sequence of ``decs`` ([N1, 3],
    `kernels.triton_plan`): o [T, HV, V] at its token, its new state to the pool row it
    writes (and h, checkpoints, non-finite flags, the rows as read into ``st.saved``, the
    raw inputs' checks into ``x.checks``)."""
    h, ckpt_addrs = st.pointers(o)
    saved = st.pool if st.saved is None else st.saved
    grid = (decs.shape[0] * triton.cdiv(x.V, cfg.rec_bv), x.HV)
    recurrent_step_kernel[grid](
        x.q, x.k, x.v, x.g, x.beta, x.a_log, x.dt_bias, o, st.pool, st.indices, st.write_indices, h, decs,
        ckpt_addrs, st.flag_pointer(st.indices), saved, x.check_pointer(st.indices),
        x.scale, x.lower_bound, *st.pool_strides, *st.h_strides, *st.ckpt_strides, saved.stride(0),
        H=x.H, HV=x.HV, K=x.K, V=x.V, BK=max(16, triton.next_power_of_2(x.K)), BV=cfg.rec_bv, **x.flags,
        STORE_H=st.h is not None, CHECKPOINT=st.ckpt_addrs is not None, FLAG=st.flags is not None,
        SAVE=st.saved is not None, CHECK=x.checks is not None, num_warps=cfg.rec_warps,
    )
