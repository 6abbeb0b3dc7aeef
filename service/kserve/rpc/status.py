"""The service's errors as gRPC status codes, mapped from the REST table, with the same
messages as the HTTP problem details (``detail``) and ``{"error": ...}`` bodies.

400, 415, 422 -> INVALID_ARGUMENT; 401 -> UNAUTHENTICATED; 404 -> NOT_FOUND; 408 ->
DEADLINE_EXCEEDED; 409 (state_lost) -> FAILED_PRECONDITION; 413 and 503 (pool full,
persistence unavailable) -> RESOURCE_EXHAUSTED; not ready (warming) -> UNAVAILABLE.
Methods not implemented: UNIMPLEMENTED. A new call while the server stops: UNAVAILABLE
(`ShuttingDown`). Anything else is a bug: INTERNAL, and the log has the traceback.

A message travels in the ``grpc-message`` trailer, percent-encoded (up to 3 bytes a byte),
and clients drop a call whose trailers pass their metadata limit (grpcio: 8 KiB) with a
RESOURCE_EXHAUSTED of their own. A message echoes what the request sent (a model name, a
datatype, parameter names), of any length over gRPC, so it is cut to `MESSAGE_MAX_BYTES`.
"""
from __future__ import annotations

import logging

import grpc

from state_store import GeometryMismatch, PoolFull, SnapshotError, UnknownSlot

from ...errors import API_KEY_REQUIRED, PERSISTENCE_UNAVAILABLE, NotReady, ServiceError

log = logging.getLogger("kda_serve.grpc")
Code = grpc.StatusCode
MESSAGE_MAX_BYTES = 2048  # UTF-8; at most 6 KiB percent-encoded
BY_HTTP_STATUS: dict[int, grpc.StatusCode] = {
    400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 404: Code.NOT_FOUND, 408: Code.DEADLINE_EXCEEDED,
    409: Code.FAILED_PRECONDITION, 413: Code.RESOURCE_EXHAUSTED, 415: Code.INVALID_ARGUMENT,
    422: Code.INVALID_ARGUMENT, 503: Code.RESOURCE_EXHAUSTED,
}


class Unauthenticated(ServiceError):
    """A call without ``authorization: Bearer <api key>`` metadata, where a key is set."""

    status = 401
    slug = "unauthorized"
    title = "Unauthorized"

    def __init__(self) -> None:
        super().__init__(API_KEY_REQUIRED)


class ShuttingDown(Exception):
    """A new call (or stream) after the server was asked to stop."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: reconnect to another instance")


class Unimplemented(Exception):
    """A method of the service this server does not implement."""

    def __init__(self, method: str) -> None:
        super().__init__(f"kda-serve does not implement {method}")


def bounded(message: str) -> str:
    """``message``, cut to at most `MESSAGE_MAX_BYTES` of UTF-8 (at a character) with a
    note of how much was cut; a lone surrogate (JSON parameters may hold one) as ``\\udc80``."""
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= MESSAGE_MAX_BYTES:
        return data.decode("utf-8")
    note = f" ... ({len(data)} bytes, cut)"
    head = data[:MESSAGE_MAX_BYTES - len(note)].decode("utf-8", "ignore")
    return head + note


def rpc_status(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call that raised ``e`` ends with (`bounded`)."""
    code, message = _status(e)
    return code, bounded(message)


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, Unimplemented):
        return Code.UNIMPLEMENTED, str(e)
    if isinstance(e, ShuttingDown):
        return Code.UNAVAILABLE, str(e)
    if isinstance(e, NotReady):
        return Code.UNAVAILABLE, e.detail
    if isinstance(e, ServiceError):
        return BY_HTTP_STATUS.get(e.status, Code.INVALID_ARGUMENT if e.status < 500 else Code.INTERNAL), e.detail
    if isinstance(e, PoolFull):
        return Code.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, UnknownSlot):
        return Code.NOT_FOUND, str(e)
    if isinstance(e, GeometryMismatch):
        return Code.INVALID_ARGUMENT, str(e)
    if isinstance(e, SnapshotError):
        log.error("refused a request: %s", e)
        return Code.RESOURCE_EXHAUSTED, PERSISTENCE_UNAVAILABLE
    log.error("internal error in a gRPC call", exc_info=e)
    return Code.INTERNAL, f"internal error ({type(e).__name__}); the server log has details"
