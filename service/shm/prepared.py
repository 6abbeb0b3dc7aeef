"""Prepared prefills through shared memory: a shared memory prefill document checked once
(`checked_request`), then run again and again with whatever its input bytes hold at each
run, its outputs written to the same places (`service.core.prepared`).

The regions the document names stay leased (mapped) while the prepared prefill lives, so
the inputs are read from, and the outputs written to, the same bytes every run: on a GPU
server the packed inputs come into buffers of their own (device to device from CUDA
regions, by DMA from page-locked system regions, or read in place with
``--cuda-ipc-zero-copy``), the gate tensors (A_log, dt_bias) once, when it is prepared. A
run after one of its regions was unregistered is refused (400) with nothing changed: the
client releases the prepared prefill and prepares a new one.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from ..core.inputs import REQUIRED_TENSORS, PrefillResult
from ..core.prepared import PreparedPrefill
from ..core.server import ServerCore
from ..errors import InvalidRequest
from ..wire.prefill import prefill_inputs_of
from .prefill import PrefillShmRequest, ShmPlan, checked_request, region_names, write_result
from .registry import ShmRegistry
from .tensors import refillable


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
    try:
        sources, o_dtype, final = checked_request(request, regions, core)
        device = core.geometry.device
        tensors, fill = refillable(sources, regions, device, REQUIRED_TENSORS)
        inputs = prefill_inputs_of(request, tensors, device.type == "cuda")
        plan = ShmPlan(inputs, request.outputs.o, o_dtype, final)

        def refill() -> None:
            for name, region in regions.items():
                if region.closing:
                    raise InvalidRequest(f"shared memory region {name!r} was unregistered since this prefill was "
                                         "prepared: release it and prepare it again", field="shared_memory_region")
            fill()

        def deliver(result: PrefillResult) -> None:
            write_result(plan, result, regions)

        prepared = await core.prepare(inputs, refill, deliver)
    except BaseException:
        lease.close()
        raise
    return ShmPrepared(prepared, lease)
