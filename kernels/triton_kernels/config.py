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
    intra_stages: int
    wy_bk: int
    wy_bv: int
    wy_warps: int
    wy_stages: int
    wy_block_scan: bool
    state_bv: int | None  # None: decided by shape (`state_launch`)
    state_warps: int | None  # None: decided by shape (`state_launch`)
    state_stages: int | None  # None: decided by head dim and operand size (`state_launch`)
    out_bk: int
    out_bv: int
    out_warps: int
    out_stages: int
    rec_bv: int
    rec_warps: int
    fuse_output: bool | None = None  # None: decided by shape (`fuse_output`)
    # Cut batches into pieces of about this many (chunk, head) programs per parallel launch,
    # so each piece's state pass overlaps the next pieces' parallel stages (0: one piece;
    # None: decided by shape, `piece_chunks`).
    piece_chunk_heads: int | None = 0
    # 16-bit inputs: store w, kg, qg, A_qk in fp16 and multiply in fp16 (10-bit mantissa, as
    # tf32) instead of fp32 + tf32; fp32 inputs always keep fp32 operands (`fp32_products`).
    fp16_operands: bool = False
    # ... and, with unit-norm keys and sigmoid betas (bounded entries, see
    # `intra.solve_unit_lower`), run the triangular solve and T diag(beta) in fp16 too.
    fp16_solve: bool = False
    # Solve levels inside 16-row blocks on the diagonal blocks alone (`intra.solve_unit_lower`).
    solve_diag16: bool = False
    # The k side of A from block-level and in-block decay factors (`intra.chunk_matrices`).
    factored_a: bool = False
    # The intra stage of the bounded gate with 16-bit inputs from `intra_bounded` (its own
    # kernel; other problems keep `intra`).
    bounded_intra: bool = False
    # ... its registers a thread (0: ptxas's choice; 168 lets 3 programs of 4 warps share an SM).
    bounded_intra_maxnreg: int = 168
    # How fp32 inputs' products run (`tl.dot` input_precision): "tf32x3" (three tf32
    # tensor-core products of the operands' high and low parts: about fp32's accuracy) or
    # "ieee" (fp32 FMAs, off the tensor cores). 16-bit inputs always take fp16/tf32 products.
    fp32_products: str = "tf32x3"
    # The checkpointed state pass loads each chunk's checkpoint address one chunk ahead
    # instead of right before the store's branch, which waits for that load every chunk. H200,
    # 8x4096 H32, 32 checkpoints (2026-12-04, three runs): the state kernel 0.813-0.820 ms
    # against 0.826-0.835 (plain 0.663-0.669); the server's path +10.5 to +12.0% against +12.9
    # to +14.1%. Other ways to store them lost there: from the registers by inline PTX (0.902),
    # after a loop over the chunks up to each (0.865), 8 warps (0.880), BV 32 (1.056).
    state_ckpt_prefetch: bool = True
    # End a state-pass segment at every checkpoint and store each after its segment's chunk
    # loop, which stays the plain one (a state launch per level of segments: the plan's
    # cuts), when that makes at most this many launches per piece; denser checkpoints are
    # stored from inside the chunk loop (0: always). State kernel device ms, 8x4096 H32
    # (2026-12-04 afternoon, runs 1-2; plain 0.662): a checkpoint every 1024 tokens (4 levels)
    # 0.776-0.778 against 0.814-0.815 in the loop; every 256 (16 levels) 1.147 against 1.007;
    # every 128 (32) 1.654 against 1.119. Each level costs ~0.035 ms (its pipeline fill,
    # carry and launch gap), so segments pay up to ~5 levels; 4 is the measured win.
    state_ckpt_levels: int = 4

    def with_overrides(self, **kw: int) -> "LaunchConfig":
        return replace(self, **kw)


# Compute o inside the state pass from this many (sequence, head) programs on (0: always).
# Measured on an H200
# (H=32, K=V=128, bf16): fusing wins at every grid case, one 65536-token sequence included
# (12.4 vs 13.3 ms), as it skips the h / v_new round trip through memory.
FUSE_MIN_SEQ_HEADS = 0
# Batches of fewer (sequence, head) pairs than this leave the GPU mostly idle during the
# state pass (one program per (sequence, head, V block), each a chain of dependent chunk
# steps), so they are cut into pieces whose state passes overlap the next pieces' parallel
# stages (a side stream). H200, H=32, K=V=128, bf16, same run (2026-11-30): 1x65536 7.37 ms
# in pieces vs 7.68 in one (8.44 vs 7.28 with a 2-stage state kernel). Wider batches keep
# one piece: the state pass fills the GPU by itself, and overlapping it takes SM room from
# the parallel kernels (8x4096 3.72 vs 3.65, 256x128 4.31 vs 4.22 in pieces).
WIDE_STATE_MIN_SEQ_HEADS = 128
# Programs per parallel launch of one piece: 4096 (chunk, head) programs are ~15 waves of
# the intra kernel on an H200 (132 SMs, two programs each).
PIECE_CHUNK_HEADS = 4096


# The triangular solve in fp16 where its entries are bounded (`LaunchConfig.fp16_solve`).
FP16_SOLVE = True
# The solve's first levels on [4, 16, 16] diagonal blocks (`LaunchConfig.solve_diag16`) and
# A's k side from factored decays (`LaunchConfig.factored_a`). H200, H=32, K=V=128, bf16,
# same run as fla-core (2026-12-01, `bench/kernels.py --sweep`): the two together take
# 8x4096 from 3.64 to 3.25 ms and 1x65536 from 7.28 to 6.53 (each alone about half of that),
# o and final states within 1e-3 of the previous path's.
SOLVE_DIAG16 = True
FACTORED_A = True
# The bounded gate's intra kernel (`LaunchConfig.bounded_intra`, `intra_bounded`). H200, H=32,
# K=V=128, bf16, same run as FlashKDA (2026-12-04, `bench/kernels.py --sweep`): intra 1.315 ->
# 0.964 ms at 8x4096, so 8x4096 3.247 -> 2.914 ms, 256x128 3.843 -> 3.481, 1x65536 6.536 -> 6.026,
# 1x4096 0.463 -> 0.425; o and final states as accurate against the fp32 reference (1.8e-3 /
# 4.5e-4) and within 1e-3 of the previous kernel's; its GPU tests 14/14 and test_triton_gpu's
# 11/11 passed compiled with it on.
BOUNDED_INTRA = True
# fp32 inputs' products (`LaunchConfig.fp32_products`). H200, H=32, K=V=128, fp32 inputs
# (2026-12-02, `bench/kernels.py --sweep`): tf32x3 takes 1x4096 from 28.3 to 1.34 ms and
# 8x4096 from 247 to 11.3 (the ieee state pass spills: 231 of the 247 ms), o and final
# states within 5e-7 of ieee's; on the GPU it meets the float64 reference at 1e-4.
FP32_PRODUCTS = "tf32x3"


def fuse_output(cfg: LaunchConfig, num_seq_heads: int) -> bool:
    """Whether the state pass also computes o (no h / v_new round trip through memory)."""
    if cfg.fuse_output is not None:
        return cfg.fuse_output
    return num_seq_heads >= FUSE_MIN_SEQ_HEADS


def _wide(num_seq_heads: int) -> bool:
    return num_seq_heads >= WIDE_STATE_MIN_SEQ_HEADS


def piece_chunks(cfg: LaunchConfig, HV: int, num_seqs: int) -> int:
    """Chunks per piece (`kernels.triton_plan`) for ``num_seqs`` multi-token sequences of
    HV value heads; 0 for one piece."""
    target = cfg.piece_chunk_heads
    if target is None:
        target = 0 if _wide(num_seqs * HV) else PIECE_CHUNK_HEADS
    return max(1, -(-target // HV)) if target > 0 else 0


def state_launch(cfg: LaunchConfig, num_seq_heads: int, K: int, V: int, operand_bytes: int) -> tuple[int, int, int]:
    """(BV, warps, stages) of the state pass: the config's, else 4 warps (they share an SM
    with the parallel kernels, and beat 8 warps even alone: 4.20 vs 4.36 ms on 8x4096, H200),
    BV = 64 for wide batches, 32 for narrow ones (more programs to spread over the GPU:
    1x16384 1.89 vs 1.96 ms) or K > 128 (the [K, BV] state and the [64, K] tiles crowd the
    registers), and as many pipeline stages of the [64, K] w, kg, qg tiles (``operand_bytes``
    per element: 2 for fp16, 4 for fp32) as fit in the 227 KB of shared memory a Hopper
    block may take (sm_90 compiles, `tests/triton/test_triton_sm90_shared_memory.py`):
    3 stages of fp16 at K <= 128 take 192-216 KB, of fp32 256-288 KB, so fp32 takes 2
    (136-160 KB); K > 128 takes 1. A compiled variant that asks more than a block may take
    (the checkpointed pass adds its in-loop store's scratch: 232 KB at 3 stages in some
    Triton versions' compiles) launches with fewer stages (`state.launch_state`)."""
    bv = cfg.state_bv or min(_pow2(V), 64 if _wide(num_seq_heads) and K <= 128 else 32)
    stages = cfg.state_stages or (1 if K > 128 else 3 if operand_bytes <= 2 else 2)
    return bv, cfg.state_warps or 4, stages


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def select_config(K: int, V: int, interpret: bool) -> LaunchConfig:
    """The launch config for head dims K, V (any 1..256; padded to powers of two and masked)."""
    bk, bv = _pow2(K), _pow2(V)
    if interpret:  # numpy per program: fewer, wider steps are faster; warps mean nothing
        return LaunchConfig(
            intra_bk=bk, intra_bkd=bk, intra_warps=4, intra_stages=1, wy_bk=bk, wy_bv=bv, wy_warps=4,
            wy_stages=1, wy_block_scan=True, state_bv=bv, state_warps=4, state_stages=1,
            out_bk=bk, out_bv=bv, out_warps=4, out_stages=1,
            rec_bv=bv, rec_warps=4, fp16_operands=True, fp16_solve=FP16_SOLVE, piece_chunk_heads=PIECE_CHUNK_HEADS,
            solve_diag16=SOLVE_DIAG16, factored_a=FACTORED_A, fp32_products=FP32_PRODUCTS,
            bounded_intra=BOUNDED_INTRA,
        )
    return LaunchConfig(
        intra_bk=min(bk, 16), intra_bkd=8, intra_warps=4, intra_stages=3, wy_bk=min(bk, 32), wy_bv=min(bv, 64),
        wy_warps=4, wy_stages=3, wy_block_scan=True, state_bv=None, state_warps=None, state_stages=None,
        out_bk=min(bk, 128), out_bv=min(bv, 64), out_warps=4, out_stages=2,
        rec_bv=min(bv, 16 if bk > 128 else 32), rec_warps=4,
        fp16_operands=True, fp16_solve=FP16_SOLVE, piece_chunk_heads=None,
        solve_diag16=SOLVE_DIAG16, factored_a=FACTORED_A, fp32_products=FP32_PRODUCTS,
        bounded_intra=BOUNDED_INTRA,
    )
