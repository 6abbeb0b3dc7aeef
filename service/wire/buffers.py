"""The buffers a body lands in, on either side of the wire: `BodyBuffer` collects a body that
arrives in chunks into one writable buffer to view tensors over; `WarmBuffers` keeps large
bytearrays for reuse, so that the next large body lands in memory that is already paged in.

Writing into fresh memory costs a page fault per 4 KiB: on these machines ~100 ms per
100 MB, eight times the copy itself (glibc serves every allocation over its mmap threshold,
32 MiB at most, with fresh pages and returns them on free). A body of the same size as
one before it (the common case: one client, one geometry) reuses that one's buffer.

A buffer is reused only when nothing but this pool references it (CPython's reference
count; every memoryview, tensor view or message holding it counts), so no reader can see
it change. Only sizes from `MIN_BYTES` up are kept: smaller ones come from the allocator's
own free lists, already warm.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

from ..errors import MalformedBody

MIN_BYTES = 1 << 20
"""Bodies smaller than this are not worth keeping buffers for."""


class WarmBuffers:
    """Up to ``keep`` buffers, the most recently kept last. Thread-safe."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._held: list[bytearray] = []
        self._lock = threading.Lock()  # two takers must never both see a buffer unused

    def take(self, size: int) -> Optional[bytearray]:
        """A kept buffer no one else references, resized to ``size`` bytes without moving
        (``size`` within its allocation and at least half of it); None when none fits. Its
        bytes are whatever it held before."""
        if size < MIN_BYTES:
            return None
        with self._lock:
            for i in range(len(self._held) - 1, -1, -1):
                if self._unused(i) and self._fits(self._held[i], size):
                    buf = self._held[i]
                    if size < len(buf):
                        del buf[size:]
                    elif size > len(buf):
                        buf += bytes(size - len(buf))
                    return buf
        return None

    def keep(self, buf: bytearray) -> None:
        """Hold ``buf`` (just handed to a reader) for a later `take`; the oldest is let go
        past ``keep`` buffers."""
        if len(buf) < MIN_BYTES:
            return
        with self._lock:
            if not any(held is buf for held in self._held):
                self._held.append(buf)
                del self._held[:-self._keep]

    def _unused(self, i: int) -> bool:
        return sys.getrefcount(self._held[i]) == 2  # the list's reference and getrefcount's argument

    @staticmethod
    def _fits(buf: bytearray, size: int) -> bool:
        allocated = buf.__alloc__()  # bytes reserved, one more than the most it holds without moving
        return size < allocated and 2 * size >= allocated


class BodyBuffer:
    """Appends chunks into a bytearray that grows as bytes arrive: memory follows what was
    received, never what a Content-Length merely announces (a client that declares a large
    body and sends a few bytes costs a few bytes). Growing reallocates in place for large
    buffers (mremap), so this is as fast as a preallocated buffer. A first chunk that is a
    bytearray (a whole body handed over by `service.http.protocol` or the client's
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
