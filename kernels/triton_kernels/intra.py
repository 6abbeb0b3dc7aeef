"""Stage 1a of chunked KDA: the intra-chunk matrices and the triangular solve.

One program per (64-token chunk, value head). It fuses the gate and its chunk-local
cumsum, the q/k L2 norm and the beta activation, builds A_qk and A_kk,

    A[t, s] = sum_c x_t[c] k_s[c] exp(G_t[c] - G_s[c])     (x = q for A_qk, k for A_kk)

and inverts T = (I + diag(beta) A_kk_strict)^-1 by block doubling. It writes
T diag(beta) and A_qk (s <= t) per token row, and the q/k norm factors; `wy` turns them
into the WY factors w, u. With a launch's input check (CHECK) it checks the raw q, k, g
and beta as it loads them: row sums of `checks.nan_where_bad`, one atomic per program
only when they are NaN (`checks.flag_if_nan`; `wy` checks v).

Numerics. A chunk's cumsum G can fall far below -88 (real gates give one token a log decay
near -2600), so exp(G_t - G_s) is never factored through the chunk-level G. The chunk is cut
into four 16-token blocks; every exponent is a sum of per-token log decays over (s, t],
assembled from block-local pieces whose magnitudes stay small:
  F_t inclusive prefix of g inside t's block, Off_i the cumsum before block i (sum of the
  earlier block totals), G_t = Off_i + F_t, R_s exclusive suffix inside s's block.
Off-diagonal blocks (s in block j < i = block of t) factor through the anchor Off_i as
exp(F_t) * exp(Off_i - G_s), both exponents non-positive, so one batched tensor-core product
covers them. Diagonal blocks take exp(F_t - F_s) pairwise (GATE given/softplus: any
magnitude), or, when the gate is bounded (lower_bound >= -5, |F| <= 80), join the same
product with exponents up to 80 (SAFE). The kg exponent G_last - G_t is assembled as R_t
plus the later block totals. Per-token decays are clamped at -LOG_DECAY_FLOOR (exp(-30) is
below fp32 resolution), which bounds every cancellation: |F| <= 480, |G| <= 1920 (measured
on the real-scale vectors: o and states within 3e-6 of float64).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import LaunchConfig
from .checks import flag_if_nan, nan_where_bad
from .gate import (GATE_LOWER_BOUND, LOG_DECAY_FLOOR, activate_beta, block_sums, decay_tile, decays_of, gate_params,
                   load_rows)
from .inputs import StageInputs

BT = 64  # chunk
BC = 16  # sub-block
NB = 4  # sub-blocks per chunk


@triton.jit
def _diag_pairwise(q_c, k_c, g_c, a_log, dt_bias, lower_bound, rows, m_rows, rq, rk, i_hv,
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
        gt = decay_tile(g_c, a, bias, lower_bound, rows, m_rows, cols, m_c, HV * K, GATE, FLOOR)
        F3 = tl.cumsum(tl.reshape(gt, [4, 16, BKD]), axis=1)
        q3 = tl.reshape(load_rows(q_c, rows, m_rows, H * K, cols, m_c) * rq[:, None], [4, 16, BKD])
        k3 = tl.reshape(load_rows(k_c, rows, m_rows, H * K, cols, m_c) * rk[:, None], [4, 16, BKD])
        ex = tl.where(tri, F3[:, :, None, :] - F3[:, None, :, :], float("-inf"))
        kE = k3[:, None, :, :] * tl.exp(ex)
        dqk += tl.sum(q3[:, :, None, :] * kE, axis=3)
        dkk += tl.sum(k3[:, :, None, :] * kE, axis=3)
    return dqk, dkk


@triton.jit
def _doubling_level(L, X, r, c, k: tl.constexpr, DOT_PREC: tl.constexpr, FP16: tl.constexpr):
    """X_(k+1) from X_k (see `solve_unit_lower`); r, c broadcast to L's and X's shape, whose
    last two dims are the rows and columns (2D, or 3D: a batch of diagonal blocks)."""
    sel = ((r >> k) == (c >> k) + 1) & ((r >> (k + 1)) == (c >> (k + 1)))
    if FP16:
        BX = tl.dot(tl.where(sel, L, 0.0).to(tl.float16), X.to(tl.float16))
        X = X - tl.dot(X.to(tl.float16), BX.to(tl.float16))
    else:
        BX = tl.dot(tl.where(sel, L, 0.0), X, input_precision=DOT_PREC)
        X = X - tl.dot(X, BX, input_precision=DOT_PREC)
    return X


@triton.jit
def solve_unit_lower(L, DOT_PREC: tl.constexpr, FP16: tl.constexpr, DIAG16: tl.constexpr):
    """T = (I + L)^-1 for a strictly lower-triangular [BT, BT] fp32 L, by block doubling.

    FP16: the products take fp16 operands (fp32 accumulation; the same 11-bit significand
    as tf32, at twice the tensor-core rate). Only for bounded entries: with keys of norm
    <= 1, betas in (0, 2) and decays <= 1, |L| <= 2, and column j of T is the WY recursion
    started from S = k_j (norm <= 1) and carried by the non-expansive per-token maps
    (I - beta k k^T) diag(exp(g)), so |T| <= 2 and |T diag(beta)| <= 4; every partial
    inverse X_k is the same on sub-chunks, and the products B X_k stay under 2 * 2 * 32.
    All far inside fp16's range (65504); entries under 6e-5 lose only absolute 6e-8.

    X_k inverts the block-diagonal part of I + L at block size 2^k. For each block
    [[A, 0], [B, C]] of size 2^(k+1), the inverse is [[A^-1, 0], [-C^-1 B A^-1, C^-1]], i.e.
    X_(k+1) = X_k - X_k B_k X_k with B_k the entries of L in the lower-left quarter of every
    2^(k+1) block. Six levels reach 64; all work is in tensor-core products (no sequential
    row steps), and every level is an exact block inversion (no Neumann-series cancellation).

    DIAG16: the levels inside 16-row blocks (sizes 2 to 16) run on the four diagonal
    blocks alone, as [4, 16, 16] batched products (1/16 of the multiply-adds of full
    [64, 64] products that are mostly zeros); the last two levels on [64, 64].
    """
    o_t = tl.arange(0, 64)
    r = o_t[:, None]
    c = o_t[None, :]
    if DIAG16:
        o_b = tl.arange(0, 4)
        o_s = tl.arange(0, 16)
        same = o_b[:, None, None, None] == o_b[None, None, :, None]  # [4, 1, 4, 1]
        D = tl.sum(tl.where(same, tl.reshape(L, [4, 16, 4, 16]), 0.0), axis=2)  # [4, 16, 16]
        r3 = o_s[None, :, None]
        c3 = o_s[None, None, :]
        X3 = (r3 == c3).to(tl.float32) - tl.where((r3 == c3 + 1) & (r3 % 2 == 1), D, 0.0)
        for k in tl.static_range(1, 4):
            X3 = _doubling_level(D, X3, r3, c3, k, DOT_PREC, FP16)
        X = tl.reshape(tl.where(same, X3[:, :, None, :], 0.0), [64, 64])
        for k in tl.static_range(4, 6):
            X = _doubling_level(L, X, r, c, k, DOT_PREC, FP16)
    else:
        X = (r == c).to(tl.float32) - tl.where((r == c + 1) & (r % 2 == 1), L, 0.0)  # level 1: X_0 = I
        for k in tl.static_range(1, 6):
            X = _doubling_level(L, X, r, c, k, DOT_PREC, FP16)
    return X


@triton.jit
def chunk_matrices(
    q_c, k_c, g_c, beta_c, a_log, dt_bias, scale, lower_bound, n_t, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, USE_L2NORM: tl.constexpr,
    SAFE: tl.constexpr, DOT_PREC: tl.constexpr, FLOOR: tl.constexpr, FACTORED: tl.constexpr,
    CHECK: tl.constexpr,
):
    """One chunk's intra-chunk matrices, from its first rows: q_c, k_c [.., H, K], g_c
    [.., HV, K] and beta_c [.., HV] point at the chunk's first token and head; n_t <= 64
    tokens are valid.

    Returns (A_qk [64, 64] fp32 with s <= t, L [64, 64] fp32 = diag(beta) A_kk strictly
    lower, beta [64] activated, rq [64] = scale / |q_t|, rk [64] = 1 / |k_t|, bad [64]:
    with CHECK per row the sum of its raw q, k, g and beta values' `checks.nan_where_bad`,
    else zeros); rows and columns past n_t are zero.

    FACTORED: the k side's exp(Off_i - G_s), for s in block j, is taken as the product
    exp(Off_i - Off_(j+1)) * exp(R_s) (R_s the exclusive suffix inside block j): 16 + 1
    exponentials per key column instead of 4 x 16, and no [64, BK] cumsum G. Both factors
    are <= 1 for j < i; for j == i (SAFE) the first is exp(-Tot_i) <= exp(80) and the second
    >= exp(-75), so the product loses nothing an underflow would not also lose unfactored.
    """
    o_t = tl.arange(0, 64)
    m_t = o_t < n_t
    o_b = tl.arange(0, 4)
    blk_t = o_t // 16

    before = o_b[None, :] < o_b[:, None]  # [NB(b), NB(m)]: m < b
    x_b = tl.load(beta_c + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b = tl.where(m_t, activate_beta(x_b, BETA_SIGMOID, NEG_EIGVAL), 0.0)
    bad = tl.zeros([64], dtype=tl.float32)
    if CHECK:
        bad += nan_where_bad(x_b, False)

    # ---- A_qk, A_kk: one batched product per key slice over row blocks i -------------
    # Row block i is anchored at Off_i (the cumsum before its first row): the q side is
    # exp(G_t - Off_i) = exp(F_t) <= 1, the k side exp(Off_i - G_s), <= 1 for earlier blocks
    # (and <= exp(80) for block i itself when SAFE); blocks after i (and block i unless SAFE)
    # are masked out.
    ib = o_b[:, None, None]
    jb = blk_t[None, :, None]
    if SAFE:
        m_ks = jb <= ib
        m_ij = o_b[None, :, None] <= o_b[:, None, None]  # [NB(i), NB(j), 1]
    else:
        m_ks = jb < ib
        m_ij = o_b[None, :, None] < o_b[:, None, None]
    acc_qk = tl.zeros([4, 16, 64], dtype=tl.float32)
    acc_kk = tl.zeros([4, 16, 64], dtype=tl.float32)
    sq_q = tl.zeros([64, BK], dtype=tl.float32)
    sq_k = tl.zeros([64, BK], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m_c = cols < K
        bias, a = gate_params(a_log, dt_bias, i_hv, cols, m_c, K, HAS_A_LOG, HAS_DT_BIAS)
        xg = load_rows(g_c, o_t, m_t, HV * K, cols, m_c)
        gt = decays_of(xg, a, bias, lower_bound, m_t, m_c, GATE, FLOOR)
        F3, Tot, R3 = block_sums(gt, BK)
        off = tl.sum(tl.where(before[:, :, None], Tot[None, :, :], 0.0), axis=1)  # [NB, BK]
        qt = load_rows(q_c, o_t, m_t, H * K, cols, m_c)
        kt = load_rows(k_c, o_t, m_t, H * K, cols, m_c)
        if CHECK:
            bad += tl.sum(nan_where_bad(xg, GATE == 0) + nan_where_bad(qt, False) + nan_where_bad(kt, False), axis=1)
        sq_q += qt * qt
        sq_k += kt * kt
        if FACTORED:
            fac = tl.exp(tl.where(m_ij, off[:, None, :] - (off + Tot)[None, :, :], float("-inf")))  # [i, j, BK]
            kR = tl.reshape(kt, [4, 16, BK]) * tl.exp(R3)  # [NB(j), BC, BK]
            ks = tl.reshape(kR[None, :, :, :] * fac[:, :, None, :], [4, 64, BK])
        else:
            G = tl.reshape(F3 + off[:, None, :], [64, BK])
            ks = kt[None, :, :] * tl.exp(tl.where(m_ks, off[:, None, :] - G[None, :, :], float("-inf")))
        ks = tl.permute(ks, (0, 2, 1))  # [NB, BK, BT]
        eF = tl.exp(F3)
        acc_qk = tl.dot(tl.reshape(qt, [4, 16, BK]) * eF, ks, acc_qk, input_precision=DOT_PREC)
        acc_kk = tl.dot(tl.reshape(kt, [4, 16, BK]) * eF, ks, acc_kk, input_precision=DOT_PREC)
    ssq = tl.sum(sq_q, axis=1)
    ssk = tl.sum(sq_k, axis=1)
    # q/k L2 norms and the scale are row/column scalings of the raw products
    if USE_L2NORM:
        rq = tl.rsqrt(ssq + 1e-6) * scale
        rk = tl.rsqrt(ssk + 1e-6)
    else:
        rq = tl.full([64], 1.0, dtype=tl.float32) * scale
        rk = tl.full([64], 1.0, dtype=tl.float32)
    A_qk = tl.reshape(acc_qk, [64, 64]) * (rq[:, None] * rk[None, :])
    A_kk = tl.reshape(acc_kk, [64, 64]) * (rk[:, None] * rk[None, :])
    if not SAFE:
        dqk, dkk = _diag_pairwise(q_c, k_c, g_c, a_log, dt_bias, lower_bound, o_t, m_t, rq, rk, i_hv,
                                  H, HV, K, BKD, GATE, HAS_A_LOG, HAS_DT_BIAS, FLOOR)
        same = (o_b[:, None] == o_b[None, :])[:, None, :, None]
        A_qk += tl.reshape(tl.where(same, dqk[:, :, None, :], 0.0), [64, 64])
        A_kk += tl.reshape(tl.where(same, dkk[:, :, None, :], 0.0), [64, 64])
    valid = m_t[:, None] & m_t[None, :]
    A_qk = tl.where(valid & (o_t[:, None] >= o_t[None, :]), A_qk, 0.0)
    L = tl.where(valid & (o_t[:, None] > o_t[None, :]), A_kk * b[:, None], 0.0)
    return A_qk, L, b, rq, rk, bad


@triton.jit
def chunk_intra_kernel(
    q, k, g, beta, a_log, dt_bias,
    tb, aqk, rqk,
    chunks,
    scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, BKD: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    SAFE: tl.constexpr, DOT_PREC: tl.constexpr, FLOOR: tl.constexpr, FP16_SOLVE: tl.constexpr,
    DIAG16: tl.constexpr, FACTORED: tl.constexpr, checks, CHECK: tl.constexpr,
):
    """Grid (NTc, HV). chunks: [NTc, 3] int64 (first token, end token, h index).

    q, k: [T, H, K]; g: [T, HV, K]; beta: [T, HV] (any float dtype). Writes
    tb = T diag(beta) [T, HV, 64] (fp16 with FP16_SOLVE, else fp32), aqk = A_qk [T, HV, 64] (operand dtype) and
    rqk [T, HV, 2] fp32: (scale / |q_t|, 1 / |k_t|) (scale, 1 without L2 norm). CHECK: the
    raw q, k, g and beta values set ``checks`` [1] int32 to 1 when one is a NaN or Inf or
    (GATE given) g > 0 (`kernels.problem.PrefillProblem.input_checks`).
    """
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    o_t = tl.arange(0, 64)
    m_t = o_t < t1 - t0
    # chunk bases: 64-bit scalars, 32-bit in-tile offsets
    A_qk, L, b, rq, rk, bad = chunk_matrices(
        q + t0 * (H * K) + i_h * K, k + t0 * (H * K) + i_h * K, g + t0 * (HV * K) + i_hv * K,
        beta + t0 * HV + i_hv, a_log, dt_bias, scale, lower_bound, t1 - t0, i_hv,
        H, HV, K, BK, BKD, GATE, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID, NEG_EIGVAL, USE_L2NORM,
        SAFE, DOT_PREC, FLOOR, FACTORED, CHECK,
    )
    if CHECK:
        flag_if_nan(checks, tl.sum(bad, axis=0))
    Tm = solve_unit_lower(L, DOT_PREC, FP16_SOLVE, DIAG16)

    o_r = o_t[:, None] * (HV * 64) + o_t[None, :]
    tl.store(tb + (t0 * HV + i_hv) * 64 + o_r, (Tm * b[None, :]).to(tb.dtype.element_ty), mask=m_t[:, None])
    r_c = rqk + (t0 * HV + i_hv) * 2
    tl.store(r_c + o_t * (HV * 2), rq, mask=m_t)
    tl.store(r_c + o_t * (HV * 2) + 1, rk, mask=m_t)
    tl.store(aqk + (t0 * HV + i_hv) * 64 + o_r, A_qk.to(aqk.dtype.element_ty), mask=m_t[:, None])


@dataclass(frozen=True)
class IntraOutputs:
    """The intra stage's outputs: tb = T diag(beta) [T, HV, 64] (fp16 with fp16_solve, else
    fp32), aqk = A_qk [T, HV, 64] in the operand dtype, rqk [T, HV, 2] fp32 (q, k norm factors)."""

    tb: torch.Tensor
    aqk: torch.Tensor
    rqk: torch.Tensor

    @classmethod
    def alloc(cls, x: StageInputs) -> "IntraOutputs":
        rows = (x.T, x.HV, BT)
        return cls(tb=torch.empty(rows, dtype=torch.float16 if x.fp16_solve else torch.float32, device=x.device),
                   aqk=torch.empty(rows, dtype=x.mat, device=x.device),
                   rqk=torch.empty(x.T, x.HV, 2, dtype=torch.float32, device=x.device))


def launch_intra(x: StageInputs, chunks: torch.Tensor, out: IntraOutputs, cfg: LaunchConfig) -> None:
    """The intra-chunk matrices and the solve of the chunk rows ``chunks`` ([NTc, 3],
    `kernels.triton_plan`), into ``out``; q, k, g and beta checked into ``x.checks`` as
    they are read (when given)."""
    chunk_intra_kernel[(chunks.shape[0], x.HV)](
        x.q, x.k, x.g, x.beta, x.a_log, x.dt_bias, out.tb, out.aqk, out.rqk, chunks, x.scale, x.lower_bound,
        H=x.H, HV=x.HV, K=x.K, BK=cfg.intra_bk, BKD=cfg.intra_bkd, **x.flags, SAFE=x.gate == GATE_LOWER_BOUND,
        DOT_PREC=x.dot_prec, FLOOR=LOG_DECAY_FLOOR, FP16_SOLVE=x.fp16_solve, DIAG16=cfg.solve_diag16,
        FACTORED=cfg.factored_a, checks=x.check_pointer(chunks), CHECK=x.checks is not None,
        num_warps=cfg.intra_warps, num_stages=cfg.intra_stages,
    )
