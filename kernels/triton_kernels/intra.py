"""Stage 1 of chunked KDA: everything that stays inside one 64-token chunk.

One program per (chunk, value head). It fuses the gate and its chunk-local cumsum, the
q/k L2 norm and the beta activation, builds the intra-chunk matrices A_qk and A_kk,
inverts T = (I + diag(beta) A_kk_strict)^-1 and writes the WY factors the later stages
read:

    w  = T diag(beta) (K * exp(G))          [T, HV, K]  work dtype
    u  = T diag(beta) V                     [T, HV, V]  work dtype
    kg = K * exp(G_last - G)                [T, HV, K]  work dtype
    qg = scale * Q * exp(G)                 [T, HV, K]  work dtype
    aqk = A_qk (s <= t)                     [T, HV, 64] work dtype
    gexp = exp(G_last) per chunk            [NT, HV, K] fp32

Numerics. A chunk's cumsum G can fall far below -88 (real gates give one token a log decay
near -2600), so exp(G_t - G_s) is never factored through the chunk-level G. The chunk is cut
into four 16-token blocks; every exponent is a sum of per-token log decays over (s, t],
assembled from block-local pieces whose magnitudes stay small:
  F_t  inclusive prefix of g inside t's block, R_s exclusive suffix inside s's block,
  Mid(i, j) the sum of the whole blocks strictly between blocks j and i.
Off-diagonal blocks (s in block j < i = block of t) factor as exp(F_t) * exp(R_s + Mid(i, j)),
both exponents non-positive, so one batched tensor-core product covers them. Diagonal blocks
take exp(F_t - F_s) pairwise (GATE given/softplus: any magnitude), or, when the gate is
bounded (lower_bound >= -5, |F| <= 80), factor as exp(F_t) * exp(-F_s) and join the
same product (SAFE). Per-token decays are clamped at -LOG_DECAY_FLOOR, which bounds
the cancellation in F_t - F_s and Tot - F_s to |F| <= 480.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gate import activate_beta, gate_params, log_decay

BT = 64  # chunk
BC = 16  # sub-block
NB = 4  # sub-blocks per chunk


@triton.jit
def _load_rows(ptr, rows, m_rows, stride_row, cols, m_cols):
    """[len(rows), len(cols)] fp32 tile of ptr[rows * stride_row + cols], 0 where masked."""
    p = ptr + rows[:, None] * stride_row + cols[None, :]
    return tl.load(p, mask=m_rows[:, None] & m_cols[None, :], other=0.0).to(tl.float32)


@triton.jit
def _decay_tile(g, a, bias, lower_bound, rows, m_rows, cols, m_cols, i_hv,
                HV: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, FLOOR: tl.constexpr):
    """[BT, BK] clamped per-token log decays of value head i_hv; 0 on masked rows/cols."""
    x = _load_rows(g + i_hv * K, rows, m_rows, HV * K, cols, m_cols)
    x = tl.maximum(log_decay(x, bias[None, :], a, lower_bound, GATE), -FLOOR)
    return tl.where(m_rows[:, None] & m_cols[None, :], x, 0.0)


@triton.jit
def _block_sums(gt, BK: tl.constexpr):
    """Block structure of a [BT, BK] decay tile.

    Returns F3 [NB, BC, BK] (inclusive prefix inside each block), Tot [NB, BK] (block totals)
    and R3 [NB, BC, BK] (exclusive suffix inside each block).
    """
    g3 = tl.reshape(gt, [4, 16, BK])
    F3 = tl.cumsum(g3, axis=1)
    Tot = tl.sum(g3, axis=1)
    R3 = Tot[:, None, :] - F3
    return F3, Tot, R3


@triton.jit
def _row_norms(q, k, rows, m_rows, i_h, H: tl.constexpr, K: tl.constexpr,
               BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """[BT] fp32 factors 1/sqrt(sum x^2 + 1e-6) for the q and k rows (ones without L2 norm)."""
    if USE_L2NORM:
        ssq = tl.zeros([64], dtype=tl.float32)
        ssk = tl.zeros([64], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            m_c = cols < K
            qt = _load_rows(q + i_h * K, rows, m_rows, H * K, cols, m_c)
            kt = _load_rows(k + i_h * K, rows, m_rows, H * K, cols, m_c)
            ssq += tl.sum(qt * qt, axis=1)
            ssk += tl.sum(kt * kt, axis=1)
        rq = tl.rsqrt(ssq + 1e-6)
        rk = tl.rsqrt(ssk + 1e-6)
    else:
        rq = tl.full([64], 1.0, dtype=tl.float32)
        rk = tl.full([64], 1.0, dtype=tl.float32)
    return rq, rk


@triton.jit
def _diag_pairwise(q, k, g, a_log, dt_bias, lower_bound, rows, m_rows, rq, rk, i_h, i_hv,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKD: tl.constexpr,
                   GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                   FLOOR: tl.constexpr):
    """Diagonal 16x16 blocks of A_qk and A_kk from pairwise exponents F_t - F_s (s <= t).

    Returns dqk, dkk [NB, BC, BC] fp32 (q already scaled by rq, k by rk; s > t zero).
    Works on BKD-wide key slices to keep the [NB, BC, BC, BKD] temporaries small.
    """
    o_c = tl.arange(0, 16)
    tri = (o_c[:, None] >= o_c[None, :])[None, :, :, None]
    dqk = tl.zeros([4, 16, 16], dtype=tl.float32)
    dkk = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BKD)):
        cols = i_k * BKD + tl.arange(0, BKD)
        m_c = cols < K
        bias, a = gate_params(a_log, dt_bias, i_hv, cols, m_c, K, HAS_A_LOG, HAS_DT_BIAS)
        gt = _decay_tile(g, a, bias, lower_bound, rows, m_rows, cols, m_c, i_hv, HV, K, GATE, FLOOR)
        F3 = tl.cumsum(tl.reshape(gt, [4, 16, BKD]), axis=1)
        q3 = tl.reshape(_load_rows(q + i_h * K, rows, m_rows, H * K, cols, m_c) * rq[:, None], [4, 16, BKD])
        k3 = tl.reshape(_load_rows(k + i_h * K, rows, m_rows, H * K, cols, m_c) * rk[:, None], [4, 16, BKD])
        ex = tl.where(tri, F3[:, :, None, :] - F3[:, None, :, :], float("-inf"))
        kE = k3[:, None, :, :] * tl.exp(ex)
        dqk += tl.sum(q3[:, :, None, :] * kE, axis=3)
        dkk += tl.sum(k3[:, :, None, :] * kE, axis=3)
    return dqk, dkk


@triton.jit
def _solve_unit_lower(L, DOT_PREC: tl.constexpr):
    """T = (I + L)^-1 for a strictly lower-triangular [BT, BT] fp32 L.

    Diagonal 16x16 blocks by forward substitution (all four at once, 15 steps); then with
    Td the block-diagonal inverse and N = Td L_off (block-strictly-lower, N^4 = 0):
    (I + L)^-1 = (I + N)^-1 Td = (I - N + N^2 - N^3) Td.
    """
    o_b = tl.arange(0, 4)
    o_c = tl.arange(0, 16)
    same = (o_b[:, None] == o_b[None, :])[:, None, :, None]  # [NB, 1, NB, 1]
    L4 = tl.reshape(L, [4, 16, 4, 16])
    Ld = tl.sum(tl.where(same, L4, 0.0), axis=2)  # [NB, BC, BC]
    eye_c = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    Ti = tl.zeros([4, 16, 16], dtype=tl.float32) + eye_c[None, :, :]
    for r in range(1, 16):
        sel = (o_c == r)[None, :, None]
        lr = tl.sum(tl.where(sel, Ld, 0.0), axis=1)  # [NB, BC]: row r of each block
        new = (o_c == r).to(tl.float32)[None, :] - tl.sum(lr[:, :, None] * Ti, axis=1)
        Ti = tl.where(sel, new[:, None, :], Ti)
    Td = tl.reshape(tl.where(same, Ti[:, :, None, :], 0.0), [64, 64])
    o_t = tl.arange(0, 64)
    Loff = tl.where((o_t[:, None] // 16) > (o_t[None, :] // 16), L, 0.0)
    N = tl.dot(Td, Loff, input_precision=DOT_PREC)
    N2 = tl.dot(N, N, input_precision=DOT_PREC)
    N3 = tl.dot(N2, N, input_precision=DOT_PREC)
    eye = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    return tl.dot(eye - N + N2 - N3, Td, input_precision=DOT_PREC)


@triton.jit
def chunk_intra_kernel(
    q, k, v, g, beta, a_log, dt_bias,
    w, u, kg, qg, aqk, gexp,
    chunks,
    scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BKD: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    SAFE: tl.constexpr, DOT_PREC: tl.constexpr, FLOOR: tl.constexpr,
):
    """Grid (NTc, HV). chunks: [NTc, 3] int64 (first token, end token, h index).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K]; beta: [T, HV] (any float dtype);
    outputs as listed in the module docstring.
    """
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    i_g = tl.load(chunks + i_c * 3 + 2)

    o_t = tl.arange(0, 64)
    rows = t0 + o_t
    m_t = rows < t1
    o_b = tl.arange(0, 4)
    blk_t = o_t // 16

    b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b = tl.where(m_t, activate_beta(b, BETA_SIGMOID, NEG_EIGVAL), 0.0)
    rq, rk = _row_norms(q, k, rows, m_t, i_h, H, K, BK, USE_L2NORM)
    rq = rq * scale

    # ---- A_qk, A_kk: one batched product per key slice over row blocks i -------------
    # ks[i, s, :] = k_s * exp(exponent from the start of block i back to s), zero where
    # block(s) > i (and block(s) == i unless SAFE).
    ib = o_b[:, None, None]
    jb = blk_t[None, :, None]
    mm = o_b[None, None, :]
    # Mid(i, j) selector over m: j < m < i  -> [NB(i), NB(j), NB(m)]
    sel_mid = (mm > o_b[None, :, None]) & (mm < o_b[:, None, None])
    acc_qk = tl.zeros([4, 16, 64], dtype=tl.float32)
    acc_kk = tl.zeros([4, 16, 64], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m_c = cols < K
        bias, a = gate_params(a_log, dt_bias, i_hv, cols, m_c, K, HAS_A_LOG, HAS_DT_BIAS)
        gt = _decay_tile(g, a, bias, lower_bound, rows, m_t, cols, m_c, i_hv, HV, K, GATE, FLOOR)
        F3, Tot, R3 = _block_sums(gt, BK)
        qt = _load_rows(q + i_h * K, rows, m_t, H * K, cols, m_c) * rq[:, None]
        kt = _load_rows(k + i_h * K, rows, m_t, H * K, cols, m_c) * rk[:, None]
        mid = tl.sum(tl.where(sel_mid[:, :, :, None], Tot[None, None, :, :], 0.0), axis=2)
        mid_s = tl.reshape(tl.broadcast_to(mid[:, :, None, :], [4, 4, 16, BK]), [4, 64, BK])
        ex = tl.where(jb < ib, tl.reshape(R3, [64, BK])[None, :, :] + mid_s, float("-inf"))
        if SAFE:
            ex = tl.where(jb == ib, -tl.reshape(F3, [64, BK])[None, :, :], ex)
        ks = tl.permute(kt[None, :, :] * tl.exp(ex), (0, 2, 1))  # [NB, BK, BT]
        eF = tl.exp(F3)
        acc_qk = tl.dot(tl.reshape(qt, [4, 16, BK]) * eF, ks, acc_qk, input_precision=DOT_PREC)
        acc_kk = tl.dot(tl.reshape(kt, [4, 16, BK]) * eF, ks, acc_kk, input_precision=DOT_PREC)
    A_qk = tl.reshape(acc_qk, [64, 64])
    A_kk = tl.reshape(acc_kk, [64, 64])
    if not SAFE:
        dqk, dkk = _diag_pairwise(q, k, g, a_log, dt_bias, lower_bound, rows, m_t, rq, rk, i_h, i_hv,
                                  H, HV, K, BKD, GATE, HAS_A_LOG, HAS_DT_BIAS, FLOOR)
        same = (o_b[:, None] == o_b[None, :])[:, None, :, None]
        A_qk += tl.reshape(tl.where(same, dqk[:, :, None, :], 0.0), [64, 64])
        A_kk += tl.reshape(tl.where(same, dkk[:, :, None, :], 0.0), [64, 64])
    valid = m_t[:, None] & m_t[None, :]
    A_qk = tl.where(valid & (o_t[:, None] >= o_t[None, :]), A_qk, 0.0)
    L = tl.where(valid & (o_t[:, None] > o_t[None, :]), A_kk * b[:, None], 0.0)
    Tm = _solve_unit_lower(L, DOT_PREC)

    # ---- w, kg, qg, exp(G_last) --------------------------------------------------------
    before = o_b[None, :] < o_b[:, None]  # [NB(b), NB(m)]: m < b
    after = o_b[None, :] > o_b[:, None]  # m > b
    for i_k in range(tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m_c = cols < K
        bias, a = gate_params(a_log, dt_bias, i_hv, cols, m_c, K, HAS_A_LOG, HAS_DT_BIAS)
        gt = _decay_tile(g, a, bias, lower_bound, rows, m_t, cols, m_c, i_hv, HV, K, GATE, FLOOR)
        F3, Tot, R3 = _block_sums(gt, BK)
        off = tl.sum(tl.where(before[:, :, None], Tot[None, :, :], 0.0), axis=1)  # [NB, BK]
        aft = tl.sum(tl.where(after[:, :, None], Tot[None, :, :], 0.0), axis=1)
        eG = tl.exp(tl.reshape(off[:, None, :] + F3, [64, BK]))
        eK = tl.exp(tl.reshape(R3 + aft[:, None, :], [64, BK]))
        qt = _load_rows(q + i_h * K, rows, m_t, H * K, cols, m_c) * rq[:, None]
        kt = _load_rows(k + i_h * K, rows, m_t, H * K, cols, m_c) * rk[:, None]
        wt = tl.dot(Tm, kt * eG * b[:, None], input_precision=DOT_PREC)
        p = rows[:, None] * (HV * K) + i_hv * K + cols[None, :]
        m = m_t[:, None] & m_c[None, :]
        tl.store(w + p, wt.to(w.dtype.element_ty), mask=m)
        tl.store(kg + p, (kt * eK).to(kg.dtype.element_ty), mask=m)
        tl.store(qg + p, (qt * eG).to(qg.dtype.element_ty), mask=m)
        tl.store(gexp + (i_g * HV + i_hv) * K + cols, tl.exp(tl.sum(Tot, axis=0)), mask=m_c)

    # ---- u, A_qk -----------------------------------------------------------------------
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        vt = _load_rows(v + i_hv * V, rows, m_t, HV * V, cv, m_v)
        ut = tl.dot(Tm, vt * b[:, None], input_precision=DOT_PREC)
        tl.store(u + rows[:, None] * (HV * V) + i_hv * V + cv[None, :], ut.to(u.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
    tl.store(aqk + rows[:, None] * (HV * 64) + i_hv * 64 + o_t[None, :], A_qk.to(aqk.dtype.element_ty),
             mask=m_t[:, None])
