"""Reading a request's whole body (Starlette) into one writable buffer to view tensors over."""
from __future__ import annotations

from starlette.requests import Request

from ..wire.buffers import BodyBuffer


async def read_body(request: Request) -> bytearray:
    """The whole body of ``request`` in one writable buffer (tensors are viewed over it). A
    size limit is the app's middleware's to enforce as the bytes arrive."""
    length = request.headers.get("content-length")
    buf = BodyBuffer(int(length) if length is not None else None)
    async for chunk in request.stream():
        buf.add(chunk)
    return buf.finish()
