"""`PinnedStaging`: a launch's host inputs to the GPU through one reused pinned buffer.

A copy from pageable memory to the GPU goes through the driver's own small pinned
buffers, one synchronous step at a time. Here each input is packed (the launch's parts
concatenated along tokens) straight into page-locked memory and sent with an asynchronous
copy, so the DMA of one input runs while the next is packed, and the launch's kernels queue
behind the copies on the same stream. The buffer is allocated once, grown to the largest
launch seen (up to ``max_bytes``; larger launches take the plain path), and reused: before
packing into it again, `to_device` waits for the copies of the previous launch that read it.
Inputs already on the device (CUDA shared memory) do not pass through it.

`copy_stream(device)`: the side stream device-to-device and shared memory copies run on;
`on_stream(stream)` (`kernels.cuda_streams`, here for the front ends that may not import the
kernels): a stream made current for a block without `torch.cuda.stream`'s device queries.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence, Union

import numpy as np
import torch

from kernels.cuda_streams import on_stream  # noqa: F401  (for the front ends: they may not import kernels)

ALIGN = 256  # bytes; where each packed input starts in the buffer
DEFAULT_MAX_BYTES = 2 << 30


@lru_cache(maxsize=None)
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream copies into and out of CUDA shared memory run on, for ``device``: waiting
    for one's copies (``synchronize()``) then never waits for a kernel launch in flight on
    the launch stream, as a device-wide synchronize would."""
    return torch.cuda.Stream(device=device)


def host_ints_to(values: Union[Sequence[int], np.ndarray], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on ``device`` (a copy: ``values`` may change after). On a GPU
    through page-locked memory with an asynchronous copy: a plain copy of a host list would
    wait for everything queued on the stream first (copies from pageable memory
    synchronize), here the inputs' copies."""
    if device.type != "cuda":  # the host (np.array copies: a third of the cost of torch's copy)
        return torch.from_numpy(np.array(values, dtype=np.int64))
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).pin_memory().to(device, non_blocking=True)


def host_ints_pair_to(first: np.ndarray, second: np.ndarray,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`host_ints_to` of both int64 arrays: on a GPU one upload of the two (each upload pins
    memory and queues a copy), two views of it; on the host two arrays (views cost more
    there than the copies)."""
    if device.type != "cuda":
        return host_ints_to(first, device), host_ints_to(second, device)
    both = host_ints_to(np.concatenate((first, second)), device)
    return both[:len(first)], both[len(first):]


def drain_copy_streams() -> None:
    """Wait for every copy queued on a `copy_stream` so far (of every device that has one):
    before memory those copies read or write is unmapped or unpinned."""
    if torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            copy_stream(torch.device("cuda", index)).synchronize()


class PinnedStaging:
    """Stages host tensors for ``device`` (a CUDA device) through one pinned buffer."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._buffer: Optional[torch.Tensor] = None  # uint8, pinned
        self._read: Optional[torch.cuda.Event] = None  # the last copies out of the buffer are done

    def to_device(self, groups: Sequence[Sequence[torch.Tensor]]) -> Optional[list[torch.Tensor]]:
        """Each group's parts (host tensors of one dtype, equal trailing dims) concatenated
        along dim 0, on the device: copies queued on the current stream, in order. None when
        the groups need more than ``max_bytes`` or a part is not a host tensor (the caller
        copies them its own way)."""
        if any(p.device.type != "cpu" for parts in groups for p in parts):
            return None
        sizes = [sum(p.numel() for p in parts) * parts[0].element_size() for parts in groups]
        total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
        if total > self.max_bytes:
            return None
        buffer = self._room(total)
        out, offset = [], 0
        for parts, size in zip(groups, sizes):
            shape = (sum(int(p.shape[0]) for p in parts), *parts[0].shape[1:])
            host = buffer[offset:offset + size].view(parts[0].dtype).view(shape)
            torch.cat(list(parts), out=host)
            out.append(host.to(self.device, non_blocking=True))
            offset += -(-size // ALIGN) * ALIGN
        self._read = torch.cuda.Event()
        self._read.record(torch.cuda.current_stream(self.device))
        return out

    def _room(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least ``nbytes`` long, once no earlier copy still reads it."""
        if self._read is not None:
            self._read.synchronize()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # the old one is freed before the larger one is pinned
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buffer
