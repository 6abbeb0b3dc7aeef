"""``POST /slots`` (with ``prefix``: restored from the prefix cache), ``GET``/``DELETE
/slots/{id}``, ``POST /slots/{id}/fork``.

The two routes that create slots hand their ids to the client only in the response: when
the client has left by then, the slots are freed again (499), and a cancelled request
(Ray Serve cancels the request of a client that left) frees them once they exist
(`service.http.abandon`)."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Request, Response

from ...core.api import CoreAPI
from ...wire.schema import AllocRequest, Forked, SlotMetadata, SlotsCreated
from ..abandon import Abandonment
from ..openapi import error_responses
from .prefix import match_json


def add_slot_routes(router: APIRouter, core: CoreAPI, left: Abandonment) -> None:
    """The slot routes on ``core``; ``left`` frees what a departed client's request made."""

    @router.post("/slots", status_code=201, response_model=SlotsCreated, response_model_exclude_unset=True,
                 responses=error_responses(400, 408, 413, 422, 503),
                 summary="Allocate slots, all or none: zero state, or the longest prefix cache entry of `prefix`")
    async def alloc(request: Request, body: Optional[AllocRequest] = None) -> Any:
        count = body.count if body is not None else 1
        if body is None or body.prefix is None:
            slots = await left.made(core.alloc(count), list)
            return await left.check(request, slots) or {"slots": slots}
        slots, match = await left.made(core.alloc_prefix(body.prefix, count), lambda made: made[0])
        return await left.check(request, slots) or {"slots": slots, "prefix": match_json(match)}

    @router.get("/slots/{slot_id}", response_model=SlotMetadata, responses=error_responses(404),
                summary="Slot metadata")
    async def slot_info(slot_id: str) -> dict[str, Any]:
        info = await core.slot_info(slot_id)
        return {"slot": info.slot_id, "created": info.created, "last_used": info.last_used,
                "tokens_per_layer": info.tokens_per_layer, "state_lost": info.state_lost}

    @router.delete("/slots/{slot_id}", status_code=204, responses=error_responses(404, 503), summary="Free a slot")
    async def free(slot_id: str) -> Response:
        await core.free(slot_id)
        return Response(status_code=204)

    @router.post("/slots/{slot_id}/fork", status_code=201, response_model=Forked, responses=error_responses(404, 503),
                 summary="Copy a slot's state into a new slot (prefix reuse)")
    async def fork(slot_id: str, request: Request) -> Any:
        child = await left.made(core.fork(slot_id), lambda made: [made])
        return await left.check(request, [child]) or {"slot": child}
