"""Collecting a body that arrives in chunks into one writable buffer to view tensors over."""
from __future__ import annotations

from typing import Optional

from starlette.requests import Request

from ..errors import MalformedBody


class BodyBuffer:
    """Appends chunks into a bytearray that grows as bytes arrive: memory follows what was
    received, never what a Content-Length merely announces (a client that declares a large
    body and sends a few bytes costs a few bytes). Growing reallocates in place for large
    buffers (mremap), so this is as fast as a preallocated buffer. A first chunk that is a
    bytearray (a whole body handed over by `service.http_protocol` or the client's
    transport) becomes the buffer itself, not copied: the caller gives it up. ``finish()``
    checks the announced length was met."""

    def __init__(self, expected: Optional[int] = None) -> None:
        self._expected = expected
        self._buf = bytearray()

    def add(self, chunk: bytes | bytearray) -> None:
        if self._expected is not None and len(self._buf) + len(chunk) > self._expected:
            raise MalformedBody(f"body is longer than its Content-Length of {self._expected} bytes")
        if not self._buf and isinstance(chunk, bytearray):
            self._buf = chunk
        else:
            self._buf += chunk

    def finish(self) -> bytearray:
        if self._expected is not None and len(self._buf) != self._expected:
            raise MalformedBody(f"body ended after {len(self._buf)} of its {self._expected} bytes (Content-Length)")
        return self._buf


async def read_body(request: Request) -> bytearray:
    """The whole body of ``request`` in one writable buffer (tensors are viewed over it). A
    size limit is the app's middleware's to enforce as the bytes arrive."""
    length = request.headers.get("content-length")
    buf = BodyBuffer(int(length) if length is not None else None)
    async for chunk in request.stream():
        buf.add(chunk)
    return buf.finish()
