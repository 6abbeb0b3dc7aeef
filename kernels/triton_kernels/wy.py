"""Stage 1b of chunked KDA: the WY factors, from the solve of stage 1a.

One program per (64-token chunk, value head). With tb = T diag(beta) and the q/k norm
factors (rq = scale / |q|, rk = 1 / |k|) from `intra`, and the gate cumsum recomputed
per key slice:

    w  = tb (rk K * exp(G))                 [T, HV, K]  operand dtype
    u  = tb V                               [T, HV, V]  fp32
    kg = rk K * exp(G_last - G)             [T, HV, K]  operand dtype
    qg = rq Q * exp(G)                      [T, HV, K]  operand dtype
    gexp = exp(G_last) per chunk            [NT, HV, K] fp32

G is the chunk-inclusive prefix of the clamped decays (a prefix sum of non-positive terms:
no cancellation); G_last - G_t is the exclusive suffix sum, never G_last - G itself (see
`chunk_cumsums`: by 16-row blocks, as intra builds them, or by two 64-row scans).

With a launch's input check (CHECK) this stage checks v as it loads it: each tile's rows
folded into a per-program sum (`checks.nan_where_bad`), flagged by one atomic when it is
NaN (`checks.flag_if_nan`); the intra stage checks q, k, g and beta. (The checks of q, k
and g here, where the tiles are also loaded, cost 0.32-0.37 ms at 8x4096 H32 on the H200
against ~0 in the intra stage, 2026-12-04: not placed here.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import LaunchConfig
from .checks import flag_if_nan, nan_where_bad
from .gate import LOG_DECAY_FLOOR, block_sums, decay_tile, gate_params, load_rows
from .inputs import StageInputs


@triton.jit
def chunk_cumsums(gt, BK: tl.constexpr, BLOCK_SCAN: tl.constexpr):
    """(G, G_last - G, G_last) of a [64, BK] tile of clamped log decays: the inclusive
    prefix, the exclusive suffix [64, BK], and the chunk total [BK].

    BLOCK_SCAN: from 16-row block sums (scans inside blocks, then four block totals), as
    the intra kernel builds them; else by two 64-row scans. Either way the suffix cancels
    only against block- or token-sized sums (|.| <= 480), never against G itself.
    """
    if BLOCK_SCAN:
        F3, Tot, R3 = block_sums(gt, BK)
        o_b = tl.arange(0, 4)
        before = (o_b[None, :] < o_b[:, None])[:, :, None]  # [b, m, 1]: block m before b
        off = tl.sum(tl.where(before, Tot[None, :, :], 0.0), axis=1)
        later = tl.sum(tl.where(tl.permute(before, (1, 0, 2)), Tot[None, :, :], 0.0), axis=1)
        G = tl.reshape(F3 + off[:, None, :], [64, BK])
        Gs = tl.reshape(R3 + later[:, None, :], [64, BK])
        total = tl.sum(Tot, axis=0)
    else:
        G = tl.cumsum(gt, axis=0)
        Gs = tl.cumsum(gt, axis=0, reverse=True) - gt
        total = tl.sum(gt, axis=0)
    return G, Gs, total


@triton.jit
def store_wy_factors(
    Tb, rq, rk, q_c, k_c, g_c, v_c, w_c, kg_c, qg_c, u_c, gexp_c, a_log, dt_bias, lower_bound, n_t, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr, FLOOR: tl.constexpr, BLOCK_SCAN: tl.constexpr, TB_FP16: tl.constexpr,
    CHECK: tl.constexpr,
):
    """One chunk's WY factors from Tb = T diag(beta) [64, 64] fp32 (with TB_FP16 its values
    are fp16's, bounded as `intra.solve_unit_lower` shows, and w is an fp16 product) and the norm
    factors rq, rk [64]. The ``*_c`` pointers are at the chunk's first token and head
    (gexp_c at its chunk row); n_t <= 64 tokens are valid. Stores w, kg, qg, u and gexp as
    in the module docstring. Returns [64] fp32: per token row, with CHECK, the sum of its
    raw v values' `checks.nan_where_bad` (NaN where one failed), else zeros."""
    o_t = tl.arange(0, 64)
    m_t = o_t < n_t
    for i_k in range(tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m_c = cols < K
        bias, a = gate_params(a_log, dt_bias, i_hv, cols, m_c, K, HAS_A_LOG, HAS_DT_BIAS)
        gt = decay_tile(g_c, a, bias, lower_bound, o_t, m_t, cols, m_c, HV * K, GATE, FLOOR)
        G, Gs, total = chunk_cumsums(gt, BK, BLOCK_SCAN)
        eG = tl.exp(G)
        eK = tl.exp(Gs)
        kt = load_rows(k_c, o_t, m_t, H * K, cols, m_c) * rk[:, None]
        qt = load_rows(q_c, o_t, m_t, H * K, cols, m_c) * rq[:, None]
        if TB_FP16:
            wt = tl.dot(Tb.to(tl.float16), (kt * eG).to(tl.float16))
        else:
            wt = tl.dot(Tb, kt * eG, input_precision=DOT_PREC)
        p = o_t[:, None] * (HV * K) + cols[None, :]
        m = m_t[:, None] & m_c[None, :]
        tl.store(w_c + p, wt.to(w_c.dtype.element_ty), mask=m)
        tl.store(kg_c + p, (kt * eK).to(kg_c.dtype.element_ty), mask=m)
        tl.store(qg_c + p, (qt * eG).to(qg_c.dtype.element_ty), mask=m)
        tl.store(gexp_c + cols, tl.exp(total), mask=m_c)

    bad_rows = tl.zeros([64], dtype=tl.float32)  # CHECK: the raw v rows' `nan_where_bad`, summed
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        vt = load_rows(v_c, o_t, m_t, HV * V, cv, m_v)
        if CHECK:
            bad_rows += tl.sum(nan_where_bad(vt, False), axis=1)
        ut = tl.dot(Tb, vt, input_precision=DOT_PREC)
        tl.store(u_c + (o_t[:, None] * (HV * V) + cv[None, :]), ut, mask=m_t[:, None] & m_v[None, :])
    return bad_rows


@triton.jit
def chunk_wy_kernel(
    q, k, v, g, a_log, dt_bias, tb, rqk,
    w, u, kg, qg, gexp,
    chunks, checks, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr, FLOOR: tl.constexpr, BLOCK_SCAN: tl.constexpr, CHECK: tl.constexpr,
):
    """Grid (NTc, HV). chunks: [NTc, 3] int64 (first token, end token, h index).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (any float dtype); tb: [T, HV, 64] (fp16
    or fp32) and rqk: [T, HV, 2] fp32 from `intra`; outputs as in the module docstring.
    CHECK: v's raw values (the intra stage checks the other inputs) set ``checks`` [1]
    int32 to 1 when one is a NaN or Inf (`kernels.problem.PrefillProblem.input_checks`).
    """
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    i_g = tl.load(chunks + i_c * 3 + 2)
    o_t = tl.arange(0, 64)
    m_t = o_t < t1 - t0
    Tb = load_rows(tb + (t0 * HV + i_hv) * 64, o_t, m_t, HV * 64, o_t, o_t < 64)
    r_c = rqk + (t0 * HV + i_hv) * 2
    rq = tl.load(r_c + o_t * (HV * 2), mask=m_t, other=0.0)
    rk = tl.load(r_c + o_t * (HV * 2) + 1, mask=m_t, other=0.0)
    tk = (t0 * HV + i_hv) * K  # chunk bases: 64-bit scalars, 32-bit in-tile offsets
    bad_rows = store_wy_factors(
        Tb, rq, rk, q + t0 * (H * K) + i_h * K, k + t0 * (H * K) + i_h * K, g + t0 * (HV * K) + i_hv * K,
        v + (t0 * HV + i_hv) * V, w + tk, kg + tk, qg + tk, u + (t0 * HV + i_hv) * V, gexp + (i_g * HV + i_hv) * K,
        a_log, dt_bias, lower_bound, t1 - t0, i_hv, H, HV, K, V, BK, BV, GATE, HAS_A_LOG, HAS_DT_BIAS,
        DOT_PREC, FLOOR, BLOCK_SCAN, tb.dtype.element_ty == tl.float16, CHECK,
    )
    if CHECK:
        flag_if_nan(checks, tl.sum(bad_rows, axis=0))


@dataclass(frozen=True)
class WyOutputs:
    """The WY stage's outputs (see the module docstring): w, kg, qg [T, HV, K] in the
    operand dtype, u [T, HV, V] fp32, gexp [NT, HV, K] fp32."""

    w: torch.Tensor
    u: torch.Tensor
    kg: torch.Tensor
    qg: torch.Tensor
    gexp: torch.Tensor

    @classmethod
    def alloc(cls, x: StageInputs, num_chunks: int) -> "WyOutputs":
        w = torch.empty(x.T, x.HV, x.K, dtype=x.mat, device=x.device)
        return cls(w=w, u=torch.empty(x.T, x.HV, x.V, dtype=torch.float32, device=x.device),
                   kg=torch.empty_like(w), qg=torch.empty_like(w),
                   gexp=torch.empty(num_chunks, x.HV, x.K, dtype=torch.float32, device=x.device))


def launch_wy(x: StageInputs, chunks: torch.Tensor, tb: torch.Tensor, rqk: torch.Tensor, out: WyOutputs,
              cfg: LaunchConfig) -> None:
    """The WY factors of the chunk rows ``chunks`` ([NTc, 3], `kernels.triton_plan`) from
    intra's tb [T, HV, 64] and rqk [T, HV, 2], into ``out``; the raw inputs checked
    into ``x.checks`` as they are read (v's; when given)."""
    chunk_wy_kernel[(chunks.shape[0], x.HV)](
        x.q, x.k, x.v, x.g, x.a_log, x.dt_bias, tb, rqk, out.w, out.u, out.kg, out.qg, out.gexp, chunks,
        x.check_pointer(chunks), x.lower_bound, H=x.H, HV=x.HV, K=x.K, V=x.V, BK=cfg.wy_bk, BV=cfg.wy_bv,
        **x.gate_flags, DOT_PREC=x.dot_prec, FLOOR=LOG_DECAY_FLOOR, BLOCK_SCAN=cfg.wy_block_scan,
        CHECK=x.checks is not None, num_warps=cfg.wy_warps, num_stages=cfg.wy_stages,
    )
