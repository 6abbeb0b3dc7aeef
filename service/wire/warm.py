"""`WarmBuffers`: large bytearrays kept for reuse, so that the next large body lands in
memory that is already paged in.

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
