"""A successful reply the client cannot decode raises `kda_client.MalformedResponse` (a
`KDAError`, like every other failure of the service's answer), with the decoder's error as
its ``__cause__``; before, the wire decoders' own errors leaked out (the server's
`service.errors.MalformedBody` and `SchemaError`, KeyError, JSONDecodeError, an
AssertionError), which a caller catching `KDAError` missed.

No kda-serve here: the peer is a tiny HTTP server on 127.0.0.1 (and, for the framed
socket, a Unix socket peer) that answers the client's routes with a 200 whose body is
broken while its Content-Type and framing are right, as a proxy that mangles bodies, or a
server cut short, would: bad JSON, a safetensors header that lies about its data, a body
truncated (its Content-Length re-set to what is left), a JSON body missing a member, an
HTML page under a 200. Sync (`SmallExchange` and `StdlibTransport` paths) and async
clients, on prefill (HTTP, shared memory, framed socket, prepared) and state download.
"""
from __future__ import annotations

import asyncio
import json
import socketserver
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from http_peers import serving

from kda_client import AsyncKDAClient, KDAClient, KDAError, MalformedResponse, ServiceUnavailable
from kda_client.errors import decoding
from service.errors import MalformedBody
from service.wire.frames import Op, reply_frame
from service.wire.media import JSON, SAFETENSORS
from service.wire.safetensors_codec import encode_safetensors

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0
"""Each request's timeout (s): no test waits on the peer longer."""
H, HV, K, V = 2, 2, 8, 8
GEOMETRY = {"num_heads": HV, "head_v_dim": V, "head_k_dim": K, "state_dtype": "float32"}

Reply = tuple[int, Optional[str], bytes]
"""(status, Content-Type or None, body)."""


# -- the peers -----------------------------------------------------------------------------

class _Peer(ThreadingHTTPServer):
    """Answers `KDAClient`'s routes: /info with a pool geometry, region registrations with
    201, unregistrations with 204, and ``POST /prefill`` and ``GET /slots/*/state`` with
    what the test sets (``prefill``, ``state``: callables of the peer, for replies that
    name the registered region). Unknown routes: 404."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.info: dict[str, Any] = dict(GEOMETRY)
        self.prefill: Callable[["_Peer"], Reply] = lambda _: (500, None, b"")
        self.state: Callable[["_Peer"], Reply] = lambda _: (500, None, b"")
        self.region: Optional[str] = None  # the last region registered
        self.served: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, method: str, path: str, body: bytes) -> Reply:
        self.served.append(f"{method} {path}")
        if (method, path) == ("GET", "/info"):
            return 200, JSON, json.dumps(self.info).encode()
        if (method, path) == ("POST", "/shm/regions"):
            self.region = json.loads(body)["name"]
            return 201, JSON, b"{}"
        if method == "DELETE" and path.startswith("/shm/regions/"):
            return 204, None, b""
        if (method, path) == ("POST", "/prefill"):
            return self.prefill(self)
        if method == "GET" and path.startswith("/slots/") and path.endswith("/state"):
            return self.state(self)
        return 404, "application/problem+json", json.dumps({"status": 404, "detail": path}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as kda-serve's connections are
    server: _Peer

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        status, content_type, payload = self.server.answer(self.command, self.path, body)
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def peer() -> Iterator[_Peer]:
    with serving(_Peer()) as srv:
        yield srv


class _FramedPeer(socketserver.ThreadingUnixStreamServer):
    """A framed socket peer: answers each request frame with ``replies[op]`` (raw reply
    bytes, its length prefix included), connection after connection."""

    daemon_threads = True

    def __init__(self, path: str, replies: dict[Op, bytes]) -> None:
        self.replies = replies
        super().__init__(path, _FramedHandler)


class _FramedHandler(socketserver.BaseRequestHandler):
    server: _FramedPeer

    def handle(self) -> None:
        sock = self.request
        sock.settimeout(TIMEOUT)
        try:
            while head := _exactly(sock, 4):
                frame = _exactly(sock, struct.unpack(">I", head)[0])
                sock.sendall(self.server.replies[Op(frame[0])])
        except OSError:
            pass


def _exactly(sock: Any, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            return b""
        got += chunk
    return got


@pytest.fixture
def framed(tmp_path: Path) -> Iterator[Callable[[dict[Op, bytes]], str]]:
    """Starts a framed socket peer with the given replies; its path."""
    started: list[tuple[_FramedPeer, threading.Thread]] = []

    def start(replies: dict[Op, bytes]) -> str:
        path = str(tmp_path / f"framed{len(started)}.sock")
        srv = _FramedPeer(path, replies)
        thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        started.append((srv, thread))
        return path

    try:
        yield start
    finally:
        for srv, thread in started:
            srv.shutdown()
            srv.server_close()
            thread.join(TIMEOUT)


# -- what the client sends and what comes back ----------------------------------------------

def _sequence(tokens: int, slot: Optional[str] = None) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(tokens)
    return (slot, torch.randn(tokens, H, K, generator=g), torch.randn(tokens, H, K, generator=g),
            torch.randn(tokens, HV, V, generator=g), -torch.rand(tokens, HV, K, generator=g),
            torch.rand(tokens, HV, generator=g))


def _prefill_safetensors(tokens: int = 4) -> bytearray:
    """A well-formed safetensors /prefill reply (o, final_state, the slots in metadata)."""
    return encode_safetensors({"o": torch.zeros(tokens, HV, V), "final_state": torch.zeros(1, HV, V, K)},
                              {"response": json.dumps({"slots": ["s0"]})})


def _lying_header(name: str, shape: list[int], metadata: dict[str, str], data: int) -> bytes:
    """A safetensors body whose header says ``name`` is float32 ``shape`` over all its
    data, which holds only ``data`` bytes."""
    need = 4 * int(torch.tensor(shape).prod())
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, need]},
                         "__metadata__": metadata}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(data)


def _short(body: bytes) -> bytes:
    """``body`` cut in half (its Content-Length then says so: the body a proxy truncated)."""
    return bytes(body[:len(body) // 2])


PREFILL_REPLIES: dict[str, tuple[str, Reply]] = {
    # id: (the client's encoding, the reply)
    "bad json": ("json", (200, JSON, b'{"slots": ["s0"], "o": {"dtype": "float32", "sha')),
    "json missing o": ("json", (200, JSON, json.dumps({"slots": ["s0"]}).encode())),
    "json truncated": ("json", (200, JSON, _short(json.dumps(
        {"slots": ["s0"], "o": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}}).encode()))),
    "json bad base64": ("json", (200, JSON, json.dumps(
        {"slots": ["s0"], "o": {"dtype": "float32", "shape": [1], "data": "!!!!!!!!"}}).encode())),
    "safetensors lying header": ("safetensors", (200, SAFETENSORS, _lying_header(
        "o", [4, HV, V], {"response": json.dumps({"slots": ["s0"]})}, 16))),
    "safetensors truncated": ("safetensors", (200, SAFETENSORS, _short(_prefill_safetensors()))),
    "safetensors missing slots": ("safetensors", (200, SAFETENSORS, bytes(
        encode_safetensors({"o": torch.zeros(4, HV, V)}, {"response": "{}"})))),
    "html under a 200": ("safetensors", (200, "text/html", b"<html><body>502 Bad Gateway</body></html>")),
}

STATE_REPLIES: dict[str, tuple[str, Reply]] = {
    "safetensors lying header": ("safetensors", (200, SAFETENSORS, _lying_header("state", [2, HV, V, K], {}, 64))),
    "safetensors truncated": ("safetensors", (200, SAFETENSORS, _short(
        encode_safetensors({"state": torch.zeros(2, HV, V, K)})))),
    "safetensors wrong tensor": ("safetensors", (200, SAFETENSORS, bytes(
        encode_safetensors({"slots": torch.zeros(2, HV, V, K)})))),
    "json missing state": ("json", (200, JSON, b'{"slot": "s0"}')),
    "bad json": ("json", (200, JSON, b'{"state": ')),
}

SIZES = {"small": 4, "large": 1100}
"""Tokens of a prefill: a small body (`SmallExchange`) and one over 64 KiB (`StdlibTransport`)."""


def _check(err: pytest.ExceptionInfo[MalformedResponse], status: int = 200) -> None:
    """The error is the client's own, says what it could not decode in a few words, and
    keeps the decoder's error as its cause."""
    e = err.value
    assert isinstance(e, KDAError)
    assert e.status == status and e.problem["status"] == status
    assert e.__cause__ is not None and not isinstance(e.__cause__, MalformedResponse)
    assert e.what and e.what in str(e)
    assert len(str(e)) <= 500, str(e)


def _arun(coro: Any) -> Any:
    """Run ``coro`` to its end, within the request timeout (and some)."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 3 * TIMEOUT)
    return asyncio.run(bounded())


# -- prefill and state download over HTTP ---------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", PREFILL_REPLIES)
def test_a_malformed_prefill_reply_raises_malformed_response(peer: _Peer, case: str, size: str) -> None:
    encoding, reply = PREFILL_REPLIES[case]
    peer.prefill = lambda _: reply
    with KDAClient(peer.url, encoding=encoding, timeout=TIMEOUT) as c:  # type: ignore[arg-type]
        with pytest.raises(MalformedResponse) as err:
            c.prefill(0, [_sequence(SIZES[size])])
    _check(err)
    assert "POST /prefill" in err.value.what
    assert "<html>" not in str(err.value)  # what failed, never the body


@pytest.mark.parametrize("case", PREFILL_REPLIES)
def test_a_malformed_prefill_reply_raises_malformed_response_async(peer: _Peer, case: str) -> None:
    encoding, reply = PREFILL_REPLIES[case]
    peer.prefill = lambda _: reply

    async def main() -> None:
        async with AsyncKDAClient(peer.url, encoding=encoding, timeout=TIMEOUT) as c:  # type: ignore[arg-type]
            await c.prefill(0, [_sequence(4)])

    with pytest.raises(MalformedResponse) as err:
        _arun(main())
    _check(err)


@pytest.mark.parametrize("case", STATE_REPLIES)
def test_a_malformed_state_download_raises_malformed_response(peer: _Peer, case: str) -> None:
    encoding, reply = STATE_REPLIES[case]
    peer.state = lambda _: reply
    with KDAClient(peer.url, encoding=encoding, timeout=TIMEOUT) as c:  # type: ignore[arg-type]
        with pytest.raises(MalformedResponse) as err:
            c.get_state("s0")
    _check(err)
    assert "/slots/s0/state" in err.value.what


@pytest.mark.parametrize("case", STATE_REPLIES)
def test_a_malformed_state_download_raises_malformed_response_async(peer: _Peer, case: str) -> None:
    encoding, reply = STATE_REPLIES[case]
    peer.state = lambda _: reply

    async def main() -> None:
        async with AsyncKDAClient(peer.url, encoding=encoding, timeout=TIMEOUT) as c:  # type: ignore[arg-type]
            await c.get_state("s0")

    with pytest.raises(MalformedResponse) as err:
        _arun(main())
    _check(err)


def test_a_well_formed_reply_still_decodes(peer: _Peer) -> None:
    """The peer's well-formed replies decode (the malformed ones above fail for their
    bodies, not for the peer)."""
    peer.prefill = lambda _: (200, SAFETENSORS, bytes(_prefill_safetensors()))
    peer.state = lambda _: (200, SAFETENSORS, bytes(encode_safetensors({"state": torch.ones(2, HV, V, K)})))
    with KDAClient(peer.url, timeout=TIMEOUT) as c:
        out = c.prefill(0, [_sequence(4)])
        assert out.slots == ["s0"] and out.o_packed.shape == (4, HV, V)
        assert c.get_state("s0").shape == (2, HV, V, K)


# -- shared memory: the reply names where the outputs are ------------------------------------

def _shm_reply(o: Optional[dict[str, Any]]) -> Callable[[_Peer], Reply]:
    def reply(p: _Peer) -> Reply:
        doc: dict[str, Any] = {"slots": ["s0"]}
        if o is not None:
            doc["o"] = {"dtype": "float32", "shape": [4, HV, V],
                        "shm": {"region": p.region, "offset": 0, "byte_size": 4 * HV * V * 4, **o}}
        return 200, JSON, json.dumps(doc).encode()
    return reply


SHM_REPLIES: dict[str, Callable[[_Peer], Reply]] = {
    "bad json": lambda _: (200, JSON, b'{"slots": ["s0"], "o": {"dtype": "float32", "sha'),
    "missing o": _shm_reply(None),
    "o past the region's end": _shm_reply({"offset": 1 << 40}),
    "o bigger than its shape": _shm_reply({"byte_size": 1 << 12}),
    "o in another region": _shm_reply({"region": "someone-else"}),
}


@pytest.mark.parametrize("case", SHM_REPLIES)
def test_a_malformed_shared_memory_prefill_reply_raises_malformed_response(peer: _Peer, case: str) -> None:
    peer.prefill = SHM_REPLIES[case]
    with KDAClient(peer.url, transport="shm", timeout=TIMEOUT) as c:
        with pytest.raises(MalformedResponse) as err:
            c.prefill(0, [_sequence(4)])
    _check(err)


@pytest.mark.parametrize("case", SHM_REPLIES)
def test_a_malformed_shared_memory_prefill_reply_raises_malformed_response_async(peer: _Peer, case: str) -> None:
    peer.prefill = SHM_REPLIES[case]

    async def main() -> None:
        async with AsyncKDAClient(peer.url, transport="shm", timeout=TIMEOUT) as c:
            await c.prefill(0, [_sequence(4)])

    with pytest.raises(MalformedResponse) as err:
        _arun(main())
    _check(err)


def test_an_info_reply_without_the_geometry_raises_malformed_response(peer: _Peer) -> None:
    """A shared memory client reads the pool's geometry from /info before its first prefill."""
    peer.info = {"num_heads": HV}
    with KDAClient(peer.url, transport="shm", timeout=TIMEOUT) as c:
        with pytest.raises(MalformedResponse) as err:
            c.prefill(0, [_sequence(4)])
    _check(err)

    async def main() -> None:
        async with AsyncKDAClient(peer.url, transport="shm", timeout=TIMEOUT) as c:
            await c.prefill(0, [_sequence(4)])

    with pytest.raises(MalformedResponse) as err:
        _arun(main())
    _check(err)


# -- the framed socket, and prepared prefills on it ------------------------------------------

FRAMED_REPLIES: dict[str, tuple[Op, bytes, int]] = {
    # id: (the op the client sends, its reply frame, the status the error carries)
    "prefill, bad json": (Op.PREFILL, reply_frame(200, "", b'{"slots": ["s0"], "o"'), 200),
    "prefill, timing not ascii": (Op.PREFILL, struct.pack(">IHH", 4 + 2 + 2, 200, 2) + b"\xff\xfe{}", 200),
    "prepare, missing its id": (Op.PREPARE, reply_frame(201, "", b'{"slots": ["s0"], "graphed": false}'), 201),
    "prepare, bad json": (Op.PREPARE, reply_frame(201, "", b'{"prepared": '), 201),
}


def _framed_call(op: Op) -> Callable[[Any], Any]:
    seq = _sequence(4, "s0")
    return (lambda c: c.prefill(0, [seq])) if op == Op.PREFILL else (lambda c: c.prepare(0, [seq]))


@pytest.mark.parametrize("case", FRAMED_REPLIES)
def test_a_malformed_framed_reply_raises_malformed_response(peer: _Peer, framed: Any, case: str) -> None:
    op, frame, status = FRAMED_REPLIES[case]
    path = framed({op: frame})
    with KDAClient(peer.url, transport="shm", framed_socket=path, timeout=TIMEOUT) as c:
        with pytest.raises(MalformedResponse) as err:
            _framed_call(op)(c)
    _check(err, status)
    if op == Op.PREPARE:  # the prepared prefill's region went back
        assert sum(s.startswith("DELETE /shm/regions/") for s in peer.served) == 1


@pytest.mark.parametrize("case", FRAMED_REPLIES)
def test_a_malformed_framed_reply_raises_malformed_response_async(peer: _Peer, framed: Any, case: str) -> None:
    op, frame, status = FRAMED_REPLIES[case]
    path = framed({op: frame})

    async def main() -> None:
        async with AsyncKDAClient(peer.url, transport="shm", framed_socket=path, timeout=TIMEOUT) as c:
            result = _framed_call(op)(c)
            await result

    with pytest.raises(MalformedResponse) as err:
        _arun(main())
    _check(err, status)


# -- only decoding failures become MalformedResponse ---------------------------------------------

@pytest.mark.parametrize("raised", [
    MalformedBody("bad safetensors body"), ValueError("no"), KeyError("o"), TypeError("list indices"),
    json.JSONDecodeError("Expecting value", "{", 1),
], ids=lambda e: type(e).__name__)
def test_decoding_turns_a_decoding_error_into_malformed_response(raised: Exception) -> None:
    with pytest.raises(MalformedResponse) as err:
        with decoding(200, "the GET /info response"):
            raise raised
    assert err.value.__cause__ is raised
    assert err.value.what == "the GET /info response"


@pytest.mark.parametrize("raised", [
    torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("a kernel failed"), MemoryError(),
    KeyboardInterrupt(), ConnectionResetError(),
], ids=lambda e: type(e).__name__)
def test_decoding_lets_every_other_error_through(raised: BaseException) -> None:
    with pytest.raises(type(raised)) as err:
        with decoding(200, "the POST /prefill response"):
            raise raised
    assert err.value is raised


def test_malformed_response_is_exported() -> None:
    import kda_client
    import service.client

    assert "MalformedResponse" in kda_client.__all__
    assert service.client.MalformedResponse is MalformedResponse  # the old import path too


@pytest.mark.parametrize("member", [{"num_heads": "2"}, {"head_v_dim": 8.0}, {"head_k_dim": True}, {"num_heads": 0},
                                    {"head_v_dim": -8}])
def test_an_info_reply_with_a_wrong_typed_geometry_member_raises_malformed_response(peer: _Peer,
                                                                                  member: dict[str, Any]) -> None:
    """A geometry member of /info that is not a positive integer is a reply the client
    cannot decode: MalformedResponse at once, not a bare TypeError while laying out the
    region, nor a region laid out by it and a prefill sent."""
    peer.info = {**GEOMETRY, **member}
    with KDAClient(peer.url, transport="shm", timeout=TIMEOUT) as c:
        with pytest.raises(MalformedResponse) as err:
            c.prefill(0, [_sequence(4)])
    _check(err)
    assert "GET /info" in err.value.what and "POST /prefill" not in peer.served

    async def main() -> None:
        async with AsyncKDAClient(peer.url, transport="shm", timeout=TIMEOUT) as c:
            await c.prefill(0, [_sequence(4)])

    with pytest.raises(MalformedResponse) as err:
        _arun(main())
    _check(err)


@pytest.mark.parametrize("retry_after", [10 ** 400, -1, "5", None], ids=["huge", "negative", "string", "null"])
def test_a_503_whose_retry_after_member_is_no_number_of_seconds_gives_none(peer: _Peer, retry_after: Any) -> None:
    """A 503 without the header (as the framed socket's replies are) whose problem member
    ``retry_after`` is too large for a float, negative or not a number: the client's
    ServiceUnavailable, its ``retry_after`` None, not an OverflowError."""
    problem = {"type": "urn:kda-serve:pool-full", "status": 503, "detail": "full", "retry_after": retry_after}
    peer.prefill = lambda _: (503, "application/problem+json", json.dumps(problem).encode())
    with KDAClient(peer.url, timeout=TIMEOUT) as c:
        with pytest.raises(ServiceUnavailable) as err:
            c.prefill(0, [_sequence(4)])
    assert err.value.retry_after is None
