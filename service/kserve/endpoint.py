"""`KServeEndpoint`: the one request path of the Open Inference Protocol, behind both front
ends (HTTP routes, `service.kserve.routes`; the gRPC servicer, `service.kserve.rpc`).

A front end decodes its wire form into a `ParsedRequest` (`service.kserve.codec`) and
encodes the `Reply`; everything between is here, the same for both: the model check, the
readiness check, the shared memory leases, reading the inputs, planning the outputs, the
sequence -> slot logic and the prefill on the core (`service.kserve.infer`), and writing
outputs into shared memory (on a GPU server from the device directly when every output
goes there, as ``POST /prefill`` by reference does). One sequence table serves both transports, so a sequence
started over HTTP continues over gRPC and back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..core.server import ServerCore
from ..core.worker import off_loop
from ..errors import NotReady
from ..shm.registry import ShmRegistry
from ..wire.buffers import WarmBuffers
from . import infer
from .codec import ParsedRequest, plan_outputs, prefill_inputs, read_inputs, write_shm_outputs
from .model import EXTENSIONS, MODEL, PLATFORM, check_model
from .sequences import SUFFIX, SequenceTable


@dataclass(frozen=True)
class Reply:
    """What an inference request produced: each requested output (in request order; those
    bound for shared memory are written there already) and the response parameters
    (``slot``: the slot holding the sequence's state, when it lives on)."""

    tensors: dict[str, torch.Tensor]  # on the pool's device when all went into shared memory
    parameters: dict[str, Union[str, int, bool]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class KServeEndpoint:
    """The KServe model ``kda`` on ``core``. ``ready`` says whether the kernels are warm and
    passed their self-test; ``registry`` holds the app's shared memory regions (its owner
    closes it). With a snapshot path the sequence table is kept beside the pool snapshot: saved
    after each one and journaled between them (`service.kserve.sequences`), so after a
    ``kill -9`` every sequence whose slot the restored pool holds comes back, one STARTed
    after the table's last save included; one whose slot was allocated after the last pool
    snapshot must START again. Call `load` once the core has started; the table's save
    after the snapshot at shutdown closes the journal."""

    def __init__(self, core: ServerCore, ready: Callable[[], bool], registry: ShmRegistry) -> None:
        self.core = core
        self.ready = ready
        self.registry = registry
        self.shm_inputs = WarmBuffers()  # host buffers shared memory inputs are copied out into
        self.table = SequenceTable(core.snapshot_path + SUFFIX if core.snapshot_path else None)
        if self.table.path is not None:  # saved with every pool snapshot, periodic and at shutdown
            core.on_checkpoint(self.table.save)

    def load(self) -> None:
        """Restore the saved and journaled sequences whose slot the (restored) pool still holds."""
        self.table.load(self.core.has_slot)

    @property
    def extensions(self) -> list[str]:
        """The protocol extensions this server speaks."""
        return [*EXTENSIONS, *(["cuda_shared_memory"] if self.registry.cuda_reason is None else [])]

    async def infer(self, model: str, version: Optional[str], request: ParsedRequest) -> Reply:
        """Run ``request`` on model ``model`` (version ``version``; None or "": any): 404
        for another model, 503 (gRPC UNAVAILABLE) until the kernels are warm and passed their
        self-test, then as `service.kserve.infer` says. A refusal changes nothing."""
        check_model(model, version)
        if not self.ready():
            raise NotReady("the model is not ready yet: its kernels are warming, or failed their self-test "
                           "(/health/ready says which)")
        g = self.core.geometry
        with self.registry.lease(request.regions) as regions:
            tensors = await off_loop(read_inputs, request, regions, self.shm_inputs, g.device,
                                     nbytes=request.input_bytes)
            v = tensors["v"]
            plan_outputs(request, v.dtype, v.numel() * v.element_size(), g.dtype,
                         g.num_heads * g.head_v_dim * g.head_k_dim * g.dtype.itemsize, regions)
            on_device = g.device.type == "cuda" and request.outputs_in_shm  # written from the device
            outcome = await infer.run(self.core, self.table, MODEL, request.options,
                                      functools.partial(prefill_inputs, request, tensors, device_outputs=on_device))
            result = outcome.result
            produced = {"o": result.o}
            if result.final_state is not None:
                produced["final_state"] = result.final_state[0]
            outputs = {spec.name: produced[spec.name] for spec in request.outputs}
            parameters: dict[str, Union[str, int]] = {} if outcome.slot is None else {"slot": outcome.slot}
            if outcome.match is not None:
                parameters.update(prefix_matched=outcome.match.matched, prefix_tokens=outcome.match.tokens)
                if outcome.match.key is not None:
                    parameters["prefix_key"] = outcome.match.key
            reply = Reply(outputs, parameters)
            await off_loop(write_shm_outputs, request, outputs, regions, nbytes=reply.nbytes)
        return reply

    def server_metadata(self, version: str) -> dict[str, Union[str, list[str]]]:
        """``$metadata_server_response`` of a server at ``version``."""
        return {"name": PLATFORM, "version": version, "extensions": self.extensions}
