"""The Open Inference Protocol (KServe v2) front ends of a `ServerCore`: HTTP and gRPC.

`kserve_router(core, ready, registry, settings)` serves ``/v2/...`` over HTTP (health,
metadata, infer with Triton-style sequences, the binary tensor data and shared memory
extensions) and, with ``settings.grpc_port``, the same over gRPC (`service.kserve.rpc`);
`ProtocolErrors` renders the service's errors under ``/v2`` as the protocol's
``{"error": ...}``. Modules, one job each: `model` (what the model takes and returns),
`protocol` (JSON documents), `datatypes`, `options` (request parameters), `codec` (the
transport-neutral request, checked, to tensors), `http_codec` (HTTP bodies), `endpoint`
(the one request path both front ends call), `infer` (sequence -> slot, the prefill on the
core), `sequences` (the sequence table), `errors`, `routes` (HTTP), `rpc` (gRPC). Shared
memory regions live in the transport-neutral `service.shm.registry` (and
`service.shm.cuda_ipc`), shared with ``POST /prefill``.
"""
from .errors import ProtocolErrors
from .routes import kserve_router

__all__ = ["kserve_router", "ProtocolErrors"]
