"""`kserve_router(core, ready, registry)`: the Open Inference Protocol (KServe v2) on a `ServerCore`,
so tritonclient and the KServe ecosystem work unchanged.

Routes (model ``kda``, version ``1``; the ``/versions/{version}`` forms are accepted too):
GET /v2, GET /v2/health/live, GET /v2/health/ready, GET /v2/models/kda,
GET /v2/models/kda/ready, POST /v2/models/kda/infer, and the system and CUDA shared memory
extensions under /v2/systemsharedmemory and /v2/cudasharedmemory.

Each infer request is one sequence of T tokens on one layer: inputs q, k [T, H, K],
v [T, HV, V], g [T, HV, K], beta [T, HV] (optional A_log [HV], dt_bias [HV, K]) in FP32, BF16
or FP16; outputs o [T, HV, V] in v's datatype and final_state [HV, V, K] in the pool's.
It goes through `ServerCore.prefill` like ``POST /prefill``: the same validation, per-slot
ordering, and batching (concurrent requests share one kernel launch). Errors are the
service's own, rendered as ``{"error": ...}`` by `ProtocolErrors`.

The router owns the app's sequence table: its lifespan loads it (when a snapshot path is
set) and saves it at shutdown. The shared memory registry is the app's, shared with
``POST /prefill`` (the app unmaps every region at shutdown).
"""
from __future__ import annotations

import base64
import binascii
import functools
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import APIRouter, Request, Response

from ..core.inputs import OPTIONAL_TENSORS
from ..core.server import ServerCore
from ..errors import InvalidRequest, UnsupportedMediaType
from ..http.body import read_body
from ..wire.buffers import WarmBuffers
from ..wire.media import JSON
from ..wire.schema import parse_model
from ..core.worker import off_loop
from . import infer
from .codec import (
    HEADER_LENGTH, encode_response, header_end, parse_request, plan_outputs, prefill_inputs, read_inputs,
)
from .datatypes import ACCEPTED, datatype_name
from .errors import UnknownModel
from .protocol import CudaShmRegister, SystemShmRegister
from .sequences import SUFFIX, SequenceTable
from ..shm.registry import CUDA, SYSTEM, ShmRegistry

MODEL, VERSION, PLATFORM = "kda", "1", "kda-serve"
OCTET = "application/octet-stream"
_INFER_BODY = {"requestBody": {"required": True, "content": {
    JSON: {"schema": {"type": "object", "description": "$inference_request (Open Inference Protocol)"}},
    OCTET: {"schema": {"type": "string", "format": "binary", "description": (
        "$inference_request JSON (its length in Inference-Header-Content-Length), then each binary input's "
        "bytes in input order")}},
}}}
Status = list[dict[str, Union[str, int]]]


def _check_model(model: str, version: Optional[str]) -> None:
    if model != MODEL:
        raise UnknownModel(f"unknown model {model!r}: this server serves {MODEL!r}", field="model")
    if version is not None and version != VERSION:
        raise UnknownModel(f"unknown version {version!r} of model {MODEL!r}: it has version {VERSION!r}",
                           field="version")


def model_metadata(core: ServerCore) -> dict[str, Any]:
    """``$metadata_model_response``: -1 marks the token dimension (and q/k's heads H, any
    divisor of HV). Each tensor's ``parameters`` say which datatypes it takes, as the
    protocol's one ``datatype`` cannot."""
    g = core.geometry
    HV, K, V = g.num_heads, g.head_k_dim, g.head_v_dim
    shapes = {"q": [-1, -1, K], "k": [-1, -1, K], "v": [-1, HV, V], "g": [-1, HV, K], "beta": [-1, HV],
              "A_log": [HV], "dt_bias": [HV, K]}
    inputs = [{"name": name, "datatype": "FP32", "shape": shape,
               "parameters": {"datatypes": ACCEPTED, "optional": name in OPTIONAL_TENSORS}}
              for name, shape in shapes.items()]
    state = datatype_name(g.dtype)
    outputs = [
        {"name": "o", "datatype": "FP32", "shape": [-1, HV, V], "parameters": {"datatypes": "v's datatype"}},
        {"name": "final_state", "datatype": state, "shape": [HV, V, K], "parameters": {"datatypes": state}},
    ]
    return {"name": MODEL, "versions": [VERSION], "platform": PLATFORM, "inputs": inputs, "outputs": outputs}


def kserve_router(core: ServerCore, ready: Callable[[], bool], registry: ShmRegistry) -> APIRouter:
    """The KServe v2 routes on ``core``; ``ready`` says whether the kernels are warm;
    ``registry`` holds the app's shared memory regions (its owner closes it). Mount with
    ``app.include_router`` and add `ProtocolErrors` to the app."""
    table = SequenceTable(core.snapshot_path + SUFFIX if core.snapshot_path else None)
    shm_inputs = WarmBuffers()  # host buffers shared memory inputs are copied out into

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        table.load(core.pool.contains)
        yield

    if table.path is not None:  # saved with every pool snapshot, periodic and at shutdown
        core.on_checkpoint(table.save)

    router = APIRouter(lifespan=lifespan, tags=["Open Inference Protocol (KServe v2)"])

    @router.get("/v2", summary="Server metadata")
    async def server_metadata(request: Request) -> dict[str, Any]:
        extensions = ["binary_tensor_data", "sequence", "sequence(string_id)", "system_shared_memory", "parameters"]
        if registry.cuda_reason is None:
            extensions.append("cuda_shared_memory")
        return {"name": PLATFORM, "version": request.app.version, "extensions": extensions}

    @router.get("/v2/health/live", summary="200: the server is live")
    async def live() -> Response:
        return Response(status_code=200)

    @router.get("/v2/health/ready", summary="200: ready (the kernels are warm); 400 while warming")
    async def server_ready() -> Response:
        return Response(status_code=200 if ready() else 400)

    @router.get("/v2/models/{model}", summary="Model metadata")
    @router.get("/v2/models/{model}/versions/{version}", summary="Model metadata")
    async def metadata(model: str, request: Request) -> dict[str, Any]:
        _check_model(model, request.path_params.get("version"))
        return model_metadata(core)

    @router.get("/v2/models/{model}/ready", summary="200: the model is ready; 400 while warming")
    @router.get("/v2/models/{model}/versions/{version}/ready", summary="200: the model is ready; 400 while warming")
    async def model_ready(model: str, request: Request) -> Response:
        _check_model(model, request.path_params.get("version"))
        return Response(status_code=200 if ready() else 400)

    @router.post("/v2/models/{model}/infer", openapi_extra=_INFER_BODY, response_class=Response,
                 summary="Prefill one sequence (Triton sequence parameters map sequence ids to slots)")
    @router.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=_INFER_BODY, response_class=Response,
                 summary="Prefill one sequence (Triton sequence parameters map sequence ids to slots)")
    async def infer_route(model: str, request: Request) -> Response:
        _check_model(model, request.path_params.get("version"))
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send the body uncompressed",
                                       field="Content-Encoding")
        body = await read_body(request)
        json_end = header_end(len(body), request.headers.get(HEADER_LENGTH))
        parsed = await off_loop(parse_request, body, json_end, nbytes=json_end)
        g = core.geometry
        with registry.lease(parsed.regions) as regions:
            tensors = await off_loop(read_inputs, parsed, body, regions, shm_inputs, g.device, nbytes=len(body))
            v = tensors["v"]
            plan_outputs(parsed, v.dtype, v.numel() * v.element_size(), g.dtype,
                         g.num_heads * g.head_v_dim * g.head_k_dim * g.dtype.itemsize, regions)
            on_device = g.device.type == "cuda" and parsed.outputs_in_shm  # written from the device
            outcome = await infer.run(core, table, MODEL, parsed.options,
                                      functools.partial(prefill_inputs, parsed, tensors, device_outputs=on_device))
            result = outcome.result
            outputs = {"o": result.o}
            if result.final_state is not None:
                outputs["final_state"] = result.final_state[0]
            parameters = {} if outcome.slot is None else {"slot": outcome.slot}
            content, json_length = await off_loop(encode_response, parsed, MODEL, VERSION, outputs, parameters,
                                                 regions, nbytes=result.o.numel() * result.o.element_size())
        if json_length is None:
            return Response(content, media_type=JSON)
        return Response(content, media_type=OCTET, headers={HEADER_LENGTH: str(json_length)})

    # -- shared memory extensions ------------------------------------------------------

    @router.get("/v2/systemsharedmemory/status", summary="Every registered system shared memory region")
    async def system_status_all() -> Status:
        return registry.status(SYSTEM)

    @router.get("/v2/systemsharedmemory/region/{name}/status", summary="One system shared memory region")
    async def system_status(name: str) -> Status:
        return registry.status(SYSTEM, name)

    @router.post("/v2/systemsharedmemory/region/{name}/register", summary="Register a POSIX shared memory region")
    async def system_register(name: str, request: Request) -> dict[str, Any]:
        body = parse_model(SystemShmRegister, await read_body(request))
        registry.register_system(name, body.key, body.offset, body.byte_size, body.ttl_s)
        return {}

    @router.post("/v2/systemsharedmemory/unregister", summary="Unregister every system shared memory region")
    @router.post("/v2/systemsharedmemory/region/{name}/unregister", summary="Unregister a system shared memory region")
    async def system_unregister(request: Request) -> dict[str, Any]:
        registry.unregister(SYSTEM, request.path_params.get("name"))
        return {}

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

    return router
