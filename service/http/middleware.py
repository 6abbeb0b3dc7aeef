"""ASGI middleware around every route: metrics, API-key check, body-size limit and timeout.

Pure ASGI (no BaseHTTPMiddleware): bodies stream through untouched and handlers are never
cancelled by a wrapper.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.metrics import UNMATCHED_ROUTE, Metrics
from ..errors import API_KEY_REQUIRED
from .problem_details import PAYLOAD_TOO_LARGE, problem

log = logging.getLogger("kda_serve.http")

OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"})
"""The only paths served without the API key: the liveness and readiness probes (ours and
KServe v2's), which orchestrators call without credentials. Anything else, unknown paths
included, is 401 without the key, so nothing about the API shows."""


class InternalErrors:
    """An exception that escapes a route (a bug: every refusal is a ServiceError with its
    own 4xx) becomes a 500 problem with ``Connection: close``, logged once with its
    traceback: the server then closes the connection, so a keep-alive client's next request
    goes out on a fresh one. Add it inside `ProtocolErrors` (which gives ``/v2`` its
    ``{"error"}`` form) and outside the metrics (which count the 500). An exception after
    the response started cannot be answered: it propagates, and uvicorn closes the
    connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:
                raise
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            response = problem(500, "internal-error", f"internal error ({type(e).__name__}); the server log has "
                               "details", headers={"Connection": "close"})
            await response(scope, receive, send)


def route_label(scope: Scope) -> str:
    """The route template a request matched (``/slots/{slot_id}``), ``unmatched`` when none
    did. FastAPI's API routes name themselves in the scope; the app's other routes (the
    docs, ``/openapi.json``) are found by matching the request against the app's routes."""
    route = scope.get("route")
    if route is None:
        app = scope.get("app")
        route = next((r for r in getattr(app, "routes", ()) if r.matches(scope)[0] == Match.FULL), None)
    return getattr(route, "path", UNMATCHED_ROUTE)


class MetricsMiddleware:
    """Counts requests and errors by route template (e.g. ``/slots/{slot_id}``), method
    and status, times them, and counts those in flight. Unmatched paths share the route
    label ``unmatched``."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], Metrics]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        status = 500  # if the app raises before responding
        m = self.metrics()
        m.in_flight.inc()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            m.in_flight.dec()
            labels = (route_label(scope), scope["method"])
            m.requests.labels(*labels, str(status)).inc()
            if status >= 400:
                m.errors.labels(*labels, str(status)).inc()
            m.latency.labels(*labels).observe(time.monotonic() - start)


class AuthMiddleware:
    """``Authorization: Bearer <api_key>`` on every path but the health probes
    (`OPEN_PATHS`), compared in constant time; 401 problem+json otherwise."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self.key)):
                response = problem(401, "unauthorized", API_KEY_REQUIRED,
                                   headers={"WWW-Authenticate": 'Bearer realm="kda-serve"'})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses bodies over ``max_bytes``: from Content-Length before reading a byte (413,
    and the connection is closed), and by counting while reading (HTTP 413 raised from
    ``receive``, rendered by the app's handlers). A body whose next bytes take longer than
    ``timeout_s`` to arrive (a client that announced more than it sends, or stalls), or
    that is not complete ``deadline_s`` after the request's headers (a client dribbling a
    byte now and then), is refused the same way with 408, so a slow upload holds no handler
    for long. A ``Transfer-Encoding`` other than ``chunked`` alone is 501 (the server
    decodes no other coding), before the body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, deadline_s: float = 120.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = time.monotonic() + self.deadline_s
        headers = Headers(scope=scope)
        codings = [c.strip().lower() for value in headers.getlist("transfer-encoding") for c in value.split(",")]
        if codings and codings != ["chunked"]:
            response = problem(501, "not-implemented", f"Transfer-Encoding {', '.join(codings)!r}: this server "
                               "decodes only 'chunked'; send the body uncompressed", headers={"Connection": "close"})
            return await response(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                response = problem(400, "bad-content-length", f"Content-Length {declared!r} is not a byte count",
                                   headers={"Connection": "close"})
                return await response(scope, receive, send)
            if int(declared) > self.max_bytes:
                slug, title = PAYLOAD_TOO_LARGE
                response = problem(413, slug, self._detail(int(declared)), title=title,
                                   headers={"Connection": "close"})
                return await response(scope, receive, send)
        received = 0
        complete = False

        async def counted() -> Message:
            nonlocal received, complete
            if complete:  # after the body: a wait for the client to disconnect, with no deadline
                return await receive()
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                async with asyncio.timeout(min(self.timeout_s, left)):  # no task per read, as wait_for makes
                    message = await receive()
            except TimeoutError:
                if left <= self.timeout_s:
                    detail = (f"the request body did not arrive within {self.deadline_s:g} s ({received} bytes "
                              "received; --body-deadline-s)")
                else:
                    detail = (f"no request body bytes arrived for {self.timeout_s:g} s after the {received} "
                              "received (--body-timeout-s)")
                raise HTTPException(408, detail, headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._detail(received), headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)

    def _detail(self, size: int) -> str:
        return f"request body of {size} bytes or more exceeds the {self.max_bytes}-byte limit (--max-body-mb)"
