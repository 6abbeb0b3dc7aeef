"""Connections cannot be held open for free: a body has a total deadline (not only a gap
timeout), headers have a deadline and a size limit, a connection must start its first
request soon, an ``Upgrade`` is refused cleanly (problem+json, never a hang or a text/plain
403), and a ``Transfer-Encoding`` other than ``chunked`` is 501. Each over raw sockets to a
live server with short limits; the server serves normally afterwards.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from reliability_helpers import GEOMETRY_ARGS, PROBLEM, connect, read_response, request_head, start_server

BODY_DEADLINE_S = 2.0
HEADER_TIMEOUT_S = 1.0
MAX_HEADER_KB = 16
FIRST_REQUEST_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = start_server([*GEOMETRY_ARGS, "--body-deadline-s", str(BODY_DEADLINE_S), "--body-timeout-s", "30",
                        "--header-timeout-s", str(HEADER_TIMEOUT_S), "--max-header-kb", str(MAX_HEADER_KB),
                        "--first-request-timeout-s", str(FIRST_REQUEST_S)],
                       tmp_path_factory.mktemp("connections") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


def _dribble(s: socket.socket, period: float, stop: threading.Event) -> threading.Thread:
    """Send one byte every ``period`` seconds until ``stop`` or the socket fails."""
    def run() -> None:
        while not stop.wait(period):
            try:
                s.sendall(b"a")
            except OSError:
                return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _closed(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` (EOF or reset) within ``within`` seconds."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionError:
        return True
    except socket.timeout:
        return False


def _problem(body: bytes, status: int, slug: str) -> dict[str, Any]:
    doc = json.loads(body)
    assert doc["status"] == status and doc["type"].endswith(":" + slug), doc
    return doc


def test_a_body_dribbled_a_byte_at_a_time_meets_the_total_deadline(server: Any) -> None:
    """One byte every 0.3 s never trips the 30 s gap timeout; the 2 s total does: 408."""
    s = connect(server.url, timeout=15)
    stop = threading.Event()
    try:
        s.sendall(request_head("POST", "/prefill", [("Content-Type", "application/json"), ("Content-Length", "1000")]))
        _dribble(s, 0.3, stop)
        start = time.monotonic()
        status, headers, body = read_response(s)
        took = time.monotonic() - start
        assert status == 408 and headers["content-type"] == PROBLEM, (status, body)
        assert "--body-deadline-s" in _problem(body, 408, "request-timeout")["detail"]
        assert BODY_DEADLINE_S - 0.5 < took < BODY_DEADLINE_S + 3, took
        assert headers.get("connection") == "close" and _closed(s, 5)
    finally:
        stop.set()
        s.close()


def test_headers_dribbled_a_byte_at_a_time_meet_the_header_deadline(server: Any) -> None:
    s = connect(server.url, timeout=15)
    stop = threading.Event()
    try:
        s.sendall(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        _dribble(s, 0.2, stop)
        start = time.monotonic()
        status, headers, body = read_response(s)
        assert status == 408 and headers["content-type"] == PROBLEM, (status, body)
        assert "--header-timeout-s" in _problem(body, 408, "request-timeout")["detail"]
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 3
        assert _closed(s, 5)
    finally:
        stop.set()
        s.close()


@pytest.mark.parametrize("size_kb", [MAX_HEADER_KB * 2, 48 * 1024])
def test_headers_over_the_size_limit_are_431_before_they_are_all_read(server: Any, size_kb: int) -> None:
    """A header past ``--max-header-kb`` is refused as it arrives: 431, connection closed,
    and the server's memory never holds the 48 MiB a client sends."""
    s = connect(server.url, timeout=15)
    try:
        s.sendall(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        chunk, sent = b"b" * 65536, 0
        try:
            while sent < size_kb * 1024:
                s.sendall(chunk[:min(len(chunk), size_kb * 1024 - sent)])
                sent += len(chunk)
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass  # the server refused and closed before the end
        status, headers, body = read_response(s)
        assert status == 431 and headers["content-type"] == PROBLEM, (status, body)
        assert "--max-header-kb" in _problem(body, 431, "request-header-fields-too-large")["detail"]
        assert _closed(s, 5)
    finally:
        s.close()


def test_connections_that_never_send_a_byte_are_closed(server: Any) -> None:
    sockets = [connect(server.url, timeout=10) for _ in range(200)]
    try:
        time.sleep(FIRST_REQUEST_S + 1.0)
        assert all(_closed(s, 3) for s in sockets)
    finally:
        for s in sockets:
            s.close()


def test_a_prompt_request_is_not_cut_by_the_first_request_timeout(server: Any) -> None:
    """A connection that sends its request in time is served, and keep-alive works after
    (the idle time between requests is uvicorn's keep-alive timeout, 5 s)."""
    s = connect(server.url, timeout=10)
    try:
        time.sleep(FIRST_REQUEST_S / 2)
        for _ in range(3):
            s.sendall(request_head("GET", "/health/live", []))
            status, _, _ = read_response(s)
            assert status == 200
            time.sleep(FIRST_REQUEST_S * 1.5)  # longer than the first-request limit, shorter than keep-alive
    finally:
        s.close()


@pytest.mark.parametrize("method, path, extra", [
    ("POST", "/prefill", [("Content-Type", "application/json"), ("Content-Length", "2")]),
    ("GET", "/", [("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]),
    ("GET", "/v2/health/live", [("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]),
])
def test_an_upgrade_is_refused_with_a_problem(server: Any, method: str, path: str, extra: list) -> None:
    s = connect(server.url, timeout=10)
    try:
        s.sendall(request_head(method, path, [("Connection", "Upgrade"), ("Upgrade", "websocket"), *extra])
                  + (b"{}" if method == "POST" else b""))
        status, headers, body = read_response(s)
        assert status == 400 and headers["content-type"] == PROBLEM, (status, headers, body)
        assert "upgrade" in _problem(body, 400, "upgrade-not-supported")["detail"].lower()
        assert _closed(s, 5)
    finally:
        s.close()


@pytest.mark.parametrize("path, media", [("/prefill", PROBLEM), ("/v2/models/kda/infer", "application/json")])
def test_a_transfer_coding_other_than_chunked_is_501(server: Any, path: str, media: str) -> None:
    s = connect(server.url, timeout=10)
    try:
        s.sendall(request_head("POST", path, [("Content-Type", "application/json"),
                                              ("Transfer-Encoding", "gzip, chunked")]) + b"2\r\n{}\r\n0\r\n\r\n")
        status, headers, body = read_response(s)
        assert status == 501 and headers["content-type"] == media, (status, body)
        text = json.loads(body)["detail" if media == PROBLEM else "error"]
        assert "gzip" in text and "chunked" in text
        assert headers.get("connection") == "close" and _closed(s, 5)
    finally:
        s.close()


def test_the_server_serves_normally_after_all_of_it(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        slot = c.post("/slots").json()["slots"][0]
        assert c.get(f"/slots/{slot}").status_code == 200
        assert c.delete(f"/slots/{slot}").status_code == 204
        assert c.get("/health/ready").status_code == 200
