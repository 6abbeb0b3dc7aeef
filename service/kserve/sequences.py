"""The sequence table: Triton-style sequence ids mapped to slots of the pool, for one app.

A request with ``sequence_start`` binds a new slot to its ``sequence_id``; later requests
with that id continue the slot (on any layer: a slot holds every layer of a sequence);
one with ``sequence_end`` frees it after the request. Requests of one sequence run one at a
time, in arrival order (`hold`), so a START is bound before the next request of its
sequence looks it up.

The table is in memory. With a snapshot path it is kept on disk as the pool is
(`state_store.persistence`): a table file and a journal beside it.

- The table (``<snapshot>.kserve-sequences.json``) is saved after each pool snapshot, the
  periodic ones and the one at shutdown (atomically: a temporary file, fsync, rename), and
  the journal is emptied then. It is also saved when the journal outgrows
  ``max(COMPACT_MIN_BYTES, 4 x the table's last saved size)`` (with periodic snapshots
  off it would otherwise grow by a record per change for the server's whole life); what a
  restart restores is the same either way (the saved table is the journal's net effect).
- The journal (``<snapshot>.kserve-sequences.json.journal``) gets one JSON line per change
  since: ``{"op": "bind", "id": .., "slot": ..}`` or ``{"op": "unbind", "id": ..}``,
  appended (``O_APPEND``) when the change is made, without fsync: the page cache outlives a
  crashed process, so after a ``kill -9`` every record is there.

At start, `load` removes the temporary files of an interrupted save, reads the table,
replays the journal over it in order, keeps the entries whose slot the restored pool
holds, and, when the journal held anything, saves the table (emptying the journal, so
appending never follows a torn line). So after a ``kill -9`` every sequence whose
slot is in the last pool snapshot comes back, one STARTed after the table's last save
included (a crash between the pool snapshot's rename and the table's save used to lose it);
a slot that advanced after the snapshot answers 409 ``state_lost``, as through REST. A
sequence whose slot was allocated after the last pool snapshot is unknown (the restored
pool lacks its slot): its next request is refused as one that must specify START.

Replay is safe wherever a crash falls. Records are last-writer-wins per id, so records the
table already holds (a crash between the save's rename and the journal's truncation)
change nothing. A torn last line (a crash mid-write: no newline, or not a record) is
dropped; an unreadable line before the last ends the replay there (logged). A record that
is missing (a power loss took the page cache; a write failed, e.g. a full disk: logged
once, the request goes on and the binding lives in memory until the next save, journaling
resuming once a save empties the journal) only degrades to the behaviour without a
journal: the sequence is unknown and its slot lingers until the ttl. It never makes a wrong
binding: a slot belongs to one sequence for its life, ids are never reused, and a freed
slot is freed again by the pool's own (fsynced) journal, so an outdated binding names a
slot the restored pool lacks and is dropped. Without a snapshot path, nothing is written
and a restart loses every sequence.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import tempfile
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional

from state_store import SlotOrdering, SnapshotError
from state_store.snapshot import remove_temporaries

from .options import SequenceId

log = logging.getLogger("kda_serve.kserve.sequences")
SUFFIX = ".kserve-sequences.json"
JOURNAL_SUFFIX = ".journal"
_FORMAT = "kda-serve/kserve-sequences/1"
_BIND, _UNBIND = "bind", "unbind"
_LEGACY_TEMPORARY = re.compile(r"\.kserve-sequences-[a-z0-9_]{8}")  # temporaries of versions before the journal
Entries = dict[SequenceId, str]
COMPACT_MIN_BYTES = 1 << 20
"""The floor of the journal's size past which a change saves the table (see above)."""


class SequenceTable:
    """Sequence id -> slot id. ``path`` is where `save` writes and `load` reads, and
    ``journal_path`` (``path`` + ``.journal``) where the changes since the last save go
    (None: memory only). The journal's fd is opened by the first change after a save and
    closed by the next save (so none outlives the snapshot at shutdown) or by `close`.

    Used from one event loop.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self.journal_path = None if path is None else path + JOURNAL_SUFFIX
        self._slots: Entries = {}
        self._ordering = SlotOrdering()
        self._journal: Optional[int] = None  # the fd, while open
        self._journaling = True  # False from a failed write until a save empties the journal
        self._journal_bytes = 0  # appended since the last save (or failed save) began
        self._table_bytes = 0  # the size of the table last saved

    @asynccontextmanager
    async def hold(self, sequence: SequenceId) -> AsyncIterator[None]:
        """Run the block as the only request of ``sequence``, after those that arrived before."""
        async with self._ordering.hold([sequence]):
            yield

    def slot(self, sequence: SequenceId) -> Optional[str]:
        return self._slots.get(sequence)

    def bind(self, sequence: SequenceId, slot: str) -> None:
        self._slots[sequence] = slot
        self._record({"op": _BIND, "id": sequence, "slot": slot})

    def unbind(self, sequence: SequenceId) -> None:
        self._slots.pop(sequence, None)
        self._record({"op": _UNBIND, "id": sequence})

    def live(self) -> Entries:
        """A copy of the table."""
        return dict(self._slots)

    def save(self) -> None:
        """Write the table to ``path`` atomically (temp file, fsync, rename), then empty the
        journal. Raises OSError when the table cannot be written (the journal stays)."""
        if self.path is None:
            return
        self._journal_bytes = 0  # a failed save is not retried before the journal grows as much again
        self._write_table()
        log.info("saved %d sequence(s) to %s", len(self._slots), self.path)
        self._empty_journal()

    def load(self, slot_exists: Callable[[str], bool]) -> None:
        """Replace the table with the saved one and the journal's changes after it, keeping
        entries whose slot exists; remove the temporary files of an interrupted save. A
        missing file is an empty table; an unreadable one is logged and ignored (the journal
        still applies; its other slots stay in the pool, reachable through the REST API, and
        expire with the ttl). A journal
        that held anything is then folded into the table (`save`), so appending starts clean."""
        if self.path is None:
            return
        self._remove_temporaries()
        entries = self._read_table()
        records, written = _read_journal(self.journal_path)
        for record in records:
            _apply(entries, record)
        self._slots = {seq: slot for seq, slot in entries.items() if slot_exists(slot)}
        if len(self._slots) < len(entries):
            log.warning("dropped %d saved sequence(s) whose slot the pool no longer holds",
                        len(entries) - len(self._slots))
        log.info("restored %d sequence(s) from %s and %d journal record(s)", len(self._slots), self.path, len(records))
        if written:
            self._fold_journal()

    def close(self) -> None:
        """Close the journal's fd (a later change opens it again)."""
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None

    def _record(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the journal; a failure is logged (once until journaling
        resumes) and leaves the change in memory only."""
        if self.journal_path is None or not self._journaling:
            return
        line = (json.dumps(record) + "\n").encode()
        try:
            if self._journal is None:
                self._journal = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if os.write(self._journal, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            self._journaling = False  # a gap: later records would mislead until a save covers it
            log.warning("cannot append to the sequence journal %s (%s): changes are kept in memory and saved "
                        "with the next snapshot; a kill -9 before it loses them", self.journal_path, e)
            return
        self._journal_bytes += len(line)
        if self._journal_bytes > max(COMPACT_MIN_BYTES, 4 * self._table_bytes):
            try:  # fold the journal into the table: the same restore, a bounded journal
                self.save()
            except OSError as e:  # the journal is intact and still journals every change
                log.warning("cannot save the sequence table %s to empty its journal: %s", self.path, e)

    def _write_table(self) -> None:
        assert self.path is not None
        doc = {"format": _FORMAT, "sequences": [{"id": seq, "slot": slot} for seq, slot in self._slots.items()]}
        directory, base = os.path.split(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=".tmp")  # as remove_temporaries knows
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, self.path)
            self._table_bytes = size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _empty_journal(self) -> None:
        """Truncate the journal (the table now holds its records) and resume journaling. If
        it cannot be truncated, its records stay harmless to replay: journaling goes on
        unless a failed write had paused it (the journal would miss changes the table has)."""
        assert self.journal_path is not None
        self.close()
        try:
            os.truncate(self.journal_path, 0)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot empty the sequence journal %s: %s", self.journal_path, e)
            return
        self._journaling = True

    def _fold_journal(self) -> None:
        """`save` at load; if it fails, no journaling until a save succeeds (a torn tail
        would hide the records appended after it)."""
        try:
            self.save()
        except OSError as e:
            self._journaling = False
            log.error("cannot save the sequence table %s: %s; sequences started before the next snapshot "
                      "will not survive a kill -9", self.path, e)

    def _read_table(self) -> Entries:
        """The saved table; {} when there is none or it is unreadable (logged)."""
        assert self.path is not None
        if not os.path.exists(self.path):
            return {}
        try:
            with open(self.path) as f:
                doc = json.load(f)
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {_FORMAT!r}")
            entries = [(e["id"], e["slot"]) for e in doc["sequences"]]
            if not all(_is_id(seq) and type(slot) is str for seq, slot in entries):
                raise ValueError("an entry is not {id: int | str, slot: str}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.error("ignoring the sequence table %s: %s", self.path, e)
            return {}
        return dict(entries)

    def _remove_temporaries(self) -> None:
        """Remove the temporary files a crash mid-save left beside ``path``."""
        assert self.path is not None
        try:
            remove_temporaries(self.path)
            directory = os.path.dirname(os.path.abspath(self.path))
            for name in os.listdir(directory):
                if _LEGACY_TEMPORARY.fullmatch(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(directory, name))
        except (OSError, SnapshotError) as e:
            log.warning("cannot remove the temporary files of the sequence table %s: %s", self.path, e)


def _is_id(value: object) -> bool:
    return type(value) in (int, str)


def _parse(line: bytes) -> dict[str, Any]:
    """One journal line as a record; ValueError when it is none."""
    record = json.loads(line)
    valid = (isinstance(record, dict) and _is_id(record.get("id"))
             and (record.get("op") == _UNBIND or (record.get("op") == _BIND and type(record.get("slot")) is str)))
    if not valid:
        raise ValueError(f"not a record: {line[:200]!r}")
    return record


def _read_journal(path: Optional[str]) -> tuple[list[dict[str, Any]], bool]:
    """The journal's records in order (a torn last line dropped; an unreadable line before
    it ends them, logged), and whether the file held any bytes."""
    try:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            data = f.read()
    except FileNotFoundError:
        return [], False
    except OSError as e:
        log.error("ignoring the sequence journal %s: %s", path, e)
        return [], False
    *lines, tail = data.split(b"\n")  # tail: b"" unless the last line is torn
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(_parse(line))
        except ValueError as e:
            if number < len(lines) or tail:
                log.error("ignoring the sequence journal %s from line %d on: %s", path, number, e)
            break
    return records, bool(data)


def _apply(entries: Entries, record: dict[str, Any]) -> None:
    if record["op"] == _BIND:
        entries[record["id"]] = record["slot"]
    else:
        entries.pop(record["id"], None)
