"""Stage 1a for the serving config: the intra-chunk matrices and the solve, lean.

The same outputs as `intra` (tb = T diag(beta), A_qk, the q/k norm factors) from a
kernel that only serves the bounded gate: the lower-bound gate (per-token log decays in
[L, 0], -5 <= L < 0), 16-bit inputs with the fp16 solve (so unit-norm keys and sigmoid
betas, `triton_backend.stage_inputs`). `launch_intra_bounded` runs it where
`bounded_intra_applies`; every other problem keeps `intra.launch_intra`.

What it drops, against `intra` (whose kernel is latency-bound: ~8200 SASS instructions a
warp issued per program, 240-255 registers, two programs an SM; this one ~6300):

- Exponents in log2 units, taken with `tl.exp2` alone: one MUFU.EX2 each, where `tl.exp`
  is five instructions (a prescale and a denormal fix-up around it). The gate's sigmoid
  is rsqrt((1 + e)^2) (one MUFU.RSQ and one multiply) instead of a division (seven).
- No per-token floor: with |g| <= 5 the clamp at -LOG_DECAY_FLOOR never acts.
- The k side of A is built as [4(i), BK, 64] directly (key slice before token), which
  lets Triton stage it with ldmatrix instead of per-element shared loads and moves.
- A_qk and the norm factors are stored before the solve, the triangle masks take one
  compare (rows and columns past the chunk's end are zero already: their q, k and gate
  rows load as zeros), and the norms accumulate as [64] vectors, not [64, BK] tiles.
- At most `LaunchConfig.bounded_intra_maxnreg` (168) registers a thread: 3 programs of 4
  warps an SM instead of 2 (offline sm_90 compiles: no spill with Triton 3.6; with 3.9,
  24 bytes of stack, six 4-byte reloads a key slice, all loop-invariant).

Numerics (why one anchor per 16-token block is safe here, and what is exact). The chunk
is cut into four 16-token blocks; with G the chunk's inclusive cumsum of the log2
decays, F_t = G_t - Off_i (the inclusive prefix inside t's block i, Off_i the sum of
the earlier blocks' totals Tot), R_s = Off_(j+1) - G_s (the exclusive suffix inside s's
block j):

    A[t, s] = sum_c x_t[c] k_s[c] 2^(G_t[c] - G_s[c])
            = sum_c (x_t 2^F_t)[c] * fac[i, j, c] * (k_s 2^R_s)[c],
    fac[i, j] = 2^(Off_i - Off_(j+1)) (j < i),   2^(-Tot_i) (j = i),   0 (j > i).

Each per-token log2 decay is in [L log2(e), 0] (>= -7.22), so |F|, |R|, |Tot| <= 80 log2(e)
= 115.4 < 126: 2^F and 2^R are normal fp32 numbers in [2^-115.4, 1], 2^(-Tot) <= 2^115.4,
and every factor is a sum of at most 16 decays (no cancellation against a chunk-level
cumsum). For j < i both factors are <= 1, so a factor that underflows (tl.exp2 flushes
below 2^-126) belongs to a term below 2^-126 |x| |k|; for j = i the product is exact in
range. The products run in tf32 as in `intra` (the operands reach 2^115, past fp16); as
there, a raw key element times 2^115.4 must stay below fp32's largest value (|k| < 2^12
per element, before the L2 norm, in a block whose decays all sit at the bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import LaunchConfig
from .checks import flag_if_nan, nan_where_bad
from .gate import GATE_LOWER_BOUND, load_rows
from .inputs import StageInputs
from .intra import IntraOutputs, solve_unit_lower

BK = 16  # key slice: a [64, 16] tile's four 16-row blocks are the four warps' own rows
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _sigmoid_rsqrt(e):
    """1 / (1 + e) for e >= 0 (fp32, any shape) as rsqrt((1 + e)^2): one MUFU.RSQ and a
    multiply (relative error ~2^-22); 0 once (1 + e)^2 passes fp32's range."""
    d = 1.0 + e
    return tl.rsqrt(d * d)


@triton.jit
def chunk_intra_bounded_kernel(
    q, k, g, beta, a_log, dt_bias,
    tb, aqk, rqk,
    chunks,
    scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, NEG_EIGVAL: tl.constexpr, checks, CHECK: tl.constexpr,
):
    """Grid (NTc, HV). chunks: [NTc, 3] int64 (first token, end token, h index).

    q, k: [T, H, K] and g: [T, HV, K] (raw gate), beta: [T, HV] (logits), all bf16 or
    fp16; a_log [HV], dt_bias [HV, K] fp32 (placeholders when absent); lower_bound in
    [-5, 0). Writes tb = T diag(beta) [T, HV, 64] fp16, aqk = A_qk [T, HV, 64] fp16 (s <= t,
    zeros above) and rqk [T, HV, 2] fp32 = (scale / |q_t|, 1 / |k_t|), rows of the chunk's
    tokens only; the q/k L2 norm and beta = sigmoid(logit) (x2 with NEG_EIGVAL) are fused.
    CHECK: the raw q, k, g and beta values set ``checks`` [1] int32 to 1 when one is a NaN
    or Inf (row sums of `checks.nan_where_bad`, one atomic only then).
    """
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    t0 = tl.load(chunks + i_c * 3)
    t1 = tl.load(chunks + i_c * 3 + 1)
    o_t = tl.arange(0, 64)
    m_t = o_t < t1 - t0
    q_c = q + t0 * (H * K) + i_h * K  # chunk bases: 64-bit scalars, 32-bit in-tile offsets
    k_c = k + t0 * (H * K) + i_h * K
    g_c = g + t0 * (HV * K) + i_hv * K

    # 2^(x * zs + bias * zs) = exp(-a (x + bias)); g2 = gs * sigmoid(a (x + bias)) in log2 units
    if HAS_A_LOG:
        zs = -tl.exp2(tl.load(a_log + i_hv).to(tl.float32) * LOG2E) * LOG2E
    else:
        zs = -LOG2E
    gs = lower_bound * LOG2E

    o_b = tl.arange(0, 4)
    before = (o_b[None, :] < o_b[:, None])[:, :, None]  # [NB(i), NB(m), 1]: m < i
    upto = (o_b[None, :] <= o_b[:, None])[:, :, None]  # [NB(i), NB(j), 1]: j <= i
    acc_qk = tl.zeros([4, 16, 64], dtype=tl.float32)
    acc_kk = tl.zeros([4, 16, 64], dtype=tl.float32)
    ssq = tl.zeros([64], dtype=tl.float32)
    ssk = tl.zeros([64], dtype=tl.float32)
    bad = tl.zeros([64], dtype=tl.float32)  # CHECK
    for i_k in range(tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m_c = cols < K
        if HAS_DT_BIAS:
            bzs = tl.load(dt_bias + i_hv * K + cols, mask=m_c, other=0.0).to(tl.float32) * zs
        else:
            bzs = tl.zeros([BK], dtype=tl.float32)
        x = load_rows(g_c, o_t, m_t, HV * K, cols, m_c)
        g2 = tl.where(m_t[:, None] & m_c[None, :], gs * _sigmoid_rsqrt(tl.exp2(x * zs + bzs[None, :])), 0.0)
        g3 = tl.reshape(g2, [4, 16, BK])
        F3 = tl.cumsum(g3, axis=1)  # inclusive prefix inside each block
        Tot = tl.sum(g3, axis=1)  # [NB, BK]
        off = tl.sum(tl.where(before, Tot[None, :, :], 0.0), axis=1)  # [NB, BK]: Off_i
        # fac[i, j] = 2^(Off_i - Off_(j+1)) for j <= i (2^-Tot_i at j = i), else 0
        fac = tl.exp2(tl.where(upto, off[:, None, :] - (off + Tot)[None, :, :], float("-inf")))
        qt = load_rows(q_c, o_t, m_t, H * K, cols, m_c)
        kt = load_rows(k_c, o_t, m_t, H * K, cols, m_c)
        ssq += tl.sum(qt * qt, axis=1)
        ssk += tl.sum(kt * kt, axis=1)
        if CHECK:
            bad += tl.sum(nan_where_bad(x, False) + nan_where_bad(qt, False) + nan_where_bad(kt, False), axis=1)
        kR = tl.reshape(kt, [4, 16, BK]) * tl.exp2(Tot[:, None, :] - F3)  # k_s 2^R_s
        # the k side [4(i), BK, 64]: key slice before token, so its shared copy feeds ldmatrix
        ks = tl.reshape(tl.permute(kR, (2, 0, 1))[None, :, :, :] * tl.permute(fac, (0, 2, 1))[:, :, :, None],
                        [4, BK, 64])
        eF = tl.exp2(F3)
        acc_qk = tl.dot(tl.reshape(qt, [4, 16, BK]) * eF, ks, acc_qk, input_precision="tf32")
        acc_kk = tl.dot(tl.reshape(kt, [4, 16, BK]) * eF, ks, acc_kk, input_precision="tf32")

    rq = tl.rsqrt(ssq + 1e-6) * scale
    rk = tl.rsqrt(ssk + 1e-6)
    base = (t0 * HV + i_hv) * 64
    o_r = o_t[:, None] * (HV * 64) + o_t[None, :]
    A_qk = tl.where(o_t[:, None] >= o_t[None, :], tl.reshape(acc_qk, [64, 64]), 0.0) * rq[:, None] * rk[None, :]
    tl.store(aqk + base + o_r, A_qk.to(aqk.dtype.element_ty), mask=m_t[:, None])
    r_c = rqk + (t0 * HV + i_hv) * 2
    tl.store(r_c + o_t * (HV * 2), rq, mask=m_t)
    tl.store(r_c + o_t * (HV * 2) + 1, rk, mask=m_t)
    # beta after the loop: nothing of it is live across the key slices
    x_b = tl.load(beta + t0 * HV + i_hv + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b = tl.where(m_t, _sigmoid_rsqrt(tl.exp2(-x_b * LOG2E)), 0.0)
    if CHECK:
        flag_if_nan(checks, tl.sum(bad + nan_where_bad(x_b, False), axis=0))
    if NEG_EIGVAL:
        b = b * 2.0
    L = tl.where(o_t[:, None] > o_t[None, :], tl.reshape(acc_kk, [64, 64]), 0.0) * (rk * b)[:, None] * rk[None, :]
    Tm = solve_unit_lower(L, "tf32", True, True)
    tl.store(tb + base + o_r, (Tm * b[None, :]).to(tb.dtype.element_ty), mask=m_t[:, None])


def bounded_intra_applies(x: StageInputs) -> bool:
    """Whether ``x`` is a problem `chunk_intra_bounded_kernel` serves: the lower-bound gate
    and the fp16 solve (16-bit inputs, q/k L2 norm, sigmoid betas)."""
    return x.gate == GATE_LOWER_BOUND and x.fp16_solve and -5.0 <= x.lower_bound < 0.0


def launch_intra_bounded(x: StageInputs, chunks: torch.Tensor, out: IntraOutputs, cfg: LaunchConfig) -> None:
    """`intra.launch_intra`'s outputs for the chunk rows ``chunks`` ([NTc, 3],
    `kernels.triton_plan`) of a problem `bounded_intra_applies` to, into ``out`` (q, k, g
    and beta checked into ``x.checks`` when given)."""
    assert bounded_intra_applies(x) and out.tb.dtype == torch.float16 and out.aqk.dtype == torch.float16
    cap = {"maxnreg": cfg.bounded_intra_maxnreg} if cfg.bounded_intra_maxnreg else {}
    chunk_intra_bounded_kernel[(chunks.shape[0], x.HV)](
        x.q, x.k, x.g, x.beta, x.a_log, x.dt_bias, out.tb, out.aqk, out.rqk, chunks, x.scale, x.lower_bound,
        H=x.H, HV=x.HV, K=x.K, BK=BK, HAS_A_LOG=x.has_a_log, HAS_DT_BIAS=x.has_dt_bias, NEG_EIGVAL=x.neg_eigval,
        checks=x.check_pointer(chunks), CHECK=x.checks is not None, num_warps=4, num_stages=cfg.intra_stages, **cap,
    )
