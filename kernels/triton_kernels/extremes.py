"""The value range of several tensors at once: one launch per dtype, no synchronization.

Used to check a request's inputs on the GPU (every value finite, a given log decay <= 0)
without reading anything back before the launch: the answer lands in a small device tensor
that the caller copies to the host at its own synchronization.

Row i of the result describes tensor i as three float32 maxima, so that one fill of -inf
initializes every row and each program adds its block with atomic maxima:
``(-min, max, bad)`` over the tensor's finite values, ``bad`` > 0 when the tensor holds a
NaN or an Inf. A program walks its tensor's blocks with a grid stride, reduces them in
registers and issues three atomics at the end.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

MAX_TENSORS = 8  # tensors per launch (addresses are scalar arguments: no host-to-device table)
BLOCK = 4096  # elements per step of one program
PROGRAMS_PER_SM = 4


@triton.jit
def _pick(j, a0, a1, a2, a3, a4, a5, a6, a7):
    """The j-th of eight scalars (j < 8)."""
    lo = tl.where(j == 0, a0, tl.where(j == 1, a1, tl.where(j == 2, a2, a3)))
    hi = tl.where(j == 4, a4, tl.where(j == 5, a5, tl.where(j == 6, a6, a7)))
    return tl.where(j < 4, lo, hi)


@triton.jit
def value_extremes_kernel(
    out, a0, a1, a2, a3, a4, a5, a6, a7, n0, n1, n2, n3, n4, n5, n6, n7,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (P, n): program p of tensor j reduces blocks p, p + P, ... of tensor j (at
    address a_j, n_j elements of DTYPE) into ``out[j]`` (float32 [n, 3], -inf-filled):
    atomic maxima of -min and max over finite values, and of 1 when a value is not finite."""
    p = tl.program_id(0)
    j = tl.program_id(1)
    base = _pick(j, a0, a1, a2, a3, a4, a5, a6, a7).to(tl.pointer_type(DTYPE))
    n = _pick(j, n0, n1, n2, n3, n4, n5, n6, n7)
    offs = tl.arange(0, BLOCK)
    neg_lo = tl.full([BLOCK], float("-inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(p * BLOCK, n, tl.num_programs(0) * BLOCK):
        idx = start + offs
        m = idx < n
        x = tl.load(base + idx, mask=m, other=0.0).to(tl.float32)
        finite = (x == x) & (tl.abs(x) <= 3.4028234663852886e38)
        bad = tl.maximum(bad, (m & ~finite).to(tl.int32))
        keep = m & finite
        neg_lo = tl.maximum(neg_lo, tl.where(keep, -x, float("-inf")))
        hi = tl.maximum(hi, tl.where(keep, x, float("-inf")))
    row = out + j * 3
    tl.atomic_max(row, tl.max(neg_lo, axis=0))
    tl.atomic_max(row + 1, tl.max(hi, axis=0))
    tl.atomic_max(row + 2, tl.where(tl.max(bad, axis=0) > 0, 1.0, float("-inf")))


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def value_extremes(tensors: Sequence[torch.Tensor], *, block: int = BLOCK, programs_per_sm: int = PROGRAMS_PER_SM,
                   num_warps: int = 8) -> torch.Tensor:
    """``[n, 3]`` float32 on the tensors' device (one CUDA device, or the CPU under the
    Triton interpreter): row i is ``(-min, max, bad)`` of ``tensors[i]`` (float32, bfloat16
    or float16, any shape, at least one element) over its finite values, ``bad`` > 0 when it
    holds a NaN or an Inf (-inf otherwise; min and max are then of the finite values).
    Launched on the current stream, one launch per dtype; nothing is read back. ``block``
    (elements per program step, a power of two), ``programs_per_sm`` and ``num_warps``:
    the launch's shape (bench/prepared_graph.py --extremes times variants)."""
    device = tensors[0].device
    out = torch.full((len(tensors), 3), float("-inf"), dtype=torch.float32, device=device)
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(flat):
        groups.setdefault(t.dtype, []).append(i)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    shape = (block, max(1, sms * programs_per_sm), num_warps)
    for dtype, rows in groups.items():
        for c in range(0, len(rows), MAX_TENSORS):
            chunk = rows[c:c + MAX_TENSORS]
            _launch(out, [flat[i] for i in chunk], chunk, dtype, shape)
    return out


def _launch(out: torch.Tensor, tensors: list[torch.Tensor], rows: list[int], dtype: torch.dtype,
            shape: tuple[int, int, int]) -> None:
    """One launch over ``tensors`` (one dtype, at most `MAX_TENSORS`), into ``out[rows]``,
    of ``shape`` (block, the most programs per tensor, warps). Rows must be consecutive for
    the kernel's ``out + j * 3``: they are (groups keep order) unless dtypes interleave, in
    which case each tensor gets its own launch."""
    if rows != list(range(rows[0], rows[0] + len(rows))):
        for t, r in zip(tensors, rows):
            _launch(out, [t], [r], dtype, shape)
        return
    block, most, warps = shape
    pad = MAX_TENSORS - len(tensors)
    addrs = [t.data_ptr() for t in tensors] + [0] * pad
    sizes = [t.numel() for t in tensors] + [0] * pad
    programs = min(max(triton.cdiv(n, block) for n in sizes), most)
    value_extremes_kernel[(programs, len(tensors))](
        out[rows[0]:], *addrs, *sizes, DTYPE=_DTYPES[dtype], BLOCK=block, num_warps=warps,
    )
