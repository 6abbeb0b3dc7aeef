"""A shard's incarnations: which life of its process issued an id, and which lives lost
their slots.

`ServerCore` keeps a shard's pool durable by itself (with a snapshot path: periodic
snapshots, a journal, restore at start, a last snapshot at close): after a crash, slots of
the last snapshot come back (flagged ``state_lost`` when they changed since), and slots
created after it are gone. This module tells those gone ids from freed ones: a shard's
ids carry the incarnation that issued them, and the incarnation record says which
incarnations ended in a crash. An id of such an incarnation that the pool lacks is 410
Gone (its state may have died with the process), never a zeroed state; an id the pool
lacks from the unbroken chain of clean stops since is 404 (it was freed), and so is one
of an incarnation the shard never had (another shard's, a forged one: never issued here).

Incarnation numbers are milliseconds of wall time at start, kept increasing across a
shard's record (which lists them too), so a shard with no state directory (nothing
survives its process, no list either) still tells an earlier number's ids, all presumed
lost, from its own and later ones. With a state directory,
``{name}.lock`` (an exclusive flock held for the process's life) also makes a successor
wait until its predecessor has written its last snapshot: Serve may start the new
replica while the old one is still stopping. The kernel drops the lock when a process
dies, so a crash never blocks the restart.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Incarnation:
    """``number``: this process's incarnation; ids issued by incarnations in
    (``lost_through``, ``number``] belong to the unbroken chain of clean stops that led
    here (absent ones were freed). ``earlier``: the shard's earlier incarnations (None: not
    recorded, so any earlier number may have been one). An absent id of an earlier one
    outside the chain may have died with a process; of any other number, it was never
    issued here."""

    number: int
    lost_through: int
    earlier: Optional[frozenset[int]] = None

    @classmethod
    def fresh(cls, clock: Callable[[], float] = time.time) -> "Incarnation":
        """A start with nothing restored: every earlier incarnation's slots are lost."""
        number = int(clock() * 1000)
        return cls(number, number - 1)

    def lost(self, issued: int) -> bool:
        """Whether a slot issued by incarnation ``issued`` that the pool lacks died with a
        process (410) rather than having been freed or never issued here (404)."""
        if issued > self.lost_through:
            return False
        return self.earlier is None or issued in self.earlier


class ShardFiles:
    """The files of shard ``name`` under ``state_dir``: ``{name}.snapshot`` (the pool,
    `ServerCore`'s to write and restore), ``{name}.incarnation.json`` (the record) and
    ``{name}.lock``."""

    def __init__(self, state_dir: str, name: str, clock: Callable[[], float] = time.time) -> None:
        self.snapshot_path = os.path.join(state_dir, f"{name}.snapshot")
        self._record_path = os.path.join(state_dir, f"{name}.incarnation.json")
        self._lock_path = os.path.join(state_dir, f"{name}.lock")
        self._state_dir = state_dir
        self._name = name
        self._clock = clock
        self._lock_fd: Optional[int] = None
        self._incarnation: Optional[Incarnation] = None

    def open(self, timeout_s: float) -> Incarnation:
        """Take the lock (waiting up to ``timeout_s`` for a predecessor that is still
        stopping), then start a new incarnation: it keeps the record's ``lost_through``
        when the previous one stopped cleanly, else every earlier id may be lost, and lists
        the earlier incarnations (a record from before they were listed gives only its
        own). The new record, marked unclean until `close`, is on disk before this returns."""
        os.makedirs(self._state_dir, exist_ok=True)
        self._lock(timeout_s)
        previous, clean = self._read()
        number = max(int(self._clock() * 1000), previous.number + 1 if previous else 0)
        lost_through = previous.lost_through if previous is not None and clean else number - 1
        earlier = frozenset() if previous is None else frozenset(previous.earlier or ()) | {previous.number}
        self._incarnation = Incarnation(number, lost_through, earlier)
        self._write(self._incarnation, clean=False)
        return self._incarnation

    def close(self) -> None:
        """Mark this incarnation's stop clean (call after the last snapshot is written) and
        release the lock."""
        if self._incarnation is not None:
            self._write(self._incarnation, clean=True)
            self._incarnation = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _lock(self, timeout_s: float) -> None:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise TimeoutError(f"shard {self._name!r}: {self._lock_path} is still held by another process "
                                       f"after {timeout_s:.0f} s (a predecessor still stopping, or a second "
                                       f"replica of the shard: each shard needs exactly one)") from None
                time.sleep(0.05)

    def _read(self) -> tuple[Optional[Incarnation], bool]:
        """The previous incarnation and whether it stopped cleanly (None, False: no record)."""
        try:
            with open(self._record_path, encoding="utf-8") as f:
                doc = json.load(f)
            earlier = frozenset(int(n) for n in doc.get("earlier", ()))
            return Incarnation(int(doc["number"]), int(doc["lost_through"]), earlier), doc["clean"] is True
        except FileNotFoundError:
            return None, False
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"shard {self._name!r}: {self._record_path} is not an incarnation record: {e}") from None

    def _write(self, incarnation: Incarnation, clean: bool) -> None:
        tmp = self._record_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"number": incarnation.number, "lost_through": incarnation.lost_through,
                       "earlier": sorted(incarnation.earlier or ()), "clean": clean}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._record_path)
        _fsync_dir(self._state_dir)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
