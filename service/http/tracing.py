"""OpenTelemetry spans of the HTTP requests and of a prefill's phases, when
``opentelemetry-api`` is installed (the ``otel`` extra); without it every function here
does nothing and `service.http.request_id` makes the trace context itself.

Spans go to the process's global tracer provider: kda-serve configures none (no exporter,
no sampler of its own), so with the API alone nothing is recorded; a deployment that
installs the SDK and sets a provider (e.g. through ``opentelemetry-instrument``) gets:

- one SERVER span per request, a child of the client's ``traceparent``, with the
  attribute ``kda.request_id``: FastAPI's own where it makes one, else ours, named
  ``METHOD /route/template`` once routed, with ``http.request.method``, ``url.path``,
  ``http.route`` and ``http.response.status_code`` (an error status for 5xx);
- inside the span of ``POST /prefill`` (under FastAPI's ``fastapi.endpoint`` span where it
  makes one), one span per ``Server-Timing`` phase (`Phase`): ``decode``, ``validate``,
  ``kernel``, ``encode``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from starlette.types import Scope

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    trace = None

_tracer: Any = trace.get_tracer("kda_serve") if trace is not None else None  # follows the provider set later
_propagator: Any = TraceContextTextMapPropagator() if trace is not None else None


@dataclass(frozen=True)
class Phase:
    """One phase of a request: ``name``, ``start_ns`` (``time.time_ns()``) and its length."""

    name: str
    start_ns: int
    seconds: float

    @classmethod
    def ending(cls, name: str, end_ns: int, seconds: float) -> Phase:
        """The phase of ``seconds`` that ended at ``end_ns``."""
        return cls(name, end_ns - round(seconds * 1e9), seconds)


class Stopwatch:
    """Times one phase after another: wall clock starts (for spans), monotonic lengths."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Start the next phase now."""
        self.start_ns = time.time_ns()
        self._start = time.perf_counter()

    def phase(self, name: str) -> Phase:
        """The phase that started at the last `restart` and ends now."""
        return Phase(name, self.start_ns, time.perf_counter() - self._start)


class RequestSpan:
    """The span a request runs in: ``span`` (None without OpenTelemetry); ``own``: made by
    `request_span` (so named and given its status here), else the framework's."""

    def __init__(self, span: Any = None, own: bool = False) -> None:
        self.span = span
        self.own = own

    def traceparent(self) -> Optional[tuple[str, str, str]]:
        """(trace id, span id, flags) in hex of the span when it records, for the response's
        ``traceparent``; None without one (no OpenTelemetry, no provider, not sampled)."""
        if self.span is None or not self.span.is_recording():
            return None
        context = self.span.get_span_context()
        return f"{context.trace_id:032x}", f"{context.span_id:016x}", f"{int(context.trace_flags):02x}"

    def finish(self, scope: Scope, status: int) -> None:
        """Name an own span by the route the request matched and give it the response status."""
        if not self.own:
            return
        route = getattr(scope.get("route"), "path", None)
        if route is not None:
            self.span.update_name(f"{scope['method']} {route}")
            self.span.set_attribute("http.route", route)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(StatusCode.ERROR)


@contextmanager
def request_span(scope: Scope, traceparent: Optional[str], tracestate: Optional[str],
                 request_id: str) -> Iterator[RequestSpan]:
    """The span the request of ``scope`` runs in (current inside). When a server span is
    already recording (FastAPI's own request span, from the versions that make one, or an
    ASGI instrumentation's), that one, given ``kda.request_id``; else a new SERVER span
    under the client's ``traceparent``."""
    if _tracer is None:
        yield RequestSpan()
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attribute("kda.request_id", request_id)
        yield RequestSpan(current)
        return
    carrier = {} if traceparent is None else {"traceparent": traceparent}
    if tracestate is not None:
        carrier["tracestate"] = tracestate
    attributes = {"http.request.method": scope["method"], "url.path": scope["path"], "kda.request_id": request_id}
    with _tracer.start_as_current_span(scope["method"], context=_propagator.extract(carrier), kind=SpanKind.SERVER,
                                       attributes=attributes) as span:
        yield RequestSpan(span, own=True)


def record_phases(phases: Sequence[Phase]) -> None:
    """One span per phase, children of the current span (the request's, or the endpoint's
    inside it), at the phases' times."""
    if _tracer is None:
        return
    for phase in phases:
        span = _tracer.start_span(phase.name, start_time=phase.start_ns)
        span.end(end_time=phase.start_ns + round(phase.seconds * 1e9))
