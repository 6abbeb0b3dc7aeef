"""`InferenceServicer`: the KServe v2 ``GRPCInferenceService`` over a `KServeEndpoint`.

Every method is a thin front end: decode the message (`codec`, `metadata`), call the
endpoint or the shared memory registry, encode the answer; `Calls` checks the key, maps
errors to status codes and counts. Health: ServerLive, ServerReady, ModelReady (false for
another model, as Triton answers; both false once the server is stopping, `Calls.ready`).
Metadata: ServerMetadata, ModelMetadata, ModelConfig, RepositoryIndex. Inference:
ModelInfer, ModelStreamInfer (`stream`). Shared memory: System/CudaSharedMemory Register,
Status, Unregister (one registry with HTTP and ``POST /prefill``; region names checked by
`protocol.region_name`, as over HTTP). Statistics, repository load/unload, trace and log
settings answer UNIMPLEMENTED.
"""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Callable

import grpc

from ...shm.registry import CUDA, SYSTEM
from ...wire.schema import parse_model
from ..endpoint import KServeEndpoint
from ..model import MODEL, VERSION, check_model
from ..protocol import CudaShmRegister, SystemShmRegister, region_name
from . import metadata
from .calls import Calls
from .codec import model_infer
from .messages import pb, pb_grpc
from .status import Unimplemented, rpc_status
from .stream import METHOD as STREAM, Request, StreamSession, serve_stream

Context = grpc.aio.ServicerContext


def _unimplemented(method: str) -> Callable[..., Any]:
    async def call(self: "InferenceServicer", request: Any, context: Context) -> Any:
        async def body() -> Any:
            raise Unimplemented(method)
        return await self.calls.unary(method, request, context, body)
    call.__name__ = method
    return call


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The service on ``endpoint``; ``version`` is the server's (ServerMetadata)."""

    def __init__(self, endpoint: KServeEndpoint, calls: Calls, version: str) -> None:
        self.endpoint = endpoint
        self.calls = calls
        self.version = version
        self.registry = endpoint.registry

    def _ready(self) -> bool:
        """Whether readiness answers true: the kernels ready and the server not stopping."""
        return self.calls.ready(self.endpoint.ready())

    # -- health and metadata ------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        async def body() -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)
        return await self.calls.unary("ServerLive", request, context, body)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        async def body() -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=self._ready())
        return await self.calls.unary("ServerReady", request, context, body)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        async def body() -> pb.ModelReadyResponse:
            known = request.name == MODEL and request.version in ("", VERSION)
            return pb.ModelReadyResponse(ready=known and self._ready())
        return await self.calls.unary("ModelReady", request, context, body)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        async def body() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(**self.endpoint.server_metadata(self.version))
        return await self.calls.unary("ServerMetadata", request, context, body)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        async def body() -> pb.ModelMetadataResponse:
            check_model(request.name, request.version)
            return metadata.model_metadata(self.endpoint.core.geometry)
        return await self.calls.unary("ModelMetadata", request, context, body)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        async def body() -> pb.ModelConfigResponse:
            check_model(request.name, request.version)
            return metadata.model_config(self.endpoint.core.geometry)
        return await self.calls.unary("ModelConfig", request, context, body)

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                              context: Context) -> pb.RepositoryIndexResponse:
        async def body() -> pb.RepositoryIndexResponse:
            state = "READY" if self._ready() else "UNAVAILABLE"
            models = [] if request.ready and state != "READY" else [
                pb.RepositoryIndexResponse.ModelIndex(name=MODEL, version=VERSION, state=state)]
            return pb.RepositoryIndexResponse(models=models)
        return await self.calls.unary("RepositoryIndex", request, context, body)

    # -- inference ------------------------------------------------------------------------

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        async def body() -> pb.ModelInferResponse:
            return await self.calls.whole(model_infer(self.endpoint, request))
        return await self.calls.unary("ModelInfer", request, context, body)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Request], context: Context) -> None:
        start = time.monotonic()
        try:
            self.calls.admit(STREAM, context)
        except Exception as e:
            code, message = rpc_status(e)
            self.calls.count(STREAM, code, time.monotonic() - start)
            await context.abort(code, message)
        closed = await serve_stream(StreamSession(self.endpoint, self.calls, context), request_iterator,
                                    self.calls.stopping.wait)
        if not closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down: reconnect to another "
                                                             "instance (every request answered so far was applied)")

    # -- shared memory --------------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Context) -> pb.SystemSharedMemoryStatusResponse:
        async def body() -> pb.SystemSharedMemoryStatusResponse:
            return metadata.system_status(self.registry, request.name)
        return await self.calls.unary("SystemSharedMemoryStatus", request, context, body)

    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Context) -> pb.SystemSharedMemoryRegisterResponse:
        async def body() -> pb.SystemSharedMemoryRegisterResponse:
            name = region_name(request.name)
            doc = parse_model(SystemShmRegister, json.dumps(
                {"key": request.key, "offset": request.offset, "byte_size": request.byte_size}), where="request")
            self.registry.register_system(name, doc.key, doc.offset, doc.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()
        return await self.calls.unary("SystemSharedMemoryRegister", request, context, body)

    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Context) -> pb.SystemSharedMemoryUnregisterResponse:
        async def body() -> pb.SystemSharedMemoryUnregisterResponse:
            self.registry.unregister(SYSTEM, request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()
        return await self.calls.unary("SystemSharedMemoryUnregister", request, context, body)

    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Context) -> pb.CudaSharedMemoryStatusResponse:
        async def body() -> pb.CudaSharedMemoryStatusResponse:
            return metadata.cuda_status(self.registry, request.name)
        return await self.calls.unary("CudaSharedMemoryStatus", request, context, body)

    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context: Context) -> pb.CudaSharedMemoryRegisterResponse:
        async def body() -> pb.CudaSharedMemoryRegisterResponse:
            self.registry.require_cuda()
            name = region_name(request.name)
            doc = parse_model(CudaShmRegister, json.dumps(
                {"raw_handle": {"b64": ""}, "device_id": request.device_id, "byte_size": request.byte_size}),
                where="request")
            self.registry.register_cuda(name, request.raw_handle, doc.device_id, doc.byte_size)
            return pb.CudaSharedMemoryRegisterResponse()
        return await self.calls.unary("CudaSharedMemoryRegister", request, context, body)

    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Context) -> pb.CudaSharedMemoryUnregisterResponse:
        async def body() -> pb.CudaSharedMemoryUnregisterResponse:
            self.registry.require_cuda()
            self.registry.unregister(CUDA, request.name or None)
            return pb.CudaSharedMemoryUnregisterResponse()
        return await self.calls.unary("CudaSharedMemoryUnregister", request, context, body)

    ModelStatistics = _unimplemented("ModelStatistics")
    RepositoryModelLoad = _unimplemented("RepositoryModelLoad")
    RepositoryModelUnload = _unimplemented("RepositoryModelUnload")
    TraceSetting = _unimplemented("TraceSetting")
    LogSettings = _unimplemented("LogSettings")
