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
    state_bv: int
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


# Compute o inside the state pass when the (sequence, head) programs alone fill the GPU;
# with few of them (one long sequence) a separate, fully parallel output stage is faster.
FUSE_MIN_SEQ_HEADS = 128


def fuse_output(cfg: LaunchConfig, num_seq_heads: int) -> bool:
    """Whether the state pass also computes o (no h / v_new round trip through memory)."""
    if cfg.fuse_output is not None:
        return cfg.fuse_output
    return num_seq_heads >= FUSE_MIN_SEQ_HEADS


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
        intra_bk=min(bk, 32), intra_bkd=8, intra_warps=8, wy_bk=min(bk, 32), wy_bv=min(bv, 64), wy_warps=4,
        state_bv=min(bv, 32), state_warps=8, state_stages=2,
        out_bk=min(bk, 128), out_bv=min(bv, 64), out_warps=4, out_stages=2,
        rec_bv=min(bv, 16 if bk > 128 else 32), rec_warps=4,
        fp16_operands=True,
    )
