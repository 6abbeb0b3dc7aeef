"""`FramedExchange` (`KDAClient`'s) and `AsyncFramedExchange` (`AsyncKDAClient`'s): the
path to a server's framed socket (``kda-serve --framed-socket PATH``), for shared memory and
CUDA IPC prefills on the same host.

One request frame out, one reply frame back, on a kept-alive Unix socket (the format:
`service.wire.frames`); no HTTP request line, headers or parser on either side. A reply
comes back as `kda_client.small.Response`, its ``Server-Timing`` and content type set
as an HTTP response's would be, so `KDAClient` parses it and raises its errors as for
HTTP. Failures raise httpx's exceptions, as the HTTP paths do: ConnectError, WriteError,
ReadError, ReadTimeout, RemoteProtocolError; a reply that cannot be decoded,
`kda_client.MalformedResponse`. A connection the server closed while idle is
replaced before a request is sent on it; a request whose reply was lost is not re-sent.

Connections are numbered (``connection``: the current one's, from 1). A request bound to
one (``request(..., connection=N)``: a prepared prefill's RUN and RELEASE, whose ids count
from 1 on every connection) is never sent on another: when connection N is gone it is
answered here, 404 ``unknown-prepared``, as the server answers an id it does not hold.
"""
from __future__ import annotations

import asyncio
import json
import select
import socket
import struct
import threading
from typing import Optional

import httpx

from service.wire.frames import Op, request_frame, split_reply
from service.wire.media import JSON, PROBLEM

from .errors import decoding
from .small import Response

_FIRST_READ = 1 << 16
"""Bytes a reply's first receive asks for: every reply but a large error document's fits."""


def _gone(connection: int) -> Response:
    """The answer to a request bound to ``connection`` once that connection has closed."""
    problem = {"type": "urn:kda-serve:problem:unknown-prepared", "title": "Unknown prepared prefill", "status": 404,
               "detail": f"framed socket connection {connection}, which this prepared prefill lived on, has "
                         "closed (and its prepared prefills with it): prepare again"}
    return Response(404, {"content-type": PROBLEM}, bytearray(json.dumps(problem).encode("utf-8")))


class FramedExchange:
    """Requests to the framed socket at ``path``; ``api_key`` sent once per connection
    when given; ``timeout`` (s) bounds the connect and each read."""

    def __init__(self, path: str, api_key: Optional[str], timeout: float) -> None:
        self.path, self.timeout = path, timeout
        self.key = None if api_key is None else api_key.encode("utf-8")
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self.connection = 0  # the current connection's number (0: none yet)

    def request(self, op: Op, payload: bytes, connection: Optional[int] = None) -> Response:
        """``op`` with ``payload``, and its reply (a refused API key's 401 in its place);
        with ``connection``, only on that connection (see the module docstring)."""
        return self.request_on(op, payload, connection)[0]

    def request_on(self, op: Op, payload: bytes, connection: Optional[int] = None) -> tuple[Response, int]:
        """`request`, and the number of the connection that answered."""
        with self._lock:
            try:
                if connection is None:
                    sock, refused = self._connected()
                    if refused is not None:
                        self._drop()
                        return refused, self.connection
                elif (sock := self._held(connection)) is None:
                    return _gone(connection), connection
                self._send(sock, request_frame(op, payload))
                return self._read(sock), self.connection
            except BaseException:
                self._drop()
                raise

    def _held(self, connection: int) -> Optional[socket.socket]:
        """The kept socket when it is connection number ``connection`` and still open (the
        server has not closed it: nothing to read while idle), else None."""
        sock = self._sock
        if connection != self.connection or sock is None or select.select([sock], [], [], 0)[0]:
            return None
        return sock

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _connected(self) -> tuple[socket.socket, Optional[Response]]:
        """The kept connection when the server has not closed it, else a new one,
        authorized when a key is set (with the AUTH reply when that was refused)."""
        if self._sock is not None and not select.select([self._sock], [], [], 0)[0]:
            return self._sock, None  # nothing to read on an idle connection: still open
        self._drop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise httpx.ConnectError(f"framed socket {self.path}: {e}") from e
        self._sock = sock
        self.connection += 1
        if self.key is not None:
            self._send(sock, request_frame(Op.AUTH, self.key))
            answer = self._read(sock)
            if answer.status >= 400:
                return sock, answer
        return sock, None

    @staticmethod
    def _send(sock: socket.socket, frame: bytes) -> None:
        try:
            sock.sendall(frame)
        except OSError as e:
            raise httpx.WriteError(f"framed socket: {e}") from e

    def _read(self, sock: socket.socket) -> Response:
        """The reply: what the socket holds read at once (a small reply, the common one, is
        then one receive), the rest of a larger one after it. Only one request is ever
        outstanding, so nothing past the reply can arrive."""
        got = self._receive(sock, _FIRST_READ)
        while len(got) < 4:
            got += self._receive(sock, _FIRST_READ)
        size = _reply_size(got[:4])
        frame = got[4:]
        if len(frame) > size:
            raise httpx.RemoteProtocolError("the framed socket sent more than one reply")
        return _response(frame if len(frame) == size else frame + self._exactly(sock, size - len(frame)))

    @classmethod
    def _exactly(cls, sock: socket.socket, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = cls._receive(sock, left)
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    @staticmethod
    def _receive(sock: socket.socket, most: int) -> bytes:
        """One receive of at most ``most`` bytes (at least one); httpx's errors."""
        try:
            chunk = sock.recv(most)
        except socket.timeout as e:
            raise httpx.ReadTimeout("no reply from the framed socket in time") from e
        except OSError as e:
            raise httpx.ReadError(f"framed socket: {e}") from e
        if not chunk:
            raise httpx.ReadError("the server closed the framed socket connection before its reply")
        return chunk

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class AsyncFramedExchange:
    """`FramedExchange` for asyncio (`AsyncKDAClient`): the same frames, errors and key, on
    one kept connection, requests one at a time."""

    def __init__(self, path: str, api_key: Optional[str], timeout: float) -> None:
        self.path, self.timeout = path, timeout
        self.key = None if api_key is None else api_key.encode("utf-8")
        self._streams: Optional[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = None
        self._lock = asyncio.Lock()
        self.connection = 0  # as `FramedExchange.connection`

    async def request(self, op: Op, payload: bytes, connection: Optional[int] = None) -> Response:
        """``op`` with ``payload``, and its reply (a refused API key's 401 in its place);
        with ``connection``, only on that connection (see the module docstring)."""
        return (await self.request_on(op, payload, connection))[0]

    async def request_on(self, op: Op, payload: bytes, connection: Optional[int] = None) -> tuple[Response, int]:
        """`request`, and the number of the connection that answered."""
        async with self._lock:
            if connection is not None and (connection != self.connection or self._streams is None
                                           or self._streams[0].at_eof()):
                return _gone(connection), connection
            try:
                streams, refused = await self._connected()
                if refused is not None:
                    await self.aclose_connection()
                    return refused, self.connection
                return await self._exchange(streams, request_frame(op, payload)), self.connection
            except BaseException:
                await self.aclose_connection()
                raise

    async def aclose_connection(self) -> None:
        """Close the kept connection (the next request opens a new one)."""
        if self._streams is not None:
            _, writer = self._streams
            self._streams = None
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass  # already reset by the server

    async def _connected(self) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], Optional[Response]]:
        """The kept connection unless the server closed it, else a new one, authorized
        when a key is set (with the AUTH reply when that was refused)."""
        if self._streams is not None and not self._streams[0].at_eof():
            return self._streams, None
        await self.aclose_connection()
        try:
            streams = await asyncio.wait_for(asyncio.open_unix_connection(self.path), self.timeout)
        except (OSError, TimeoutError) as e:
            raise httpx.ConnectError(f"framed socket {self.path}: {e}") from e
        self._streams = streams
        self.connection += 1
        if self.key is not None:
            answer = await self._exchange(streams, request_frame(Op.AUTH, self.key))
            if answer.status >= 400:
                return streams, answer
        return streams, None

    async def _exchange(self, streams: tuple[asyncio.StreamReader, asyncio.StreamWriter], frame: bytes) -> Response:
        reader, writer = streams
        try:
            writer.write(frame)
            await writer.drain()
        except OSError as e:
            raise httpx.WriteError(f"framed socket: {e}") from e
        try:
            async with asyncio.timeout(self.timeout):
                head = await reader.readexactly(4)
                return _response(await reader.readexactly(_reply_size(head)))
        except TimeoutError as e:
            raise httpx.ReadTimeout("no reply from the framed socket in time") from e
        except (OSError, asyncio.IncompleteReadError) as e:
            raise httpx.ReadError("the server closed the framed socket connection before its reply") from e


def _reply_size(head: bytes) -> int:
    """A reply's length from its first 4 bytes (at least its status and timing length)."""
    (size,) = struct.unpack(">I", head)
    if size < 4:
        raise httpx.RemoteProtocolError(f"a reply frame of {size} bytes is shorter than its status")
    return size


def _response(frame: bytes) -> Response:
    """A reply (its bytes after the length) as an HTTP response's status, headers and body
    (MalformedResponse for a timing that is not ASCII)."""
    with decoding(int.from_bytes(frame[:2], "big"), "a framed socket reply's timing"):
        status, timing, body = split_reply(frame)
    headers = {"content-type": PROBLEM if status >= 400 else JSON}
    if timing:
        headers["server-timing"] = timing
    return Response(status, headers, bytearray(body))
