"""Stage 3 of chunked KDA (when not fused into the state pass): outputs, all chunks in
parallel.

    o = qg h + A_qk v_new        per chunk: [64, K] x [K, BV] + [64, 64] x [64, BV]

with h the state before the chunk (from the state pass), qg = scale * Q * exp(G). With
FLAG, a program whose o tile holds a NaN or Inf sets ``flag_any`` (the launch's flags[N]:
this stage does not know its chunk's sequence).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import LaunchConfig
from .inputs import StageInputs, StateTargets
from .checks import flag_nonfinite


@triton.jit
def chunk_output_kernel(
    qg, h, v_new, aqk, o, chunks, flag_any,
    s_hk, s_hv,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, FLAG: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (NTc * cdiv(V, BV), HV). chunks: [NTc, 3] int64 (first token, end token, h index).

    qg: [T, HV, K], aqk: [T, HV, 64] in the operand dtype (fp32 or fp16); v_new: [T, HV, V]
    and h: [NT, HV, .., ..] (strides s_hk, s_hv) fp32; o: [T, HV, V] in v's dtype;
    flag_any: [1] int32 (FLAG).
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v = tl.program_id(0) % NV
    i_c = tl.program_id(0) // NV
    i_hv = tl.program_id(1)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    i_g = tl.load(chunks + i_c * 3 + 2)
    o_t = tl.arange(0, 64)
    m_t = o_t < t1 - t0
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    tk = (t0 * HV + i_hv) * K  # chunk bases: 64-bit scalars, 32-bit in-tile offsets
    tv = (t0 * HV + i_hv) * V

    acc = tl.zeros([64, BV], dtype=tl.float32)
    h_base = h + (i_g * HV + i_hv) * (K * V)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(qg + tk + (o_t[:, None] * (HV * K) + o_k[None, :]), mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(h_base + (o_k[:, None] * s_hk + o_v[None, :] * s_hv), mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc = tl.dot(b_q, b_h.to(b_q.dtype), acc, input_precision=DOT_PREC)
    b_a = tl.load(aqk + (t0 * HV + i_hv) * 64 + (o_t[:, None] * (HV * 64) + o_t[None, :]), mask=m_t[:, None], other=0.0)
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = o_t[:, None] * (HV * V) + o_v[None, :]
    b_v = tl.load(v_new + tv + p_tv, mask=m_tv, other=0.0)
    b_o = tl.dot(b_a, b_v.to(b_a.dtype), acc, input_precision=DOT_PREC).to(o.dtype.element_ty)
    tl.store(o + tv + p_tv, b_o, mask=m_tv)
    if FLAG:
        flag_nonfinite(flag_any, b_o, m_tv)


def launch_output(x: StageInputs, chunks: torch.Tensor, qg: torch.Tensor, st: StateTargets,
                  v_new: torch.Tensor, aqk: torch.Tensor, o: torch.Tensor, cfg: LaunchConfig) -> None:
    """o [T, HV, V] of the chunk rows ``chunks`` from the state pass's per-chunk states
    ``st.h`` (key, value strides ``st.h_strides``) and v_new, and the WY stage's qg and
    intra's aqk; a non-finite o sets the last of ``st.flags``."""
    flag_any = chunks if st.flags is None else st.flags[-1:]
    chunk_output_kernel[(chunks.shape[0] * triton.cdiv(x.V, cfg.out_bv), x.HV)](
        qg, st.h, v_new, aqk, o, chunks, flag_any, *st.h_strides, HV=x.HV, K=x.K, V=x.V, BK=cfg.out_bk,
        BV=cfg.out_bv, FLAG=st.flags is not None, DOT_PREC=x.dot_prec, num_warps=cfg.out_warps,
        num_stages=cfg.out_stages,
    )
