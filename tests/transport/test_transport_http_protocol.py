"""`service.http.protocol.KDAHttpConnection` (and the `KDAHttpProtocol` it wraps) and `service.wire.buffers.WarmBuffers`.

The protocol is served here by uvicorn (loop "auto", as ``kda-serve`` runs it) in a thread, in
front of a small ASGI app that reports what it received: the body's length and SHA-256,
how many ``http.request`` messages carried it, and the buffer's address (to see warm reuse).
The real server's side (framing errors as problems, a client leaving mid-body) is in
``test_transport_http_server.py``.
"""
from __future__ import annotations

import hashlib
import json
import socket
import time
from typing import Any, Iterator

import pytest
from transport_helpers import read_response, request_head

from server_harness import uvicorn_in_thread
from service.http.protocol import PROGRESS_S, KDAHttpConnection, declared_length
from service.wire.buffers import MIN_BYTES, WarmBuffers

HELD: list[Any] = []  # bodies the /hold route keeps referenced; cleared by the fixture


async def report_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """POST any path: reads the body with ``receive`` and answers a JSON report of it.
    ``/hold`` also keeps the body referenced; ``/early`` answers 413 without reading it."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/early":
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-length", b"0"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b""})
        return
    parts, messages, empty = [], 0, 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        messages += 1
        if message["body"]:
            parts.append(message["body"])
        else:
            empty += 1
        if not message.get("more_body", False):
            break
    body = parts[0] if len(parts) == 1 else b"".join(parts)  # one part: the buffer itself
    report = {"length": len(body), "sha256": hashlib.sha256(body).hexdigest(), "messages": messages,
              "empty": empty, "address": id(body), "type": type(body).__name__}
    if scope["path"] == "/hold":
        HELD.append(body)
    del parts, body
    payload = json.dumps(report).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """`report_app` behind uvicorn with `KDAHttpConnection`, in a thread, keep-alive 1 s."""
    with uvicorn_in_thread(report_app, KDAHttpConnection, timeout_keep_alive=1) as url:
        yield url
    HELD.clear()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _post(s: socket.socket, path: str, body: bytes | bytearray) -> dict[str, Any]:
    s.sendall(request_head("POST", path, [("Content-Length", str(len(body)))]))
    s.sendall(body)
    status, _, reply = read_response(s)
    assert status == 200, reply
    return json.loads(reply)


def _body(n: int, seed: int) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (n // 32 + 1))[:n]


@pytest.mark.parametrize("n", [0, 1, 65535, 65536, 65537, 100_000_000])
def test_a_body_arrives_whole_and_intact(url, n):
    """Every size, across uvicorn's 64 KiB pause mark and up to 100 MB: the bytes the
    client sent, in one ``http.request`` message after at most a few empty progress ones."""
    body = _body(n, n)
    with _connect(url) as s:
        report = _post(s, "/", body)
    assert report["length"] == n and report["sha256"] == hashlib.sha256(body).hexdigest()
    assert report["messages"] - report["empty"] <= 1  # uvicorn alone: one message per 64 KiB or so


def test_one_connection_reuses_its_warm_buffer_and_never_shows_old_bytes(url):
    """Bodies of one size on one connection land in the same buffer once the first is
    let go, and each time the app sees exactly the new bytes."""
    n = 8 * MIN_BYTES
    with _connect(url) as s:
        reports = [_post(s, "/", _body(n, seed)) for seed in range(4)]
    assert [r["sha256"] for r in reports] == [hashlib.sha256(_body(n, seed)).hexdigest() for seed in range(4)]
    assert len({r["address"] for r in reports[1:]}) == 1 and all(r["type"] == "bytearray" for r in reports)


def test_connections_share_the_servers_warm_buffers(url):
    """The warm buffers are the server's, not a connection's: a body on a new connection
    lands in the buffer a closed one used (so idle connections hold no body memory)."""
    n = 6 * MIN_BYTES
    reports = []
    for seed in range(3):
        with _connect(url) as s:
            reports.append(_post(s, "/", _body(n, seed)))
    assert [r["sha256"] for r in reports] == [hashlib.sha256(_body(n, seed)).hexdigest() for seed in range(3)]
    assert len({r["address"] for r in reports[1:]}) == 1


def test_a_body_still_referenced_is_never_reused(url):
    """The app keeps each body: the next one goes elsewhere and the kept ones never change."""
    n = 4 * MIN_BYTES
    HELD.clear()
    with _connect(url) as s:
        reports = [_post(s, "/hold", _body(n, seed)) for seed in range(3)]
    assert len({r["address"] for r in reports}) == 3
    assert [hashlib.sha256(b).hexdigest() for b in HELD] == [r["sha256"] for r in reports]
    HELD.clear()


def test_a_slow_upload_wakes_the_app_with_progress_and_arrives_intact(url):
    """A body trickling in over ~1 s: the app is woken with empty progress messages (so a
    deadline on the next bytes still sees bytes arriving), then gets it whole."""
    body = _body(400_000, 7)
    with _connect(url) as s:
        s.sendall(request_head("POST", "/", [("Content-Length", str(len(body)))]))
        for start in range(0, len(body), 40_000):
            s.sendall(body[start:start + 40_000])
            time.sleep(0.1)
        status, _, reply = read_response(s)
    report = json.loads(reply)
    assert status == 200 and report["sha256"] == hashlib.sha256(body).hexdigest()
    assert report["empty"] >= 3 and report["messages"] == report["empty"] + 1


def test_a_client_leaving_mid_body_leaves_the_server_serving(url):
    """Half a body then a close: the app is told the client left; the next connection
    is served (and its body is its own, even if it lands in a buffer used before)."""
    n = 16 * MIN_BYTES
    with _connect(url) as s:
        _post(s, "/", _body(n, 1))
        s.sendall(request_head("POST", "/", [("Content-Length", str(n))]) + _body(n // 2, 2))
    time.sleep(0.3)
    with _connect(url) as s:
        report = _post(s, "/", _body(n, 3))
    assert report["sha256"] == hashlib.sha256(_body(n, 3)).hexdigest()


def test_keep_alive_pipelining_and_chunked_bodies_behave_as_uvicorns(url):
    """Two requests sent back to back on one connection are answered in order; a chunked
    body (no Content-Length) is uvicorn's path and arrives intact too."""
    first, second = _body(200_000, 11), _body(70_000, 12)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"abc", b"defgh")) + b"0\r\n\r\n"
    with _connect(url) as s:
        s.sendall(request_head("POST", "/", [("Content-Length", str(len(first)))]) + first
                  + request_head("POST", "/", [("Content-Length", str(len(second)))]) + second
                  + request_head("POST", "/", [("Transfer-Encoding", "chunked")]) + chunked)
        replies = [json.loads(read_response(s)[2]) for _ in range(3)]
    assert [r["sha256"] for r in replies] == [hashlib.sha256(b).hexdigest() for b in (first, second, b"abcdefgh")]


def test_a_request_right_behind_a_whole_body_is_parsed_from_a_clean_state(url):
    """A large body (its bytes copied past the parser) with the next request in the same
    writes, then a third one later: each is answered with exactly its own bytes."""
    first, second, third = _body(3_000_001, 21), _body(17, 22), _body(2_000_000, 23)
    with _connect(url) as s:
        s.sendall(request_head("POST", "/", [("Content-Length", str(len(first)))]) + first
                  + request_head("POST", "/", [("Content-Length", str(len(second)))]) + second)
        replies = [json.loads(read_response(s)[2]) for _ in range(2)]
        replies.append(_post(s, "/", third))
    assert [r["sha256"] for r in replies] == [hashlib.sha256(b).hexdigest() for b in (first, second, third)]


def test_an_idle_connection_closes_after_the_keep_alive_timeout(url):
    with _connect(url) as s:
        _post(s, "/", b"x")
        time.sleep(1.5)
        assert s.recv(1) == b""


def test_a_parser_error_is_a_problem_and_closes_the_connection(url):
    with _connect(url) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, reply = read_response(s)
        assert s.recv(1) == b""
    assert status == 400 and headers["content-type"] == "application/problem+json"
    assert headers["connection"] == "close"
    assert json.loads(reply)["type"] == "urn:kda-serve:problem:bad-request"


def test_declared_length_is_content_length_framing_only():
    assert declared_length([(b"content-length", b"12")]) == 12
    assert declared_length([(b"host", b"x")]) is None
    assert declared_length([(b"transfer-encoding", b"chunked"), (b"content-length", b"5")]) is None


def test_progress_interval_is_well_under_any_body_timeout():
    assert PROGRESS_S <= 0.25


class TestWarmBuffers:
    def test_small_sizes_are_not_kept(self):
        warm = WarmBuffers()
        warm.keep(bytearray(MIN_BYTES - 1))
        assert warm.take(MIN_BYTES - 1) is None

    def test_a_free_buffer_is_resized_in_place(self):
        warm = WarmBuffers()
        buf = bytearray(2 * MIN_BYTES)
        address = id(buf)
        warm.keep(buf)
        del buf
        again = warm.take(2 * MIN_BYTES - 100)
        assert again is not None and id(again) == address and len(again) == 2 * MIN_BYTES - 100

    def test_a_referenced_buffer_is_not_taken(self):
        warm = WarmBuffers()
        buf = bytearray(2 * MIN_BYTES)
        warm.keep(buf)
        assert warm.take(2 * MIN_BYTES) is None  # `buf` still refers to it
        view = memoryview(buf)
        del buf
        assert warm.take(2 * MIN_BYTES) is None  # so does the view
        view.release()
        del view
        assert warm.take(2 * MIN_BYTES) is not None

    def test_a_size_far_from_the_allocation_is_not_served(self):
        warm = WarmBuffers()
        warm.keep(bytearray(8 * MIN_BYTES))
        assert warm.take(16 * MIN_BYTES) is None and warm.take(2 * MIN_BYTES) is None

    def test_only_the_most_recent_are_kept(self):
        warm = WarmBuffers(keep=2)
        for size in (2, 5, 6):
            warm.keep(bytearray(size * MIN_BYTES))
        assert warm.take(2 * MIN_BYTES) is None  # let go: the 5 and 6 MiB ones are too large for it
        assert warm.take(5 * MIN_BYTES) is not None


class _Recorder:
    """A transport that records what is written to it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str) -> str:
        return f"extra {name}"


def test_corked_writes_go_out_joined_in_order_and_large_ones_as_they_are():
    import asyncio

    from service.http.protocol import CorkedWrites

    async def main() -> None:
        raw = _Recorder()
        cork = CorkedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        cork.write(b"HTTP/1.1 200 OK\r\n\r\n")
        cork.write(memoryview(b"abc"))
        assert raw.writes == []  # held
        cork.flush()
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nabc"]
        big = bytes(CorkedWrites.HELD + 1)
        cork.write(b"head")
        cork.write(big)  # what is held first, then the large write as it is
        assert raw.writes[1:] == [b"head", big]
        cork.write(b"tail")
        await asyncio.sleep(0)  # the end of the loop's turn flushes too
        assert raw.writes[-1] == b"tail"
        cork.write(b"late")
        cork.close()  # flushes, then closes
        assert raw.writes[-1] == b"late" and raw.closing
        cork.write(b"gone")
        cork.flush()  # the client left: dropped, not written
        assert raw.writes[-1] == b"late"
        assert cork.get_extra_info("peername") == "extra peername"

    asyncio.run(main())


def test_a_small_response_reaches_the_client_whole_in_one_read(url):
    """The status line, headers and body of a small answer leave in one write."""
    with _connect(url) as s:
        s.sendall(request_head("POST", "/", [("Content-Length", "1")]) + b"x")
        data = s.recv(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["length"] == 1
