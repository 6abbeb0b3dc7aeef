"""`kda_client.small.SmallExchange`, `KDAClient`'s path for small requests: framing by
Content-Length, chunked and close, kept-alive connections reused only while the server
keeps them, and httpx's timeouts and exceptions; against the stdlib HTTP/1.1 server of
`test_transport_http_client` (same handler, its own port)."""
from __future__ import annotations

import hashlib
import json
import time
from typing import Iterator

import httpx
import pytest

from server_harness import free_port
from transport_helpers import serving
from kda_client.client import KDAClient, _Call, _json
from kda_client.small import MAX_BODY, SmallExchange
from test_transport_http_client import BIG, Handler


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving(Handler) as port:
        yield port


@pytest.fixture
def small(port: int) -> Iterator[SmallExchange]:
    Handler.seen.clear()
    exchange = SmallExchange("127.0.0.1", port, f"127.0.0.1:{port}", "", {"authorization": "Bearer k"}, 10)
    yield exchange
    exchange.close()


@pytest.mark.parametrize("path", ["/big", "/chunked", "/"])
def test_a_response_is_read_whole_by_its_framing(small, path):
    r = small.request("GET", path, {})
    assert r.status == 200
    assert r.body == (BIG if path != "/" else json.dumps({"ok": True}).encode())
    assert ("transfer-encoding" in r.headers) == (path == "/chunked")


def test_one_connection_carries_every_request_and_the_clients_headers(small):
    for _ in range(3):
        assert small.request("GET", "/", {}).status == 200
    assert len({s["port"] for s in Handler.seen}) == 1
    assert {s["authorization"] for s in Handler.seen} == {"Bearer k"}


def test_a_body_in_pieces_arrives_intact(small):
    pieces = [b"x" * 1000, memoryview(b"y" * 3000), bytearray(b"z" * 17)]
    r = small.request("POST", "/", {"content-length": "4017"}, pieces)
    assert json.loads(r.body) == {"sha256": hashlib.sha256(b"x" * 1000 + b"y" * 3000 + b"z" * 17).hexdigest(),
                                  "length": 4017}


def test_a_connection_the_server_closed_is_not_reused(small):
    for _ in range(3):
        assert small.request("GET", "/hangup", {}).status == 200
        time.sleep(0.2)  # the server's close has arrived
    assert len({s["port"] for s in Handler.seen}) == 3


def test_a_slow_answer_is_a_read_timeout(port):
    exchange = SmallExchange("127.0.0.1", port, f"127.0.0.1:{port}", "", {}, 0.5)
    with pytest.raises(httpx.ReadTimeout):
        exchange.request("GET", "/slow", {})
    assert exchange.request("GET", "/", {}).status == 200  # the timed-out connection was dropped
    exchange.close()


def test_nobody_listening_is_a_connect_error():
    exchange = SmallExchange("127.0.0.1", free_port(), "x", "", {}, 5)
    with pytest.raises(httpx.ConnectError):
        exchange.request("GET", "/", {})


def test_kdaclient_sends_small_calls_here_and_large_bodies_through_httpx(port):
    """Up to MAX_BODY bytes a call takes SmallExchange (one kept connection), beyond it
    httpx's transport."""
    Handler.seen.clear()
    large = bytes(MAX_BODY + 1)
    with KDAClient(f"http://127.0.0.1:{port}") as kda:
        kda.info()
        assert kda._run(_Call("POST", "/", _json, large)) == {"sha256": hashlib.sha256(large).hexdigest(),
                                                               "length": len(large)}
        kda.info()
        assert len(kda._small._idle) == 1
    assert len(Handler.seen) == 2 and Handler.seen[0]["port"] == Handler.seen[1]["port"]
