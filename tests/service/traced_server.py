"""kda-serve as a deployment would trace it, for `test_tracing`: the process sets up
OpenTelemetry (or hides it), and its own log handler, then runs `service.cli.main`.

Environment:
- ``KDA_TEST_SPANS=PATH``: an SDK tracer provider writing each finished span as one JSON
  line to PATH (name, kind, trace and span ids in hex, parent span id, times in ns,
  attributes), exported as the span ends.
- ``KDA_TEST_NO_OTEL=1``: the server's tracing cannot import opentelemetry, as without
  the API installed.
- ``KDA_TEST_LOG=PATH``: the ``kda_serve`` loggers at INFO also write
  ``request_id trace_id logger: message`` lines to PATH, through `RequestIdFilter`.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Sequence


def _hide_opentelemetry() -> None:
    """Make `service.http.tracing`'s imports of opentelemetry fail, as without the API.
    (FastAPI from 0.16x needs the API itself, so it is imported first: only the modules the
    server's tracing needs are then taken away.)"""
    import fastapi  # noqa: F401

    sys.modules["opentelemetry.trace.propagation.tracecontext"] = None  # type: ignore[assignment]  (ImportError)


def _trace_to(path: str) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class JsonLines(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with open(path, "a") as out:
                for span in spans:
                    context = span.get_span_context()
                    out.write(json.dumps({
                        "name": span.name, "kind": span.kind.name,
                        "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
                        "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
                        "start_ns": span.start_time, "end_ns": span.end_time,
                        "status": span.status.status_code.name, "attributes": dict(span.attributes or {}),
                    }) + "\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLines()))
    trace.set_tracer_provider(provider)


def _log_to(path: str) -> None:
    from service.http.request_id import RequestIdFilter

    handler = logging.FileHandler(path)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(request_id)s %(trace_id)s %(name)s: %(message)s"))
    logger = logging.getLogger("kda_serve")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)


if __name__ == "__main__":
    if os.environ.get("KDA_TEST_NO_OTEL"):
        _hide_opentelemetry()
    if spans := os.environ.get("KDA_TEST_SPANS"):
        _trace_to(spans)
    if log := os.environ.get("KDA_TEST_LOG"):
        _log_to(log)
    from service.cli import main

    sys.exit(main())
