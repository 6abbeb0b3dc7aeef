"""`create_ingress_app(core, settings)`: the HTTP API of the single server over a
`ShardedCore`, plus the routes of a sharded deployment.

The REST routes are the single server's own (`service.http.routes`, mounted by
`service.http.rest_app.create_rest_app`): same bodies, media negotiation, Server-Timing,
errors (problem+json), middleware (API key, body limit, per-route metrics) and freeing of
the slots made for a client that left before learning their ids (499; and, as Serve
cancels the request of a client that left, after a cancellation too), so `kda_client`
works unchanged. Shared memory is refused: each ingress replica would hold its own region
registry, so /prefill answers a shared memory body 415 and /shm/regions 404. Added here:

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

from fastapi import APIRouter, FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.http.rest_app import create_rest_app

from .router import ShardedCore


class MoveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    shard: Optional[str] = Field(None, description="the shard to move to; null: the emptiest other shard")


class Moved(BaseModel):
    slot: str = Field(description="the slot's id (unchanged)")
    shard: str = Field(description="the shard that holds it now")


class PicklableBodies:
    """ASGI middleware that turns each response body piece given as a memoryview (the REST
    routes send views of the result tensors, uncopied) into bytes: Serve pickles the ASGI
    messages from the replica to its HTTP proxy, and a memoryview does not pickle."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_bytes(message: Message) -> None:
            if message["type"] == "http.response.body" and isinstance(message.get("body"), memoryview):
                message = {**message, "body": message["body"].tobytes()}
            await send(message)

        await self.app(scope, receive, send_bytes)


def shard_router(core: ShardedCore) -> APIRouter:
    """The routes only a sharded deployment has: moves and the shard table, drain, resume."""
    router = APIRouter()

    @router.post("/slots/{slot_id}/move", response_model=Moved,
                 summary="Move a slot to another shard (its id keeps working), bit for bit")
    async def move(slot_id: str, body: Optional[MoveRequest] = None) -> dict[str, str]:
        slot, shard = await core.move(slot_id, body.shard if body is not None else None)
        return {"slot": slot, "shard": shard}

    @router.get("/shards", summary="Each shard: up, draining, free and used slots, incarnation")
    async def shards() -> dict[str, Any]:
        return {"shards": await core.shard_table()}

    @router.post("/shards/{name}/drain", summary="Place no new slots on a shard and move all of its slots away")
    async def drain(name: str) -> dict[str, Any]:
        return await core.drain(name)

    @router.post("/shards/{name}/resume", status_code=204, summary="Place new slots on a drained shard again")
    async def resume(name: str) -> Response:
        await core.resume(name)
        return Response(status_code=204)

    return router


def create_ingress_app(core: ShardedCore, settings: Settings) -> FastAPI:
    """The FastAPI app of the ingress: ``settings`` give the API key and body limit."""
    app = create_rest_app(core, settings, title="kda-serve (Ray Serve ingress)",
                          summary="KDA chunked prefill over HTTP, sharded over one state pool per GPU",
                          server_cancels=True)  # Serve cancels the request of a client that left
    app.add_middleware(PicklableBodies)  # outermost: every body the app sends goes to Serve's pickle
    app.include_router(shard_router(core))
    return app
