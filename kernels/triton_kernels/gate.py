"""Triton device functions for the per-token transforms (gate, beta) and the chunk-local
gate cumsum pieces the chunk kernels share.

The same formulas as `kernels.gate`, fused into the kernels that consume them. All
arithmetic is fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

# GATE constexpr values.
GATE_GIVEN = 0  # g is already the log decay
GATE_SOFTPLUS = 1  # g = -exp(A_log) * softplus(g_raw + dt_bias)
GATE_LOWER_BOUND = 2  # g = L * sigmoid(exp(A_log) * (g_raw + dt_bias))

# Per-token log decays are clamped at -LOG_DECAY_FLOOR (natural log). exp(-30) ~ 9e-14 is
# below fp32 resolution against any O(1) term, so the clamp changes no result, while it
# bounds the 16-token prefix sums (|F| <= 480) whose differences the chunk kernel takes.
LOG_DECAY_FLOOR = 30.0

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


@triton.jit
def softplus(x):
    """log(1 + exp(x)), x itself above the threshold 20; log1p done accurately
    (Goldberg's u = 1 + e trick) so tiny results keep their relative precision."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def log_decay(x, bias, a, lower_bound, GATE: tl.constexpr):
    """The log decay from raw gate values.

    x: raw g (or the log decay when GATE == GATE_GIVEN), fp32, any shape [..., BK];
    bias: dt_bias broadcastable to x (0.0 when absent); a: exp(A_log[h]) (1.0 when absent).
    """
    if GATE == 1:
        x = -a * softplus(x + bias)
    elif GATE == 2:
        x = lower_bound * tl.sigmoid(a * (x + bias))
    return x


@triton.jit
def activate_beta(b, SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """sigmoid(b) when SIGMOID, times 2 when NEG_EIGVAL; b fp32."""
    if SIGMOID:
        b = tl.sigmoid(b)
    if NEG_EIGVAL:
        b = b * 2.0
    return b


@triton.jit
def gate_params(a_log, dt_bias, i_hv, cols, m_cols, K: tl.constexpr,
                HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """(bias [BK], a scalar) for value head i_hv: dt_bias[i_hv, cols] and exp(A_log[i_hv])."""
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + i_hv * K + cols, mask=m_cols, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros_like(cols).to(tl.float32)
    if HAS_A_LOG:
        a = tl.exp(tl.load(a_log + i_hv).to(tl.float32))
    else:
        a = 1.0
    return bias, a


@triton.jit
def load_rows(base, rows, m_rows, stride_row, cols, m_cols):
    """[len(rows), len(cols)] fp32 tile of base[rows * stride_row + cols], 0 where masked.

    base: a scalar pointer to the tile's first row (64-bit offsets stay scalar); rows, cols:
    int32 in-tile indices, so per-element address math is 32-bit.
    """
    p = base + (rows[:, None] * stride_row + cols[None, :])
    return tl.load(p, mask=m_rows[:, None] & m_cols[None, :], other=0.0).to(tl.float32)


@triton.jit
def decay_tile(g_base, a, bias, lower_bound, rows, m_rows, cols, m_cols, stride_row,
               GATE: tl.constexpr, FLOOR: tl.constexpr):
    """[BT, BK] clamped per-token log decays (rows of g from g_base); 0 on masked rows/cols."""
    return decays_of(load_rows(g_base, rows, m_rows, stride_row, cols, m_cols), a, bias, lower_bound, m_rows, m_cols,
                     GATE, FLOOR)


@triton.jit
def decays_of(x, a, bias, lower_bound, m_rows, m_cols, GATE: tl.constexpr, FLOOR: tl.constexpr):
    """`decay_tile` of the raw gate tile ``x`` [BT, BK] fp32 as loaded."""
    x = tl.maximum(log_decay(x, bias[None, :], a, lower_bound, GATE), -FLOOR)
    return tl.where(m_rows[:, None] & m_cols[None, :], x, 0.0)


@triton.jit
def block_sums(gt, BK: tl.constexpr):
    """Block structure of a [BT, BK] decay tile.

    Returns F3 [NB, BC, BK] (inclusive prefix inside each block), Tot [NB, BK] (block totals)
    and R3 [NB, BC, BK] (exclusive suffix inside each block).
    """
    g3 = tl.reshape(gt, [4, 16, BK])
    F3 = tl.cumsum(g3, axis=1)
    Tot = tl.sum(g3, axis=1)
    R3 = Tot[:, None, :] - F3
    return F3, Tot, R3
