"""`KDAHttpProtocol`: uvicorn's httptools protocol, with large request bodies collected whole
and HTTP framing errors answered as problem+json; `KDAHttpConnection`, the buffered
protocol around it that uvicorn is given.

uvicorn hands a body to the app in the pieces it reads (64 KiB or so), pauses reading
whenever 64 KiB wait unread (``flow_control.HIGH_WATER_LIMIT``), and copies each piece into
new bytes in ``receive()``: a 100 MB body is ~1600 ``receive()`` round trips through the
middleware, and each byte is copied once more than needed. Here, once the app asks for the
body of a request framed by Content-Length (asking means accepting that size: kda-serve's
body limit refuses a larger Content-Length before the first ``receive()``), reading no
longer pauses, the bytes still to come are copied from each read straight into one buffer
(past the HTTP parser, which would first copy them into new bytes; it is replaced by a
fresh one once the body is complete; uvicorn is given `KDAHttpConnection`, a buffered
protocol, so that once the body's warm buffer is known the reads land in it with no copy at
all), and the app gets the whole body in one ``http.request`` message whose ``body`` is
that buffer (a bytearray, handed over, not copied). While the body arrives the app is woken every `PROGRESS_S` with an empty
``more_body`` message, so a deadline on the next bytes (``--body-timeout-s``) still tells
a slow upload from a stalled one. A client that announces a large body and sends a few
bytes still costs a few bytes: the buffer grows as bytes arrive. The server keeps the
buffers of its last two large bodies, whichever connections they came on
(`service.wire.buffers`, in uvicorn's per-server ``app_state``): the next body of that size is
read into memory already paged in (page faults on fresh memory cost ~8x the copy here),
and idle keep-alive connections hold no body memory.

A response's writes are corked (`CorkedWrites`): uvicorn writes the status line and
headers, then each body message, each with its own ``send()``; small writes go out joined in one ``send()`` when the response is complete, or at the end
of the event loop's turn when it is not yet (a small safetensors reply: one system call
instead of four, and one read for the client).

Requests without Content-Length (chunked), bodies the app does not read, pipelined
requests waiting their turn, keep-alive, disconnects and shutdown are uvicorn's own; the
client's FIN is not. uvicorn takes it for the client leaving and closes the connection:
requests read whole behind the one running were never answered (nor run). But a FIN may
be a half-close (``shutdown(SHUT_WR)``, ``nc -N``: the client still reads) as well as a
close, and the server cannot tell which. Here (`KDAHttpProtocol.eof_received`) nothing
more is read, every request received whole before the FIN is run and answered, in order,
and the connection then closes. A request the FIN cut short is dropped: its headers
unfinished, it is never run; its body unfinished, it never gets it (it is not started when
its turn comes after the FIN, and is told the client left when already running, as on any
disconnect). A request that asks, once its body is read, whether its client is still there
is told it is gone, as before: in kda-serve only one that made slots asks, about to hand
over their ids (`service.http.abandon`), which a client that closed would never read; it
frees them, its answer is dropped and the connection closed (`KDAHttpProtocol._after_fin`).

Nor are pipelined requests left in the dark when the connection is lost (a reset, or a
close with an answer left unread). uvicorn tells only the newest request, the last one
queued, so the one running answered into nothing (and the slots it made stayed allocated,
their ids never delivered): here every request not yet answered is told
(`KDAHttpProtocol.connection_lost`), and those queued never run. While requests wait their
turn reading is paused, so the event loop does not see a reset or FIN that has arrived; a
request that asks, once its body is read, whether its client is still there is also told
it is gone when the kernel already knows (`client_hung_up`), or when the connection is
closing (its answer would go nowhere).

Where uvicorn answers a request its HTTP parser refuses with a plain-text 400, this answers
with an RFC 9457 problem (``bad-content-length`` for a malformed Content-Length or one
framing the body twice, 413 ``payload-too-large`` for one beyond 64 bits, ``bad-request``
otherwise, also for a request target the parser let through and uvicorn's URL parser
refuses, which uvicorn answers not at all), and closes the connection, as uvicorn does.

Connections are bounded where uvicorn leaves them open (`ConnectionLimits`, from the
server's settings through uvicorn's per-server ``app_state``, `LIMITS_STATE_KEY`): a new
connection must begin its first request within ``first_request_timeout_s`` (and one idle
between requests, its next within uvicorn's keep-alive timeout), else it is closed; a
request's line and headers must arrive within ``header_timeout_s`` of their first byte (408
after) and hold at most ``max_header_bytes`` (431, counted as they arrive, so a client
cannot make the server hold a 48 MiB header). A request asking to ``Upgrade`` (WebSocket,
h2c) is answered 400 ``upgrade-not-supported``: the server speaks HTTP/1.1 only. Each of
these answers is problem+json and closes the connection. An answer of the app's that closes
the connection (``Connection: close``) before the request's body was read whole, such as
the body limit's 413 from Content-Length, closes it lingering (`KDAHttpProtocol._linger`):
half-closed, the client's further bytes read and dropped for at most `LINGER_S` and
`LINGER_BYTES`, so that a client still sending its body reads the answer rather than a
reset. A request refused before the app saw it is counted through the app's `CountRefused`
(uvicorn's per-server ``app_state``, `REFUSED_STATE_KEY`): the app counts those it runs.

    uvicorn.run(app, http=KDAHttpConnection)

It overrides hooks of uvicorn's ``HttpToolsProtocol`` that are not public API
(``_start_asgi_task``, the cycle's fields), as of uvicorn 0.54 and 0.55: pyproject.toml caps
uvicorn to those minors, tests/transport/test_transport_http_protocol.py fails if they move,
and `service.http.protocol_choice` serves with uvicorn's stock protocol (and a warning) when
this module does not import or the hooks are gone.
"""
from __future__ import annotations

import asyncio
import socket
import time
from contextlib import suppress
from functools import partial
from typing import Any, Callable, Optional

import httptools
from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGIReceiveEvent, ASGISendCallable, Scope
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from .limits import LIMITS_STATE_KEY, REFUSED_STATE_KEY, ConnectionLimits, CountRefused
from .problem_details import PAYLOAD_TOO_LARGE, problem
from .request_id import REQUEST_ID_HEADER, new_request_id
from ..wire.buffers import WarmBuffers

PROGRESS_S = 0.1
"""How often the app is woken, with no bytes, while a whole body is being collected."""

LINGER_S = 2.0
"""At most how long a connection answered before its request's body was read (an early
413 or 408, ``Connection: close``) goes on reading, and dropping, what its client sends
before it closes (`KDAHttpProtocol._linger`)."""

LINGER_BYTES = 8 << 20
"""At most how many bytes it drops meanwhile: the connection closes at whichever comes first."""


WARM_STATE_KEY = "kda_serve.warm_bodies"
"""Where the server's `WarmBuffers` lives in uvicorn's per-server lifespan state."""

TCP_HUNG_UP = (7, 8)
"""Linux's TCP states (``tcpi_state``, include/net/tcp_states.h) of a connection whose peer
has ended it: CLOSE (reset) and CLOSE_WAIT (its FIN arrived)."""


class _Refusal(Exception):
    """Raised from a parser callback to stop parsing: ``response`` (whole, bytes, its
    status ``status``) is sent and the connection closed."""

    def __init__(self, status: int, response: bytes) -> None:
        super().__init__("request refused")
        self.status = status
        self.response = response


def raw_problem(status: int, slug: str, detail: str, title: Optional[str] = None) -> bytes:
    """A whole HTTP/1.1 problem+json response with ``Connection: close``, as bytes, under a
    new request id (the request never reached the app that gives one)."""
    request_id = new_request_id()
    response = problem(status, slug, detail, title=title, request_id=request_id,
                       headers={"Connection": "close", REQUEST_ID_HEADER: request_id})
    head = [STATUS_LINE[status]] + [name + b": " + value + b"\r\n" for name, value in response.raw_headers]
    return b"".join(head) + b"\r\n" + response.body


def client_hung_up(transport: asyncio.Transport) -> bool:
    """Whether the kernel already knows that the client of ``transport`` (open, not
    closing: its socket is still its own) has reset or closed its side, though the event
    loop may not have read it yet: while pipelined requests wait their turn reading is
    paused, and the loop does not watch the socket at all. Linux only (``TCP_INFO``);
    False elsewhere, and for a connection that is not TCP."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except OSError:
        return False
    return state[0] in TCP_HUNG_UP


def declared_length(headers: list[tuple[bytes, bytes]]) -> Optional[int]:
    """The Content-Length of a request framed by it alone (None when chunked or absent);
    the HTTP parser has already refused malformed or conflicting values."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
    return length


def declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers announce a body: chunked, or a Content-Length above 0."""
    return any(name == b"transfer-encoding" for name, _ in headers) or bool(declared_length(headers))


def parser_problem(error: httptools.HttpParserError) -> tuple[int, bytes]:
    """(status, the whole HTTP response) for a request the parser refused; it closes the connection."""
    detail = str(error) or "invalid HTTP request"
    if "Content-Length overflow" in detail:
        slug, title = PAYLOAD_TOO_LARGE
        return 413, raw_problem(413, slug, f"{detail}: the body's size does not fit in 64 bits", title=title)
    if "Content-Length" in detail:
        return 400, raw_problem(400, "bad-content-length", f"{detail}: the body's framing cannot be trusted")
    return 400, raw_problem(400, "bad-request", f"{detail}: not a valid HTTP/1.1 request")


class _Collect:
    """A body being collected whole: into a warm buffer of its size, or by growing
    ``cycle.body`` (the buffer is then kept warm for the next body of its size)."""

    def __init__(self, cycle: RequestResponseCycle, length: int, warm: WarmBuffers) -> None:
        self.cycle = cycle
        self._warm = warm
        self._into = warm.take(length)
        self._view: Optional[memoryview] = None
        self._filled = 0
        self.remaining = length - len(cycle.body)  # body bytes not seen yet
        if self._into is not None:
            self._view = memoryview(self._into)
            self._filled = len(cycle.body)
            self._view[:self._filled] = cycle.body  # what arrived before the app asked for the body
            cycle.body = bytearray()

    def add(self, data: bytes | bytearray | memoryview) -> None:
        self.remaining -= len(data)
        if self.cycle.response_complete:  # answered without its body: the rest is dropped
            return
        if self._view is None:
            self.cycle.body += data
            return
        self._view[self._filled:self._filled + len(data)] = data
        self._filled += len(data)

    def target(self) -> Optional[memoryview]:
        """The rest of the warm buffer, for a read to land in directly (then `advance`);
        None when the body grows in ``cycle.body`` or its answer has gone out already."""
        if self._view is None or self.cycle.response_complete or self.remaining <= 0:
            return None
        return self._view[self._filled:self._filled + self.remaining]

    def advance(self, n: int) -> None:
        """``n`` bytes were read into `target`."""
        self._filled += n
        self.remaining -= n

    def finish(self) -> bytearray:
        """The whole body, handed over (the parser has seen exactly Content-Length bytes)."""
        self.release()
        if self._into is not None:
            return self._into
        body, self.cycle.body = self.cycle.body, bytearray()
        self._warm.keep(body)
        return body

    def release(self) -> None:
        """Let go of the warm buffer's memoryview (a buffer viewed is never reused)."""
        if self._view is not None:
            self._view.release()
            self._view = None


class CorkedWrites:
    """A transport whose small writes are held and go out joined, in one write, at `flush`
    (the protocol calls it when the response is complete) or at the end of the event loop's
    current turn, whichever comes first: at most `HELD` bytes are held; a larger write
    flushes what is held and goes out as it is. Everything else is the transport's."""

    HELD = 64 * 1024

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 owner: Optional[RequestResponseCycle] = None, closer: Optional[Callable[[], None]] = None) -> None:
        self._transport = transport
        self.owner = owner  # the cycle whose response this carries
        self._closer = closer or transport.close  # how `close` ends the connection, once what is held is out
        self._loop = loop
        self._held: list[Any] = []  # bytes-like pieces, in order
        self._size = 0

    def write(self, data: Any) -> None:
        n = len(memoryview(data).cast("B"))
        if self._size + n > self.HELD:
            self.flush()
            if n > self.HELD:
                self._transport.write(data)
                return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)
        self._size += n

    def flush(self) -> None:
        """Write what is held (dropped when the transport is closing: the client is gone)."""
        held, self._held, self._size = self._held, [], 0
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._closer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class KDAHttpProtocol(HttpToolsProtocol):
    """See the module docstring. One instance per connection, as uvicorn's; the warm
    buffers (`service.wire.buffers`) are the server's, shared by its connections."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._warm: WarmBuffers = app_state.setdefault(WARM_STATE_KEY, WarmBuffers())
        self._whole: Optional[_Collect] = None  # the body being collected whole, if any
        self._woken = 0.0  # when its reader was last woken (time.monotonic)
        self.limits: ConnectionLimits = app_state.get(LIMITS_STATE_KEY) or ConnectionLimits()
        self._count_refused: Optional[CountRefused] = app_state.get(REFUSED_STATE_KEY)
        self._in_headers = False  # a request has begun and its headers are not yet handed to the app
        self._header_bytes = 0  # bytes of those headers seen so far (at least)
        self._messages = 0  # requests begun on this connection
        self._idle: Optional[asyncio.TimerHandle] = None  # closes a connection that starts no request
        self._header_deadline: Optional[asyncio.TimerHandle] = None  # 408 for headers still incomplete
        self._corks: list[CorkedWrites] = []  # the writes of responses not yet complete (pipelining: several)
        self._refusal: Optional[bytes] = None  # a refusal waiting for the responses to the requests before it
        self._trailer_bytes = 0  # the trailer fields of the request's chunked body so far
        self._eof = False  # the client has sent its FIN: nothing more will arrive
        self._linger_end: Optional[asyncio.TimerHandle] = None  # set while the connection lingers (`_linger`)
        self._linger_left = 0  # bytes it may still drop meanwhile

    # -- connection limits ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle = self.loop.call_later(self.limits.first_request_timeout_s, self._close_idle)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_timers()
        self._disconnect_all()
        super().connection_lost(exc)

    def _disconnect_all(self) -> None:
        """Tell every request of the connection not yet answered that its client is gone:
        uvicorn tells only the newest (``self.cycle``), which is a queued one when requests
        are pipelined, so the one running would answer into nothing (and the slots it made
        would stay allocated, their ids never delivered). The queued ones never run."""
        for cycle in self._unanswered():
            cycle.disconnected = True
            cycle.message_event.set()

    def _unanswered(self) -> list[RequestResponseCycle]:
        """The requests begun on this connection whose answer is not complete: those started
        (each owns a cork until its response completes) and those queued behind them."""
        started = [cork.owner for cork in self._corks if cork.owner is not None]
        queued = [cycle for cycle, _ in self.pipeline]
        return [cycle for cycle in started + queued if not cycle.response_complete]

    def eof_received(self) -> bool:
        """The client's FIN (see the module docstring): nothing more is read. The connection
        stays open, half-closed, while requests received whole before it are still to be
        answered (`on_response_complete` closes it after the last); else it closes now
        (False). A request the FIN cut short is dropped: one in its headers at once, one
        with its body unfinished at its turn (`_after_fin`), or at once when it is running
        (its app is told the client left). Called again whenever reading resumes (uvloop)."""
        self._eof = True
        self._cancel_timers()
        running_cut_short = self.cycle is not None and self.cycle.more_body and not self.pipeline
        return self._answering() and not running_cut_short

    def _gone(self, cycle: RequestResponseCycle) -> None:
        """Take ``cycle``'s client for gone: its answer goes nowhere, and the connection
        closes (nothing behind it is run)."""
        cycle.disconnected = True
        self.transport.close()

    def _hung_up(self) -> bool:
        """Whether the client is known to be gone: its FIN read, the connection closing (an
        answer goes nowhere), or its FIN or reset already in the kernel (`client_hung_up`)."""
        if self._eof or self.transport.is_closing():
            return True
        return client_hung_up(self.transport)

    def _cancel_timers(self) -> None:
        for timer in (self._idle, self._header_deadline, self._linger_end):
            if timer is not None:
                timer.cancel()
        self._idle = self._header_deadline = self._linger_end = None

    def _close_after(self, cycle: RequestResponseCycle) -> None:
        """End the connection once ``cycle``'s response (``Connection: close``) is out: at
        once, or lingering (`_linger`) when that response came before the request's body
        was read whole, while its client may still be sending it."""
        if (cycle is self.cycle and cycle.response_complete and cycle.more_body and not self._eof
                and not self.transport.is_closing()):
            self._linger(cycle)
        else:
            self.transport.close()

    def _linger(self, cycle: RequestResponseCycle) -> None:
        """A lingering close (RFC 9112 9.6): closed with the body's bytes unread, the socket
        would send a reset, and a client still writing its body might never read the
        response ahead of it (httpx's asyncio client: ``ReadError``). Instead the server
        half-closes (its FIN follows the response) and reads, dropping what arrives, until
        the client closes, `LINGER_BYTES` are dropped or `LINGER_S` pass; then it closes."""
        self._cancel_timers()
        self._whole, cycle.body = None, bytearray()  # none of the body is kept
        cycle.waiting_for_100_continue = False  # nothing more is written
        self._linger_left = LINGER_BYTES
        self._linger_end = self.loop.call_later(LINGER_S, self.transport.close)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()

    def _drop(self, n: int) -> None:
        """``n`` bytes arrived while lingering: dropped, and the connection closed past the cap."""
        self._linger_left -= n
        if self._linger_left < 0:
            self.transport.close()

    def _close_idle(self) -> None:
        """No request began in time: nothing to answer, the connection just closes."""
        self._idle = None
        if not self.transport.is_closing():
            self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self._in_headers and not self.transport.is_closing():
            self._refuse(408, raw_problem(408, "request-timeout", f"the request's headers did not arrive within "
                                          f"{self.limits.header_timeout_s:g} s of their first byte "
                                          "(--header-timeout-s)"))

    def _refuse(self, status: int, response: bytes) -> None:
        """Answer a request that cannot be read with ``response`` (its status ``status``) and
        close the connection: at once when it is the request whose body is being read (its
        own handler sees the client gone), else (a request that follows others on the
        connection) once the requests before it are answered, in order (pipelining);
        nothing more is read meanwhile. Counted (`CountRefused`) when the app never sees
        the request (`_unseen`): the app counts the requests it runs."""
        self._cancel_timers()
        self.logger.warning("refused a request: %s", response.split(b"\r\n", 1)[0].decode("latin-1"))
        if self._count_refused is not None and self._unseen():
            # the parser has read the method once it read any of the target that follows it
            self._count_refused(status, self.parser.get_method().decode("ascii") if self.url else "unknown")
        if not (self.cycle is not None and self.cycle.more_body) and self._answering():
            self._refusal = response
            self.flow.pause_reading()
            return
        self.transport.write(response)
        self.transport.close()

    def _unseen(self) -> bool:
        """Whether the request being read, now refused, never reaches the app: its request
        line or headers unfinished (or refused in `on_headers_complete`), or its body
        unfinished while it waits its turn behind others (the refusal closes the
        connection: nothing queued runs)."""
        return self._in_headers or any(cycle is self.cycle for cycle, _ in self.pipeline)

    def _answering(self) -> bool:
        """Whether a request begun before now is still to be answered (running or queued)."""
        return (self.cycle is not None and not self.cycle.response_complete) or bool(self.pipeline)

    def _header_size_problem(self, size: int) -> bytes:
        return raw_problem(431, "request-header-fields-too-large", f"the request line and headers hold {size} bytes "
                           f"or more, over the {self.limits.max_header_bytes}-byte limit (--max-header-kb)")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_headers:
            super().on_header(name, value)
            return
        # a chunked body's trailer field: counted against the header limit, then dropped (nothing reads trailers)
        self._trailer_bytes += len(name) + len(value) + 4
        if self._trailer_bytes > self.limits.max_header_bytes:
            raise _Refusal(431, raw_problem(431, "request-header-fields-too-large", f"the chunked body's trailer "
                                            f"fields hold {self._trailer_bytes} bytes or more, over the "
                                            f"{self.limits.max_header_bytes}-byte limit (--max-header-kb)"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._trailer_bytes = 0
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._in_headers, self._header_bytes = True, 0
        self._messages += 1
        self._header_deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            raise _Refusal(431, self._header_size_problem(size))
        if self.parser.should_upgrade():
            upgrade = dict(self.headers).get(b"upgrade", b"").decode("latin-1")
            raise _Refusal(400, raw_problem(400, "upgrade-not-supported", f"this server speaks HTTP/1.1 only: it "
                                            f"does not upgrade the connection (Upgrade: {upgrade[:64]!r}); send the "
                                            "request without Upgrade", title="Upgrade not supported"))
        version = self.parser.get_http_version()
        if version == "1.0":
            self.expect_100_continue = False  # RFC 9110 10.1.1: an HTTP/1.0 request's expectation is ignored
        elif (hosts := sum(1 for name, _ in self.headers if name == b"host")) != 1:
            raise _Refusal(400, raw_problem(400, "bad-request", f"an HTTP/{version} request needs exactly one Host "
                                            f"header (RFC 9112 3.2), got {hosts}"))
        super().on_headers_complete()  # the request is the app's from here (raising: refused, `data_received`)
        self._in_headers = False

    def on_response_complete(self) -> None:
        for cork in self._corks:  # the whole response out now, before anything may close the connection
            cork.flush()
        self._corks = [c for c in self._corks if c.owner is not None and not c.owner.response_complete]
        super().on_response_complete()
        if self._refusal is not None:  # the refused request's turn once every request before it is answered
            self.flow.pause_reading()
            if not self._answering() and not self.transport.is_closing():
                self.transport.write(self._refusal)
                self.transport.close()
            return
        if self.transport.is_closing() or self._linger_end is not None:
            return
        if self._eof:  # half-closed: the connection ends with the last answer
            if not self._answering():
                self.transport.close()
        elif not self.pipeline and self._idle is None:
            # idle between requests: uvicorn's keep-alive timer, which any byte cancels; this
            # one only a request's start does
            self._idle = self.loop.call_later(self.timeout_keep_alive, self._close_idle)

    # -- bytes in ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._linger_end is not None:
            self._drop(len(data))
            return
        if self._refusal is not None:  # a request was refused: nothing after it is read
            return
        self._unset_keepalive_if_required()
        whole = self._whole
        if whole is not None and whole.cycle is self.cycle and whole.remaining > 0:
            # The body's bytes go straight into its buffer, past the parser (which would
            # copy each piece into new bytes first). The parser, still expecting them, is
            # replaced once the body is complete; it sees whatever follows (a pipelined
            # request) from a clean state.
            n = min(len(data), whole.remaining)
            with memoryview(data) as view:
                whole.add(view[:n])
            self._body_progress(whole)
            data = data[n:]
            if not data:
                return
        counted = self._messages if self._in_headers else -1  # this request's headers go on in data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            refusal = e.__context__
            if isinstance(refusal, httptools.HttpParserInvalidURLError):  # llhttp took it, uvicorn's parse_url not
                refusal = _Refusal(400, raw_problem(400, "bad-request", "the request target is not a valid URL"))
            if not isinstance(refusal, _Refusal):
                raise
            self._refuse(refusal.status, refusal.response)
            return
        except httptools.HttpParserUpgrade:  # refused in on_headers_complete: not reached
            self._refuse(400, raw_problem(400, "upgrade-not-supported", "this server does not upgrade connections"))
            return
        except httptools.HttpParserError as e:
            status, response = parser_problem(e)
            self.logger.warning("Invalid HTTP request received (%s): %d", e, status)
            self._refuse(status, response)
            return
        if self._in_headers and self._messages == counted:  # still the same headers: all of data was theirs
            self._header_bytes += len(data)  # (a request that began inside data is counted from the next read)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, self._header_size_problem(self._header_bytes))

    def body_target(self) -> Optional[memoryview]:
        """Where the next read may land directly (`KDAHttpConnection`): the rest of the
        whole body being collected, in its warm buffer; None when there is no such place."""
        whole = self._whole
        if whole is None or whole.cycle is not self.cycle:
            return None
        return whole.target()

    def body_arrived(self, n: int) -> None:
        """``n`` bytes were read into `body_target`'s memory."""
        self._unset_keepalive_if_required()
        assert self._whole is not None
        self._whole.advance(n)
        self._body_progress(self._whole)

    def _body_progress(self, whole: _Collect) -> None:
        """After bytes of ``whole`` arrived past the parser: wake its reader now and then,
        and once it is complete, end the message with a fresh parser."""
        self._progress(whole)
        if whole.remaining == 0:
            self._fresh_parser()
            self.on_message_complete()

    def _fresh_parser(self) -> None:
        """A parser in its initial state, set up as uvicorn sets up its own."""
        self.parser = httptools.HttpRequestParser(self)
        with suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)

    def on_body(self, body: bytes) -> None:
        whole = self._whole
        if whole is None or whole.cycle is not self.cycle:
            super().on_body(body)
            return
        whole.add(body)
        self._progress(whole)

    def _progress(self, whole: _Collect) -> None:
        """Wake the body's reader every PROGRESS_S while bytes arrive (its deadline on the
        next bytes must see them)."""
        now = time.monotonic()
        if now - self._woken >= PROGRESS_S and not whole.cycle.response_complete:
            self._woken = now
            whole.cycle.message_event.set()

    def on_message_complete(self) -> None:
        if self._whole is not None and self._whole.cycle is self.cycle:
            if self.cycle.response_complete:  # answered without its body: the buffer is free again
                self._whole.release()
            self._whole = None
        super().on_message_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        cork = CorkedWrites(cycle.transport, self.loop, cycle, closer=partial(self._close_after, cycle))
        cycle.transport = cork  # type: ignore[assignment]
        self._corks.append(cork)
        app = self._after_fin(cycle, app)
        length = declared_length(cycle.scope["headers"])
        if length is not None:
            app = self._with_whole_body(cycle, length, app)
        super()._start_asgi_task(cycle, app)

    def _after_fin(self, cycle: RequestResponseCycle, app: ASGI3Application) -> ASGI3Application:
        """``app`` minding the client's FIN (`eof_received`): not started when the FIN cut
        ``cycle``'s body short; once its body is handed over (or when it has none), a
        ``receive`` after the FIN is told the client is gone (`_gone`), as a client that
        closed must be: only a request that made slots asks, to free them rather than send
        their ids to nobody. So is one whose connection is closing, or whose client the
        kernel knows has reset or closed the connection (`client_hung_up`) though the
        event loop has not read it yet (reading is paused while pipelined requests wait)."""
        body_due = declares_body(cycle.scope["headers"])

        async def fin_aware_app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
            if self._eof and cycle.more_body:  # its body will never come
                self._gone(cycle)
                return

            async def fin_aware_receive() -> ASGIReceiveEvent:
                nonlocal body_due
                if not body_due and not cycle.response_complete and self._hung_up():
                    self._gone(cycle)
                    return {"type": "http.disconnect"}
                message = await receive()
                body_due = message["type"] == "http.request" and bool(message.get("more_body", False))
                return message

            await app(scope, fin_aware_receive, send)

        return fin_aware_app

    def _with_whole_body(self, cycle: RequestResponseCycle, length: int, app: ASGI3Application) -> ASGI3Application:
        """``app`` with ``receive`` replaced by one that delivers ``cycle``'s body whole."""
        whole: Optional[_Collect] = None

        async def receive() -> ASGIReceiveEvent:
            # uvicorn's RequestResponseCycle.receive, but for the body: whole, and not copied.
            nonlocal whole
            if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
                cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                cycle.waiting_for_100_continue = False
            if not cycle.disconnected and not cycle.response_complete:
                if whole is None and cycle is self.cycle and cycle.more_body:
                    whole = self._whole = _Collect(cycle, length, self._warm)
                    self._woken = time.monotonic()
                cycle.flow.resume_reading()
                await cycle.message_event.wait()
                cycle.message_event.clear()
            if cycle.disconnected or cycle.response_complete:
                return {"type": "http.disconnect"}
            if cycle.more_body:
                return {"type": "http.request", "body": b"", "more_body": True}
            if whole is not None:
                body, whole = whole.finish(), None
            else:
                body, cycle.body = cycle.body, bytearray()
            return {"type": "http.request", "body": body, "more_body": False}  # type: ignore[typeddict-item]

        async def whole_body_app(scope: Scope, _: ASGIReceiveCallable, send: ASGISendCallable) -> None:
            await app(scope, receive, send)

        return whole_body_app


class KDAHttpConnection(asyncio.BufferedProtocol):
    """What uvicorn is given (``http=KDAHttpConnection``): a `KDAHttpProtocol` behind
    asyncio's buffered-protocol interface, so that reads of a whole body land in its buffer
    with no copy in between. uvloop (like asyncio) reads straight into the memory a
    buffered protocol hands it, but into its own buffer, then new bytes, for an
    ``asyncio.Protocol`` such as uvicorn's. Everything else is read into a scratch buffer
    and handed to the wrapped protocol's ``data_received`` as bytes, as before.
    """

    READ_SIZE = 256 * 1024  # uvloop's own read buffer size

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self.http = KDAHttpProtocol(config, server_state, app_state, _loop)
        self._scratch = memoryview(bytearray(self.READ_SIZE))
        self._into_body = False  # whether the last buffer handed out was the body's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.http.connection_lost(exc)

    def eof_received(self) -> Optional[bool]:
        return self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self.http.body_target()
        self._into_body = target is not None
        return target if target is not None else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_body:
            self.http.body_arrived(nbytes)
        else:
            self.http.data_received(bytes(self._scratch[:nbytes]))
