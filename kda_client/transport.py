"""`StdlibTransport`: an httpx transport for plain ``http://`` over the standard library's
``http.client``, built for large bodies.

httpx's default transport (httpcore and h11) joins every request chunk into new bytes
before sending it, and reads a response through h11's receive buffer in 64 KiB pieces
(two more copies of every byte). Here each request chunk (the client's memoryviews of
tensors) goes to the socket as it is (``sendall``), and a response with a Content-Length
is read with ``readinto`` straight into one buffer of that size, handed to httpx as one
bytearray chunk (`service.wire.buffers.BodyBuffer` takes it over without a copy). Buffers of
large responses are reused once nothing references them any more (`service.wire.buffers`:
the transport keeps the last two), so a response of the size before it lands in memory
already paged in.

httpx stays the API: base URL, default headers (the API key), ``timeout`` (connect, write
and read, applied to the socket per phase), streaming responses, status codes; socket and
protocol failures raise httpx's exceptions (ConnectError, ConnectTimeout, WriteError,
WriteTimeout, ReadError, ReadTimeout, RemoteProtocolError). Connections are kept alive and
reused, as httpcore's are: one is returned to the pool once its response has been read to
the end, and an idle one the server has closed meanwhile is dropped before reuse. As
httpcore does, a request whose body the server cuts off (an early 413) still gets the
response the server sent. Only plain HTTP/1.1: HTTPS and proxies stay with httpx's own
transport (`KDAClient` mounts this one for ``http://`` alone).
"""
from __future__ import annotations

import http.client
import select
import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import httpx

from service.wire.buffers import WarmBuffers

_Key = tuple[str, int]
MAX_IDLE = 8
"""Idle connections kept per host and port."""


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: the server closed it (EOF) or
    sent bytes nobody asked for; either way it cannot carry the next request."""
    ready, _, _ = select.select([sock], [], [], 0)
    return bool(ready)


@contextmanager
def _mapped(request: httpx.Request, timeout: type[httpx.TimeoutException], error: type[httpx.TransportError]
            ) -> Iterator[None]:
    """Socket and http.client failures inside as httpx's ``timeout`` / ``error`` (protocol
    violations as RemoteProtocolError)."""
    try:
        yield
    except socket.timeout as e:
        raise timeout(str(e) or "timed out", request=request) from e
    except (http.client.HTTPException, ValueError) as e:  # bad status line, headers, chunking, incomplete body
        raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}", request=request) from e
    except OSError as e:
        raise error(f"{type(e).__name__}: {e}", request=request) from e


def _timeout(request: httpx.Request, phase: str) -> Optional[float]:
    return request.extensions.get("timeout", {}).get(phase)


class _Connection(http.client.HTTPConnection):
    """An HTTP connection whose request line, headers and body go out in one ``send()``
    while they come to at most `HELD` bytes together (a small request: one system call,
    and one read for the server, instead of one per body piece); past that, what is held
    goes out and the rest as it comes."""

    HELD = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: Optional[list[Any]] = None  # None: not corked
        self._held_size = 0

    def cork(self) -> None:
        """Hold what is sent from now on (until `uncork`, or HELD bytes)."""
        self._held, self._held_size = [], 0

    def uncork(self) -> None:
        """Send what is held, joined."""
        held, self._held = self._held, None
        if held:
            super().send(held[0] if len(held) == 1 else b"".join(held))

    def send(self, data: Any) -> None:
        if self._held is not None:
            n = memoryview(data).nbytes
            if self._held_size + n <= self.HELD:
                self._held.append(data)
                self._held_size += n
                return
            self.uncork()
        super().send(data)


class _ResponseBody(httpx.SyncByteStream):
    """A response's body; its connection goes back to the pool once the body has been read
    to the end, and is closed otherwise."""

    def __init__(self, transport: "StdlibTransport", key: _Key, conn: _Connection,
                 response: http.client.HTTPResponse, request: httpx.Request) -> None:
        self._transport = transport
        self._key = key
        self._conn = conn
        self._response = response
        self._request = request

    def __iter__(self) -> Iterator[bytes]:
        response = self._response
        with _mapped(self._request, httpx.ReadTimeout, httpx.ReadError):
            if response.length is not None and not response.chunked:
                yield self._whole(response.length)
            else:
                while chunk := response.read1(1 << 20):
                    yield chunk

    def _whole(self, length: int) -> bytearray:
        warm = self._transport.warm
        buf = warm.take(length) or bytearray(length)
        with memoryview(buf) as view:
            got = 0
            while got < length:
                n = self._response.readinto(view[got:])
                if not n:
                    raise http.client.IncompleteRead(bytes(0), length - got)
                got += n
        warm.keep(buf)
        return buf

    def close(self) -> None:
        if self._response.isclosed() and not self._response.will_close:
            self._transport.release(self._key, self._conn)
        else:
            self._response.close()
            self._conn.close()


class StdlibTransport(httpx.BaseTransport):
    """See the module docstring. Thread-safe: each request holds its own connection."""

    def __init__(self, max_idle: int = MAX_IDLE) -> None:
        self._max_idle = max_idle
        self._idle: dict[_Key, list[_Connection]] = {}
        self._lock = threading.Lock()
        self.warm = WarmBuffers()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"StdlibTransport serves http:// only, not {request.url.scheme}://",
                                            request=request)
        key = (request.url.host, request.url.port or 80)
        conn = self._connection(key, request)
        try:
            response = self._exchange(conn, request)
        except BaseException:
            conn.close()
            raise
        return httpx.Response(
            response.status, headers=response.getheaders(),
            stream=_ResponseBody(self, key, conn, response, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason.encode("latin-1")},
        )

    def _connection(self, key: _Key, request: httpx.Request) -> _Connection:
        """An idle connection to ``key`` still open, or a new one."""
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                conn = idle.pop()
                if conn.sock is not None and not _readable(conn.sock):
                    return conn
                conn.close()
        conn = _Connection(key[0], key[1], timeout=_timeout(request, "connect"))
        with _mapped(request, httpx.ConnectTimeout, httpx.ConnectError):
            conn.connect()
        return conn

    def _exchange(self, conn: _Connection, request: httpx.Request) -> http.client.HTTPResponse:
        """Send ``request`` on ``conn`` and read the response's status line and headers."""
        assert conn.sock is not None
        conn.sock.settimeout(_timeout(request, "write"))
        with _mapped(request, httpx.WriteTimeout, httpx.WriteError):
            conn.cork()
            conn.putrequest(request.method, request.url.raw_path.decode("ascii"), skip_host=True,
                            skip_accept_encoding=True)
            for name, value in request.headers.raw:
                conn.putheader(name, value)
            conn.endheaders()
        try:
            with _mapped(request, httpx.WriteTimeout, httpx.WriteError):
                self._send_body(conn, request)
                conn.uncork()
        except httpx.WriteError as cut_off:
            try:  # the server may have refused the body early and said why (httpcore does the same)
                return self._response(conn, request)
            except httpx.TransportError:
                raise cut_off from None
        return self._response(conn, request)

    @staticmethod
    def _send_body(conn: http.client.HTTPConnection, request: httpx.Request) -> None:
        chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
        for chunk in request.stream:  # type: ignore[union-attr]  (a sync client's request)
            if chunked and chunk:
                conn.send(b"%x\r\n" % len(chunk))
            if chunk:
                conn.send(chunk)
            if chunked and chunk:
                conn.send(b"\r\n")
        if chunked:
            conn.send(b"0\r\n\r\n")

    @staticmethod
    def _response(conn: http.client.HTTPConnection, request: httpx.Request) -> http.client.HTTPResponse:
        if conn.sock is not None:
            conn.sock.settimeout(_timeout(request, "read"))
        with _mapped(request, httpx.ReadTimeout, httpx.RemoteProtocolError):
            return conn.getresponse()

    def release(self, key: _Key, conn: _Connection) -> None:
        """Keep ``conn`` (its last response read to the end) for the next request to ``key``."""
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if conn.sock is not None and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
