"""Device functions that flag values as the kernels load or store them: no second pass.

`flag_nonfinite` marks a NaN or Inf in a tile as it is stored (the stages' non-finite flags
on o and the states): predicated relaxed atomics per element, no reduction across threads
(a reduction's barrier in the state pass's chunk loop cost 7% at 8x4096 H32).

The inputs' checks fold each raw tile into a running sum as it is loaded (`nan_where_bad`:
x * 0, NaN exactly where x is a NaN or Inf, and where a given log decay is > 0), reduce it
once per program and issue one atomic only when the sum is NaN (`flag_if_nan`). Per-element
predicated atomics there (as `flag_nonfinite` issues) made the WY stage at 8x4096 H32 1.75
ms slower (2026-12-04): they are for the few tiles a program stores, not the inputs it reads.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def flag_nonfinite(flag, x, mask):
    """Set the int32 at ``flag`` to 1 when the tile ``x`` (any float dtype) holds a NaN or
    +-Inf where ``mask``."""
    xf = x.to(tl.float32)
    bad = ((xf != xf) | (tl.abs(xf) > 3.4028234663852886e38)) & mask
    tl.atomic_max(flag + bad.to(tl.int32) * 0, 1, mask=bad, sem="relaxed")


@triton.jit
def nan_where_bad(x, LOG_DECAY: tl.constexpr):
    """The fp32 tile ``x`` (a raw input, 0 where masked) as 0 where it passes the inputs'
    checks and NaN where it does not: a NaN or Inf, or with LOG_DECAY (g given as the log
    decay) a value > 0. Summed, the tiles of a program stay 0 (sums of signed zeros) unless
    one value failed."""
    z = x * 0.0
    if LOG_DECAY:
        z = z + tl.where(x > 0.0, float("nan"), 0.0)
    return z


@triton.jit
def flag_if_nan(flag, s):
    """Set the int32 at ``flag`` to 1 when the fp32 scalar ``s`` is NaN: one atomic, only then."""
    if s != s:
        tl.atomic_max(flag, 1, sem="relaxed")
