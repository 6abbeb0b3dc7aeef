"""The Open Inference Protocol (KServe v2) front end of a `ServerCore`.

`kserve_router(core, ready, registry)` serves ``/v2/...`` (health, metadata, infer with Triton-style
sequences, the binary tensor data and shared memory extensions); `ProtocolErrors` renders
the service's errors under ``/v2`` as the protocol's ``{"error": ...}``. Modules, one job
each: `protocol` (JSON documents), `datatypes`, `options` (request parameters), `codec`
(bodies <-> tensors), `sequences` (sequence id -> slot), `infer` (one request on the
core), `errors`, `routes`. Shared memory regions live in the transport-neutral
`service.shm.registry` (and `service.shm.cuda_ipc`), shared with ``POST /prefill``.
"""
from .errors import ProtocolErrors
from .routes import kserve_router

__all__ = ["kserve_router", "ProtocolErrors"]
