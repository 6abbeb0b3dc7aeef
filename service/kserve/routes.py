"""`kserve_router(core, ready, registry, settings)`: the Open Inference Protocol (KServe v2) over
HTTP on a `ServerCore`, so tritonclient and the KServe ecosystem work unchanged; with
``settings.grpc_port`` also over gRPC (`service.kserve.rpc`), in the same process, on the
same `KServeEndpoint`.

Routes (model ``kda``, version ``1``; the ``/versions/{version}`` forms are accepted too):
GET /v2, GET /v2/health/live, GET /v2/health/ready, GET /v2/models/kda,
GET /v2/models/kda/ready, POST /v2/models/kda/infer, and the system and CUDA shared memory
extensions under /v2/systemsharedmemory and /v2/cudasharedmemory.

Each infer request is one sequence of T tokens on one layer (`service.kserve.model`). It
goes through `ServerCore.prefill` like ``POST /prefill``: the same validation, per-slot
ordering, and batching (concurrent requests share one kernel launch). Errors are the
service's own, rendered as ``{"error": ...}`` by `ProtocolErrors`. The routes only move
bytes: decoding is `service.kserve.http_codec`'s, the request path the endpoint's.

The router's lifespan loads the sequence table (when a snapshot path is set; it is saved
with every snapshot) and starts the gRPC server. gRPC stops taking new work as soon as
``stopping`` is set (the process got SIGTERM; HTTP drains meanwhile), and at shutdown the
lifespan drains and stops it before the app closes the core. The shared memory registry
is the app's, shared with ``POST /prefill`` (the app unmaps every region at shutdown);
region names are checked by `protocol.region_name`, as over gRPC.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import APIRouter, FastAPI, Request, Response

from ..config import Settings
from ..core.server import ServerCore
from ..core.worker import off_loop
from ..errors import InvalidRequest, UnsupportedMediaType
from ..http.body import read_body
from ..shm.registry import CUDA, SYSTEM, ShmRegistry
from ..wire.media import JSON
from ..wire.schema import parse_model
from .endpoint import KServeEndpoint
from .http_codec import HEADER_LENGTH, encode_response, header_end, parse_request
from .model import MODEL, PLATFORM, VERSION, check_model, model_inputs, model_outputs
from .protocol import CudaShmRegister, SystemShmRegister, region_name

__all__ = ["MODEL", "VERSION", "kserve_router", "model_metadata"]
OCTET = "application/octet-stream"
_INFER_BODY = {"requestBody": {"required": True, "content": {
    JSON: {"schema": {"type": "object", "description": "$inference_request (Open Inference Protocol)"}},
    OCTET: {"schema": {"type": "string", "format": "binary", "description": (
        "$inference_request JSON (its length in Inference-Header-Content-Length), then each binary input's "
        "bytes in input order")}},
}}}
Status = list[dict[str, Union[str, int]]]


def model_metadata(core: ServerCore) -> dict[str, Any]:
    """``$metadata_model_response``. Each tensor's ``parameters`` say which datatypes it
    takes (and whether it is optional), as the protocol's one ``datatype`` cannot."""
    g = core.geometry
    inputs = [{"name": t.name, "datatype": t.datatype, "shape": t.shape,
               "parameters": {"datatypes": t.datatypes, "optional": t.optional}} for t in model_inputs(g)]
    outputs = [{"name": t.name, "datatype": t.datatype, "shape": t.shape, "parameters": {"datatypes": t.datatypes}}
               for t in model_outputs(g)]
    return {"name": MODEL, "versions": [VERSION], "platform": PLATFORM, "inputs": inputs, "outputs": outputs}


def _grpc_front_end(endpoint: KServeEndpoint, settings: Settings, stopping: asyncio.Event) -> Any:
    """The gRPC front end for ``settings.grpc_port`` (not started). ValueError when grpcio
    or tritonclient's generated messages are missing (the ``grpc`` extra)."""
    try:
        from .rpc import GrpcFrontEnd
    except ImportError as e:
        raise ValueError(f"--grpc-port needs the grpc extra (from the checkout: pip install -e '.[grpc]'): {e}") from None
    return GrpcFrontEnd(endpoint, settings, stopping)


def kserve_router(core: ServerCore, ready: Callable[[], bool], registry: ShmRegistry,
                  settings: Optional[Settings] = None, stopping: Optional[asyncio.Event] = None) -> APIRouter:
    """The KServe v2 routes on ``core``; ``ready`` says whether the kernels are warm and
    passed their self-test; ``registry`` holds the app's shared memory regions (its owner
    closes it); a non-zero ``settings.grpc_port`` serves gRPC too, which stops taking new
    work once ``stopping`` is set (None: at the app's shutdown only). Mount with
    ``app.include_router`` and add `ProtocolErrors` to the app."""
    endpoint = KServeEndpoint(core, ready, registry)
    grpc = (_grpc_front_end(endpoint, settings, stopping or asyncio.Event())
            if settings is not None and settings.grpc_port else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        endpoint.load()
        if grpc is not None:
            await grpc.start(app.version)
        try:
            yield
        finally:
            if grpc is not None:
                await grpc.stop()

    router = APIRouter(lifespan=lifespan, tags=["Open Inference Protocol (KServe v2)"])
    _health_and_metadata(router, endpoint)
    _infer(router, endpoint)
    _system_shared_memory(router, registry)
    _cuda_shared_memory(router, registry)
    return router


def _health_and_metadata(router: APIRouter, endpoint: KServeEndpoint) -> None:
    @router.get("/v2", summary="Server metadata")
    async def server_metadata(request: Request) -> dict[str, Any]:
        return endpoint.server_metadata(request.app.version)

    @router.get("/v2/health/live", summary="200: the server is live")
    async def live() -> Response:
        return Response(status_code=200)

    @router.get("/v2/health/ready", summary="200: ready (the kernels warm and self-tested); 400 until then")
    async def server_ready() -> Response:
        return Response(status_code=200 if endpoint.ready() else 400)

    @router.get("/v2/models/{model}", summary="Model metadata")
    @router.get("/v2/models/{model}/versions/{version}", summary="Model metadata")
    async def metadata(model: str, request: Request) -> dict[str, Any]:
        check_model(model, request.path_params.get("version"))
        return model_metadata(endpoint.core)

    @router.get("/v2/models/{model}/ready", summary="200: the model is ready; 400 until then")
    @router.get("/v2/models/{model}/versions/{version}/ready", summary="200: the model is ready; 400 until then")
    async def model_ready(model: str, request: Request) -> Response:
        check_model(model, request.path_params.get("version"))
        return Response(status_code=200 if endpoint.ready() else 400)


def _infer(router: APIRouter, endpoint: KServeEndpoint) -> None:
    summary = "Prefill one sequence (Triton sequence parameters map sequence ids to slots)"

    @router.post("/v2/models/{model}/infer", openapi_extra=_INFER_BODY, response_class=Response, summary=summary)
    @router.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=_INFER_BODY, response_class=Response,
                 summary=summary)
    async def infer_route(model: str, request: Request) -> Response:
        version = request.path_params.get("version")
        check_model(model, version)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send the body uncompressed",
                                       field="Content-Encoding")
        body = await read_body(request)
        json_end = header_end(len(body), request.headers.get(HEADER_LENGTH))
        parsed = await off_loop(parse_request, body, json_end, model, version, nbytes=json_end)
        reply = await endpoint.infer(model, version, parsed)
        content, json_length = await off_loop(encode_response, parsed, MODEL, VERSION, reply.tensors,
                                             reply.parameters, nbytes=reply.nbytes)
        if json_length is None:
            return Response(content, media_type=JSON)
        return Response(content, media_type=OCTET, headers={HEADER_LENGTH: str(json_length)})


def _system_shared_memory(router: APIRouter, registry: ShmRegistry) -> None:
    @router.get("/v2/systemsharedmemory/status", summary="Every registered system shared memory region")
    async def system_status_all() -> Status:
        return registry.status(SYSTEM)

    @router.get("/v2/systemsharedmemory/region/{name}/status", summary="One system shared memory region")
    async def system_status(name: str) -> Status:
        return registry.status(SYSTEM, name)

    @router.post("/v2/systemsharedmemory/region/{name}/register", summary="Register a POSIX shared memory region")
    async def system_register(name: str, request: Request) -> dict[str, Any]:
        region_name(name)
        body = parse_model(SystemShmRegister, await read_body(request))
        registry.register_system(name, body.key, body.offset, body.byte_size, body.ttl_s)
        return {}

    @router.post("/v2/systemsharedmemory/unregister", summary="Unregister every system shared memory region")
    @router.post("/v2/systemsharedmemory/region/{name}/unregister", summary="Unregister a system shared memory region")
    async def system_unregister(request: Request) -> dict[str, Any]:
        registry.unregister(SYSTEM, request.path_params.get("name"))
        return {}


def _cuda_shared_memory(router: APIRouter, registry: ShmRegistry) -> None:
    @router.get("/v2/cudasharedmemory/status", summary="Every registered CUDA shared memory region")
    async def cuda_status_all() -> Status:
        registry.require_cuda()
        return registry.status(CUDA)

    @router.get("/v2/cudasharedmemory/region/{name}/status", summary="One CUDA shared memory region")
    async def cuda_status(name: str) -> Status:
        registry.require_cuda()
        return registry.status(CUDA, name)

    @router.post("/v2/cudasharedmemory/region/{name}/register", summary="Register a CUDA IPC memory region")
    async def cuda_register(name: str, request: Request) -> dict[str, Any]:
        registry.require_cuda()
        region_name(name)
        body = parse_model(CudaShmRegister, await read_body(request))
        try:
            raw = base64.b64decode(body.raw_handle.b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("raw_handle.b64 is not valid base64", field="raw_handle") from None
        registry.register_cuda(name, raw, body.device_id, body.byte_size, body.ttl_s)
        return {}

    @router.post("/v2/cudasharedmemory/unregister", summary="Unregister every CUDA shared memory region")
    @router.post("/v2/cudasharedmemory/region/{name}/unregister", summary="Unregister a CUDA shared memory region")
    async def cuda_unregister(request: Request) -> dict[str, Any]:
        registry.require_cuda()
        registry.unregister(CUDA, request.path_params.get("name"))
        return {}
