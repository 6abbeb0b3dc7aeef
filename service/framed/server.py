"""`FramedServer`: the framed socket front end over one `ServerCore` and the app's region
registry (frames: `service.wire.frames`).

A prefill runs as ``POST /prefill`` runs a shared memory request: the document parsed, its
regions leased, the inputs copied out (`service.shm.prefill.read_request`), the core's
validation, ordering and batching, the outputs written into the client's regions
(`write_result`), the reply's timing in ``Server-Timing`` form (decode, validate, kernel,
encode, and total: from the request's last byte read to its reply's write). What it leaves
out is HTTP: no request line or headers to parse, no ASGI middleware, one small frame each
way. Errors are the app's own problem documents with their HTTP statuses (``render``), so
a client handles them as it does over HTTP; bad input never changes a slot, as on every
front end. Slots a prefill created are freed when its reply cannot be delivered (the
client left).

PREPARE, RUN and RELEASE frames serve prepared prefills (`service.shm.prepared` over
`service.core.prepared`): a document checked once and kept on its connection under an id,
then run by that id as often as the client asks, each run reading the document's input
bytes anew; a connection's prepared prefills are released when it ends.

The socket file is created with mode 0600: only the server's user (and root) can connect.
A server with an API key also asks for it, once per connection (`Op.AUTH`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import stat
import time
from typing import Awaitable, Callable, Optional

from ..core.abandoned import release_abandoned
from ..core.server import ServerCore
from ..core.worker import off_loop
from ..errors import API_KEY_REQUIRED, ServiceError
from ..shm.prefill import host_bytes, input_refs, parse_shm_request, read_request, region_names, write_result
from ..shm.prepared import ShmPrepared, prepare_shm
from ..shm.registry import ShmRegistry
from ..wire.buffers import WarmBuffers
from ..wire.frames import PREPARED_ID, EmptyFrame, FrameTooLarge, Op, read_request as read_frame, reply_frame

log = logging.getLogger("kda_serve.framed")

Render = Callable[[Exception], Awaitable[tuple[int, bytes]]]
"""An exception's (HTTP status, problem+json body), as the HTTP app renders it."""


_OP_NAMES = {int(op): op.name.lower() for op in Op}
"""Each op's name in the metrics (``unknown`` for any other byte)."""
ABANDONED = 499  # the status a request whose client left before its reply counts with (nginx's, as over HTTP)

MAX_PREPARED = 256
"""Prepared prefills one connection may hold at once (a model's layers times its shapes)."""


def socket_path_problem(path: str) -> Optional[str]:
    """Why a framed socket cannot be made at ``path`` (its folder missing, a file that is
    not a socket there, or a socket a process listens on), or None; a stale socket there
    (nobody listens) is replaced by `FramedServer.start`."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"no folder {folder}"
    if not os.path.lexists(path):
        return None
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        return "a file that is not a socket is there"
    return _listened_on(path)


def _listened_on(path: str) -> Optional[str]:
    """Why the socket file at ``path`` is not stale (a connection to it is accepted, or
    refused for another reason than that nobody listens), or None when it is."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)  # a listener whose backlog is full would hold a blocking connect
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None  # left by a server that did not close, or gone since
        except OSError as e:
            return f"the socket there cannot be probed ({e.strerror or e}); remove it if it is stale"
    return "a server is listening on it (another kda-serve?)"


class _Refusal(ServiceError):
    """A framing-level refusal (unknown op, missing API key): ``status`` given per instance."""

    def __init__(self, status: int, slug: str, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.slug, self.title = status, slug, title


class FramedServer:
    """Serves ``path`` (a Unix socket, created on `start`, removed on `close`) for ``core``
    with the shared memory ``regions``. ``render`` turns a refused request's exception into
    its problem; ``api_key``: asked once per connection when set; ``timeout_s``: longest wait
    for the rest of a started frame (the connection is closed after it)."""

    def __init__(self, core: ServerCore, regions: ShmRegistry, path: str, render: Render, *,
                 api_key: Optional[str], timeout_s: float) -> None:
        self.core, self.regions, self.path, self.render = core, regions, path, render
        self.key = None if api_key is None else api_key.encode("utf-8")
        self.timeout_s = timeout_s
        self.buffers = WarmBuffers()  # host buffers POSIX shared memory inputs are copied out into
        self._server: Optional[asyncio.base_events.Server] = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen on the socket. A stale socket file (a server that did not close) is
        replaced; a path `socket_path_problem` refuses is an OSError."""
        if (why := socket_path_problem(self.path)) is not None:
            raise OSError(f"--framed-socket {self.path}: {why}")
        if os.path.lexists(self.path):
            os.unlink(self.path)
        old = os.umask(0o177)  # the socket is made 0600, with no window in which others could connect
        try:
            self._server = await asyncio.start_unix_server(self._connection, path=self.path)
        finally:
            os.umask(old)
        log.info("framed socket front end on %s", self.path)

    async def close(self) -> None:
        """Stop listening, end the open connections and remove the socket file."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        if os.path.lexists(self.path):
            os.unlink(self.path)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        prepared = _Prepared()  # this connection's
        try:
            await self._serve(reader, writer, prepared)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, asyncio.CancelledError):
            pass  # the client left, stalled inside a frame, or the server is closing: nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()
            for held in prepared.held.values():  # what the connection prepared goes with it
                try:
                    await self._release(held)
                except Exception:
                    log.exception("releasing a prepared prefill of a closed connection failed")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     prepared: "_Prepared") -> None:
        """Requests one at a time until the client closes the connection; ``prepared``
        holds the connection's prepared prefills."""
        authorized = self.key is None
        while True:
            try:
                request = await read_frame(reader, self.timeout_s)
            except (FrameTooLarge, EmptyFrame) as e:  # the frame's bytes are not read: the connection ends
                status = 413 if isinstance(e, FrameTooLarge) else 400
                slug, title = ("payload-too-large", "Request frame too large") if status == 413 else (
                    "malformed-body", "Malformed request frame")
                await self._reply(writer, "frame", *await self.render(_Refusal(status, slug, title, str(e))))
                return
            if request is None:
                return
            op, payload = request
            name = _OP_NAMES.get(op, "unknown")
            reply = _Reply(writer, time.perf_counter())
            status, timing, body, created = await self._answer(op, payload, authorized, prepared, reply)
            authorized = authorized or (op == Op.AUTH and status < 400)
            try:
                if not reply.sent:
                    reply.send(status, timing, body)
                await writer.drain()
            except ConnectionError:  # the reply cannot be delivered: nor may the slots made for it
                if created:  # freed, counted in kda_responses_abandoned
                    await release_abandoned(self.core.free, self.core.metrics.abandoned, self.core.slot_missing,
                                            created)
                self._count(name, ABANDONED, reply.started)
                raise
            self._count(name, reply.status, reply.started)

    def _count(self, op: str, status: int, started: float) -> None:
        """``kda_framed_requests{op, status}`` and the request's latency since ``started``."""
        self.core.metrics.framed_requests.labels(op, str(status)).inc()
        self.core.metrics.framed_latency.labels(op).observe(time.perf_counter() - started)

    async def _reply(self, writer: asyncio.StreamWriter, op: str, status: int, body: bytes) -> None:
        """A reply outside the request loop (a frame refused unread)."""
        writer.write(reply_frame(status, "", body))
        await writer.drain()
        self.core.metrics.framed_requests.labels(op, str(status)).inc()

    async def _answer(self, op: int, payload: bytes, authorized: bool, prepared: "_Prepared", reply: "_Reply"
                      ) -> tuple[int, str, bytes, list[str]]:
        """(status, timing, body, slots created) of one request (a RUN may have sent its
        reply already: ``reply.sent``)."""
        try:
            if op == Op.AUTH:
                if self.key is not None and not hmac.compare_digest(payload, self.key):
                    raise _Refusal(401, "unauthorized", "Unauthorized", "the API key does not match")
                return 204, "", b"", []
            if not authorized:
                raise _Refusal(401, "unauthorized", "Unauthorized",
                               f"{API_KEY_REQUIRED}: send it first in an AUTH frame (op {int(Op.AUTH)})")
            if op == Op.PING:
                return 200, "", b"", []
            if op == Op.PREFILL:
                return await self._prefill(payload)
            if op == Op.RUN:
                return await self._run(prepared.named(payload), reply)
            if op == Op.PREPARE:
                return await self._prepare(payload, prepared)
            if op == Op.RELEASE:
                await self._release(prepared.pop(payload))
                return 204, "", b"", []
            raise _Refusal(400, "unknown-op", "Unknown op",
                           f"op {op} is none of {', '.join(f'{o.name} ({int(o)})' for o in Op)}")
        except Exception as e:  # every refusal, and a bug: the app's problem for it (500 for a bug)
            if not isinstance(e, (ServiceError, *self.core.slot_missing)):
                log.exception("internal error answering a framed request (op %d)", op)
            status, body = await self.render(e)
            return status, "", body, []

    async def _prefill(self, payload: bytes) -> tuple[int, str, bytes, list[str]]:
        """A shared memory prefill (see the module docstring)."""
        parsed = parse_shm_request(payload)
        with self.regions.lease(region_names(parsed)) as leased:
            t0 = time.perf_counter()
            plan = await off_loop(read_request, parsed, leased, self.core, self.buffers,
                                  nbytes=host_bytes(input_refs(parsed), leased))
            decode_s = time.perf_counter() - t0
            result = await self.core.prefill(plan.inputs)
            t1 = time.perf_counter()
            try:
                doc = await off_loop(write_result, plan, result, leased,
                                     nbytes=host_bytes((plan.o, plan.final_state), leased))
            except ServiceError:  # the outputs cannot reach the client: nor may the slots made for it
                for slot_id in result.allocated:
                    await self.core.free(slot_id)
                raise
            encode_s = time.perf_counter() - t1
        phases = (("decode", decode_s), ("validate", result.validate_s), ("kernel", result.kernel_s),
                  ("encode", encode_s))
        timing = ", ".join(f"{name};dur={s * 1000:.3f}" for name, s in phases)
        return 200, timing, json.dumps(doc, separators=(",", ":")).encode(), result.allocated

    async def _prepare(self, payload: bytes, prepared: "_Prepared") -> tuple[int, str, bytes, list[str]]:
        """PREPARE: the document checked and kept under the connection's next id."""
        if len(prepared.held) >= MAX_PREPARED:
            raise _Refusal(400, "too-many-prepared", "Too many prepared prefills",
                           f"this connection holds {len(prepared.held)} prepared prefills, the most it may: "
                           "release some")
        held = await prepare_shm(parse_shm_request(payload), self.regions, self.core)
        number = prepared.add(held)
        self.core.metrics.prepared.inc()
        doc = {"prepared": number, "slots": held.prepared.slots, "graphed": held.prepared.graphed}
        return 201, "", json.dumps(doc, separators=(",", ":")).encode(), []

    async def _release(self, held: ShmPrepared) -> None:
        self.core.metrics.prepared.dec()
        await held.release(self.core)

    async def _run(self, held: ShmPrepared, reply: "_Reply") -> tuple[int, str, bytes, list[str]]:
        """RUN: one run of a prepared prefill, its outputs in place when it answers; the
        reply sent as soon as the run stands (before the core's bookkeeping, on the loop)."""
        await self.core.run_prepared(held.prepared, lambda run: reply.send(200, run.server_timing(), b""))
        return 200, "", b"", []  # sent


class _Reply:
    """One request's reply on ``writer``: `send` writes it once (without waiting for the
    socket: the caller drains), its timing given ``total``, the request's whole time in the
    server from ``started`` (its phases and all between them)."""

    def __init__(self, writer: asyncio.StreamWriter, started: float) -> None:
        self._writer = writer
        self.started = started
        self.sent = False
        self.status = 0

    def send(self, status: int, timing: str, body: bytes) -> None:
        """Write the reply frame (once: the caller checks ``sent``)."""
        if timing:
            timing += f", total;dur={(time.perf_counter() - self.started) * 1000:.3f}"
        self._writer.write(reply_frame(status, timing, body))
        self.sent, self.status = True, status


class _Prepared:
    """A connection's prepared prefills by id (ids count from 1 and are never reused on
    the connection, so a stale id is a 404, never another prefill)."""

    def __init__(self) -> None:
        self.held: dict[int, ShmPrepared] = {}
        self._next = 1

    def add(self, held: ShmPrepared) -> int:
        number, self._next = self._next, self._next + 1
        self.held[number] = held
        return number

    def named(self, payload: bytes) -> ShmPrepared:
        """The prepared prefill a RUN or RELEASE payload names (400 for a payload that is
        not an id, 404 for an id this connection does not hold)."""
        return self.held[self._number(payload)]

    def pop(self, payload: bytes) -> ShmPrepared:
        """`named`, no longer held."""
        return self.held.pop(self._number(payload))

    def _number(self, payload: bytes) -> int:
        """The id in a RUN or RELEASE payload, one this connection holds (else 400 or 404)."""
        if len(payload) != PREPARED_ID.size:
            raise _Refusal(400, "malformed-body", "Malformed request frame",
                           f"a RUN or RELEASE payload is a {PREPARED_ID.size}-byte prepared id, got {len(payload)} "
                           "bytes")
        (number,) = PREPARED_ID.unpack(payload)
        if number not in self.held:
            raise _Refusal(404, "unknown-prepared", "Unknown prepared prefill",
                           f"this connection holds no prepared prefill {number} (ids are per connection)")
        return number
