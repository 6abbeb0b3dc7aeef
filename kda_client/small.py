"""`SmallExchange`: `KDAClient`'s path for small requests over plain ``http://``, without
httpx.

A small call (a one-token prefill: ~1.5 KB each way) spends most of the client's time in
httpx's request and response objects (URL merging, header models, cookies, stream
contexts) and in ``http.client``'s header parser (the ``email`` package), not on the wire:
1.66 ms of client CPU per call against 0.89 for a ``GET`` through the same httpx client
(bench/RESULTS.md, issue 19). Here the request line, headers and body leave in one
``send()`` on a kept-alive socket, and the response is parsed by hand: the status line,
the header lines, then a body framed by Content-Length, chunked, or by the connection's
close. Only requests of at most `MAX_BODY` bytes come here; larger ones keep the httpx
path (`kda_client.transport.StdlibTransport`), which sends tensors' own bytes unjoined.

Behaviour matches that path where a caller can see it: the same connection is reused
while the server keeps it (one whose server has closed it, or that holds bytes nobody
asked for, is dropped before reuse), one ``timeout`` bounds each connect, write and read,
and failures raise httpx's exceptions (ConnectError, ConnectTimeout, WriteError,
WriteTimeout, ReadError, ReadTimeout, RemoteProtocolError).
"""
from __future__ import annotations

import select
import socket
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, Union

import httpx

MAX_BODY = 64 * 1024
"""Requests with bodies up to this size take this path (they leave in one ``send()``)."""

MAX_HEAD = 64 * 1024
"""A response's status line and headers may take at most this many bytes."""

MAX_IDLE = 8
"""Idle connections kept."""

_READ = 64 * 1024
_NO_BODY = frozenset({204, 304})

Piece = Union[bytes, bytearray, memoryview]


class Response:
    """A response read whole: ``status``, ``headers`` (lower-case names; repeated ones
    joined with ", ", as httpx's ``Headers.get`` gives them) and ``body``."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytearray) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class _Protocol(Exception):
    """A response that breaks HTTP/1.1 framing (raised as httpx.RemoteProtocolError)."""


class _Conn:
    """One socket and the bytes read past the last response's end (none, unless the server
    sent what nobody asked for)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def close(self) -> None:
        self.sock.close()


@contextmanager
def _mapped(method: str, url: str, timeout: type[httpx.TimeoutException], error: type[httpx.TransportError]
            ) -> Iterator[None]:
    """Socket failures and broken framing inside as httpx's exceptions."""
    try:
        yield
    except socket.timeout as e:
        raise timeout(str(e) or "timed out", request=httpx.Request(method, url)) from e
    except _Protocol as e:
        raise httpx.RemoteProtocolError(str(e), request=httpx.Request(method, url)) from e
    except OSError as e:
        raise error(f"{type(e).__name__}: {e}", request=httpx.Request(method, url)) from e


class SmallExchange:
    """Requests to ``host``:``port`` (``netloc`` in the Host header) below ``base_path``
    (the base URL's path),
    each with ``headers`` (the client's own: the API key) added, on kept-alive connections;
    ``timeout`` (seconds) per connect, write and read. Thread-safe: each request holds its
    own connection."""

    def __init__(self, host: str, port: int, netloc: str, base_path: str, headers: dict[str, str],
                 timeout: Optional[float]) -> None:
        self._address = (host, port)
        self._base = base_path.rstrip("/")
        self._origin = f"http://{netloc}"
        self._host_line = f"host: {netloc}\r\n"
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._timeout = timeout
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, headers: dict[str, str], body: Sequence[Piece] = ()) -> Response:
        """``method`` ``path`` (below the base path) with ``headers`` and the ``body``
        pieces (at most `MAX_BODY` bytes together), its response read whole."""
        target = self._base + path
        url = self._origin + target
        head = (f"{method} {target} HTTP/1.1\r\n{self._host_line}{self._fixed}"
                + "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n")
        message = b"".join((head.encode("latin-1"), *body))
        conn = self._connection(method, url)
        try:
            with _mapped(method, url, httpx.WriteTimeout, httpx.WriteError):
                conn.sock.sendall(message)
            with _mapped(method, url, httpx.ReadTimeout, httpx.ReadError):
                response, keep = _read_response(conn, method)
        except BaseException:
            conn.close()
            raise
        if keep:
            self._release(conn)
        else:
            conn.close()
        return response

    def _connection(self, method: str, url: str) -> _Conn:
        """An idle connection still open with nothing unread, or a new one."""
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not conn.buf and not select.select([conn.sock], [], [], 0)[0]:
                    return conn
                conn.close()
        with _mapped(method, url, httpx.ConnectTimeout, httpx.ConnectError):
            sock = socket.create_connection(self._address, timeout=self._timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock)

    def _release(self, conn: _Conn) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _fill(conn: _Conn) -> bool:
    """Read what the socket has into ``conn.buf``; False at the end of the stream."""
    chunk = conn.sock.recv(_READ)
    conn.buf += chunk
    return bool(chunk)


def _read_head(conn: _Conn) -> tuple[int, dict[str, str]]:
    """The next response's status and headers, consumed from ``conn``."""
    while (end := conn.buf.find(b"\r\n\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD:
            raise _Protocol(f"response headers longer than {MAX_HEAD} bytes")
        if not _fill(conn):
            raise _Protocol("the server closed the connection before a complete response head"
                            if conn.buf else "the server closed the connection without a response")
    lines = bytes(conn.buf[:end]).decode("latin-1").split("\r\n")
    del conn.buf[:end + 4]
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise _Protocol(f"bad status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise _Protocol(f"bad header line {line!r}")
        name, value = name.lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return int(code), headers


def _read_response(conn: _Conn, method: str) -> tuple[Response, bool]:
    """The response to the request just sent (interim 1xx responses skipped) and whether
    the connection can carry another request."""
    status, headers = _read_head(conn)
    while 100 <= status < 200:
        status, headers = _read_head(conn)
    keep = headers.get("connection", "").lower() != "close"
    if method == "HEAD" or status in _NO_BODY:
        return Response(status, headers, bytearray()), keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Response(status, headers, _read_chunked(conn)), keep
    length = headers.get("content-length")
    if length is None:
        while _fill(conn):
            pass
        body, conn.buf = conn.buf, bytearray()
        return Response(status, headers, body), False
    if not length.isdigit():
        raise _Protocol(f"bad Content-Length {length!r}")
    return Response(status, headers, _read_exactly(conn, int(length))), keep


def _read_exactly(conn: _Conn, length: int) -> bytearray:
    """The next ``length`` bytes, in a buffer of their own."""
    if len(conn.buf) >= length:
        body = conn.buf[:length]
        del conn.buf[:length]
        return body
    body = bytearray(length)
    got = len(conn.buf)
    body[:got] = conn.buf
    conn.buf = bytearray()
    with memoryview(body) as view:
        while got < length:
            n = conn.sock.recv_into(view[got:])
            if not n:
                raise _Protocol(f"the body ended after {got} of its {length} bytes (Content-Length)")
            got += n
    return body


def _read_line(conn: _Conn) -> bytes:
    while (end := conn.buf.find(b"\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD or not _fill(conn):
            raise _Protocol("bad chunked body framing")
    line = bytes(conn.buf[:end])
    del conn.buf[:end + 2]
    return line


def _read_chunked(conn: _Conn) -> bytearray:
    """A chunked body, joined (chunk extensions and trailers read and dropped)."""
    body = bytearray()
    while True:
        size = _read_line(conn).split(b";", 1)[0].strip()
        try:
            n = int(size, 16)
        except ValueError:
            raise _Protocol(f"bad chunk size {size!r}") from None
        if n == 0:
            while _read_line(conn):
                pass
            return body
        body += _read_exactly(conn, n)
        if _read_line(conn):
            raise _Protocol("a chunk longer than its size")
