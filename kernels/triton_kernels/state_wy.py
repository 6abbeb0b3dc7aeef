"""Stage 2 of chunked KDA with the WY work folded in: the state pass reads the inputs.

One program per (sequence, value head, V block), as `state`, but instead of reading the
WY factors w, u, kg, qg that a separate stage stored (2.4 KB per token-head written, then
read again), each chunk step rebuilds them beside the chain from q, k, g, v and intra's
T diag(beta), A_qk and norm factors:

    kw = rk K exp(G),  qg = rq Q exp(G),  kg = rk K exp(G_last - G)     [64, K]
    v_new = Tb (V - kw S)                                               [64, BV]
    o     = qg S + A_qk v_new
    S     = diag(exp(G_last)) S + kg^T v_new

(Tb = T diag(beta); v_new = u - w S with u = Tb V and w = Tb kw, taken in the order that
needs no w). The gate and its chunk cumsums are the WY stage's (`wy.chunk_cumsums`); the
rest, the pool, carry rows, h and checkpoints, as in `state.chunk_state_kernel`. Per
token-head the pipeline then moves about 2.6 KB instead of 5.7 (bf16 inputs, K = V = 128).
This kernel must never be autotuned: a timing run would advance live states.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gate import LOG_DECAY_FLOOR, decay_tile, gate_params, load_rows
from .inputs import StageInputs, StateTargets
from .intra import IntraOutputs
from .state import store_checkpoint
from .wy import chunk_cumsums


@triton.jit
def chunk_state_wy_kernel(
    q, k, v, g, a_log, dt_bias, tb, rqk, aqk, o, h, pool, indices, segs, carry, ckpt_rows, ckpt,
    lower_bound,
    s_slot, s_head, s_pk, s_pv, s_hk, s_hv, c_row, c_head, c_k, c_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr, FLOOR: tl.constexpr, BLOCK_SCAN: tl.constexpr,
    STORE_H: tl.constexpr, CHECKPOINT: tl.constexpr,
):
    """Grid (Ns * HV * cdiv(V, BV),); segs, carry, pool, h, ckpt as in `chunk_state_kernel`.

    q, k: [T, H, K]; v, o: [T, HV, V]; g: [T, HV, K] (any float dtype); tb, aqk: [T, HV, 64]
    and rqk: [T, HV, 2] from `intra` (tb fp16: an fp16 product, else fp32 with DOT_PREC);
    the other products take aqk's dtype (the operand dtype).
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    MAT = aqk.dtype.element_ty
    TB_FP16 = tb.dtype.element_ty == tl.float16
    i_v = tl.program_id(0) % NV
    i_nh = tl.program_id(0) // NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    seq = tl.load(segs + i_n * 6)
    bos = tl.load(segs + i_n * 6 + 1)
    eos = tl.load(segs + i_n * 6 + 2)
    hoff = tl.load(segs + i_n * 6 + 3)
    load_carry = tl.load(segs + i_n * 6 + 4)
    store_carry = tl.load(segs + i_n * 6 + 5)
    slot = tl.load(indices + seq)

    # the state is carried transposed, S^T [BV, BK]: as the left operand of every product
    # it stays in registers, and the operands built per chunk go to shared memory as right
    # operands (kw^T, qg^T, kg, Tb^T, A_qk^T)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    if load_carry >= 0:
        b_h = tl.load(carry + (load_carry * HV + i_hv) * (K * V) + (o_k[None, :] * V + o_v[:, None]),
                      mask=m_vk, other=0.0)
    else:  # slot -1: zeros
        p_pool = pool + slot * s_slot + i_hv * s_head + (o_k[None, :] * s_pk + o_v[:, None] * s_pv)
        b_h = tl.load(p_pool, mask=m_vk & (slot + o_k * 0 >= 0)[None, :], other=0.0).to(tl.float32)

    bias, a = gate_params(a_log, dt_bias, i_hv, o_k, m_k, K, HAS_A_LOG, HAS_DT_BIAS)
    o_t = tl.arange(0, 64)
    for i_t in range(tl.cdiv(eos - bos, 64)):
        t0 = bos + i_t * 64
        m_t = o_t < eos - t0
        i_g = hoff + i_t
        if STORE_H:
            p_h = h + (i_g * HV + i_hv) * (K * V) + (o_k[None, :] * s_hk + o_v[:, None] * s_hv)
            tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_vk)

        # this chunk's WY pieces; chunk bases are 64-bit scalars, in-tile offsets 32-bit
        r_c = rqk + (t0 * HV + i_hv) * 2
        rq = tl.load(r_c + o_t * (HV * 2), mask=m_t, other=0.0)
        rk = tl.load(r_c + o_t * (HV * 2) + 1, mask=m_t, other=0.0)
        gt = decay_tile(g + (t0 * HV + i_hv) * K, a, bias, lower_bound, o_t, m_t, o_k, m_k, HV * K, GATE, FLOOR)
        G, Gs, total = chunk_cumsums(gt, BK, BLOCK_SCAN)
        eG = tl.exp(G)
        kt = load_rows(k + t0 * (H * K) + i_h * K, o_t, m_t, H * K, o_k, m_k) * rk[:, None]
        b_kw = (kt * eG).to(MAT)
        b_kg = (kt * tl.exp(Gs)).to(MAT)
        b_q = (load_rows(q + t0 * (H * K) + i_h * K, o_t, m_t, H * K, o_k, m_k) * (rq[:, None] * eG)).to(MAT)
        b_tb = load_rows(tb + (t0 * HV + i_hv) * 64, o_t, m_t, HV * 64, o_t, o_t < 64)

        p_vt = (t0 * HV + i_hv) * V + (o_t[None, :] * (HV * V) + o_v[:, None])  # [BV, 64]
        m_vt = m_v[:, None] & m_t[None, :]
        b_x = tl.load(v + p_vt, mask=m_vt, other=0.0).to(tl.float32)
        b_hm = b_h.to(MAT)
        b_x -= tl.dot(b_hm, tl.trans(b_kw), input_precision=DOT_PREC)  # (V - kw S)^T
        if TB_FP16:
            b_v = tl.dot(b_x.to(tl.float16), tl.trans(b_tb.to(tl.float16)))  # v_new^T = x^T Tb^T
        else:
            b_v = tl.dot(b_x, tl.trans(b_tb), input_precision=DOT_PREC)
        p_ta = (t0 * HV + i_hv) * 64 + (o_t[:, None] * (HV * 64) + o_t[None, :])
        b_a = tl.load(aqk + p_ta, mask=m_t[:, None], other=0.0)
        b_vm = b_v.to(MAT)
        b_o = tl.dot(b_hm, tl.trans(b_q), input_precision=DOT_PREC)  # o^T = S^T qg^T + v_new^T A_qk^T
        b_o = tl.dot(b_vm, tl.trans(b_a), b_o, input_precision=DOT_PREC)
        tl.store(o + p_vt, b_o.to(o.dtype.element_ty), mask=m_vt)
        b_h = b_h * tl.exp(total)[None, :] + tl.dot(b_vm, b_kg, input_precision=DOT_PREC)
        if CHECKPOINT:
            store_checkpoint(ckpt, ckpt_rows, i_g, i_hv, b_h, o_v[:, None] * c_v + o_k[None, :] * c_k, m_vk,
                             c_row, c_head)

    if store_carry >= 0:
        tl.store(carry + (store_carry * HV + i_hv) * (K * V) + (o_k[None, :] * V + o_v[:, None]), b_h, mask=m_vk)
    else:  # slot -1: no write
        p_pool = pool + slot * s_slot + i_hv * s_head + (o_k[None, :] * s_pk + o_v[:, None] * s_pv)
        tl.store(p_pool, b_h.to(pool.dtype.element_ty), mask=m_vk & (slot + o_k * 0 >= 0)[None, :])


def launch_state_wy(x: StageInputs, segs: torch.Tensor, intra: IntraOutputs, o: torch.Tensor, st: StateTargets,
                    carry: torch.Tensor, launch: tuple[int, int, int], block_scan: bool) -> None:
    """The folded state pass over the segment rows ``segs`` ([Ns, 6], `kernels.triton_plan`)
    from the inputs and intra's outputs: o [T, HV, V], final states to the pool, h and
    checkpoints to ``st``. ``launch``: (BV, warps, stages) from `config.state_launch`;
    ``block_scan``: the gate cumsums by 16-row blocks (`wy.chunk_cumsums`)."""
    bv, warps, stages = launch
    h, ckpt_rows, ckpt = st.pointers(o)
    chunk_state_wy_kernel[(segs.shape[0] * x.HV * triton.cdiv(x.V, bv),)](
        x.q, x.k, x.v, x.g, x.a_log, x.dt_bias, intra.tb, intra.rqk, intra.aqk, o, h, st.pool, st.indices, segs,
        carry, ckpt_rows, ckpt, x.lower_bound, *st.pool_strides, *st.h_strides, *st.ckpt_strides,
        H=x.H, HV=x.HV, K=x.K, V=x.V, BK=max(16, triton.next_power_of_2(x.K)), BV=bv, **x.gate_flags,
        DOT_PREC=x.dot_prec, FLOOR=LOG_DECAY_FLOOR, BLOCK_SCAN=block_scan, STORE_H=st.h is not None,
        CHECKPOINT=st.ckpt is not None, num_warps=warps, num_stages=stages,
    )
