"""`kda_client.transport.StdlibTransport`, the sync client's transport for ``http://``:
bodies sent as memoryviews, responses read whole, connections kept alive and reused,
httpx's timeouts and exceptions. Against a small stdlib HTTP/1.1 server in a thread that
records what it saw (the client's port, headers, the body's digest) and misbehaves on
request (slow, closing every connection, refusing a body early)."""
from __future__ import annotations

import hashlib
import http.server
import json
import time
from typing import Any, Iterator

import httpx
import pytest

from server_harness import free_port
from transport_helpers import serving
from kda_client.client import KDAClient
from kda_client.transport import StdlibTransport

BIG = bytes(range(256)) * (5 * 4096 + 7)  # 5 MB and a bit: several socket reads


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, close: bool = False, chunked: bool = False) -> None:
        self.send_response(status)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        if chunked:
            for start in range(0, len(body), 100_000):
                piece = body[start:start + 100_000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append({"port": self.client_address[1], "authorization": self.headers.get("authorization")})
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/hangup":  # answers as if keeping the connection, then closes it
            self._reply(200, b"{}")
            self.close_connection = True
            return
        if self.path in ("/big", "/chunked"):
            self._reply(200, BIG, chunked=self.path == "/chunked")
            return
        self._reply(200, json.dumps({"ok": True}).encode())

    def _read_chunked(self) -> bytes:
        body = b""
        while size := int(self.rfile.readline().strip(), 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        self.rfile.readline()
        return body

    def do_POST(self) -> None:
        if self.headers.get("transfer-encoding") == "chunked":
            body = self._read_chunked()
            self._reply(200, json.dumps({"sha256": hashlib.sha256(body).hexdigest(), "length": len(body)}).encode())
            return
        length = int(self.headers["content-length"])
        if self.path == "/refuse":  # refuses the body unread, as a body limit does
            self._reply(413, b'{"title": "too large"}', close=True)
            self.close_connection = True
            return
        digest = hashlib.sha256(self.rfile.read(length)).hexdigest()
        self._reply(200, json.dumps({"sha256": digest, "length": length}).encode())


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(Handler) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    Handler.seen.clear()
    with httpx.Client(base_url=url, timeout=10, mounts={"http://": StdlibTransport()}) as client:
        yield client


def test_kdaclient_reuses_one_connection_and_sends_its_key(url):
    Handler.seen.clear()
    with KDAClient(url, api_key="s3cret") as kda:
        for _ in range(3):
            assert kda.info() == {"ok": True}
    assert len({s["port"] for s in Handler.seen}) == 1
    assert {s["authorization"] for s in Handler.seen} == {"Bearer s3cret"}


def test_a_connection_the_server_closed_is_not_reused(client):
    """An idle connection the server has since closed is dropped before reuse (checked for
    readability, as httpcore does; a close racing the next request fails it, as in httpcore)."""
    for _ in range(3):
        assert client.get("/hangup").status_code == 200
        time.sleep(0.2)  # the server's close has arrived
    assert len({s["port"] for s in Handler.seen}) == 3


def test_a_body_of_memoryviews_arrives_intact(client):
    pieces = [memoryview(BIG)[i:i + (1 << 20)] for i in range(0, len(BIG), 1 << 20)]
    r = client.post("/", content=iter(pieces), headers={"content-length": str(len(BIG))})
    assert r.json() == {"sha256": hashlib.sha256(BIG).hexdigest(), "length": len(BIG)}


def test_a_chunked_request_body_is_framed(client):
    r = client.post("/", content=iter([b"abc", b"", b"defg"]))  # no length: httpx asks for chunked
    assert r.json()["sha256"] == hashlib.sha256(b"abcdefg").hexdigest()


@pytest.mark.parametrize("path", ["/big", "/chunked"])
def test_a_response_is_read_whole(client, path):
    with client.stream("GET", path) as r:
        chunks = list(r.iter_bytes())
    assert b"".join(chunks) == BIG
    if path == "/big":  # Content-Length known: one buffer of that size, read into
        assert len(chunks) == 1 and isinstance(chunks[0], bytearray)


def test_a_response_buffer_is_reused_only_once_let_go(client):
    """Large responses land in a kept buffer again once nothing references it: never in
    one still held, whose bytes stay as they were."""
    def read() -> bytearray:
        with client.stream("GET", "/big") as r:
            (chunk,) = list(r.iter_bytes())
        return chunk

    first = read()
    address = id(first)
    second = read()
    assert id(second) != address and first == BIG and second == BIG  # first is still held
    del first
    third = read()
    assert id(third) == address and third == BIG and second == BIG


def test_a_slow_answer_is_a_read_timeout(client):
    with pytest.raises(httpx.ReadTimeout):
        client.get("/slow", timeout=0.5)
    assert client.get("/").json() == {"ok": True}  # the timed-out connection was dropped, not reused


def test_nobody_listening_is_a_connect_error():
    with KDAClient(f"http://127.0.0.1:{free_port()}") as kda, pytest.raises(httpx.ConnectError):
        kda.info()
    assert not KDAClient(f"http://127.0.0.1:{free_port()}").ready()


def test_a_body_refused_early_still_gets_the_servers_answer(client):
    """The server answers 413 and closes without reading 64 MB: the client reports the 413
    (as httpcore does), not the broken pipe of its unfinished send."""
    body = bytes(64 << 20)
    r = client.post("/refuse", content=body)
    assert r.status_code == 413 and r.json() == {"title": "too large"}


def test_https_is_not_this_transports():
    with httpx.Client(transport=StdlibTransport()) as client, pytest.raises(httpx.UnsupportedProtocol):
        client.get("https://127.0.0.1:1/")


def test_a_small_request_leaves_in_one_send_and_a_large_one_in_pieces():
    from kda_client.transport import _Connection

    class Socket:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def sendall(self, data: Any) -> None:
            self.sent.append(bytes(data))

    conn = _Connection("127.0.0.1", 1)
    conn.sock = Socket()  # type: ignore[assignment]
    conn.cork()
    conn.putrequest("POST", "/prefill", skip_host=True, skip_accept_encoding=True)
    conn.putheader("Content-Length", "6")
    conn.endheaders()
    conn.send(memoryview(b"abc"))
    conn.send(b"def")
    assert conn.sock.sent == []
    conn.uncork()
    assert len(conn.sock.sent) == 1 and conn.sock.sent[0].endswith(b"\r\n\r\nabcdef")
    conn.sock.sent.clear()
    conn.cork()
    big = bytes(_Connection.HELD + 1)
    conn.send(b"head")
    conn.send(big)  # past the limit: what is held, then the rest as it comes
    conn.send(b"tail")
    conn.uncork()
    assert conn.sock.sent == [b"head", big, b"tail"]
