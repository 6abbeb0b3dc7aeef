"""Stage 1 of chunked KDA in one kernel: `intra` and `wy` fused per chunk.

One program per (64-token chunk, value head) builds A_qk and the solve exactly as
`intra.chunk_intra_kernel` does (`intra.chunk_matrices`, `intra.solve_unit_lower`), then
keeps T diag(beta) and the norm factors in registers and writes the WY factors as
`wy.chunk_wy_kernel` does (`wy.store_wy_factors`). Against the two-kernel path it skips
the T diag(beta) and norm-factor round trip through memory and one launch, and its second
reads of q, k and g come from the L2 cache its first reads just filled.

Outputs, all per token row: A_qk [T, HV, 64] (operand dtype), w, kg, qg [T, HV, K]
(operand dtype), u [T, HV, V] fp32, and gexp [NT, HV, K] fp32 per chunk.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .intra import chunk_matrices, solve_unit_lower
from .wy import store_wy_factors


@triton.jit
def chunk_prep_kernel(
    q, k, v, g, beta, a_log, dt_bias,
    aqk, w, u, kg, qg, gexp,
    chunks, scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BKD: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    SAFE: tl.constexpr, DOT_PREC: tl.constexpr, FLOOR: tl.constexpr, FP16_SOLVE: tl.constexpr,
    BLOCK_SCAN: tl.constexpr, DIAG16: tl.constexpr, FACTORED: tl.constexpr,
):
    """Grid (NTc, HV). chunks: [NTc, 3] int64 (first token, end token, chunk row of gexp).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K]; beta: [T, HV] (any float dtype). BK, BKD:
    key slices of A (as intra's); BKW, BV: key and value slices of the WY factors (as wy's).
    """
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    i_g = tl.load(chunks + i_c * 3 + 2)
    o_t = tl.arange(0, 64)
    m_t = o_t < t1 - t0
    q_c = q + t0 * (H * K) + i_h * K  # chunk bases: 64-bit scalars, 32-bit in-tile offsets
    k_c = k + t0 * (H * K) + i_h * K
    g_c = g + t0 * (HV * K) + i_hv * K
    A_qk, L, b, rq, rk = chunk_matrices(
        q_c, k_c, g_c, beta + t0 * HV + i_hv, a_log, dt_bias, scale, lower_bound, t1 - t0, i_hv,
        H, HV, K, BK, BKD, GATE, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID, NEG_EIGVAL, USE_L2NORM,
        SAFE, DOT_PREC, FLOOR, FACTORED,
    )
    o_r = o_t[:, None] * (HV * 64) + o_t[None, :]
    tl.store(aqk + (t0 * HV + i_hv) * 64 + o_r, A_qk.to(aqk.dtype.element_ty), mask=m_t[:, None])
    Tb = solve_unit_lower(L, DOT_PREC, FP16_SOLVE, DIAG16) * b[None, :]
    if FP16_SOLVE:  # the values the two-kernel path stores and reads back
        Tb = Tb.to(tl.float16).to(tl.float32)
    tk = (t0 * HV + i_hv) * K
    store_wy_factors(
        Tb, rq, rk, q_c, k_c, g_c, v + (t0 * HV + i_hv) * V, w + tk, kg + tk, qg + tk,
        u + (t0 * HV + i_hv) * V, gexp + (i_g * HV + i_hv) * K, a_log, dt_bias, lower_bound, t1 - t0, i_hv,
        H, HV, K, V, BKW, BV, GATE, HAS_A_LOG, HAS_DT_BIAS, DOT_PREC, FLOOR, BLOCK_SCAN, FP16_SOLVE,
    )
