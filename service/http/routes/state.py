"""``GET``/``PUT /slots/{id}/state``: a slot's state [L, HV, V, K] as safetensors (the
default) or JSON, chosen by Accept on the way out and Content-Type on the way in."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ...core.api import CoreAPI
from ...core.worker import off_loop
from ...wire.media import ENCODINGS, JSON, SAFETENSORS, negotiate, request_encoding
from ...wire.schema import StateJSON
from ...wire.state import decode_state_json, decode_state_safetensors, encode_state_json
from ..body import read_body
from ..openapi import STATE_BINARY, both_encodings, error_responses


def add_state_routes(router: APIRouter, core: CoreAPI) -> None:
    """The state routes on ``core``."""

    @router.get("/slots/{slot_id}/state", responses={
        200: {"description": "the state, [L, HV, V, K] (safetensors unless Accept asks for JSON)",
              "content": both_encodings(StateJSON, STATE_BINARY)}, **error_responses(404, 406)},
        summary="Export a slot's state")
    async def get_state(slot_id: str, request: Request) -> Response:
        reply = negotiate(request.headers.get("accept"), ENCODINGS, default=SAFETENSORS)
        if reply == JSON:
            state = await core.get_state(slot_id)
            data = await off_loop(encode_state_json, state, nbytes=state.numel() * state.element_size())
        else:
            data = await core.export_state(slot_id)
        return Response(data, media_type=reply)

    @router.put("/slots/{slot_id}/state", status_code=204,
                responses=error_responses(400, 404, 408, 413, 415, 422, 503),
                openapi_extra={"requestBody": {"required": True, "content": both_encodings(StateJSON, STATE_BINARY)}},
                summary="Replace a slot's state (token counts are kept)")
    async def put_state(slot_id: str, request: Request) -> Response:
        encoding = request_encoding(request.headers.get("content-type"))
        body = await read_body(request)
        decode = decode_state_json if encoding == JSON else decode_state_safetensors
        await core.put_state(slot_id, await off_loop(decode, body, nbytes=len(body)))
        return Response(status_code=204)
