"""OpenTelemetry spans of a real server whose process set up the SDK (`traced_server`), the
request ids in its log records, and the same server with OpenTelemetry not importable.
(The shared server of this folder has the API but no tracer provider: `test_request_id`.)"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch
from server_harness import GEOMETRY_ARGS, Server, make_sequence, start_server, wait_for

from kda_client.client import KDAClient

pytest.importorskip("opentelemetry.sdk.trace", reason="the tracing tests need opentelemetry-sdk")

ENTRY = (str(Path(__file__).with_name("traced_server.py")),)
PARENT_TRACE, PARENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, Path]]:
    """A server tracing into a JSON-lines file and logging request ids; (server, spans, log)."""
    folder = tmp_path_factory.mktemp("traced")
    spans, log = folder / "spans.jsonl", folder / "records.log"
    server = start_server(GEOMETRY_ARGS, folder / "kda-serve.log", entry=ENTRY,
                          env={"KDA_TEST_SPANS": str(spans), "KDA_TEST_LOG": str(log)})
    yield server, spans, log
    assert server.stop() == 0, server.log_text()


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _span_of(path: Path, span_id: str) -> dict[str, Any]:
    """The span ``span_id`` once exported (the server ends it after the response is sent)."""
    assert wait_for(lambda: any(s["span_id"] == span_id for s in _spans(path))), _spans(path)
    return next(s for s in _spans(path) if s["span_id"] == span_id)


def _own_span(response: httpx.Response) -> tuple[str, str]:
    _, trace_id, span_id, _ = response.headers["traceparent"].split("-")
    return trace_id, span_id


def test_a_request_is_a_server_span_under_the_clients(traced: tuple[Server, Path, Path]) -> None:
    server, spans, _ = traced
    response = httpx.get(f"{server.url}/slots/nope", headers={"traceparent": PARENT, "X-Request-ID": "t-1"})
    assert response.status_code == 404
    trace_id, span_id = _own_span(response)
    assert trace_id == PARENT_TRACE and span_id != PARENT_SPAN
    span = _span_of(spans, span_id)  # the response's traceparent names the span recorded
    assert span["name"] == "GET /slots/{slot_id}" and span["kind"] == "SERVER"
    assert span["trace_id"] == PARENT_TRACE and span["parent_id"] == PARENT_SPAN
    expected = {"http.request.method": "GET", "url.path": "/slots/nope", "kda.request_id": "t-1",
                "http.route": "/slots/{slot_id}", "http.response.status_code": 404}
    assert expected.items() <= span["attributes"].items(), span["attributes"]
    assert sum(s["kind"] == "SERVER" and s["trace_id"] == PARENT_TRACE for s in _spans(spans)) == 1  # one, not two


def test_a_request_without_a_parent_starts_a_recorded_trace(traced: tuple[Server, Path, Path]) -> None:
    server, spans, _ = traced
    response = httpx.get(f"{server.url}/info")
    trace_id, span_id = _own_span(response)
    span = _span_of(spans, span_id)
    assert span["trace_id"] == trace_id and span["parent_id"] is None
    assert int(response.headers["traceparent"][-2:], 16) & 1  # the sampled flag: it is recorded
    assert span["attributes"]["kda.request_id"] == response.headers["x-request-id"]


def test_prefill_phases_are_child_spans_in_order(traced: tuple[Server, Path, Path]) -> None:
    server, spans, _ = traced
    gen = torch.Generator().manual_seed(5)
    with KDAClient(server.url) as client:
        slot = client.alloc(1)[0]
        try:
            client.prefill(0, [(slot, *make_sequence(70, gen))])
        finally:
            client.free(slot)
    assert wait_for(lambda: any(s["name"] == "POST /prefill" for s in _spans(spans)))
    request = next(s for s in _spans(spans) if s["name"] == "POST /prefill")
    by_id = {s["span_id"]: s for s in _spans(spans)}

    def inside_request(span: dict[str, Any]) -> bool:
        while span["parent_id"] in by_id and span["span_id"] != request["span_id"]:
            span = by_id[span["parent_id"]]
        return span["span_id"] == request["span_id"]

    phases = {s["name"]: s for s in by_id.values()
              if s["name"] in ("decode", "validate", "kernel", "encode") and inside_request(s)}
    assert sorted(phases) == ["decode", "encode", "kernel", "validate"], _spans(spans)
    order = [phases[name] for name in ("decode", "validate", "kernel", "encode")]
    assert all(p["trace_id"] == request["trace_id"] and p["start_ns"] <= p["end_ns"] for p in order)
    assert request["start_ns"] <= order[0]["start_ns"] and order[-1]["end_ns"] <= request["end_ns"]
    assert order[0]["end_ns"] <= order[1]["start_ns"]  # decoded before the core validates
    assert order[2]["end_ns"] <= order[3]["start_ns"]  # the launch ended before encoding


def test_log_records_carry_the_request_id(traced: tuple[Server, Path, Path]) -> None:
    """A record written while a request runs (a client leaving mid-body) has its id and
    trace; one written outside a request has ``-``."""
    server, _, log = traced
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-ID: gone-1\r\ntraceparent: " + PARENT.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
    line = f"gone-1 {PARENT_TRACE} kda_serve.http: client disconnected during POST /prefill"
    assert wait_for(lambda: line in log.read_text()), log.read_text()
    assert any(r.startswith("- - kda_serve.app: kernels warm") for r in log.read_text().splitlines())


def test_without_opentelemetry_the_server_makes_the_trace_context(tmp_path: Path) -> None:
    """The server's tracing cannot import the API (a provider is still set, so FastAPI's own
    spans are recorded): ids and trace context still come back, made by the server, and no
    span of the server's tracing is recorded."""
    spans = tmp_path / "spans.jsonl"
    server = start_server(GEOMETRY_ARGS, tmp_path / "kda-serve.log", entry=ENTRY,
                          env={"KDA_TEST_NO_OTEL": "1", "KDA_TEST_SPANS": str(spans)})
    try:
        response = httpx.get(f"{server.url}/info", headers={"traceparent": PARENT, "X-Request-ID": "plain"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "plain"
        trace_id, span_id = _own_span(response)
        assert trace_id == PARENT_TRACE and span_id != PARENT_SPAN
        assert wait_for(lambda: any(s["name"] == "GET /info" for s in _spans(spans)))  # FastAPI's own
    finally:
        assert server.stop() == 0, server.log_text()
    assert all(s["span_id"] != span_id and "kda.request_id" not in s["attributes"] for s in _spans(spans))
