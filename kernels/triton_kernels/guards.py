"""Memory-speed helpers for guarding an in-place launch (no KDA math): a copy of chosen
rows of a tensor, and a flag set when a tensor holds a non-finite value.

Both read each byte once with wide loads; torch's ``index_select`` of a few 2 MiB rows and
a NaN/Inf check through torch reductions run at a fraction of the H200's memory speed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK = 4096
SCAN_BLOCK = 8192


@triton.jit
def gather_rows_kernel(src, indices, dst, R, BLOCK: tl.constexpr):
    """Grid (N, cdiv(R, BLOCK)). src: [S, R], dst: [N, R] (same dtype, contiguous);
    indices: [N] int64. dst[n] = src[indices[n]]."""
    n = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < R
    row = tl.load(indices + n)
    tl.store(dst + n.to(tl.int64) * R + offs, tl.load(src + row * R + offs, mask=mask), mask=mask)


@triton.jit
def flag_nonfinite_kernel(x, numel, flag, BLOCK: tl.constexpr):
    """Grid (cdiv(numel, BLOCK),). x: [numel] float (any width); flag: [1] int32, set to 1
    when x holds a NaN or +-Inf (one atomic per block that holds any)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b_x = tl.load(x + offs, mask=offs < numel, other=0.0).to(tl.float32)
    bad = tl.sum(((b_x != b_x) | (tl.abs(b_x) > 3.4028234663852886e38)).to(tl.int32), axis=0)
    tl.atomic_max(flag, 1, mask=bad > 0)


def launch_gather_rows(src: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[N, *src.shape[1:]] copy of the rows ``indices`` [N] (int64) of the contiguous ``src``."""
    rows = src.reshape(src.shape[0], -1)
    out = torch.empty((indices.numel(), rows.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel():
        gather_rows_kernel[(indices.numel(), triton.cdiv(rows.shape[1], ROW_BLOCK))](
            rows, indices, out, rows.shape[1], BLOCK=ROW_BLOCK, num_warps=8)
    return out.view(indices.numel(), *src.shape[1:])


def launch_flag_nonfinite(tensors: tuple[torch.Tensor, ...], flag: torch.Tensor) -> None:
    """``flag`` [1] int32 (zeroed by the caller) set to 1 when any of ``tensors``
    (contiguous, floating point) holds a NaN or Inf."""
    for t in tensors:
        if t.numel():
            flag_nonfinite_kernel[(triton.cdiv(t.numel(), SCAN_BLOCK),)](
                t.reshape(-1), t.numel(), flag, BLOCK=SCAN_BLOCK, num_warps=8)
