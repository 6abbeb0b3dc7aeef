"""Request ids and W3C trace context of every HTTP request.

`RequestIdMiddleware` (outermost in `service.http.rest_app.create_rest_app`, so the single
server, ``/v2`` and the Ray Serve ingress all wear it) gives each request:

- a request id: the client's ``X-Request-ID`` when it is a plain token (1 to 128 of
  ``A-Z a-z 0-9 . _ ~ : / + = @ -``), else a new uuid4 in hex. It is echoed in the
  response's ``X-Request-ID``, is the ``request_id`` member of problem+json bodies
  (`service.http.problem_details.problem`), and is the ``request_id`` of every log record
  written while the request runs (`RequestIdFilter`);
- a ``traceparent`` (W3C Trace Context, version 00): a child of the client's, with the same
  trace id and a span id of this server's, or a new trace when the client sent none (or
  an invalid one). With OpenTelemetry installed and a tracer provider recording, the child
  is the request's server span (`service.http.tracing`); ``tracestate`` is echoed as sent.

The id lives in a context variable: the route, the exception handlers and the middleware
inside this one run in the request's context, and threads started by ``to_thread`` copy it.
"""
from __future__ import annotations

import logging
import re
import secrets
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import tracing

REQUEST_ID_HEADER = "x-request-id"
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
_TOKEN = re.compile(r"[A-Za-z0-9._~:/+=@-]{1,128}")
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


@dataclass(frozen=True)
class TraceParent:
    """A W3C ``traceparent``: ``trace_id`` (32 hex digits), ``span_id`` (16), ``flags`` (2)."""

    trace_id: str
    span_id: str
    flags: str

    def header(self) -> str:
        """The version 00 header value."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    def child(self) -> TraceParent:
        """A span of this server under this one: same trace and flags, a new span id."""
        return TraceParent(self.trace_id, _new_span_id(), self.flags)


@dataclass(frozen=True)
class RequestContext:
    """The request being answered: its id and this server's span of its trace."""

    request_id: str
    traceparent: TraceParent


_current: ContextVar[Optional[RequestContext]] = ContextVar("kda_serve_request", default=None)


def current_request_id() -> Optional[str]:
    """The id of the request being answered in this context (None outside a request)."""
    context = _current.get()
    return None if context is None else context.request_id


def new_request_id() -> str:
    """A fresh request id: a uuid4 as 32 hex digits."""
    return uuid.uuid4().hex


def request_id_of(value: Optional[str]) -> str:
    """The client's ``X-Request-ID`` when it is a plain token, else a new id (an id with
    spaces, quotes or control characters is not written into logs and headers)."""
    return value if value is not None and _TOKEN.fullmatch(value) else new_request_id()


def _new_span_id() -> str:
    return secrets.token_hex(8)


def parse_traceparent(value: Optional[str]) -> Optional[TraceParent]:
    """The ``traceparent`` header by the W3C rules (None when absent or invalid): version
    ``ff`` and all-zero ids are invalid; version 00 has exactly four fields; a later version
    may carry more after a ``-``, which a version 00 parser ignores."""
    if value is None:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return TraceParent(trace_id, span_id, flags)


def new_trace() -> TraceParent:
    """The root of a new trace (not sampled: no caller asked for it to be recorded)."""
    return TraceParent(secrets.token_hex(16), _new_span_id(), "00")


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` to every record (``-`` outside a request), for
    log formats (``%(request_id)s``) and structured logs. Attach it to a handler, so it
    sees the records of every logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _current.get()
        record.request_id = "-" if context is None else context.request_id
        record.trace_id = "-" if context is None else context.traceparent.trace_id
        return True


class RequestIdMiddleware:
    """Sets the request's `RequestContext` for everything inside it, runs the request in
    an OpenTelemetry server span when tracing is on (`service.http.tracing`), and adds
    ``X-Request-ID``, ``traceparent`` (and ``tracestate``) to its response. Add it
    outermost, so the responses of the other middleware carry them too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        parent = parse_traceparent(headers.get(TRACEPARENT_HEADER))
        state = headers.get(TRACESTATE_HEADER) if parent is not None else None
        request_id = request_id_of(headers.get(REQUEST_ID_HEADER))
        with tracing.request_span(scope, parent and parent.header(), state, request_id) as span:
            own = span.traceparent()
            if own is not None:
                traceparent = TraceParent(*own)
            else:
                traceparent = parent.child() if parent is not None else new_trace()
            token = _current.set(RequestContext(request_id, traceparent))
            status = 500

            async def tagged(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    out = MutableHeaders(raw=list(message["headers"]))
                    out[REQUEST_ID_HEADER] = request_id
                    out[TRACEPARENT_HEADER] = traceparent.header()
                    if state is not None:
                        out[TRACESTATE_HEADER] = state
                    message = {**message, "headers": out.raw}
                await send(message)

            try:
                await self.app(scope, receive, tagged)
            finally:
                span.finish(scope, status)
                _current.reset(token)
