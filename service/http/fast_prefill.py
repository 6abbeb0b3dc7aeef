"""`PrefillFastPath`: ``POST /prefill`` handed straight to its route's endpoint, past
FastAPI's routing.

Routing a request through FastAPI (the router's match over every route, the route's
request-response wrapper, its exit stack and dependency solving) cost ~0.25 ms of a
one-token prefill on a 2-core machine, more than the whole ``GET /health/live`` handler
(bench/RESULTS.md, issue 19). /prefill's endpoint takes nothing but the request, so none
of that machinery does anything for it.

This middleware is the innermost of the app's own (inside the body limit, the metrics, the
request ids and the error middleware), so every guarantee they give holds as before. It
calls the endpoint FastAPI would have called, with the same `Request`, marks the scope
with the same route (its metrics label and span name), and renders an exception exactly
as Starlette's ``ExceptionMiddleware`` would: through the app's exception handlers found
along the exception's class hierarchy (the catch-all ``Exception`` handler excepted: that
one belongs to the error middleware outside, as in Starlette). Everything else, other
paths and methods, an app mounted below a root path, and any request FastAPI's own
OpenTelemetry instrumentation follows (its spans and metrics are named by the route its
router selects), goes through FastAPI unchanged.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping, Optional

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Handler = Callable[[Request, Exception], Awaitable[Response]]
FASTAPI_TELEMETRY = "fastapi.telemetry"
"""The scope key under which FastAPI's own OpenTelemetry instrumentation (when a provider is
configured) follows a request; its spans and metrics are named by the route FastAPI selects."""


class PrefillFastPath:
    """See the module docstring. ``route``: the app's ``POST /prefill`` route;
    ``handlers``: the app's exception handlers (``app.exception_handlers``, read per
    error so handlers added later count)."""

    def __init__(self, app: ASGIApp, route: APIRoute, handlers: Mapping[Any, Handler]) -> None:
        self.app = app
        self.route = route
        self.endpoint: Callable[[Request], Awaitable[Response]] = route.endpoint
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] != self.route.path or scope["method"] != "POST"
                or scope.get("root_path") or scope.get(FASTAPI_TELEMETRY) is not None):
            return await self.app(scope, receive, send)
        scope["route"] = self.route
        scope["endpoint"] = self.endpoint
        scope["path_params"] = {}
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        request = Request(scope, receive, tracked)
        try:
            response = await self.endpoint(request)
            await response(scope, receive, tracked)
        except Exception as e:
            handler = self._handler(e)
            if handler is None:
                raise
            if started:
                raise RuntimeError("Caught handled exception, but response already started.") from e
            response = await handler(request, e)
            await response(scope, receive, tracked)

    def _handler(self, e: Exception) -> Optional[Handler]:
        """The handler Starlette's ExceptionMiddleware would pick for ``e``: by status code
        for an HTTPException, else the first class along its hierarchy (``Exception``
        itself excepted)."""
        if isinstance(e, HTTPException) and e.status_code in self.handlers:
            return self.handlers[e.status_code]
        for cls in type(e).__mro__:
            if cls is Exception:
                return None
            if cls in self.handlers:
                return self.handlers[cls]
        return None
