"""`kernels.guards` on both backends (Triton: compiled on CUDA, interpreted on the CPU):
the row copy equals ``src[indices]`` for rows of one and of several blocks, and the
non-finite flag is set by exactly one NaN, +Inf or -Inf anywhere (the last, partial block
included) and by nothing else, in float32 and bfloat16."""
from __future__ import annotations

import zlib

import pytest
import torch

from kernels.guards import any_nonfinite, gather_rows
from kernels.triton_kernels.guards import ROW_BLOCK, SCAN_BLOCK

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh random inputs per test, reproducible from the test's name."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_shape", [(3, 5, 7), (2, ROW_BLOCK + 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_copies_the_chosen_rows(backend: str, row_shape: tuple[int, ...], dtype: torch.dtype,
                                            gen: torch.Generator) -> None:
    src = torch.randn(9, *row_shape, generator=gen).to(device=DEVICE, dtype=dtype)
    indices = torch.randperm(9, generator=gen)[:4].to(DEVICE)
    got = gather_rows(src, indices, backend=backend)
    assert got.shape == (4, *row_shape) and got.dtype == dtype
    assert torch.equal(got, src[indices])
    src.add_(1)  # a copy: later writes to src do not show in it
    assert not torch.equal(got, src[indices])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_rows_refuses_a_strided_source(backend: str) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(torch.zeros(4, 6, device=DEVICE)[:, ::2], torch.tensor([0], device=DEVICE), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_nonfinite_flags_one_bad_value_anywhere(backend: str, dtype: torch.dtype,
                                                    gen: torch.Generator) -> None:
    numel = 2 * SCAN_BLOCK + 5  # two whole blocks and a partial one
    clean = (1e3 * torch.randn(numel, generator=gen)).to(device=DEVICE, dtype=dtype)
    other = torch.randn(3, 7, generator=gen).to(device=DEVICE, dtype=dtype)
    assert any_nonfinite(clean, other, backend=backend).tolist() == [0]
    for where in (0, SCAN_BLOCK + 17, numel - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = clean.clone()
            x[where] = bad
            assert any_nonfinite(x, other, backend=backend).tolist() == [1], (where, bad)
            assert any_nonfinite(other, x.view(-1, 1), backend=backend).tolist() == [1], (where, bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_nonfinite_takes_the_largest_finite_values_as_finite(backend: str) -> None:
    big = torch.full((SCAN_BLOCK + 1,), torch.finfo(torch.float32).max, device=DEVICE)
    assert any_nonfinite(big, -big, backend=backend).tolist() == [0]
