"""`PinnedStaging` on a GPU: packed inputs reach the device exactly, the reused pinned
buffer never corrupts an earlier launch's inputs, and what it does not take is refused."""
from __future__ import annotations

import pytest
import torch

from service.core.staging import PinnedStaging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _groups(gen: torch.Generator, lengths: list[int], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """q-, v- and beta-like groups: one part per sequence, random values (never zeros)."""
    return [[torch.randn(n, 4, 16, generator=gen).to(dtype) for n in lengths],
            [torch.randn(n, 4, 32, generator=gen).to(dtype) for n in lengths],
            [torch.randn(n, 4, generator=gen).to(dtype) for n in lengths]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_inputs_equal_the_packed_host_inputs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    staging = PinnedStaging(torch.device("cuda"))
    groups = _groups(gen, [70, 1, 130], dtype)
    out = staging.to_device(groups)
    assert out is not None
    for parts, got in zip(groups, out):
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(got.cpu(), torch.cat(parts))


def test_reuse_leaves_earlier_inputs_intact_and_grows() -> None:
    gen = torch.Generator().manual_seed(2)
    staging = PinnedStaging(torch.device("cuda"))
    first_groups = _groups(gen, [300, 5], torch.float32)
    first = staging.to_device(first_groups)
    second_groups = _groups(gen, [3000, 700, 9], torch.float32)  # larger: a new buffer
    second = staging.to_device(second_groups)
    third_groups = _groups(gen, [64], torch.float32)  # smaller: packed over the second's bytes
    third = staging.to_device(third_groups)
    assert first is not None and second is not None and third is not None
    for groups, out in ((first_groups, first), (second_groups, second), (third_groups, third)):
        for parts, got in zip(groups, out):
            assert torch.equal(got.cpu(), torch.cat(parts))


def test_refuses_device_parts_and_oversize_launches() -> None:
    gen = torch.Generator().manual_seed(3)
    groups = _groups(gen, [10, 20], torch.float32)
    assert PinnedStaging(torch.device("cuda"), max_bytes=1024).to_device(groups) is None
    mixed = [groups[0], [groups[1][0].cuda(), groups[1][1]], groups[2]]
    assert PinnedStaging(torch.device("cuda")).to_device(mixed) is None


def test_host_ints_to_the_device_equal_the_values() -> None:
    """`host_ints_to`: the values as int64 on the GPU, copied asynchronously (read after a
    synchronization of the stream they were queued on)."""
    from service.core.staging import host_ints_to

    values = [5, -1, 0, 2 ** 40, 7]
    out = host_ints_to(values, torch.device("cuda"))
    assert out.dtype == torch.int64 and out.device.type == "cuda"
    torch.cuda.current_stream().synchronize()
    assert out.tolist() == values
