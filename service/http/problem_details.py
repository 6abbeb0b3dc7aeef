"""RFC 9457 problem details (``application/problem+json``) for every error the API returns,
and the exception handlers that produce them."""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from state_store import GeometryMismatch, PoolFull, SnapshotError, UnknownSlot

from ..errors import PERSISTENCE_UNAVAILABLE, ServiceError
from ..wire.media import PROBLEM
from .request_id import current_request_id

TYPE_PREFIX = "urn:kda-serve:problem:"
RETRY_AFTER_S = 1
log = logging.getLogger("kda_serve.http")


def problem(status: int, slug: str, detail: str, *, title: Optional[str] = None,
            headers: Optional[dict[str, str]] = None, retry_after: Optional[int] = None,
            **extra: Any) -> JSONResponse:
    """A problem+json response; ``extra`` members (``field``, ``errors``, ...) are added
    when not None. ``request_id``: the current request's (`service.http.request_id`)
    unless given. ``retry_after`` seconds: the ``Retry-After`` header, and the member of
    that name for transports that carry the body without the headers (the framed socket)."""
    extra.setdefault("request_id", current_request_id())
    if retry_after is not None:
        headers = {**(headers or {}), "Retry-After": str(retry_after)}
        extra["retry_after"] = retry_after
    body = {
        "type": TYPE_PREFIX + slug,
        "title": title or HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        **{k: v for k, v in extra.items() if v is not None},
    }
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM)


PAYLOAD_TOO_LARGE = ("payload-too-large", "Request body too large")
_HTTP_NAMES = {413: PAYLOAD_TOO_LARGE}


def _name(status: int) -> tuple[str, str]:
    """(slug, title) of an HTTP-level error (404 route, 405 method, 413 ...)."""
    phrase = HTTPStatus(status).phrase
    return _HTTP_NAMES.get(status, (phrase.lower().replace(" ", "-").replace("'", ""), phrase))


CLOSE = {"Connection": "close"}  # after a 500 the connection is not reused


async def _service_error(_: Request, e: ServiceError) -> JSONResponse:
    return problem(e.status, e.slug, e.detail, title=e.title, headers=CLOSE if e.status == 500 else None,
                   **e.extra())


async def _schema_error(_: Request, e: RequestValidationError) -> JSONResponse:
    errors = [{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in e.errors()]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    detail = f"{'.'.join(map(str, first['loc']))}: {first['msg']} ({len(errors)} error(s))"
    return problem(422, "schema-error", detail, title="Request does not match the schema", errors=errors)


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    slug, title = _name(e.status_code)
    return problem(e.status_code, slug, str(e.detail), title=title, headers=e.headers)


async def _pool_full(_: Request, e: PoolFull) -> JSONResponse:
    return problem(503, "pool-full", str(e), title="State pool full",
                   retry_after=RETRY_AFTER_S, requested=e.requested, free=e.free)


async def _unknown_slot(_: Request, e: UnknownSlot) -> JSONResponse:
    return problem(404, "unknown-slot", str(e), title="Unknown slot", slot=str(e.slot_id))


async def _geometry_mismatch(_: Request, e: GeometryMismatch) -> JSONResponse:
    return problem(400, "geometry-mismatch", str(e), title="State does not fit the pool", field="state")


async def _persistence(_: Request, e: SnapshotError) -> JSONResponse:
    log.error("refused a request: %s", e)
    return problem(503, "persistence-unavailable", PERSISTENCE_UNAVAILABLE, title="Persistence unavailable",
                   retry_after=RETRY_AFTER_S)


async def _client_disconnect(request: Request, _: ClientDisconnect) -> JSONResponse:
    log.info("client disconnected during %s %s; nothing was changed", request.method, request.url.path)
    return problem(400, "client-disconnected", "the client disconnected before the body was complete")


async def _internal(_: Request, e: Exception) -> JSONResponse:
    # Starlette re-raises after this response, so the server logs the traceback once.
    return problem(500, "internal-error", f"internal error ({type(e).__name__}); the server log has details",
                   headers=CLOSE)


_HANDLERS: dict[type[BaseException], Callable[[Any, Any], Awaitable[JSONResponse]]] = {
    ServiceError: _service_error, RequestValidationError: _schema_error, StarletteHTTPException: _http_error,
    PoolFull: _pool_full, UnknownSlot: _unknown_slot, GeometryMismatch: _geometry_mismatch,
    SnapshotError: _persistence, ClientDisconnect: _client_disconnect, Exception: _internal,
}


def install_problem_handlers(app: FastAPI) -> None:
    """Route every error to a problem+json response (the catch-all should never fire)."""
    for cls, handler in _HANDLERS.items():
        app.add_exception_handler(cls, handler)


async def render_problem(e: Exception) -> tuple[int, bytes]:
    """(status, problem+json body) of ``e`` as the app's handlers answer it, for a front end
    outside the ASGI app (`service.framed`): the handler of the nearest class along its
    hierarchy."""
    handler = next(_HANDLERS[cls] for cls in type(e).__mro__ if cls in _HANDLERS)
    response = await handler(None, e)
    return response.status_code, bytes(response.body)
