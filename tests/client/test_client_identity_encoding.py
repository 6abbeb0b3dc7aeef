"""The client asks for replies uncompressed (``Accept-Encoding: identity``) on every path.

httpx asks for ``gzip, deflate`` by default; a proxy or server that honours that sends the
body compressed with its compressed Content-Length, which the client's length-checked body
buffer (sized by Content-Length, fed the decompressed bytes) refuses as a malformed reply.
Tensors gain nothing from gzip anyway. The peer here is a tiny HTTP server on 127.0.0.1
that gzips a state download whenever the request allows it, as such a proxy would.
"""
from __future__ import annotations

import asyncio
import gzip
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest
import torch
from http_peers import serving

from kda_client import AsyncKDAClient, KDAClient
from service.wire.media import SAFETENSORS
from service.wire.state import encode_state_safetensors

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0
STATE = torch.arange(2 * 2 * 8 * 8, dtype=torch.float32).reshape(2, 2, 8, 8) / 7.0
"""The state the peer serves: [L, HV, V, K], values that a wrong decoding would not keep."""


class _GzippingPeer(ThreadingHTTPServer):
    """Answers ``GET /slots/*/state`` with `STATE`, gzipped when Accept-Encoding allows it;
    records each request's Accept-Encoding."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.accepted: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _GzippingPeer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        accept = self.headers.get("accept-encoding", "")
        self.server.accepted.append(accept)
        body = bytes(encode_state_safetensors(STATE))
        gzipped = "gzip" in accept
        if gzipped:
            body = gzip.compress(body)
        self.send_response(200)
        self.send_header("Content-Type", SAFETENSORS)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def peer() -> Iterator[_GzippingPeer]:
    with serving(_GzippingPeer()) as srv:
        yield srv


def test_the_sync_client_asks_for_identity_and_reads_the_state(peer: _GzippingPeer):
    with KDAClient(peer.url, timeout=TIMEOUT) as client:
        assert torch.equal(client.get_state("s"), STATE)
    assert peer.accepted == ["identity"]


def test_the_async_client_asks_for_identity_and_reads_the_state(peer: _GzippingPeer):
    async def main() -> torch.Tensor:
        async with AsyncKDAClient(peer.url, timeout=TIMEOUT) as client:
            return await client.get_state("s")

    assert torch.equal(asyncio.run(asyncio.wait_for(main(), TIMEOUT)), STATE)
    assert peer.accepted == ["identity"]
