"""`create_app(settings)`: the FastAPI front end of a `ServerCore`.

Routes (all but /health/* need the API key when one is set):
POST /slots, GET/DELETE /slots/{id}, POST /slots/{id}/fork, GET/PUT /slots/{id}/state,
POST /prefill, GET /info, GET /metrics, GET /health/live, GET /health/ready,
POST/GET /shm/regions, GET/DELETE /shm/regions/{name}.
/prefill and the state routes read the raw body themselves (JSON or safetensors, chosen
by Content-Type; the response by Accept), so their OpenAPI bodies are declared by hand.
/prefill also takes tensors by reference to registered shared memory
(``application/vnd.kda.shm+json``, see `service.shm.prefill`); the regions are the app's
`ShmRegistry`, shared with the KServe v2 shared memory extensions. Every /prefill response
carries ``Server-Timing: decode, validate, kernel, encode`` (milliseconds) so a client can
tell transport time from compute.

A client that leaves before its response (``POST /slots``, fork, a /prefill that created
slots) leaves no slot behind: the slots created for it are freed (status 499 in the
metrics), also when it leaves while a large response is still being sent.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from .abandon import Abandonment
from ..config import Settings
from ..core.server import ServerCore
from ..errors import NotReady
from ..kserve import ProtocolErrors, kserve_router
from .middleware import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from ..core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .problem_details import install_problem_handlers
from ..shm.registry import SYSTEM, ShmRegistry
from ..shm.prefill import (
    SHM_JSON, PrefillShmRequest, PrefillShmResponse, RegionRegister, RegionStatus, host_bytes, input_refs,
    parse_shm_request, read_request, region_names, write_result,
)
from .body import read_body
from ..wire.media import ENCODINGS, JSON, PROBLEM, SAFETENSORS, negotiate, request_encoding
from ..wire.prefill import decode_prefill_json, decode_prefill_safetensors, encode_prefill_json, prefill_safetensors_pieces
from ..wire.schema import (
    AllocRequest, Forked, Info, PrefillJSONRequest, PrefillJSONResponse, PrefillOptions, Problem, SlotMetadata,
    SlotsCreated, StateJSON,
)
from ..wire.state import decode_state_json, decode_state_safetensors, encode_state_json
from ..wire.buffers import WarmBuffers
from ..core.worker import off_loop

log = logging.getLogger("kda_serve.app")
_REF = "#/components/schemas/{model}"
_BINARY = {"type": "string", "format": "binary"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for error ``codes`` (and 401, 422: any route may give them), all problem+json."""
    return {code: {"description": "problem details (RFC 9457)", "content": {PROBLEM: {"schema": _ref(Problem)}}}
            for code in sorted({401, 422, *codes})}


def _both(model: type[BaseModel], binary: str) -> dict[str, Any]:
    """OpenAPI content in the two encodings: JSON ``model`` and a safetensors body."""
    return {JSON: {"schema": _ref(model)}, SAFETENSORS: {"schema": {**_BINARY, "description": binary}}}


_PREFILL_BINARY = ("safetensors with tensors q [T,H,K], k [T,H,K], v [T,HV,V], g [T,HV,K], beta [T,HV] "
                   "(optional A_log [HV], dt_bias [HV,K]) and __metadata__.request = PrefillOptions as JSON")
_STATE_BINARY = "safetensors with tensor state [L,HV,V,K] in the pool dtype"
_REGION_EXPIRY_S = 1.0  # how often leased shared memory regions are checked for expiry


def _payload(data: bytes | bytearray) -> bytes | memoryview:
    """A response body Starlette accepts, without copying a bytearray."""
    return memoryview(data) if isinstance(data, bytearray) else data


async def _client_gone(receive: Receive) -> bool:
    """Whether the client has disconnected (after its body was read), without waiting."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        return (await receive())["type"] == "http.disconnect"
    return False


class PiecesResponse(Response):
    """A response whose body is ``pieces`` sent one after another, never joined (a
    safetensors reply: its header, then views of the result tensors' own bytes)."""

    def __init__(self, pieces: Sequence[memoryview], media_type: str, headers: dict[str, str]) -> None:
        self.pieces = [piece.cast("B") for piece in pieces]
        length = sum(piece.nbytes for piece in self.pieces)
        super().__init__(b"", media_type=media_type, headers={**headers, "content-length": str(length)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(self.pieces) - 1})
        if not self.pieces:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class DeliveryGuard(PiecesResponse):
    """A response that hands its body to the server in pieces of at most ``PIECE`` bytes
    and, when the client is gone before the last piece is handed over, awaits
    ``on_abandoned`` (which frees the slots whose ids only this body carries) and stops.
    Once the last piece is handed over the server cannot tell delivery from loss; idle
    expiry (--slot-ttl-s) reclaims a slot whose id never arrived."""

    PIECE = 1 << 20

    def __init__(self, pieces: Sequence[memoryview], media_type: str,
                 on_abandoned: Callable[[], Awaitable[None]], headers: dict[str, str]) -> None:
        super().__init__(pieces, media_type, headers)
        self._on_abandoned = on_abandoned

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        slices = [piece[start:start + self.PIECE] for piece in self.pieces
                  for start in range(0, len(piece), self.PIECE)] or [memoryview(b"")]
        for i, body in enumerate(slices):
            if await _client_gone(receive):
                await self._on_abandoned()
                return
            await send({"type": "http.response.body", "body": body, "more_body": i < len(slices) - 1})


def _server_timing(**phases_s: float) -> dict[str, str]:
    """A ``Server-Timing`` header (W3C) of the phases, given in seconds, in milliseconds."""
    return {"server-timing": ", ".join(f"{name};dur={s * 1000:.3f}" for name, s in phases_s.items())}


def create_app(settings: Settings) -> FastAPI:
    """The app serving a new `ServerCore` (``app.state.core``; the pool is allocated and
    gate parameters loaded here, so bad settings fail before serving). Its lifespan starts
    the core, warms the kernels in the background (/health/ready answers 200 after), sweeps
    idle slots when a ttl is set, and closes the core (snapshot) at shutdown."""
    core = ServerCore(settings)
    registry = ShmRegistry()
    shm_inputs = WarmBuffers()  # host buffers shared memory inputs are copied out into
    ready = asyncio.Event()

    async def warm() -> None:
        try:
            await core.warmup()
        except Exception:
            log.exception("kernel warmup failed: /health/ready stays 503")
            return
        ready.set()
        log.info("kernels warm (%s on %s); ready", core.backend, core.geometry.device)

    async def sweep_forever(period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await core.sweep()
            except Exception:
                log.exception("idle sweep failed; retrying in %.2f s", period)

    async def expire_regions() -> None:
        while True:
            await asyncio.sleep(_REGION_EXPIRY_S)
            registry.expire()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.start()
        tasks = [asyncio.create_task(warm(), name="kda-warmup"),
                 asyncio.create_task(expire_regions(), name="kda-shm-leases")]
        if settings.slot_ttl_s is not None:
            period = min(max(settings.slot_ttl_s / 4, 0.05), 10.0)
            tasks.append(asyncio.create_task(sweep_forever(period), name="kda-sweep"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            registry.close()
            await core.close()

    app = FastAPI(
        title="kda-serve",
        version="0.1.0",
        summary="KDA (Kimi Delta Attention) chunked prefill over HTTP, on an in-place state pool",
        lifespan=lifespan,
        redirect_slashes=False,  # "/slots/" is a 404, not a redirect outside the documented statuses
    )
    app.state.core = core
    install_problem_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=lambda: core.metrics)
    app.add_middleware(ProtocolErrors)  # outermost: {"error": ...} bodies under /v2, from every layer
    # Open Inference Protocol (KServe v2): /v2/... over HTTP, and gRPC on --grpc-port when set
    app.include_router(kserve_router(core, ready.is_set, registry, settings))

    left = Abandonment(core.free, core.metrics.abandoned)

    @app.post("/slots", status_code=201, response_model=SlotsCreated, responses=_errors(400, 408, 413, 422, 503),
              summary="Allocate slots (zero state), all or none")
    async def alloc(request: Request, body: Optional[AllocRequest] = None) -> Any:
        slots = await core.alloc(body.count if body is not None else 1)
        return await left.check(request, slots) or {"slots": slots}

    @app.get("/slots/{slot_id}", response_model=SlotMetadata, responses=_errors(404), summary="Slot metadata")
    async def slot_info(slot_id: str) -> dict[str, Any]:
        info = await core.slot_info(slot_id)
        return {"slot": info.slot_id, "created": info.created, "last_used": info.last_used,
                "tokens_per_layer": info.tokens_per_layer, "state_lost": info.state_lost}

    @app.delete("/slots/{slot_id}", status_code=204, responses=_errors(404, 503), summary="Free a slot")
    async def free(slot_id: str) -> Response:
        await core.free(slot_id)
        return Response(status_code=204)

    @app.post("/slots/{slot_id}/fork", status_code=201, response_model=Forked, responses=_errors(404, 503),
              summary="Copy a slot's state into a new slot (prefix reuse)")
    async def fork(slot_id: str, request: Request) -> Any:
        child = await core.fork(slot_id)
        return await left.check(request, [child]) or {"slot": child}

    @app.get("/slots/{slot_id}/state", responses={
        200: {"description": "the state, [L, HV, V, K] (safetensors unless Accept asks for JSON)",
              "content": _both(StateJSON, _STATE_BINARY)}, **_errors(404, 406)},
        summary="Export a slot's state")
    async def get_state(slot_id: str, request: Request) -> Response:
        reply = negotiate(request.headers.get("accept"), ENCODINGS, default=SAFETENSORS)
        if reply == JSON:
            state = await core.get_state(slot_id)
            data = await off_loop(encode_state_json, state, nbytes=state.numel() * state.element_size())
        else:
            data = await core.export_state(slot_id)
        return Response(_payload(data), media_type=reply)

    @app.put("/slots/{slot_id}/state", status_code=204, responses=_errors(400, 404, 408, 413, 415, 422, 503),
             openapi_extra={"requestBody": {"required": True, "content": _both(StateJSON, _STATE_BINARY)}},
             summary="Replace a slot's state (token counts are kept)")
    async def put_state(slot_id: str, request: Request) -> Response:
        encoding = request_encoding(request.headers.get("content-type"))
        body = await read_body(request)
        decode = decode_state_json if encoding == JSON else decode_state_safetensors
        await core.put_state(slot_id, await off_loop(decode, body, nbytes=len(body)))
        return Response(status_code=204)

    @app.post("/prefill", responses={
        200: {"description": "outputs o [T, HV, V] and final states [N, HV, V, K]; encoding by Accept "
                             "(default: the request's). A shared memory request gets PrefillShmResponse (JSON): "
                             "the outputs are in its regions", "content": {
                  **_both(PrefillJSONResponse, "safetensors with o, final_state and __metadata__.response = "
                                               "{\"slots\": [...]}"),
                  JSON: {"schema": {"oneOf": [_ref(PrefillJSONResponse), _ref(PrefillShmResponse)]}}}},
        **_errors(400, 404, 406, 408, 409, 413, 415, 422, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            **_both(PrefillJSONRequest, _PREFILL_BINARY), SHM_JSON: {"schema": _ref(PrefillShmRequest)}}}},
        summary="Chunked KDA prefill of a batch of sequences on one layer, in place on their slots")
    async def prefill(request: Request) -> Response:
        encoding = request_encoding(request.headers.get("content-type"), (*ENCODINGS, SHM_JSON))
        if encoding == SHM_JSON:
            return await prefill_shm(request)
        reply = negotiate(request.headers.get("accept"), ENCODINGS, default=encoding)
        body = await read_body(request)
        decode = decode_prefill_json if encoding == JSON else decode_prefill_safetensors
        start = time.perf_counter()
        inputs = await off_loop(decode, body, nbytes=len(body))
        decode_s = time.perf_counter() - start
        result = await core.prefill(inputs)
        if result.allocated and (gone := await left.check(request, result.allocated)):
            return gone
        size = result.o.numel() * result.o.element_size()
        start = time.perf_counter()
        if reply == JSON:
            pieces = [memoryview(await off_loop(encode_prefill_json, result, nbytes=size))]
        else:
            pieces = prefill_safetensors_pieces(result)
        timing = _server_timing(decode=decode_s, validate=result.validate_s, kernel=result.kernel_s,
                                encode=time.perf_counter() - start)
        if result.allocated:
            return DeliveryGuard(pieces, reply, lambda: left.release(result.allocated), timing)
        return PiecesResponse(pieces, reply, timing)

    async def prefill_shm(request: Request) -> Response:
        """/prefill with tensors in shared memory (`service.shm.prefill`): the regions stay
        mapped from the bounds checks until the outputs are written."""
        negotiate(request.headers.get("accept"), (JSON,), default=JSON)
        parsed = parse_shm_request(await read_body(request))
        with registry.lease(region_names(parsed)) as regions:
            start = time.perf_counter()
            plan = await off_loop(read_request, parsed, regions, core, shm_inputs,
                                 nbytes=host_bytes(input_refs(parsed), regions))
            decode_s = time.perf_counter() - start
            result = await core.prefill(plan.inputs)
            if result.allocated and (gone := await left.check(request, result.allocated)):
                return gone
            start = time.perf_counter()
            doc = await off_loop(write_result, plan, result, regions,
                                nbytes=host_bytes((plan.o, plan.final_state), regions))
        timing = _server_timing(decode=decode_s, validate=result.validate_s, kernel=result.kernel_s,
                                encode=time.perf_counter() - start)
        return JSONResponse(doc, headers=timing)

    @app.post("/shm/regions", status_code=201, response_model=RegionStatus, responses=_errors(400, 408, 413, 422),
              summary="Register a POSIX shared memory region (for /prefill by reference)")
    async def shm_register(body: RegionRegister) -> dict[str, Any]:
        registry.register_system(body.name, body.key, body.offset, body.byte_size, body.ttl_s)
        return registry.status(SYSTEM, body.name)[0]

    @app.get("/shm/regions", response_model=list[RegionStatus], responses=_errors(),
             summary="Every registered system shared memory region")
    async def shm_regions() -> list[dict[str, Any]]:
        return registry.status(SYSTEM)

    @app.get("/shm/regions/{name}", response_model=RegionStatus, responses=_errors(400),
             summary="One registered system shared memory region (400 when unknown)")
    async def shm_region(name: str) -> dict[str, Any]:
        return registry.status(SYSTEM, name)[0]

    @app.delete("/shm/regions/{name}", status_code=204, responses=_errors(),
                summary="Unregister a region (idempotent); its mapping closes once no request uses it")
    async def shm_unregister(name: str) -> Response:
        registry.unregister(SYSTEM, name)
        return Response(status_code=204)

    @app.get("/info", response_model=Info, responses=_errors(),
             summary="Pool geometry, device, backend and free slots")
    async def info() -> dict[str, Any]:
        return await core.info()

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors()})
    async def metrics() -> Response:
        return Response(core.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/health/live", summary="The process is up")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/health/ready", responses={503: {"description": "warming up",
                                               "content": {PROBLEM: {"schema": _ref(Problem)}}}},
             summary="Ready once the pool is up and the kernels are warm")
    async def ready_probe() -> dict[str, str]:
        if not ready.is_set():
            raise NotReady("warming the kernels")
        return {"status": "ready"}

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the models only referenced from hand-declared bodies."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (PrefillJSONRequest, PrefillJSONResponse, PrefillOptions, PrefillShmRequest,
                          PrefillShmResponse, StateJSON, Problem):
                model_schema = model.model_json_schema(ref_template=_REF)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
