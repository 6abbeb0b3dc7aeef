"""Errors the service raises for a request it refuses, each bound to one HTTP status.

Plain Python, no FastAPI: the wire decoders, the validation and the server core raise these,
and `service.http.problem_details` renders them as RFC 9457 problem details. The pool's own errors
(`state_store.PoolFull`, `UnknownSlot`, ...) pass through unchanged and are mapped there too.
"""
from __future__ import annotations

from typing import Any, Optional

PERSISTENCE_UNAVAILABLE = ("the server cannot journal this change to disk, so it did not make it; the pool is "
                           "unchanged")
"""What a request refused for a journal that cannot be written (`state_store.SnapshotError`) is told."""
API_KEY_REQUIRED = "this server requires 'Authorization: Bearer <api key>'"
"""What a request without the API key (where one is set) is told, over HTTP (401) and gRPC."""


class ServiceError(Exception):
    """A refused request. ``detail`` says what was wrong and names the shapes or values seen;
    ``field`` is the request field at fault (``"q"``, ``"sequences[2].length"``), when one is."""

    status = 400
    slug = "bad-request"
    title = "Bad request"

    def __init__(self, detail: str, *, field: Optional[str] = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field

    def extra(self) -> dict[str, Any]:
        """Members added to the problem document besides type, title, status and detail."""
        return {} if self.field is None else {"field": self.field}


class MalformedBody(ServiceError):
    """The body cannot be decoded: bad JSON, bad base64, a bad safetensors container."""

    slug = "malformed-body"
    title = "Malformed request body"


class InvalidRequest(ServiceError):
    """The body decodes, but its content is wrong: shapes, dtypes, lengths, layer, a slot
    named twice, non-finite values, inconsistent gate options."""

    slug = "invalid-request"
    title = "Invalid request"


class SchemaError(ServiceError):
    """The request document does not match its schema (missing or mistyped members)."""

    status = 422
    slug = "schema-error"
    title = "Request does not match the schema"

    def __init__(self, detail: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(detail)
        self.errors = errors

    def extra(self) -> dict[str, Any]:
        return {"errors": self.errors}


class UnsupportedMediaType(ServiceError):
    status = 415
    slug = "unsupported-media-type"
    title = "Unsupported media type"


class NotAcceptable(ServiceError):
    status = 406
    slug = "not-acceptable"
    title = "No acceptable response media type"


class StateLost(ServiceError):
    """A prefill names a slot whose state cannot be trusted (``state_lost``: an update on it
    failed midway, or it advanced after the snapshot a restart restored). Continuing from it
    would be silently wrong; replace its state (PUT) or free it."""

    status = 409
    slug = "state-lost"
    title = "Slot state lost"

    def __init__(self, slot_id: str) -> None:
        super().__init__(f"slot {slot_id!r} is flagged state_lost: its state cannot be trusted (an update on it "
                         "failed, or it advanced after the snapshot the server restarted from); PUT a state into "
                         "it or free it")
        self.slot = slot_id

    def extra(self) -> dict[str, Any]:
        return {"slot": self.slot}


class NotReady(ServiceError):
    """The server is still starting (warming the kernels) or is shutting down."""

    status = 503
    slug = "not-ready"
    title = "Service not ready"


class SharedMemoryUnavailable(ServiceError):
    """The deployment reads no shared memory (a sharded one: regions registered with one
    ingress replica would be unknown to the others), so its region routes have nothing to
    serve."""

    status = 404
    slug = "shared-memory-unavailable"
    title = "No shared memory on this deployment"


class UnknownPrefix(ServiceError):
    """No prefix cache entry has this key (never stored, dropped, or evicted)."""

    status = 404
    slug = "unknown-prefix"
    title = "Unknown prefix key"

    def __init__(self, key: str) -> None:
        super().__init__(f"no prefix cache entry {key!r} (never stored, deleted, or evicted)", field="key")


class PrefixCacheOff(ServiceError):
    """The server keeps no prefix cache (``--prefix-cache-mb 0``), so nothing can be stored."""

    status = 409
    slug = "prefix-cache-off"
    title = "Prefix cache off"


class PrefixConflict(ServiceError):
    """A slot cannot be published as it is: its layers hold different token counts."""

    status = 409
    slug = "prefix-conflict"
    title = "Slot cannot be published"


class PrefixTooLarge(ServiceError):
    """An entry fits in neither tier's budget, or every entry in the way is being restored."""

    status = 507
    slug = "prefix-cache-full"
    title = "Prefix cache has no room"
