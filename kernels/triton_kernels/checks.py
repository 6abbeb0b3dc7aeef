"""Device functions that flag values as the kernels load or store them: no second pass.

`flag_nonfinite` marks a NaN or Inf in a tile (the stages' non-finite flags on o and the
states, and the inputs' checks); `flag_positive` raises an int32 to the float32 bits of a
tile's largest positive value (a given log decay must be <= 0). Both issue predicated
relaxed atomics per element, so a tile without such values costs a compare and no memory
traffic, and neither reduces across threads (a reduction's barrier in the state pass's
chunk loop cost 7% at 8x4096 H32).
"""
from __future__ import annotations

import triton
import triton.language as tl

# The slots of a launch's input checks (`kernels.problem.PrefillProblem.input_checks`).
CHECK_Q, CHECK_K, CHECK_V, CHECK_G, CHECK_BETA = 0, 1, 2, 3, 4
CHECK_G_POSITIVE = 5
NUM_CHECKS = 6


@triton.jit
def flag_nonfinite(flag, x, mask):
    """Set the int32 at ``flag`` to 1 when the tile ``x`` (any float dtype) holds a NaN or
    +-Inf where ``mask``."""
    xf = x.to(tl.float32)
    bad = ((xf != xf) | (tl.abs(xf) > 3.4028234663852886e38)) & mask
    tl.atomic_max(flag + bad.to(tl.int32) * 0, 1, mask=bad, sem="relaxed")


@triton.jit
def flag_positive(at, x, mask):
    """Raise the int32 at ``at`` to the float32 bits of the largest value > 0 of the fp32
    tile ``x`` where ``mask`` (the bit patterns of positive floats order as the floats do)."""
    pos = (x > 0.0) & mask
    tl.atomic_max(at + pos.to(tl.int32) * 0, x.to(tl.int32, bitcast=True), mask=pos, sem="relaxed")


@triton.jit
def check_inputs(checks, x, mask, SLOT: tl.constexpr, LOG_DECAY: tl.constexpr):
    """Flag the raw input tile ``x`` (fp32, as loaded) of input SLOT into ``checks`` (the
    launch's [NUM_CHECKS] int32): a NaN or Inf, and with LOG_DECAY (g given as the log
    decay) its largest positive value."""
    flag_nonfinite(checks + SLOT, x, mask)
    if LOG_DECAY:
        flag_positive(checks + 5, x, mask)  # CHECK_G_POSITIVE (a jit function reads no globals)
