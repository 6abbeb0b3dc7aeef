"""Request ids and W3C trace context on every response of a real server: REST, /v2,
errors from the routes, the middleware and the HTTP protocol itself."""
from __future__ import annotations

import re
import socket
from typing import Any

import httpx
import pytest
from server_harness import MAX_BODY_MB, Server, make_sequence

from kda_client.client import KDAClient
from service.http.request_id import parse_traceparent
from service.wire.media import PROBLEM
from service.wire.tensors import tensor_to_json

UUID_HEX = re.compile(r"[0-9a-f]{32}")
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _request_id(response: httpx.Response) -> str:
    rid = response.headers.get("x-request-id")
    assert rid, (response.status_code, dict(response.headers))
    return rid


def test_a_request_without_an_id_gets_a_new_one(server: Server) -> None:
    first = httpx.get(f"{server.url}/info")
    second = httpx.get(f"{server.url}/info")
    assert first.status_code == second.status_code == 200
    assert UUID_HEX.fullmatch(_request_id(first)) and UUID_HEX.fullmatch(_request_id(second))
    assert _request_id(first) != _request_id(second)


@pytest.mark.parametrize("path", ["/info", "/health/ready", "/metrics", "/v2/health/live", "/v2/models/kda"])
def test_the_clients_id_is_echoed(server: Server, path: str) -> None:
    response = httpx.get(server.url + path, headers={"X-Request-ID": "client-7f3a:batch/12"})
    assert response.status_code == 200
    assert _request_id(response) == "client-7f3a:batch/12"


@pytest.mark.parametrize("bad", ["has space", "x" * 129, "quote\"d", "ünï"])
def test_an_id_that_is_not_a_plain_token_is_replaced(server: Server, bad: str) -> None:
    response = httpx.get(f"{server.url}/info", headers={"X-Request-ID": bad.encode("utf-8")})
    assert response.status_code == 200
    assert UUID_HEX.fullmatch(_request_id(response))


def _problem_with_id(response: httpx.Response, status: int, request_id: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert _request_id(response) == request_id
    doc = response.json()
    assert doc["request_id"] == request_id, doc
    return doc


def test_problems_of_routes_carry_the_id(server: Server) -> None:
    with httpx.Client(base_url=server.url, headers={"X-Request-ID": "r-404"}) as http:
        _problem_with_id(http.get("/slots/no-such-slot"), 404, "r-404")  # a core error
        _problem_with_id(http.post("/slots", json={"count": "two"}), 422, "r-404")  # the schema
        _problem_with_id(http.delete("/info"), 405, "r-404")  # routing
        _problem_with_id(http.get("/nowhere"), 404, "r-404")


def test_problems_of_the_middleware_carry_the_id(server: Server) -> None:
    too_big = b"x" * (MAX_BODY_MB * (1 << 20) + 1)
    response = httpx.post(f"{server.url}/prefill", content=too_big,
                          headers={"content-type": "application/json", "X-Request-ID": "r-413"})
    _problem_with_id(response, 413, "r-413")


def test_a_problem_with_a_generated_id_carries_it(server: Server) -> None:
    response = httpx.get(f"{server.url}/slots/no-such-slot")
    doc = _problem_with_id(response, 404, _request_id(response))
    assert UUID_HEX.fullmatch(doc["request_id"])


def test_v2_errors_carry_the_id_in_their_header(server: Server) -> None:
    response = httpx.get(f"{server.url}/v2/models/nope", headers={"X-Request-ID": "kserve-1"})
    assert response.status_code == 404 and "error" in response.json()
    assert _request_id(response) == "kserve-1"


def test_a_protocol_refusal_carries_a_new_id(server: Server) -> None:
    """431 comes from the HTTP protocol before the app runs: a fresh id, header and body."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (128 * 1024) + b"\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head
    header = re.search(rb"(?im)^x-request-id: *([0-9a-f]{32})\r?$", head)
    assert header is not None, head
    assert httpx.Response(431, content=body).json()["request_id"] == header.group(1).decode()


def test_prefill_responses_carry_the_id(server: Server, gen: Any) -> None:
    with KDAClient(server.url) as client:
        slot = client.alloc(1)[0]
        try:
            body = {"layer": 0, "sequences": [{"slot": slot, "length": 3}],
                    **{name: tensor_to_json(t) for name, t in zip(("q", "k", "v", "g", "beta"), make_sequence(3, gen))}}
            response = httpx.post(f"{server.url}/prefill", json=body, headers={"X-Request-ID": "p-1"})
            assert response.status_code == 200, response.text
            assert _request_id(response) == "p-1"
            assert "server-timing" in response.headers
        finally:
            client.free(slot)


def test_a_traceparent_is_continued_by_a_child_span(server: Server) -> None:
    response = httpx.get(f"{server.url}/info", headers={"traceparent": PARENT, "tracestate": "vendor=1"})
    match = TRACEPARENT.fullmatch(response.headers["traceparent"])
    assert match is not None, response.headers["traceparent"]
    assert match.group(1) == "4bf92f3577b34da6a3ce929d0e0e4736"  # the client's trace
    assert match.group(2) not in ("00f067aa0ba902b7", "0" * 16)  # a span of the server's own
    assert match.group(3) == "01"
    assert response.headers["tracestate"] == "vendor=1"


@pytest.mark.parametrize("parent", [None, "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
                                    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"])
def test_without_a_valid_traceparent_a_new_trace_starts(server: Server, parent: Any) -> None:
    headers = {} if parent is None else {"traceparent": parent, "tracestate": "vendor=1"}
    response = httpx.get(f"{server.url}/slots/nope", headers=headers)
    assert response.status_code == 404
    match = TRACEPARENT.fullmatch(response.headers["traceparent"])
    assert match is not None and match.group(1) not in ("4bf92f3577b34da6a3ce929d0e0e4736", "0" * 32)
    assert "tracestate" not in response.headers  # it belongs to a trace the server did not continue


@pytest.mark.parametrize("value, valid", [
    (PARENT, True),
    (PARENT.upper(), False),  # hex digits are lowercase
    (PARENT + "-more", False),  # version 00 has four fields
    ("01" + PARENT[2:] + "-more", True),  # a later version may have more
    (PARENT[:-3] + "-1", False),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", False),
])
def test_traceparent_parsing(value: str, valid: bool) -> None:
    assert (parse_traceparent(value) is not None) is valid
