"""The frames of the framed socket protocol, both directions, on a Unix stream socket.

A connection carries requests one at a time, each answered before the next is read:

    request: u32 length | u8 op | payload                (length counts op and payload)
    reply:   u32 length | u16 status | u16 n | timing[n] | body

Integers are big-endian. ``op`` is an `Op`; ``status`` an HTTP status with its HTTP
meaning; ``timing`` the value a ``Server-Timing`` header would carry (ASCII, may be
empty); ``body`` JSON: the answer, or an RFC 9457 problem document for a status >= 400.
A request longer than `MAX_FRAME` is answered 413 and the connection closed unread.
"""
from __future__ import annotations

import asyncio
import enum
import struct
from typing import Optional

MAX_FRAME = 1 << 20
"""Longest request (op and payload), bytes: a shared memory request names its tensors by
reference, so even a batch of hundreds of sequences is a few tens of KiB."""
_LENGTH = struct.Struct(">I")
_REPLY_HEAD = struct.Struct(">IHH")


class Op(enum.IntEnum):
    """What a request asks."""

    PING = 0
    """Empty payload; 200 with an empty body while the server runs (no readiness check)."""
    PREFILL = 1
    """Payload: a ``POST /prefill`` shared memory document (``application/vnd.kda.shm+json``);
    200 with its ``PrefillShmResponse``."""
    AUTH = 2
    """Payload: the server's API key (UTF-8); 204. Required first on a connection to a
    server started with ``--api-key`` (anything else is 401 until then)."""
    PREPARE = 3
    """Payload: a PREFILL document whose slots all exist, without checkpoints; 201 with
    ``{"prepared": id, "slots": [...], "graphed": bool}`` (graphed: runs replay a CUDA
    graph). Nothing runs: the prefill is checked and kept (on a GPU captured as a CUDA
    graph) for RUN, on this connection, until RELEASE or the connection's end."""
    RUN = 4
    """Payload: a prepared id (`PREPARED_ID`); 200 with an empty body once the outputs are
    in place: the prepared prefill run on what its input bytes hold now."""
    RELEASE = 5
    """Payload: a prepared id (`PREPARED_ID`); 204."""


PREPARED_ID = struct.Struct(">I")
"""The payload of RUN and RELEASE: the id PREPARE answered."""


class FrameTooLarge(Exception):
    """A request announced more than `MAX_FRAME` bytes."""

    def __init__(self, size: int) -> None:
        super().__init__(f"request frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
        self.size = size


class EmptyFrame(Exception):
    """A request of zero bytes: it has no op."""


async def read_request(reader: asyncio.StreamReader, timeout_s: float) -> Optional[tuple[int, bytes]]:
    """The next request's (op, payload), or None when the client closed the connection
    between requests. Raises FrameTooLarge or EmptyFrame (the payload left unread),
    ``asyncio.IncompleteReadError`` for a connection closed inside a frame and TimeoutError
    when a started frame's bytes stop arriving for ``timeout_s``."""
    head = await reader.read(_LENGTH.size)  # waits, without a limit, for a frame to start
    if not head:
        return None
    async with asyncio.timeout(timeout_s):  # once it started, its bytes (its length's too) keep coming
        if len(head) < _LENGTH.size:
            head += await reader.readexactly(_LENGTH.size - len(head))
        (size,) = _LENGTH.unpack(head)
        if size > MAX_FRAME:
            raise FrameTooLarge(size)
        if size == 0:
            raise EmptyFrame("a request frame needs at least its op byte")
        frame = await reader.readexactly(size)
    return frame[0], frame[1:]


def reply_frame(status: int, timing: str, body: bytes) -> bytes:
    """One reply, ready to write."""
    t = timing.encode("ascii")
    return _REPLY_HEAD.pack(4 + len(t) + len(body), status, len(t)) + t + body


def request_frame(op: int, payload: bytes) -> bytes:
    """One request, ready to write (the client's side)."""
    return _LENGTH.pack(1 + len(payload)) + bytes((op,)) + payload


def split_reply(frame: bytes) -> tuple[int, str, bytes]:
    """(status, timing, body) of a reply's bytes after its length (the client's side)."""
    status, n = struct.unpack_from(">HH", frame)
    return status, frame[4:4 + n].decode("ascii"), frame[4 + n:]
