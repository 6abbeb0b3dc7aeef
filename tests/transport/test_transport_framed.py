"""The framed socket front end (``--framed-socket``) against live servers: shared memory
prefills equal the HTTP path bit for bit and the float64 reference (sync and async
clients); refusals are the same problem documents and change no slot; frames too large,
empty, cut short, stalled or of an unknown op never take the server down; the socket is its
user's alone and asks for the API key where the server has one; slots made for a client
that left are freed; a stale socket file is replaced; the client replaces a connection the
server closed."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch
from transport_helpers import (
    GEOMETRY_ARGS, HV, K, TOL, Region, Server, assert_continuation_matches, make_sequence, pool_image,
    prefill_and_continue, reference, registered_region, rel, shm_request, start_server,
)
from server_harness import metric, wait_for

from kda_client.client import AsyncKDAClient, BadRequest, KDAClient
from kda_client.framed import FramedExchange
from service.wire.frames import MAX_FRAME, Op, request_frame, split_reply

API_KEY = "framed-test-key"


def _socket_path(tmp: Path) -> str:
    return str(tmp / "kda.sock")  # tmp paths stay well under a Unix socket's 107 bytes


@pytest.fixture(scope="module")
def framed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A server with a framed socket: (server, socket path)."""
    tmp = tmp_path_factory.mktemp("framed")
    path = _socket_path(tmp)
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", path], tmp / "kda.log")
    yield srv, path
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()
    assert not os.path.exists(path), "the socket file outlived the server"


@pytest.fixture
def region(framed: tuple[Server, str]) -> Iterator[Region]:
    """A registered POSIX shared memory region of 1 MiB."""
    with registered_region(framed[0].url) as r:
        yield r


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    return sock


def _ping(path: str) -> int:
    """The status of a PING on a new connection."""
    exchange = FramedExchange(path, None, 30)
    try:
        return exchange.request(Op.PING, b"").status
    finally:
        exchange.close()


def _read_reply(sock: socket.socket) -> tuple[int, str, bytes]:
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection before its reply"
        data += chunk
    return split_reply(data[4:])


def test_framed_prefill_equals_http_and_reference(framed: tuple[Server, str], gen: torch.Generator) -> None:
    server, path = framed
    first = [make_sequence(70, gen), make_sequence(1, gen), make_sequence(130, gen)]
    second = [make_sequence(40, gen), make_sequence(65, gen), make_sequence(3, gen)]
    with KDAClient(server.url, transport="shm") as over_http, \
            KDAClient(server.url, transport="shm", framed_socket=path) as over_frames:
        outs = [prefill_and_continue(client, first, second, use_qk_l2norm=True) for client in (over_http, over_frames)]
        timing = outs[1][1].server_timing
        assert set(timing) == {"decode", "validate", "kernel", "encode", "total"}
        assert timing["total"] >= sum(timing[p] for p in ("decode", "validate", "kernel", "encode"))
        for slot in outs[0][0].slots + outs[1][0].slots:
            over_http.free(slot)
    assert_continuation_matches(first, second, outs, use_qk_l2norm=True)


@pytest.mark.parametrize("case", ["bad shape", "NaN input", "unknown region", "output past the end",
                                  "not JSON", "schema"])
def test_framed_refusals_are_problems_and_change_nothing(framed: tuple[Server, str], region: Region,
                                                         gen: torch.Generator, case: str) -> None:
    server, path = framed
    with KDAClient(server.url) as client:
        slot = client.alloc(1)[0]
        client.prefill(0, [(slot, *make_sequence(9, gen))])
        seqs = [make_sequence(10, gen), make_sequence(6, gen)]
        doc = shm_request(region, [slot, None], seqs)
        if case == "bad shape":
            doc["g"]["shape"] = [16, HV, K + 1]
            doc["g"]["shm"]["byte_size"] = 16 * HV * (K + 1) * 4
        elif case == "NaN input":
            q = torch.cat([seqs[0][0], seqs[1][0]])
            q[3, 0, 0] = float("nan")
            region.put(doc["q"]["shm"]["offset"], q)
        elif case == "unknown region":
            doc["v"]["shm"]["region"] = "nobody"
        elif case == "output past the end":
            doc["outputs"]["o"]["offset"] = region.size - 64
        elif case == "schema":
            doc["sequences"][0]["length"] = "ten"
        payload = b"{not json" if case == "not JSON" else json.dumps(doc).encode()
        before = pool_image(server.url, [slot])
        exchange = FramedExchange(path, None, 30)
        try:
            answer = exchange.request(Op.PREFILL, payload)
            problem = json.loads(answer.body)
            assert answer.status in (400, 422) and problem["status"] == answer.status, problem
            assert problem["type"].startswith("urn:kda-serve:problem:") and problem["detail"]
            if case == "bad shape":
                assert problem["field"] == "g" and f"{K + 1}" in problem["detail"]
            assert exchange.request(Op.PING, b"").status == 200  # the connection serves on
        finally:
            exchange.close()
        assert pool_image(server.url, [slot]) == before
        client.free(slot)


def test_framed_bad_frames_never_take_the_server_down(framed: tuple[Server, str]) -> None:
    server, path = framed
    with _raw(path) as sock:  # an unknown op: 400, and the connection goes on
        sock.sendall(request_frame(9, b"x"))
        status, _, body = _read_reply(sock)
        assert status == 400 and json.loads(body)["type"].endswith("unknown-op")
        sock.sendall(request_frame(Op.PING, b""))
        assert _read_reply(sock)[0] == 200
    with _raw(path) as sock:  # too large: 413 without reading it, then closed
        sock.sendall(struct.pack(">I", MAX_FRAME + 1))
        status, _, body = _read_reply(sock)
        assert status == 413 and str(MAX_FRAME) in json.loads(body)["detail"]
        assert sock.recv(16) == b""
    with _raw(path) as sock:  # empty: 400, then closed
        sock.sendall(struct.pack(">I", 0))
        assert _read_reply(sock)[0] == 400
        assert sock.recv(16) == b""
    with _raw(path) as sock:  # cut short: the client leaves inside a frame
        sock.sendall(struct.pack(">I", 100) + b"\x01{")
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "kda_framed_requests_total", op="unknown", status="400") >= 1
    assert metric(text, "kda_framed_requests_total", op="frame", status="413") >= 1
    assert _ping(path) == 200
    assert httpx.get(f"{server.url}/health/live").status_code == 200


def test_framed_socket_is_its_users_alone(framed: tuple[Server, str]) -> None:
    _, path = framed
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_framed_slots_made_for_a_client_that_left_are_freed(framed: tuple[Server, str], gen: torch.Generator) -> None:
    server, path = framed
    free = httpx.get(f"{server.url}/info").json()["free_slots"]
    tokens = metric(httpx.get(f"{server.url}/metrics").text, "kda_prefill_tokens_total")
    big = Region(32 << 20)
    try:
        assert httpx.post(f"{server.url}/shm/regions", json=big.registration()).status_code == 201
        doc = shm_request(big, [None], [make_sequence(3000, gen)])  # long enough to leave before the reply
        for _ in range(3):
            with _raw(path) as sock:
                sock.sendall(request_frame(Op.PREFILL, json.dumps(doc).encode()))
        assert wait_for(lambda: metric(httpx.get(f"{server.url}/metrics").text, "kda_prefill_tokens_total")
                        == tokens + 3 * 3000, timeout=60)  # each prefill ran, its slot made
        assert wait_for(lambda: httpx.get(f"{server.url}/info").json()["free_slots"] == free, timeout=30)
    finally:
        httpx.delete(f"{server.url}/shm/regions/{big.name}")
        big.unlink()


def test_framed_socket_asks_for_the_api_key(tmp_path: Path, gen: torch.Generator) -> None:
    path = _socket_path(tmp_path)
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", path, "--api-key", API_KEY], tmp_path / "kda.log")
    try:
        with _raw(path) as sock:
            sock.sendall(request_frame(Op.PING, b""))
            status, _, body = _read_reply(sock)
            assert status == 401 and "AUTH" in json.loads(body)["detail"]
            sock.sendall(request_frame(Op.AUTH, b"wrong"))
            assert _read_reply(sock)[0] == 401
            sock.sendall(request_frame(Op.AUTH, API_KEY.encode()))
            assert _read_reply(sock)[0] == 204
            sock.sendall(request_frame(Op.PING, b""))
            assert _read_reply(sock)[0] == 200
        seq = make_sequence(20, gen)
        with KDAClient(srv.url, api_key=API_KEY, transport="shm", framed_socket=path) as client:
            out = client.prefill(0, [(None, *seq)])
            assert rel(out.o_packed, reference([seq])[0]) < TOL
            client.free(out.slots[0])
        wrong = FramedExchange(path, "wrong", 30)  # a refused key: its 401 answers the request
        try:
            answer = wrong.request(Op.PING, b"")
            assert answer.status == 401 and json.loads(answer.body)["status"] == 401
        finally:
            wrong.close()
    finally:
        assert srv.stop() == 0


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    """A socket file left by a server that did not exit cleanly does not stop the next one."""
    path = _socket_path(tmp_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", path], tmp_path / "kda.log")
    try:
        assert _ping(path) == 200
    finally:
        assert srv.stop() == 0
    assert not os.path.exists(path)


async def prefill_and_continue_async(client: AsyncKDAClient, first: list, second: list) -> tuple:
    """`prefill_and_continue` through an `AsyncKDAClient`."""
    a = await client.prefill(0, [(None, *s) for s in first])
    b = await client.prefill(0, [(slot, *s) for slot, s in zip(a.slots, second)])
    return a, b


def test_async_client_over_the_framed_socket_equals_http(framed: tuple[Server, str], gen: torch.Generator) -> None:
    """`AsyncKDAClient(framed_socket=...)`: the same numbers as the sync client over HTTP
    (a prefill and its continuation), and a refusal raised as over HTTP."""
    server, path = framed
    first, second = [make_sequence(33, gen)], [make_sequence(70, gen)]

    async def over_frames() -> tuple:
        async with AsyncKDAClient(server.url, transport="shm", framed_socket=path) as client:
            out = await prefill_and_continue_async(client, first, second)
            with pytest.raises(BadRequest) as refused:
                await client.prefill(0, [(out[0].slots[0], *make_sequence(5, gen, heads=HV + 1))])
            assert refused.value.problem["status"] == 400
            for slot in out[0].slots:
                await client.free(slot)
            return out

    a, b = asyncio.run(over_frames())
    with KDAClient(server.url, transport="shm") as over_http:
        x, y = prefill_and_continue(over_http, first, second)
        for slot in x.slots:
            over_http.free(slot)
    assert torch.equal(a.o_packed, x.o_packed) and torch.equal(b.final_state, y.final_state)
    assert "total" in b.server_timing


def test_the_client_replaces_a_connection_the_server_closed(tmp_path: Path) -> None:
    """A server restarted between two requests: the kept connection, closed by the old
    one, is replaced before the next request goes out, with no error."""
    path = _socket_path(tmp_path)
    exchange = FramedExchange(path, None, 30)
    try:
        for run in range(2):
            srv = start_server([*GEOMETRY_ARGS, "--framed-socket", path], tmp_path / f"kda-{run}.log")
            try:
                assert exchange.request(Op.PING, b"").status == 200
            finally:
                assert srv.stop() == 0
    finally:
        exchange.close()


def test_a_frame_that_stops_arriving_has_its_connection_closed(tmp_path: Path) -> None:
    """Half a frame, then nothing: the connection is closed after --body-timeout-s, with no
    reply, and the server serves on."""
    path = _socket_path(tmp_path)
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", path, "--body-timeout-s", "0.5"], tmp_path / "kda.log")
    try:
        with _raw(path) as sock:
            sock.sendall(struct.pack(">I", 100) + b"\x01{")
            started = time.monotonic()
            assert sock.recv(16) == b""  # closed, unanswered
            assert 0.4 < time.monotonic() - started < 10
        assert _ping(path) == 200
    finally:
        assert srv.stop() == 0
