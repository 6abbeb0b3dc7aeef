"""The Open Inference Protocol (KServe v2) front end of a `ServerCore`.

`kserve_router(core, ready)` serves ``/v2/...`` (health, metadata, infer with Triton-style
sequences, the binary tensor data and shared memory extensions); `ProtocolErrors` renders
the service's errors under ``/v2`` as the protocol's ``{"error": ...}``. Modules, one job
each: `protocol` (JSON documents), `datatypes`, `options` (request parameters), `codec`
(bodies <-> tensors), `sequences` (sequence id -> slot), `infer` (one request on the
core), `shm` and `cuda_ipc` (shared memory regions), `errors`, `routes`.
"""
from .errors import ProtocolErrors
from .routes import kserve_router

__all__ = ["kserve_router", "ProtocolErrors"]
