"""`value_extremes`: the one-launch value range the server's deferred input checks read.

Each row must equal (-min, max) of its tensor's finite values as torch computes them, and
flag exactly the tensors that hold a NaN or an Inf, for every float dtype, sizes that are
and are not multiples of the block, more tensors than one launch takes, mixed dtypes in
any order, and non-contiguous tensors. Interpreted on the CPU without CUDA, compiled on a
GPU.
"""
from __future__ import annotations

import pytest
import torch

from kernels.triton_kernels.extremes import BLOCK, MAX_TENSORS, value_extremes


def expected(x: torch.Tensor) -> tuple[float, float, bool]:
    """(-min, max) over the finite values of ``x`` in float32, and whether any is not finite."""
    f = x.float()
    finite = f[torch.isfinite(f)]
    return -finite.min().item(), finite.max().item(), finite.numel() < f.numel()


def check(tensors: list[torch.Tensor]) -> None:
    out = value_extremes(tensors).cpu()
    assert out.shape == (len(tensors), 3) and out.dtype == torch.float32
    for row, t in zip(out.tolist(), tensors):
        neg_lo, hi, bad = expected(t)
        assert row[0] == neg_lo and row[1] == hi, (row, neg_lo, hi)
        assert (row[2] > 0) == bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_equal_torch_on_random_tensors(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    sizes = (1, 5, BLOCK - 1, BLOCK, 3 * BLOCK + 17)
    tensors = [(torch.randn(n, generator=gen) * 3 + 0.5).to(dtype).to(device) for n in sizes]
    check(tensors)


def test_flags_exactly_the_tensors_with_nan_or_inf(device: str) -> None:
    gen = torch.Generator().manual_seed(8)
    tensors = [torch.randn(2 * BLOCK + 3, generator=gen).to(device) for _ in range(4)]
    tensors[1][BLOCK + 1] = float("nan")
    tensors[2][-1] = float("inf")
    tensors[3][0] = float("-inf")
    check(tensors)
    out = value_extremes(tensors).cpu()
    assert [row[2] > 0 for row in out.tolist()] == [False, True, True, True]


def test_more_tensors_than_one_launch_mixed_dtypes_and_strides(device: str) -> None:
    gen = torch.Generator().manual_seed(9)
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16]
    tensors = [(torch.randn(37 + 11 * i, generator=gen) - i).to(dtypes[i % 4]).to(device)
               for i in range(MAX_TENSORS + 3)]
    tensors.append(torch.randn(64, 48, generator=gen).to(device).t())  # not contiguous
    tensors[4][3] = float("nan")
    check(tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_edge_values(device: str, dtype: torch.dtype) -> None:
    """Negative values only (max < 0), one element (below every other program's range),
    signed zeros, the dtype's largest finite values, and an -inf among finite values."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(10)
    tensors = [
        -(torch.rand(2 * BLOCK + 5, generator=gen) + 0.25).to(dtype),
        torch.tensor([-3.5]).to(dtype),
        torch.tensor([-0.0, 0.0, -0.0]).to(dtype),
        torch.tensor([info.max, -info.max, 1.0]).to(dtype),
        torch.tensor([1.0, float("-inf"), info.max]).to(dtype),
    ]
    check([t.to(device) for t in tensors])


@pytest.mark.parametrize("shape", [(1024, 1, 4), (8192, 16, 8), (16384, 2, 16)])
def test_every_launch_shape_gives_the_same_rows(device: str, shape: tuple[int, int, int]) -> None:
    """The launch shapes a sweep times (block, programs per SM, warps) reduce alike."""
    block, per_sm, warps = shape
    gen = torch.Generator().manual_seed(11)
    tensors = [(torch.randn(n, generator=gen) * 2 - 0.5).to(torch.bfloat16).to(device)
               for n in (1, 3 * block + 7, 5 * BLOCK)]
    tensors[1][block + 3] = float("nan")
    expected_rows = value_extremes(tensors).cpu()
    rows = value_extremes(tensors, block=block, programs_per_sm=per_sm, num_warps=warps).cpu()
    assert rows[:, 2].gt(0).tolist() == [False, True, False]
    assert torch.equal(rows[[0, 2]], expected_rows[[0, 2]])
    check([tensors[0], tensors[2]])
