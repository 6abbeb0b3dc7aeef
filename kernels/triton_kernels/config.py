"""Fixed launch configurations, chosen by shape (never by timing runs on a live pool).

The state pass and the decode step write the pool in place, so they must not be
autotuned; the other kernels keep fixed configs too, which also lets the Triton
interpreter (no autotuning) run the same code path.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import triton


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and warps per kernel. BK/BV: key/value tile widths (powers of two >= 16,
    except intra_bkd, the key slice of the pairwise diagonal blocks, >= 8)."""

    intra_bk: int
    intra_bkd: int
    intra_warps: int
    wy_bk: int
    wy_bv: int
    wy_warps: int
    state_bv: int | None  # None: decided by shape (`state_block_v`)
    state_warps: int
    state_stages: int
    out_bk: int
    out_bv: int
    out_warps: int
    out_stages: int
    rec_bv: int
    rec_warps: int
    fuse_output: bool | None = None  # None: decided by shape (`fuse_output`)
    # 16-bit inputs: store w, kg, qg, A_qk in fp16 and multiply in fp16 (10-bit mantissa, as
    # tf32) instead of fp32 + tf32; fp32 inputs always keep fp32 and full-precision products.
    fp16_operands: bool = False

    def with_overrides(self, **kw: int) -> "LaunchConfig":
        return replace(self, **kw)


# Compute o inside the state pass from this many (sequence, head) programs on (0: always).
# Measured on an H200
# (H=32, K=V=128, bf16): fusing wins at every grid case, one 65536-token sequence included
# (12.4 vs 13.3 ms), as it skips the h / v_new round trip through memory.
FUSE_MIN_SEQ_HEADS = 0
# With this many (sequence, head) programs the state pass fills the GPU with BV = 64 (fewer,
# wider programs: 5.7 vs 6.2 ms on 8x4096); below it BV = 32 keeps more programs in flight.
WIDE_STATE_MIN_SEQ_HEADS = 128


def fuse_output(cfg: LaunchConfig, num_seq_heads: int) -> bool:
    """Whether the state pass also computes o (no h / v_new round trip through memory)."""
    if cfg.fuse_output is not None:
        return cfg.fuse_output
    return num_seq_heads >= FUSE_MIN_SEQ_HEADS


def state_block_v(cfg: LaunchConfig, num_seq_heads: int, K: int, V: int) -> int:
    """The V block of the state pass: the config's, else by the number of programs (and 32
    for K > 128, where the [K, BV] state and the [64, K] tiles crowd the registers)."""
    if cfg.state_bv is not None:
        return cfg.state_bv
    wide = num_seq_heads >= WIDE_STATE_MIN_SEQ_HEADS and K <= 128
    return min(_pow2(V), 64 if wide else 32)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def select_config(K: int, V: int, interpret: bool) -> LaunchConfig:
    """The launch config for head dims K, V (any 1..256; padded to powers of two and masked)."""
    bk, bv = _pow2(K), _pow2(V)
    if interpret:  # numpy per program: fewer, wider steps are faster; warps mean nothing
        return LaunchConfig(
            intra_bk=bk, intra_bkd=bk, intra_warps=4, wy_bk=bk, wy_bv=bv, wy_warps=4,
            state_bv=bv, state_warps=4, state_stages=1,
            out_bk=bk, out_bv=bv, out_warps=4, out_stages=1,
            rec_bv=bv, rec_warps=4, fp16_operands=True,
        )
    return LaunchConfig(
        intra_bk=min(bk, 16), intra_bkd=8, intra_warps=4, wy_bk=min(bk, 32), wy_bv=min(bv, 64), wy_warps=4,
        state_bv=None, state_warps=8, state_stages=2 if bk <= 128 else 1,
        out_bk=min(bk, 128), out_bv=min(bv, 64), out_warps=4, out_stages=2,
        rec_bv=min(bv, 16 if bk > 128 else 32), rec_warps=4,
        fp16_operands=True,
    )
