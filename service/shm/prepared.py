"""Prepared prefills through shared memory: a shared memory prefill document checked once
(`checked_request`), then run again and again with whatever its input bytes hold at each
run, its outputs written to the same places (`service.core.prepared`).

The regions the document names stay leased (mapped) while the prepared prefill lives, so
the inputs are read from, and the outputs written to, the same bytes every run: on a GPU
server the packed inputs come into buffers of their own (device to device from CUDA
regions, by DMA from page-locked system regions, or read in place with
``--cuda-ipc-zero-copy``), the gate tensors (A_log, dt_bias) once, when it is prepared.
Copies to and from CUDA regions on the server's device and page-locked system regions are
part of the launch itself (its CUDA graph, `DeviceIO`; the regions' pages stay registered
while it lives, `Region.graph_hold`); the others run before and after it. A refused run
leaves its output bytes undefined. A run after one of its regions was unregistered, or
after a system region's object shrank, is refused (400) with nothing changed: the client
releases the prepared prefill and prepares a new one.
"""
from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Optional

import torch

from ..core.inputs import REQUIRED_TENSORS, PrefillResult
from ..core.prepared import DeviceIO, PreparedPrefill
from ..core.server import ServerCore
from ..errors import InvalidRequest
from ..wire.prefill import prefill_inputs_of
from .prefill import PrefillShmRequest, checked_request, region_names
from .registry import Region, ShmRegistry
from .tensors import ShmRef, refillable


@dataclass
class ShmPrepared:
    """A prepared shared memory prefill: the core's `PreparedPrefill` and the lease of its
    regions (``lease``: closed by `release`). Its outputs go where its document said."""

    prepared: PreparedPrefill
    lease: ExitStack

    async def release(self, core: ServerCore) -> None:
        """Let go of the core's graph and buffers, then of the regions."""
        try:
            await core.release_prepared(self.prepared)
        finally:
            self.lease.close()


async def prepare_shm(request: PrefillShmRequest, registry: ShmRegistry, core: ServerCore) -> ShmPrepared:
    """``request`` prepared on ``core`` (its refusals: `ServerCore.prepare`, and the
    references' 400s of `checked_request`), its regions leased from ``registry``."""
    lease = ExitStack()
    regions = lease.enter_context(registry.lease(region_names(request)))
    for region in regions.values():  # released before the lease (last in, first out)
        lease.enter_context(region.graph_hold())
    try:
        sources, o_dtype, final = checked_request(request, regions, core)
        g = core.geometry
        tensors, fill, copies = refillable(sources, regions, g.device, REQUIRED_TENSORS)
        inputs = prefill_inputs_of(request, tensors, g.device.type == "cuda")
        T, N = sum(inputs.lengths), len(inputs.lengths)
        o_place = _in_place(regions, request.outputs.o, (T, g.num_heads, g.head_v_dim), o_dtype, g.device)
        final_place = None if final is None else _in_place(
            regions, final, (N, g.num_heads, g.head_v_dim, g.head_k_dim), g.dtype, g.device)
        o_ref = request.outputs.o

        def refill() -> None:
            for name, region in regions.items():
                if region.closing:
                    raise InvalidRequest(f"shared memory region {name!r} was unregistered since this prefill was "
                                         "prepared: release it and prepare it again", field="shared_memory_region")
                region.check(0, 0, "shared_memory_region")  # a system region's object shrank since: 400
            fill()

        def deliver(result: PrefillResult) -> None:
            if o_place is None:
                regions[o_ref.region].write(o_ref.offset, result.o)
            if final_place is None and final is not None and result.final_state is not None:
                regions[final.region].write(final.offset, result.final_state)

        io = DeviceIO(copies, o_place, final_place)
        prepared = await core.prepare(inputs, refill, deliver, io)
    except BaseException:
        lease.close()
        raise
    return ShmPrepared(prepared, lease)


def _in_place(regions: dict[str, Region], ref: ShmRef, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> Optional[torch.Tensor]:
    """Where an output of ``shape`` and ``dtype`` goes, as a tensor the launch on ``device``
    copies it into (`Region.device_bytes`: a CUDA region there, or a page-locked system
    region; the offset aligned for the dtype), or None: written after the run (`Region.write`)."""
    size = math.prod(shape) * dtype.itemsize
    where = regions[ref.region].device_bytes(ref.offset, size, device)
    if where is None or ref.offset % dtype.itemsize:
        return None
    return where.view(dtype).view(shape)
