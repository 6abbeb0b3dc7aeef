"""Tensors in registered shared memory regions, for every front end that takes them
(``POST /prefill`` by reference, `service.shm.prefill`; KServe v2 inputs and outputs,
`service.kserve.codec`): where one lies (`ShmRef`), and the one reader that copies a
request's inputs out (`copy_out`).

Inputs are copied out once, so the kernels never see memory the client may change (unless
the server runs with ``--cuda-ipc-zero-copy``: then the token-packed inputs of CUDA regions on
the serving device are read in place, for trusted clients): on a GPU server the token-packed
inputs go into one device buffer (device to device from CUDA regions, one DMA from
page-locked system regions: no host copy); every other input (on a
CPU server all of them) into one host buffer at 64-byte aligned offsets, taken from
`WarmBuffers` when one of the size is free (its pages already mapped: fresh pages cost ~8x
the copy). Outputs are written with `Region.write` (from the device directly when the
result stayed there). A system region's host copies, both ways, go through its file
(``preadv``/``pwritev``, never the mapping) and its size is checked at every use, so a client
that truncates its object gets a 400, never a SIGBUS (`service.shm.registry`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Collection, Mapping, NamedTuple, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from tensor_io.views import nbytes, view_tensor

from ..wire.buffers import WarmBuffers
from ..core.staging import copy_stream, on_stream
from .registry import Region

ALIGN = 64  # where each copied-out input starts in its buffer
REGION_NAME = Annotated[str, Field(min_length=1, max_length=255)]


class ShmRef(BaseModel):
    """``byte_size`` bytes at ``offset`` of registered region ``region``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    region: REGION_NAME = Field(description="a registered shared memory region's name")
    offset: int = Field(0, ge=0, description="bytes from the region's start")
    byte_size: int = Field(ge=0, description="bytes of the tensor (inputs: exactly dtype x shape)")


class DeviceCopy(NamedTuple):
    """A copy of ``source`` into ``dest`` (uint8 tensors of one size: ``dest`` on a GPU,
    ``source`` there or in page-locked host memory) that its caller queues on that device
    (a prepared prefill's, in its CUDA graph)."""

    source: torch.Tensor
    dest: torch.Tensor


class ShmInput(NamedTuple):
    """An input in shared memory: where it lies, its dtype and shape (``ref.byte_size``
    equal to their bytes, and the bytes inside the region: checked by the caller)."""

    ref: ShmRef
    dtype: torch.dtype
    shape: Sequence[int]


def _packed_offsets(inputs: Mapping[str, ShmInput]) -> tuple[dict[str, int], int]:
    """Each input's offset in one buffer holding them all, `ALIGN`-ed; the buffer's size."""
    offsets, total = {}, 0
    for name, x in inputs.items():
        offsets[name] = total
        total += -(-x.ref.byte_size // ALIGN) * ALIGN
    return offsets, total


def _to_host(inputs: Mapping[str, ShmInput], regions: Mapping[str, Region], warm: WarmBuffers
             ) -> dict[str, torch.Tensor]:
    """``inputs`` copied into one host buffer (from ``warm`` when one fits; kept there for a
    later request once this one lets go of its tensors), each a view of it."""
    if not inputs:
        return {}
    offsets, total = _packed_offsets(inputs)
    buf = warm.take(total) or bytearray(total)
    warm.keep(buf)
    with memoryview(buf) as view:
        for name, x in inputs.items():
            start = offsets[name]
            regions[x.ref.region].read_into(x.ref.offset, view[start:start + x.ref.byte_size])
    return {name: view_tensor(buf, offsets[name], x.dtype, x.shape) for name, x in inputs.items()}


def _to_device(inputs: Mapping[str, ShmInput], regions: Mapping[str, Region], device: torch.device
               ) -> dict[str, torch.Tensor]:
    """``inputs`` on the GPU ``device``: read in place where their region lends its bytes
    (`Region.lend`: ``--cuda-ipc-zero-copy``) at an offset aligned for their dtype, the rest
    copied into one buffer on the device's copy stream. Nothing waits for the copies here:
    the scans that check the inputs follow them on that stream, and the launch stream (the
    device's default stream) waits for them on the GPU, so the host goes on to validate and
    launch while they run. A region is never unmapped under a copy in flight
    (`service.shm.registry`: closing one waits for its copy streams)."""
    out: dict[str, torch.Tensor] = {}
    copied: dict[str, ShmInput] = {}
    for name, x in inputs.items():
        lent = regions[x.ref.region].lend(x.ref.offset, x.ref.byte_size, device)
        if lent is not None and x.ref.offset % x.dtype.itemsize == 0:
            out[name] = lent.view(x.dtype).view(x.shape)
        else:
            copied[name] = x
    if copied:
        out.update(_copied_to_device(copied, regions, device))
    return {name: out[name] for name in inputs}


MAX_GAP = 64 << 10  # bytes between two inputs of one region that a single copy of both carries along


@dataclass
class _Run:
    """Inputs ``names`` of ``region`` that one copy of bytes [start, end) brings out."""

    region: str
    start: int
    end: int
    names: list[str]


def _copy_runs(inputs: Mapping[str, ShmInput]) -> tuple[list[tuple[str, int, int, int]], dict[str, int], int]:
    """The copies that bring ``inputs`` into one buffer: one per *run*, inputs of one region
    lying close together (by offset, at most `MAX_GAP` apart, each `ALIGN`-ed from the
    run's start, so its view is as aligned as a copy of its own would be): a client that
    packs its inputs side by side (`kda_client`) costs one copy, not five. Returns the
    copies as (region, offset, bytes, buffer offset), each input's offset in the buffer,
    and the buffer's size (runs `ALIGN`-ed)."""
    runs: list[_Run] = []
    for name, x in sorted(inputs.items(), key=lambda item: (item[1].ref.region, item[1].ref.offset)):
        ref, run = x.ref, runs[-1] if runs else None
        if (run is not None and run.region == ref.region and ref.offset - run.end <= MAX_GAP
                and (ref.offset - run.start) % ALIGN == 0):
            run.names.append(name)
            run.end = max(run.end, ref.offset + ref.byte_size)
        else:
            runs.append(_Run(ref.region, ref.offset, ref.offset + ref.byte_size, [name]))
    copies, where, total = [], {}, 0
    for run in runs:
        copies.append((run.region, run.start, run.end - run.start, total))
        for name in run.names:
            where[name] = total + inputs[name].ref.offset - run.start
        total += -(-(run.end - run.start) // ALIGN) * ALIGN
    return copies, where, total


def _copied_to_device(inputs: Mapping[str, ShmInput], regions: Mapping[str, Region], device: torch.device
                      ) -> dict[str, torch.Tensor]:
    """``inputs`` copied into one buffer on ``device`` (see `_to_device`), a copy per run
    of them (`_copy_runs`)."""
    copies, where, total = _copy_runs(inputs)
    stream = copy_stream(device)
    with on_stream(stream):
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for region, offset, size, at in copies:
            regions[region].read_into_tensor(offset, buf[at:at + size])
    launch_stream = torch.cuda.default_stream(device)
    launch_stream.wait_stream(stream)
    buf.record_stream(launch_stream)  # the launch reads it there
    return {name: buf[where[name]:where[name] + nbytes(x.shape, x.dtype)].view(x.dtype).view(x.shape)
            for name, x in inputs.items()}


def copy_out(inputs: Mapping[str, ShmInput], regions: Mapping[str, Region], warm: WarmBuffers,
             device: torch.device, to_device: Collection[str]) -> dict[str, torch.Tensor]:
    """Every input of ``inputs`` (by name) copied out of ``regions`` once: those named in
    ``to_device`` into one buffer on ``device`` when it is a GPU, the rest into one host
    buffer (see the module docstring). Tensors come back by name, in ``inputs``' order."""
    on_device = {n: x for n, x in inputs.items() if device.type == "cuda" and n in to_device}
    loaded = _to_host({n: x for n, x in inputs.items() if n not in on_device}, regions, warm)
    if on_device:
        loaded.update(_to_device(on_device, regions, device))
    return {name: loaded[name] for name in inputs}


def refillable(inputs: Mapping[str, ShmInput], regions: Mapping[str, Region], device: torch.device,
               packed: Collection[str]) -> tuple[dict[str, torch.Tensor], Callable[[], None], list[DeviceCopy]]:
    """Buffers of their own for ``inputs``, by name: those named in ``packed`` (the ones a
    prepared prefill reads anew at every run) on ``device`` when it is a GPU, read in place
    where their region lends its bytes, the rest in one host buffer, read once here; the
    function that copies the regions' current bytes into the ``packed`` buffers; and the
    copies that the caller queues on ``device`` itself instead (`Region.device_bytes`: from
    CUDA regions on that device and page-locked system regions, inside a prepared prefill's
    CUDA graph). The function's own device copies (from system regions not page-locked, or
    CUDA regions of other devices) run on the copy streams, and the device's current stream
    waits for them, so a launch queued after it reads the new bytes."""
    on_device = {n: x for n, x in inputs.items() if device.type == "cuda" and n in packed}
    on_host = {n: x for n, x in inputs.items() if n not in on_device}
    tensors: dict[str, torch.Tensor] = {}
    copies: list[tuple[str, int, torch.Tensor]] = []  # (region, offset, destination as uint8)
    queued: list[DeviceCopy] = []
    lent = {n: regions[x.ref.region].lend(x.ref.offset, x.ref.byte_size, device) for n, x in on_device.items()}
    copied = {n: x for n, x in on_device.items() if lent[n] is None or x.ref.offset % x.dtype.itemsize}
    if copied:
        runs, where, total = _copy_runs(copied)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for region, offset, size, at in runs:
            source = regions[region].device_bytes(offset, size, device)
            if source is not None:
                queued.append(DeviceCopy(source, buf[at:at + size]))
            else:
                copies.append((region, offset, buf[at:at + size]))
        tensors.update({n: buf[where[n]:where[n] + nbytes(x.shape, x.dtype)].view(x.dtype).view(x.shape)
                        for n, x in copied.items()})
    tensors.update({n: t.view(on_device[n].dtype).view(on_device[n].shape) for n, t in lent.items()
                    if n not in copied and t is not None})
    reads: list[tuple[str, int, memoryview]] = []  # (region, offset, host destination) of the packed ones
    if on_host:
        offsets, size = _packed_offsets(on_host)
        host = bytearray(size)
        view = memoryview(host)
        once = [(n, x.ref.region, x.ref.offset, view[offsets[n]:offsets[n] + x.ref.byte_size])
                for n, x in on_host.items()]
        for _, region, offset, dest in once:
            regions[region].read_into(offset, dest)
        reads = [(region, offset, dest) for n, region, offset, dest in once if n in packed]
        tensors.update({n: view_tensor(host, offsets[n], x.dtype, x.shape) for n, x in on_host.items()})

    def refill() -> None:
        for region, offset, dest in reads:
            regions[region].read_into(offset, dest)
        for region, offset, dest_t in copies:
            regions[region].read_into_tensor(offset, dest_t)
        if copies:
            torch.cuda.current_stream(device).wait_stream(copy_stream(device))

    return {name: tensors[name] for name in inputs}, refill, queued
