"""A body over ``--max-body-mb`` is refused early (413 from Content-Length, before a byte of
it is read), and the refusal must reach the client that is still writing that body. A
server that closes at once, with the body unread in its socket, resets the connection: the
asyncio client (httpx's AsyncClient under `kda_client.AsyncKDAClient`) then raised
``httpx.ReadError`` instead of the 413. The server drains the rest for a bounded time and
number of bytes (a lingering close, RFC 9112 9.6), then closes: the client reads the 413,
and a client that keeps sending past the caps is still disconnected. Each against a live
server on 127.0.0.1, which serves a normal prefill afterwards.
"""
from __future__ import annotations

import asyncio
import select
import socket
import time
from typing import Any, Iterator, Optional

import httpx
import pytest
import torch
from reliability_helpers import (
    GEOMETRY_ARGS, PROBLEM, TOL, connect, make_sequence, metric, reference, rel, request_head, start_server,
)

from kda_client import AsyncKDAClient, BadRequest
from service.http.protocol import LINGER_BYTES, LINGER_S

MAX_BODY_MB = 1
LIMIT = MAX_BODY_MB << 20
TOKENS = 3000  # ~3.1 MB of safetensors, ~4.2 MB of JSON: a few times the limit, within the drain cap
SLACK_S = 3.0  # a loaded 2-core machine's scheduling, on top of a cap


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = start_server([*GEOMETRY_ARGS, "--max-body-mb", str(MAX_BODY_MB)],
                       tmp_path_factory.mktemp("early-refusal") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


def _assert_body_limit_problem(problem: dict[str, Any]) -> None:
    assert problem["status"] == 413 and problem["type"].endswith(":payload-too-large"), problem
    assert "--max-body-mb" in problem["detail"] and f"{LIMIT}-byte limit" in problem["detail"], problem


async def _oversized_prefill(url: str, encoding: str, gen: torch.Generator) -> BadRequest:
    """The BadRequest an oversized prefill raises through the asyncio client."""
    sequence = make_sequence(TOKENS, gen)
    async with AsyncKDAClient(url, encoding=encoding, timeout=60) as client:
        with pytest.raises(BadRequest) as refused:
            await client.prefill(0, [(None, *sequence)])
    return refused.value


@pytest.mark.parametrize("encoding", ["safetensors", "json"])
def test_the_async_client_gets_the_413_of_an_oversized_body(server: Any, gen: torch.Generator,
                                                          encoding: str) -> None:
    for _ in range(3):  # the reset was not every time on every encoding: a few tries each
        refused = asyncio.run(_oversized_prefill(server.url, encoding, gen))
        assert refused.status == 413
        _assert_body_limit_problem(refused.problem)


def test_a_plain_async_post_gets_the_413(server: Any) -> None:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(f"{server.url}/prefill", content=b"x" * (3 * LIMIT),
                                     headers={"content-type": "application/json"})

    for _ in range(3):
        response = asyncio.run(post())
        assert response.status_code == 413 and response.headers["content-type"] == PROBLEM, response.text[:300]
        assert response.headers["connection"] == "close"
        _assert_body_limit_problem(response.json())


def _send_until_disconnected(s: socket.socket, period_s: float, limit_s: float) -> tuple[bytes, Optional[float]]:
    """Send body bytes on ``s`` (64 KiB every ``period_s``; 0: as fast as the socket takes
    them) while reading what the server sends, until the server ends the connection (a
    write refused or a reset) or ``limit_s`` pass: (the bytes read, the seconds the
    connection lasted, None when it outlived ``limit_s``)."""
    s.setblocking(False)
    chunk, received = b"x" * 65536, bytearray()
    start = time.monotonic()
    next_send = start
    while (now := time.monotonic()) - start < limit_s:
        readable, writable, _ = select.select([s], [s] if now >= next_send else [], [], 0.02)
        try:
            if readable:
                received += s.recv(65536)  # b"" once the server half-closed: it still drains
            if writable:
                s.send(chunk)
                next_send = now + period_s
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:  # EPIPE, ECONNRESET: the server closed
            return bytes(received), time.monotonic() - start
    return bytes(received), None


def _assert_raw_413(reply: bytes) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 413 "), reply[:300]
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"] == PROBLEM and headers["connection"] == "close", headers
    assert len(body) == int(headers["content-length"]), reply[:300]
    _assert_body_limit_problem(httpx.Response(413, content=body).json())


@pytest.mark.parametrize("period_s, cap", [(0.0, "bytes"), (0.05, "time")])
def test_a_client_sending_on_after_the_413_is_disconnected_within_the_cap(server: Any, period_s: float,
                                                                         cap: str) -> None:
    """Fast, the byte cap (`LINGER_BYTES`) ends the connection; at ~1.3 MB/s, under it for
    `LINGER_S`, the time cap does. Either way the 413 was read whole first."""
    assert LINGER_BYTES / (65536 / 0.05) > LINGER_S  # the slow client cannot reach the byte cap in time
    s = connect(server.url)
    try:
        s.sendall(request_head("POST", "/prefill", [("Content-Type", "application/json"),
                                                    ("Content-Length", str(64 * LIMIT))]))
        reply, lasted = _send_until_disconnected(s, period_s, LINGER_S + 10)
    finally:
        s.close()
    _assert_raw_413(reply)
    assert lasted is not None and lasted < LINGER_S + SLACK_S, (cap, lasted)
    if cap == "time":
        assert lasted > LINGER_S - 0.5, lasted
    else:
        assert lasted < LINGER_S, lasted


def test_the_server_serves_normally_afterwards(server: Any, gen: torch.Generator) -> None:
    """A prefill matches the float64 reference; the 413s are counted, and none was a 5xx."""
    refused = httpx.post(f"{server.url}/prefill", content=b"x" * (LIMIT + 1),
                         headers={"content-type": "application/json"})
    assert refused.status_code == 413  # the sync client, as before
    sequence = make_sequence(40, gen)

    async def prefill() -> Any:
        async with AsyncKDAClient(server.url, timeout=60) as client:
            out = await client.prefill(0, [(None, *sequence)])
            await client.free(out.slots[0])
            return out

    out = asyncio.run(prefill())
    o_ref, final_ref = reference([sequence])
    assert rel(out.o_packed, o_ref) < TOL and rel(out.final_state, final_ref) < TOL
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric(text, "kda_http_errors_total", route="unmatched", method="POST", status="413") >= 1
    fives = [line for line in text.splitlines() if line.startswith("kda_http_errors_total") and 'status="5' in line
             and 'route="/health/ready"' not in line]  # the probe is 503 while the server starts
    assert not fives, fives
