"""A client that leaves while its requests are pipelined: the one running learns it is gone.

A request that makes slots (``POST /slots``, a fork, a prefill with a new sequence) frees
them when its client has left by the time its answer would go out (`service.http.abandon`,
counted in ``kda_responses_abandoned_total``). When a connection is lost, uvicorn tells only
its newest request, which is a queued one when requests are pipelined: the running one
answered into nothing and its slots stayed allocated, their ids known to nobody. Here a
pipeline of a slot-making request, a DELETE of a live slot and a GET is sent whole and the
connection ends at once: reset (``SO_LINGER`` 0), closed with a response left unread (the
kernel then resets it too), or closed plainly (a FIN, `KDAHttpProtocol.eof_received`; a
pipelined fork, which reads no body, used to miss it too). Each time the slots made are
freed (the free-slot count is back, one more abandoned response) and the queued DELETE
never runs.

A request still waiting on ``receive()`` when the connection is lost (a handler awaiting
its client's departure) is woken with ``http.disconnect`` though a request is queued
behind it (`KDAHttpProtocol.connection_lost`): shown on uvicorn in a thread, in front of
a small app.

The server process is stopped (SIGSTOP) while the client sends and hangs up, so that the
whole pipeline and the hang-up are in the server's kernel before it reads any of it: the
running request cannot have answered before its client left, whatever the timing. Reading
is paused while a pipelined request waits, so the server may not have read the hang-up yet
when the running request asks whether its client is still there.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import torch
from reliability_helpers import GEOMETRY_ARGS, ST, connect, make_sequence, metric, start_server, wait_for

from server_harness import uvicorn_in_thread
from service.http.protocol import KDAHttpConnection
from service.wire.safetensors_codec import encode_safetensors

JSON_CT = "application/json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = start_server(GEOMETRY_ARGS, tmp_path_factory.mktemp("abandoned-pipelines") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]
    assert "Traceback" not in srv.log_text(), srv.log_text()[-3000:]


@pytest.fixture
def keep(server: Any) -> Iterator[str]:
    """A live slot that the queued DELETE names: it must survive (the DELETE never runs)."""
    slot = httpx.post(f"{server.url}/slots", timeout=10).json()["slots"][0]
    yield slot
    httpx.delete(f"{server.url}/slots/{slot}", timeout=10)


def req(method: str, target: str, body: bytes = b"", content_type: str = JSON_CT) -> bytes:
    """One whole HTTP/1.1 request, framed by Content-Length when it has a body."""
    head = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1"]
    if body:
        head += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def new_slot_prefill(tokens: int) -> bytes:
    """A safetensors /prefill of ``tokens`` random tokens on layer 0 for a new slot."""
    seq = make_sequence(tokens, torch.Generator().manual_seed(tokens))
    meta = {"request": json.dumps({"layer": 0, "sequences": [{"slot": None, "length": tokens}]})}
    body = bytes(encode_safetensors(dict(zip(("q", "k", "v", "g", "beta"), seq)), meta))
    return req("POST", "/prefill", body, content_type=ST)


MAKERS: dict[str, Callable[[str], bytes]] = {
    "alloc": lambda keep: req("POST", "/slots", json.dumps({"count": 3}).encode()),
    "fork": lambda keep: req("POST", f"/slots/{keep}/fork"),
    "prefill": lambda keep: new_slot_prefill(7),
}


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (/proc/<pid>/stat): ``T`` when stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@contextmanager
def stopped(server: Any) -> Iterator[None]:
    """The server process stopped (SIGSTOP) inside, continued (SIGCONT) after."""
    pid = server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: process_state(pid) == "T", timeout=5), "the server did not stop"
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def hang_up(s: socket.socket, how: str) -> None:
    """Close ``s``: ``reset`` with SO_LINGER 0 (the kernel sends RST, not FIN), else plainly
    (RST all the same when a response was left unread, else FIN)."""
    if how == "reset":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def leave_a_response_unread(s: socket.socket) -> None:
    """Ask for /health/live and wait (bounded) until its answer has arrived, unread: a plain
    close then resets the connection (RFC 2525 2.17), as a client that stops reading does."""
    s.sendall(req("GET", "/health/live"))
    ready, _, _ = select.select([s], [], [], 10)
    assert ready and s.recv(1, socket.MSG_PEEK), "no answer to /health/live"


def abandoned_and_free(server: Any) -> tuple[float, int]:
    """(kda_responses_abandoned_total, the pool's free slots)."""
    gone = metric(httpx.get(f"{server.url}/metrics", timeout=10).text, "kda_responses_abandoned_total")
    return gone, httpx.get(f"{server.url}/info", timeout=10).json()["free_slots"]


@pytest.mark.parametrize("how", ["reset", "close-unread", "close"])
@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_a_client_gone_behind_a_pipeline_frees_what_the_running_request_made(server, keep, maker, how):
    """A slot-making request, then a DELETE of ``keep`` and a GET queued behind it, sent
    whole; the client hangs up before the server reads them. The running request frees
    what it made (one more abandoned response, the free-slot count back); the DELETE never
    runs."""
    gone, free = abandoned_and_free(server)
    s = connect(server.url)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if how == "close-unread":
            leave_a_response_unread(s)
        with stopped(server):
            s.sendall(MAKERS[maker](keep) + req("DELETE", f"/slots/{keep}") + req("GET", "/health/live"))
            hang_up(s, how)
    finally:
        s.close()  # nothing more once hung up
    assert wait_for(lambda: abandoned_and_free(server) == (gone + 1, free), timeout=10), \
        (abandoned_and_free(server), (gone + 1, free), server.log_text()[-2000:])
    assert httpx.get(f"{server.url}/slots/{keep}", timeout=10).status_code == 200, "the queued DELETE ran"


# -- a request awaiting its client's departure, with another queued behind it -------------


class Departures:
    """An ASGI app: ``POST /wait`` reads its body, then awaits the next message (its
    client's departure) and notes its type; any other request is noted and answered 204."""

    def __init__(self) -> None:
        self.waiting = threading.Event()  # /wait has its body and awaits the next message
        self.woken = threading.Event()  # ... and got it
        self.seen: list[str] = []  # the paths run and the message /wait was woken with

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        if scope["path"] != "/wait":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        while (await receive()).get("more_body", False):
            pass
        self.waiting.set()
        self.seen.append((await receive())["type"])
        self.woken.set()


@pytest.fixture
def departures() -> Iterator[tuple[str, Departures]]:
    """(url, app): `Departures` behind uvicorn with `KDAHttpConnection`, in a thread."""
    app = Departures()
    with uvicorn_in_thread(app, KDAHttpConnection, lifespan="off") as url:
        yield url, app


@pytest.mark.parametrize("how", ["reset", "close-unread"])
def test_a_request_awaiting_its_client_is_woken_when_the_connection_is_lost(departures, how):
    """``POST /wait`` (its body whole), then a GET queued behind it; once /wait awaits its
    client's departure the client resets the connection: /wait is woken with
    ``http.disconnect`` (uvicorn wakes only the newest request, the queued GET) and the
    GET never runs. (A FIN alone is a half-close: /wait would still be answered.)"""
    url, app = departures
    s = connect(url)
    try:
        if how == "close-unread":
            leave_a_response_unread(s)
        s.sendall(req("POST", "/wait", b"{}") + req("GET", "/next"))
        assert app.waiting.wait(10), app.seen
        hang_up(s, how)
    finally:
        s.close()
    assert app.woken.wait(10), f"/wait never learned its client left: {app.seen}"
    assert app.seen[-2:] == ["/wait", "http.disconnect"] and "/next" not in app.seen, app.seen
