"""The sequence table: Triton-style sequence ids mapped to slots of the pool, for one app.

A request with ``sequence_start`` binds a new slot to its ``sequence_id``; later requests
with that id continue the slot (on any layer: a slot holds every layer of a sequence);
one with ``sequence_end`` frees it after the request. Requests of one sequence run one at a
time, in arrival order (`hold`), so a START is bound before the next request of its
sequence looks it up.

The table is in memory. With a snapshot path it is saved next to the pool snapshot each
time one is written, periodic ones and the one at shutdown
(``<snapshot>.kserve-sequences.json``, atomically), and loaded at start, keeping only the
entries whose slot the restored pool still holds. So after a ``kill -9`` the sequences
bound at the last snapshot come back with it (a slot that advanced after it answers 409
``state_lost``, as through REST); one started after it is unknown, and its next request is
refused as one that must specify START. Without a snapshot path, a restart loses them all.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional

from state_store import SlotOrdering

from .options import SequenceId

log = logging.getLogger("kda_serve.kserve.sequences")
SUFFIX = ".kserve-sequences.json"
_FORMAT = "kda-serve/kserve-sequences/1"


class SequenceTable:
    """Sequence id -> slot id. ``path`` is where `save` writes and `load` reads (None: memory only).

    Used from one event loop.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self._slots: dict[SequenceId, str] = {}
        self._ordering = SlotOrdering()

    @asynccontextmanager
    async def hold(self, sequence: SequenceId) -> AsyncIterator[None]:
        """Run the block as the only request of ``sequence``, after those that arrived before."""
        async with self._ordering.hold([sequence]):
            yield

    def slot(self, sequence: SequenceId) -> Optional[str]:
        return self._slots.get(sequence)

    def bind(self, sequence: SequenceId, slot: str) -> None:
        self._slots[sequence] = slot

    def unbind(self, sequence: SequenceId) -> None:
        self._slots.pop(sequence, None)

    def live(self) -> dict[SequenceId, str]:
        """A copy of the table."""
        return dict(self._slots)

    def save(self) -> None:
        """Write the table to ``path`` atomically (temp file, fsync, rename)."""
        if self.path is None:
            return
        doc = {"format": _FORMAT, "sequences": [{"id": seq, "slot": slot} for seq, slot in self._slots.items()]}
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".kserve-sequences-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        log.info("saved %d sequence(s) to %s", len(self._slots), self.path)

    def load(self, slot_exists: Callable[[str], bool]) -> None:
        """Replace the table with the saved one, keeping entries whose slot exists. A missing
        file is an empty table; an unreadable one is logged and ignored (its slots stay in
        the pool, reachable through the REST API, and expire with the ttl)."""
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path) as f:
                doc = json.load(f)
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {_FORMAT!r}")
            entries = [(e["id"], e["slot"]) for e in doc["sequences"]]
            if not all(type(seq) in (int, str) and type(slot) is str for seq, slot in entries):
                raise ValueError("an entry is not {id: int | str, slot: str}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.error("ignoring the sequence table %s: %s", self.path, e)
            return
        self._slots = {seq: slot for seq, slot in entries if slot_exists(slot)}
        if len(self._slots) < len(entries):
            log.warning("dropped %d saved sequence(s) whose slot the pool no longer holds",
                        len(entries) - len(self._slots))
        log.info("restored %d sequence(s) from %s", len(self._slots), self.path)
