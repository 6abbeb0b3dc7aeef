"""The pool's exceptions. Every one subclasses `PoolError`, keeps its fields as attributes
and carries a human message (``str(e)``), so the service can map each to an HTTP status."""
from __future__ import annotations

import os
from typing import Any, Optional, Union


class PoolError(Exception):
    """Base of every error the state pool raises on purpose."""


class PoolFull(PoolError):
    """An allocation asked for more slots than are free; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        self.requested = requested
        self.free = free
        super().__init__(f"state pool full: {requested} slot(s) requested, {free} free")


class UnknownSlot(PoolError):
    """The slot id was never issued, was freed, or expired."""

    def __init__(self, slot_id: Any) -> None:
        self.slot_id = slot_id
        super().__init__(f"unknown slot id {slot_id!r} (never issued, freed, or expired)")


class GeometryMismatch(PoolError):
    """A state, export or snapshot does not match the pool's geometry or dtype."""

    def __init__(self, expected: Any, got: Any) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"geometry mismatch: the pool expects {expected}, got {got}")


class SnapshotError(PoolError):
    """Serialized pool data could not be written or is not valid.

    ``path`` is the snapshot file, or None for in-memory bytes (a slot export given to
    `StatePool.import_`). ``reason`` says what is wrong.
    """

    def __init__(self, path: Optional[Union[str, os.PathLike]], reason: str) -> None:
        self.path = path
        self.reason = reason
        where = f"snapshot {os.fspath(path)!r}" if path is not None else "slot state data"
        super().__init__(f"{where}: {reason}")


class SnapshotNotDurable(SnapshotError):
    """A snapshot file was renamed into place, but making the rename durable (its
    directory's fsync) failed: after a crash the disk may hold it or the file it replaced."""
