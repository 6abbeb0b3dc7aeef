"""`service.shm.tensors._copy_runs`: the copies that bring a request's inputs out of shared
memory into one device buffer: one per run of inputs lying close together in one region,
each input's view where its bytes land (checked by replaying the copies on host bytes)."""
from __future__ import annotations

import torch

from service.shm.tensors import ALIGN, MAX_GAP, ShmInput, ShmRef, _copy_runs


def _input(region: str, offset: int, n: int, dtype: torch.dtype = torch.bfloat16) -> ShmInput:
    return ShmInput(ShmRef(region=region, offset=offset, byte_size=n * dtype.itemsize), dtype, (n,))


def _replayed(inputs: dict[str, ShmInput], regions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the copies on host bytes: each input's view of the buffer."""
    copies, where, total = _copy_runs(inputs)
    buf = torch.full((total,), 0xEE, dtype=torch.uint8)
    for region, offset, size, at in copies:
        buf[at:at + size] = regions[region][offset:offset + size]
    return {n: buf[where[n]:where[n] + x.ref.byte_size].view(x.dtype) for n, x in inputs.items()}


def _regions(*names: str, size: int = 1 << 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {n: torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for n in names}


def test_inputs_packed_side_by_side_take_one_copy() -> None:
    at, inputs = 0, {}
    for name, n in (("q", 4096), ("k", 4096), ("v", 4096), ("g", 4096), ("beta", 32)):
        inputs[name] = _input("r", at, n)
        at += -(-n * 2 // 256) * 256  # a client's packing: 256-byte aligned
    copies, where, total = _copy_runs(inputs)
    assert len(copies) == 1 and copies[0][:3] == ("r", 0, at - 256 + 64)
    regions = _regions("r")
    for name, got in _replayed(inputs, regions).items():
        x = inputs[name]
        assert torch.equal(got.view(torch.uint8), regions["r"][x.ref.offset:x.ref.offset + x.ref.byte_size])
        assert where[name] % ALIGN == 0


def test_runs_split_by_region_gap_and_alignment() -> None:
    inputs = {"q": _input("a", 0, 64), "k": _input("b", 0, 64),  # another region
              "v": _input("a", 128 + MAX_GAP + 64, 64),  # too far from q
              "g": _input("a", 128 + MAX_GAP + 64 + 130, 64),  # 130 bytes from v's start: not ALIGN-ed
              "beta": _input("a", 128 + MAX_GAP + 64 + 130 + 128, 32)}  # 128 from g's start: joins g
    copies, where, _ = _copy_runs(inputs)
    assert sorted((c[0], c[1]) for c in copies) == [("a", 0), ("a", 128 + MAX_GAP + 64),
                                                    ("a", 128 + MAX_GAP + 64 + 130), ("b", 0)]
    regions = _regions("a", "b", size=2 * MAX_GAP)
    for name, got in _replayed(inputs, regions).items():
        x = inputs[name]
        src = regions[x.ref.region][x.ref.offset:x.ref.offset + x.ref.byte_size]
        assert torch.equal(got.view(torch.uint8), src), name
        assert where[name] % 2 == 0  # every view keeps its dtype's alignment


def test_overlapping_inputs_share_one_copy() -> None:
    inputs = {"q": _input("r", 256, 512), "k": _input("r", 256, 512), "v": _input("r", 512, 512)}
    copies, _, _ = _copy_runs(inputs)
    assert copies == [("r", 256, 512 + 1024 - 256, 0)]
    regions = _regions("r")
    got = _replayed(inputs, regions)
    assert torch.equal(got["q"].view(torch.uint8), got["k"].view(torch.uint8))
    assert torch.equal(got["v"].view(torch.uint8), regions["r"][512:1536])
