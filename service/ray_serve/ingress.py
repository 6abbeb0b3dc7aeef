"""`create_ingress_app(core, settings)`: the HTTP API of the single server over a
`ShardedCore`, plus the routes of a sharded deployment.

Same routes, bodies, media negotiation, errors (problem+json, via the single server's
handlers), middleware (API key, body limit, per-route metrics) and freeing of the slots
made for a client that left before learning their ids (`service.http.abandon`, 499; and, as
Serve cancels the request of a client that left, after a cancellation too) as
`service.http.app`, so `kda_client` works unchanged. Added:

- ``POST /slots/{id}/move`` ``{"shard": name | null}``: move the slot (null: to the
  emptiest other shard); its id keeps working. 200 ``{"slot", "shard"}``.
- ``GET /shards``: each shard's figures, whether it is up and whether it is draining.
- ``POST /shards/{name}/drain``: place no new slots there, move all of its slots away.
- ``POST /shards/{name}/resume``: place new slots there again.
- 410 ``slot-gone`` for a slot whose shard lost it (its process died).
No Ray in here: `service.ray_serve.deploy` mounts this app in the ingress deployment.
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from service.http.abandon import Abandonment
from service.config import Settings
from service.errors import NotReady
from service.core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.http.middleware import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from service.http.problem_details import install_problem_handlers
from service.http.body import read_body
from service.wire.media import ENCODINGS, JSON, SAFETENSORS, negotiate, request_encoding
from service.wire.prefill import (
    decode_prefill_json, decode_prefill_safetensors, encode_prefill_json, encode_prefill_safetensors,
)
from service.wire.schema import AllocRequest, Forked, Info, SlotMetadata, SlotsCreated
from service.wire.state import decode_state_json, decode_state_safetensors, encode_state_json
from service.core.worker import off_loop
from state_store import UnknownSlot

from .errors import SlotGone
from .metrics import merge_metrics
from .router import ShardedCore


class MoveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    shard: Optional[str] = Field(None, description="the shard to move to; null: the emptiest other shard")


class Moved(BaseModel):
    slot: str = Field(description="the slot's id (unchanged)")
    shard: str = Field(description="the shard that holds it now")


def _payload(data: Any) -> bytes:
    """A response body as bytes: Serve pickles the ASGI messages from the replica to its
    HTTP proxy, and a memoryview does not pickle (so a body is copied once more here)."""
    return data if isinstance(data, bytes) else bytes(memoryview(data))


def create_ingress_app(core: ShardedCore, settings: Settings) -> FastAPI:
    """The FastAPI app of the ingress: ``settings`` give the API key and body limit."""
    metrics = core.metrics
    app = FastAPI(title="kda-serve (Ray Serve ingress)", version="0.1.0",
                  summary="KDA chunked prefill over HTTP, sharded over one state pool per GPU",
                  redirect_slashes=False)
    app.state.core = core
    install_problem_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=lambda: metrics)
    left = Abandonment(core.free, metrics.abandoned, missing=(UnknownSlot, SlotGone))

    @app.post("/slots", status_code=201, response_model=SlotsCreated, summary="Allocate slots on the emptiest shards")
    async def alloc(request: Request, body: Optional[AllocRequest] = None) -> Any:
        slots = await left.made(core.alloc(body.count if body is not None else 1), list)
        return await left.check(request, slots) or {"slots": slots}

    @app.get("/slots/{slot_id}", response_model=SlotMetadata, summary="Slot metadata")
    async def slot_info(slot_id: str) -> dict[str, Any]:
        info = await core.slot_info(slot_id)
        return {"slot": info.slot_id, "created": info.created, "last_used": info.last_used,
                "tokens_per_layer": info.tokens_per_layer, "state_lost": info.state_lost}

    @app.delete("/slots/{slot_id}", status_code=204, summary="Free a slot")
    async def free(slot_id: str) -> Response:
        await core.free(slot_id)
        return Response(status_code=204)

    @app.post("/slots/{slot_id}/fork", status_code=201, response_model=Forked,
              summary="Copy a slot's state into a new slot on its shard")
    async def fork(slot_id: str, request: Request) -> Any:
        child = await left.made(core.fork(slot_id), lambda made: [made])
        return await left.check(request, [child]) or {"slot": child}

    @app.get("/slots/{slot_id}/state", summary="Export a slot's state")
    async def get_state(slot_id: str, request: Request) -> Response:
        reply = negotiate(request.headers.get("accept"), ENCODINGS, default=SAFETENSORS)
        if reply == JSON:
            state = await core.get_state(slot_id)
            data: Any = await off_loop(encode_state_json, state, nbytes=state.numel() * state.element_size())
        else:
            data = await core.export_state(slot_id)
        return Response(_payload(data), media_type=reply)

    @app.put("/slots/{slot_id}/state", status_code=204, summary="Replace a slot's state (token counts are kept)")
    async def put_state(slot_id: str, request: Request) -> Response:
        encoding = request_encoding(request.headers.get("content-type"))
        body = await read_body(request)
        decode = decode_state_json if encoding == JSON else decode_state_safetensors
        await core.put_state(slot_id, await off_loop(decode, body, nbytes=len(body)))
        return Response(status_code=204)

    @app.post("/slots/{slot_id}/move", response_model=Moved,
              summary="Move a slot to another shard (its id keeps working), bit for bit")
    async def move(slot_id: str, body: Optional[MoveRequest] = None) -> dict[str, str]:
        slot, shard = await core.move(slot_id, body.shard if body is not None else None)
        return {"slot": slot, "shard": shard}

    @app.post("/prefill", summary="Chunked KDA prefill of a batch of sequences on one layer, on their shards")
    async def prefill(request: Request) -> Response:
        encoding = request_encoding(request.headers.get("content-type"))
        reply = negotiate(request.headers.get("accept"), ENCODINGS, default=encoding)
        body = await read_body(request)
        decode = decode_prefill_json if encoding == JSON else decode_prefill_safetensors
        inputs = await off_loop(decode, body, nbytes=len(body))
        result = await left.made(core.prefill(inputs), lambda made: made.allocated)
        if result.allocated and (gone := await left.check(request, result.allocated)):
            return gone
        encode = encode_prefill_json if reply == JSON else encode_prefill_safetensors
        size = result.o.numel() * result.o.element_size()
        return Response(_payload(await off_loop(encode, result, nbytes=size)), media_type=reply)

    @app.get("/shards", summary="Each shard: up, draining, free and used slots, incarnation")
    async def shards() -> dict[str, Any]:
        return {"shards": await core.shard_table()}

    @app.post("/shards/{name}/drain", summary="Place no new slots on a shard and move all of its slots away")
    async def drain(name: str) -> dict[str, Any]:
        return await core.drain(name)

    @app.post("/shards/{name}/resume", status_code=204, summary="Place new slots on a drained shard again")
    async def resume(name: str) -> Response:
        await core.resume(name)
        return Response(status_code=204)

    @app.get("/info", response_model=Info, summary="Geometry, devices, backends; slots summed over the shards")
    async def info() -> dict[str, Any]:
        return await core.info()

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics: ingress HTTP and every shard's")
    async def metrics_page() -> Response:
        return Response(merge_metrics(metrics.render(), await core.shard_metrics()), media_type=METRICS_CONTENT_TYPE)

    @app.get("/health/live", summary="The ingress is up")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/health/ready", summary="Ready while at least one shard answers")
    async def ready() -> dict[str, str]:
        if not any(row["up"] for row in await core.shard_table()):
            raise NotReady("no shard answers")
        return {"status": "ready"}

    return app
