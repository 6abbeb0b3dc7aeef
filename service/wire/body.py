"""Collecting a body that arrives in chunks into one writable buffer to view tensors over."""
from __future__ import annotations

from typing import Optional

from ..errors import MalformedBody


class BodyBuffer:
    """Appends chunks into a bytearray, preallocated when the length is announced (one copy
    of each byte, no regrowth). ``finish()`` checks the announced length was met."""

    def __init__(self, expected: Optional[int] = None) -> None:
        self._expected = expected
        self._buf = bytearray(expected or 0)
        self._size = 0

    def add(self, chunk: bytes) -> None:
        n = len(chunk)
        if self._expected is None:
            self._buf += chunk
        elif self._size + n > self._expected:
            raise MalformedBody(f"body is longer than its Content-Length of {self._expected} bytes")
        else:
            self._buf[self._size:self._size + n] = chunk
        self._size += n

    def finish(self) -> bytearray:
        if self._expected is not None and self._size != self._expected:
            raise MalformedBody(f"body ended after {self._size} of its {self._expected} bytes (Content-Length)")
        return self._buf
