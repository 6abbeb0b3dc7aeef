"""Stage 1b for the serving config: the WY factors of the bounded gate, lean.

The same outputs as `wy` (w, u, kg, qg, gexp; shapes and dtypes in its module docstring)
from a kernel that only serves the problems `intra_bounded` serves: the lower-bound gate
(per-token log decays in [L, 0], -5 <= L < 0) with 16-bit inputs and the fp16 solve
(fp16 tb and operand tiles). `launch_wy_bounded` runs it where `bounded_wy_applies`;
every other problem keeps `wy.launch_wy`.

What it drops, against `wy` (whose kernel, like intra's, issues more than the memory
system needs; see bench/RESULTS.md "the bounded gate's WY kernel"):

- Exponents in log2 units through `tl.exp2` (one MUFU.EX2; `tl.exp` is five
  instructions), the gate's sigmoid as rsqrt((1 + e)^2) (`intra_bounded._sigmoid_rsqrt`)
  instead of `tl.sigmoid`'s division, exp(A_log) folded into one scalar.
- No per-token floor: with |g| <= 5 the clamp at -LOG_DECAY_FLOOR never acts.
- tb is loaded once in fp16 (the w product's operand as stored) and widened once for the
  u product, not widened to fp32 and narrowed again per key slice; the gate tile is
  masked by rows only (masked key columns are never stored).

Numerics: G, the chunk-inclusive prefix of the log2 decays, lies in [64 L log2(e), 0]
(>= -462); 2^G and the exclusive suffix's 2^Gs underflow to zero exactly where `wy`'s
exp(G) does (their terms are below fp32's range against the chunk's first rows), and are
otherwise the same numbers up to rounding. G and Gs come from 16-row block sums as in `wy`
(`wy.chunk_cumsums`): the suffix never cancels against G itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import LaunchConfig
from .gate import GATE_LOWER_BOUND, load_rows
from .inputs import StageInputs
from .intra_bounded import LOG2E, _sigmoid_rsqrt
from .wy import WyOutputs, chunk_cumsums


@triton.jit
def chunk_wy_bounded_kernel(
    q, k, v, g, a_log, dt_bias, tb, rqk,
    w, u, kg, qg, gexp,
    chunks, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
):
    """Grid (NTc, HV). chunks: [NTc, 3] int64 (first token, end token, h index).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (raw gate), all bf16 or fp16; a_log
    [HV], dt_bias [HV, K] fp32 (placeholders when absent); lower_bound in [-5, 0); tb:
    [T, HV, 64] fp16 and rqk: [T, HV, 2] fp32 from the intra stage. Writes w, kg, qg
    [T, HV, K] fp16, u [T, HV, V] fp32 (rows of the chunk's tokens) and gexp [NT, HV, K]
    fp32 (the chunk's row), as `wy`'s module docstring defines them.
    """
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    i_g = tl.load(chunks + i_c * 3 + 2)
    o_t = tl.arange(0, 64)
    m_t = o_t < t1 - t0
    th = t0 * HV + i_hv  # chunk bases: 64-bit scalars, 32-bit in-tile offsets
    Tb = tl.load(tb + th * 64 + (o_t[:, None] * (HV * 64) + o_t[None, :]), mask=m_t[:, None], other=0.0)
    rq = tl.load(rqk + th * 2 + o_t * (HV * 2), mask=m_t, other=0.0)
    rk = tl.load(rqk + th * 2 + o_t * (HV * 2) + 1, mask=m_t, other=0.0)
    q_c = q + t0 * (H * K) + i_h * K
    k_c = k + t0 * (H * K) + i_h * K
    g_c = g + t0 * (HV * K) + i_hv * K
    w_c = w + th * K
    kg_c = kg + th * K
    qg_c = qg + th * K

    # 2^(x * zs + bias * zs) = exp(-a (x + bias)); g2 = gs * sigmoid(a (x + bias)) in log2 units
    if HAS_A_LOG:
        zs = -tl.exp2(tl.load(a_log + i_hv).to(tl.float32) * LOG2E) * LOG2E
    else:
        zs = -LOG2E
    gs = lower_bound * LOG2E
    for i_k in range(tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m_c = cols < K
        if HAS_DT_BIAS:
            bzs = tl.load(dt_bias + i_hv * K + cols, mask=m_c, other=0.0).to(tl.float32) * zs
        else:
            bzs = tl.zeros([BK], dtype=tl.float32)
        x = load_rows(g_c, o_t, m_t, HV * K, cols, m_c)
        g2 = tl.where(m_t[:, None], gs * _sigmoid_rsqrt(tl.exp2(x * zs + bzs[None, :])), 0.0)
        G, Gs, total = chunk_cumsums(g2, BK, True)
        kt = load_rows(k_c, o_t, m_t, H * K, cols, m_c) * rk[:, None]
        qt = load_rows(q_c, o_t, m_t, H * K, cols, m_c) * rq[:, None]
        eG = tl.exp2(G)
        wt = tl.dot(Tb, (kt * eG).to(tl.float16))
        p = o_t[:, None] * (HV * K) + cols[None, :]
        m = m_t[:, None] & m_c[None, :]
        tl.store(w_c + p, wt.to(tl.float16), mask=m)
        tl.store(qg_c + p, (qt * eG).to(tl.float16), mask=m)
        tl.store(kg_c + p, (kt * tl.exp2(Gs)).to(tl.float16), mask=m)
        tl.store(gexp + (i_g * HV + i_hv) * K + cols, tl.exp2(total), mask=m_c)

    Tb32 = Tb.to(tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        m_v = cv < V
        vt = load_rows(v + th * V, o_t, m_t, HV * V, cv, m_v)
        ut = tl.dot(Tb32, vt, input_precision="tf32")
        tl.store(u + th * V + (o_t[:, None] * (HV * V) + cv[None, :]), ut, mask=m_t[:, None] & m_v[None, :])


def bounded_wy_applies(x: StageInputs) -> bool:
    """Whether ``x`` is a problem `chunk_wy_bounded_kernel` serves: the lower-bound gate and
    the fp16 solve (16-bit inputs, q/k L2 norm, sigmoid betas), as `intra_bounded`."""
    return x.gate == GATE_LOWER_BOUND and x.fp16_solve and -5.0 <= x.lower_bound < 0.0


def launch_wy_bounded(x: StageInputs, chunks: torch.Tensor, tb: torch.Tensor, rqk: torch.Tensor, out: WyOutputs,
                      cfg: LaunchConfig) -> None:
    """`wy.launch_wy`'s outputs for the chunk rows ``chunks`` ([NTc, 3], `kernels.triton_plan`)
    of a problem `bounded_wy_applies` to, from intra's tb [T, HV, 64] fp16 and rqk
    [T, HV, 2] fp32, into ``out``."""
    assert bounded_wy_applies(x) and tb.dtype == torch.float16 and out.w.dtype == torch.float16
    cap = {"maxnreg": cfg.bounded_wy_maxnreg} if cfg.bounded_wy_maxnreg else {}
    bk = min(cfg.bounded_wy_bk, max(16, triton.next_power_of_2(x.K)))
    bv = min(cfg.bounded_wy_bv, max(16, triton.next_power_of_2(x.V)))
    chunk_wy_bounded_kernel[(chunks.shape[0], x.HV)](
        x.q, x.k, x.v, x.g, x.a_log, x.dt_bias, tb, rqk, out.w, out.u, out.kg, out.qg, out.gexp, chunks,
        x.lower_bound, H=x.H, HV=x.HV, K=x.K, V=x.V, BK=bk, BV=bv,
        HAS_A_LOG=x.has_a_log, HAS_DT_BIAS=x.has_dt_bias, num_warps=4, num_stages=cfg.wy_stages, **cap,
    )
