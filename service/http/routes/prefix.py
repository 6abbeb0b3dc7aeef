"""``POST /slots/{id}/publish``, ``GET``/``DELETE /prefix/{key}``: the prefix cache
(docs/PREFIX_CACHE.md). ``POST /slots`` with ``prefix`` (a restore) is the slot route's;
checkpoints ride on ``POST /prefill`` sequences."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from starlette.convertors import Convertor, register_url_convertor

from ...core.api import CoreAPI
from ...wire.schema import PREFIX_DROPPED_HEADER, PrefixEntryJSON, PublishRequest
from ..openapi import error_responses


class PrefixKeyConvertor(Convertor[str]):
    """A prefix key in a path: any characters after ``/prefix/``, slashes and newlines
    included (the ``path`` convertor's ``.*`` stops at a newline, so such a key's route
    did not match: a 404 where DELETE documents 204)."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("prefix_key", PrefixKeyConvertor())  # Starlette's registry: the same name, the same convertor


def entry_json(info: Any) -> dict[str, Any]:
    """A `state_store.PrefixInfo` as the API's document."""
    return {"key": info.key, "tokens": info.tokens, "layers": info.layers, "complete": info.complete,
            "bytes": info.bytes, "tier": info.tier, "last_used": info.last_used}


def match_json(match: Any) -> dict[str, Any]:
    """A `state_store.PrefixMatch` as the API's document."""
    return {"matched": match.matched, "key": match.key, "tokens": match.tokens}


def add_prefix_routes(router: APIRouter, core: CoreAPI) -> None:
    """The prefix cache routes on ``core``."""

    @router.post("/slots/{slot_id}/publish", status_code=201, response_model=PrefixEntryJSON,
                 responses=error_responses(400, 404, 409, 503, 507),
                 summary="Store a slot's state (every layer, equal token counts) as a prefix cache entry")
    async def publish(slot_id: str, body: PublishRequest) -> dict[str, Any]:
        return entry_json(await core.publish(slot_id, body.key))

    @router.get("/prefix/{key:prefix_key}", response_model=PrefixEntryJSON, responses=error_responses(404),
                summary="A prefix cache entry's metadata")
    async def prefix_info(key: str) -> dict[str, Any]:
        return entry_json(await core.prefix_info(key))

    @router.delete("/prefix/{key:prefix_key}", status_code=204, responses=error_responses(400),
                   summary="Remove a prefix cache entry (idempotent: 204 whether or not there was one; "
                           f"the {PREFIX_DROPPED_HEADER} header says which)")
    async def drop_prefix(key: str) -> Response:
        dropped = await core.drop_prefix(key)
        return Response(status_code=204, headers={PREFIX_DROPPED_HEADER: "true" if dropped else "false"})
