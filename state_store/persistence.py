"""Crash safety for a pool: numbered snapshots, and a journal of the slots that changed after
the latest one, so that a restart after a crash (``kill -9``, power loss) restores the last
snapshot and knows exactly which of its slot states are stale.

Two files: the snapshot at ``path`` (`state_store.snapshot`; its index carries the
generation n) and the journal at ``path + ".journal"``, one JSON line per record
``{"gen": n, "op": "advance" | "free", "slots": [ids]}``, appended and fsynced *before*
the change it announces:

- ``advance``: the states of these slots are about to change in place (a prefill launch, a
  state upload). Written once per slot per generation, so a busy slot costs one fsync per
  snapshot interval, not one per launch.
- ``free``: the slot is about to be freed: by a free (`Persistence.freeing`), or because it
  idled past the pool's ttl (the pool's expiry hook, lazily or in a sweep: it would
  otherwise come back alive after a restart, its ttl counting again from the snapshot).

Taking snapshot n+1 empties the journal, in the same locked step as the snapshot's atomic
rename, so no change falls between the two. At restore, the records of the snapshot's
generation say what happened after it:

- an advanced slot the snapshot holds comes back with its snapshot state, flagged
  ``state_lost`` (and listed in the report, for the log);
- an advanced slot the snapshot lacks was created after it: it is gone (its id is
  unknown) and listed;
- a freed slot is freed again (it would otherwise come back as a zombie).

Records of an older generation are stale (a crash between a snapshot's rename and the
journal's truncation) and ignored. A journal with an unreadable line, or naming a newer
generation than the snapshot (the snapshot file was replaced by an older one), flags every
restored slot lost: a restart may lose state, never return a stale state as current.

A record is written whole, or, after a crash mid-write, is a torn last line: the change it
announced had not started (the fsync precedes it), so a torn tail is dropped. A slot whose
record was written but whose change never ran is flagged lost all the same (the safe side).

Compaction
----------
Only a snapshot empties the journal, and with periodic snapshots off
(``--snapshot-interval-s 0``) the only one is at shutdown: a ``free`` record per freed slot
would pile up for the server's whole life, and a restart would read all of it. So the
journal is compacted: what a restore makes of the records of the current generation
(`Persistence._apply`) is only their net effect, two sets, and the journal is rewritten as
just those, in two records under the current generation:

- ``free``: the slots freed (or expired) since the snapshot *that the snapshot holds*
  (``_freed``). A freed slot the snapshot lacks was created after it and needs no record:
  slot ids are never reused, so nothing can bring it back. (Omitted when empty.)
- ``advance``: the slots announced advancing and not freed since (``_advanced``: `freeing`
  and expiries discard from it). Written even when empty, so that a compacted journal is
  never empty (see 2. and 4. below).

The new journal is written to a temporary file beside it (a name `remove_temporaries` of
the journal's path removes at restart), fsynced, opened for appending, renamed over the
journal, and the directory fsynced; appends then go to it. All under the pool's lock,
right after an append (and after the sets took that record in), so no record falls
between the old file and the new one.

When: after an append leaves the journal larger than ``max(compact_min_bytes, 4 x the
size of its latest compacted form)`` (``compact_min_bytes``: 1 MiB by default). The
compacted form holds at most two ids per slot of the pool (``_freed`` is within the
snapshot's slots, ``_advanced`` within the live ones and those created since), so the
journal stays below that bound plus one record, whatever the uptime, and a restart reads
at most that. It is amortised O(1) per record: a compaction writes C bytes (and fsyncs
twice), and the next one comes only after at least ``max(min, 4C) - C >= 3/4`` of the
threshold has been appended again, so compaction writes at most a third of a byte per
byte appended, and its two fsyncs and rename are shared by at least ~3/4 MiB of records
(some 15,000 records, each with an fsync of its own). A floor of 1 MiB keeps compactions
rare (a restart reads 1 MiB in milliseconds); 4x keeps the bound proportional to the
pool's own net state.

A compaction that fails (an OSError: a full disk) leaves the old journal in use and intact
and removes the temporary file; the record just appended was written and fsynced already,
so the change it announces goes ahead. It is logged once at warning and retried only once
the journal has grown by the threshold again, not on every append. When only the
directory's fsync fails after the rename, the journal in use is the new one, and the next
append fsyncs the directory again before its change may run (a record in a file whose name
may not survive is not durable).

Why a crash at any point of a compaction restores the same state. Let R be the journal's
records, g the current generation, S = ``_snapshotted`` the ids the snapshot of generation
g holds (a superset is as good: see below), and live the slots a restore finds in that
snapshot (live is within S). A restore that trusts the journal computes from the records
of g: A (slots whose last record is an advance: exactly ``_advanced``) and F (slots with
a free record); it flags A & live lost, reports A - live gone, and frees F & live again.
The compacted records are [free F & S, advance A]: replayed in that order they give
A' = A (no free follows the advance) and F' = F & S, so F' & live = F & live since live is
within S: the same flags, the same frees, the same report. Trust: the compacted journal is
whole lines of generation g only; the old one could only be distrusted for a record newer
than the snapshot a restart finds (an unreadable line is cut off before the next append,
and compaction only follows a successful append; it runs only while the two sets describe
the whole journal: after a snapshot, or a restore that found the journal empty). Records
of older generations are stale either way and dropped. Both files are non-empty (so the
restore writes its snapshot either way). At each point of a crash the journal's path names
one whole file: before the rename, the old journal (the temporary file is removed at the
restart); after it, the new one (fsynced before the rename, and the records appended to it
are fsynced after the directory); so a restart finds the old or the new file, and both
restore the same state.

After a snapshot whose rename may not be durable (`SnapshotNotDurable`), S is the new
snapshot's slots, and the generation g its generation: a restart that finds the new file
applies the records of g to it (the older ones are stale); one that finds the older file
distrusts any journal holding a record of g and flags every slot lost. Compaction follows
an append, so the uncompacted journal then holds a record of g, and the compacted one does
too (its ``advance`` record, written even when empty): both restore the same.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

from . import prefix_snapshot
from .errors import GeometryMismatch, SnapshotError, SnapshotNotDurable, UnknownSlot
from .pool import StatePool
from .prefix_cache import PrefixCache
from .snapshot import PathLike, Stamp, fsync_directory, remove_temporaries

log = logging.getLogger("kda_serve.state_store.persistence")

JOURNAL_SUFFIX = ".journal"
COMPACT_MIN_BYTES = 1 << 20
"""The default floor of the journal's compaction threshold (see "Compaction" above)."""
COMPACT_GROWTH = 4
"""A journal is compacted once larger than this many times its latest compacted form."""
ADVANCE = "advance"
FREE = "free"
_OPS = (ADVANCE, FREE)


@dataclass(frozen=True)
class Record:
    """One journal line: ``op`` (advance or free) on ``slots``, after snapshot ``generation``."""

    generation: int
    op: str
    slots: tuple[str, ...]


@dataclass(frozen=True)
class JournalContents:
    """What a journal file holds: its complete records in order, whether every complete
    line was a valid record (``intact``), and whether it had any bytes at all."""

    records: list[Record] = field(default_factory=list)
    intact: bool = True
    empty: bool = True


@dataclass(frozen=True)
class RestoreReport:
    """What a restart found. ``stamp``: the snapshot restored (None: there was none, the pool
    starts empty); ``restored``: live slots after the restore; ``lost``: slots of the
    snapshot that advanced after it, now flagged ``state_lost``; ``gone``: slots that
    advanced after the snapshot but are not in it (created later), now unknown;
    ``refreed``: slots freed (or expired) after the snapshot, freed again;
    ``journal_intact``: False when the journal could not be trusted and every restored
    slot was flagged lost;
    ``prefix_entries``: prefix cache entries restored; ``prefix_problem``: why the prefix
    cache file could not be used (the cache then starts empty), or None."""

    stamp: Optional[Stamp]
    restored: int
    lost: list[str]
    gone: list[str]
    refreed: list[str]
    journal_intact: bool
    prefix_entries: int = 0
    prefix_problem: Optional[str] = None

    def describe(self) -> str:
        """One log line."""
        if self.stamp is None:
            head = "no snapshot to restore"
        else:
            head = (f"restored snapshot generation {self.stamp.generation} (taken at unix "
                    f"{self.stamp.saved_at:.3f}): {self.restored} slot(s)")
        parts = [head]
        if not self.journal_intact:
            parts.append("the journal could not be trusted, so every restored slot is flagged state_lost")
        if self.lost:
            parts.append(f"{len(self.lost)} slot(s) advanced after the snapshot; their newer state is lost "
                         f"and they are flagged state_lost: {self.lost}")
        if self.gone:
            parts.append(f"{len(self.gone)} slot(s) created after the snapshot are lost (now unknown): {self.gone}")
        if self.refreed:
            parts.append(f"{len(self.refreed)} slot(s) freed after the snapshot were freed again")
        if self.prefix_entries:
            parts.append(f"{self.prefix_entries} prefix cache entr(y/ies) restored")
        if self.prefix_problem:
            parts.append(f"the prefix cache starts empty: {self.prefix_problem}")
        return "; ".join(parts)


def read_journal(path: PathLike) -> JournalContents:
    """The records of the journal at ``path`` (none when it does not exist)."""
    try:
        with open(path, "rb") as stream:
            data = stream.read()
    except FileNotFoundError:
        return JournalContents()
    except OSError as exc:
        raise SnapshotError(path, f"cannot read the journal: {exc}") from exc
    lines = data.split(b"\n")
    lines.pop()  # the torn tail after the last newline, or b"" when the file ends cleanly
    records, intact = [], True
    for line in lines:
        record = _parse(line)
        if record is None:
            intact = False
        else:
            records.append(record)
    return JournalContents(records, intact, empty=not data)


def _parse(line: bytes) -> Optional[Record]:
    try:
        raw: Any = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(raw, dict) and set(raw) == {"gen", "op", "slots"}):
        return None
    gen, op, slots = raw["gen"], raw["op"], raw["slots"]
    if (type(gen) is not int or gen < 0 or op not in _OPS or not isinstance(slots, list)
            or not all(isinstance(s, str) for s in slots)):
        return None
    return Record(gen, op, tuple(slots))


class Persistence:
    """Snapshots of ``pool`` at ``path`` and the journal beside it.

    Call `restore` once, before anything else: it loads the snapshot (when there is one),
    applies the journal and opens it for appending. Then announce every change with
    `advancing` (before an in-place state change) or `freeing` (before a free), note other
    changes (allocations, forks) with `note_change`, and call `snapshot` to write the next
    generation. Expiries announce themselves: this installs the pool's expiry hook, which
    journals them as frees under the pool's lock, whichever thread finds them. Every method
    holds the pool's lock; call them from the thread that changes the pool (the service's
    device thread), so an announcement and its change are never separated by a snapshot.

    With a ``prefix_cache``, every snapshot also writes its entries to ``path + ".prefix"``
    (`state_store.prefix_snapshot`) and `restore` loads them; a prefix file that cannot be
    used leaves the cache empty (entries are a cache: the slots do not depend on them).

    ``compact_min_bytes``: the floor of the journal's compaction threshold (module
    docstring, "Compaction"; 1 MiB by default).
    """

    def __init__(self, pool: StatePool, path: PathLike, prefix_cache: Optional[PrefixCache] = None,
                 compact_min_bytes: int = COMPACT_MIN_BYTES) -> None:
        if isinstance(compact_min_bytes, bool) or not isinstance(compact_min_bytes, int):
            raise TypeError(f"compact_min_bytes must be an int, got {compact_min_bytes!r}")
        if compact_min_bytes < 1:
            raise ValueError(f"compact_min_bytes must be positive, got {compact_min_bytes}")
        self._pool = pool
        self._prefix_cache = prefix_cache
        self._path = os.fspath(path)
        self._journal_path = self._path + JOURNAL_SUFFIX
        self._fd: Optional[int] = None
        self._failed_from: Optional[int] = None  # where a failed append began, until cut off (`_append`)
        self._generation = 0
        self._advanced: set[str] = set()
        self._changed = False
        # Compaction (see the module docstring):
        self._snapshotted: set[str] = set()  # the ids the latest snapshot holds (or a superset)
        self._freed: set[str] = set()  # ids of _snapshotted freed (or expired) since that snapshot
        self._compactable = False  # whether _advanced and _freed describe the whole journal
        self._compact_min = compact_min_bytes
        self._compact_at = compact_min_bytes  # compact once the journal is larger than this
        self._journal_size = 0  # bytes in the journal
        self._directory_unsynced = False  # a compaction's rename whose directory fsync failed
        self._compactions = 0
        pool.set_expiry_hook(self._expiring)

    @property
    def path(self) -> str:
        return self._path

    @property
    def journal_path(self) -> str:
        return self._journal_path

    @property
    def generation(self) -> int:
        """The generation of the latest snapshot written or restored (0: none yet)."""
        return self._generation

    @property
    def journal_size(self) -> int:
        """The journal's size in bytes."""
        return self._journal_size

    @property
    def compactions(self) -> int:
        """How many times the journal was compacted (rewritten as its net effect)."""
        return self._compactions

    @property
    def changed(self) -> bool:
        """Whether anything changed since the latest snapshot (or the restore)."""
        return self._changed

    def restore(self) -> RestoreReport:
        """Remove the temporary files a crash mid-snapshot left (`remove_temporaries`), load
        the snapshot when one exists, apply the journal (see the module docstring), open the
        journal for appending, and, when the journal held anything or a slot expired
        meanwhile (before the journal was open), write the next snapshot at once so that the
        flags just set, and the expiries, survive another crash.

        Raises SnapshotError or GeometryMismatch when the snapshot cannot be used (the pool
        is then left as it was, and nothing is written), and SnapshotError when the snapshot
        written after the journal fails (a full disk: the pool is then restored in memory,
        and the files a restart finds, the previous snapshot and its journal or the new
        snapshot, restore it the same way).
        """
        with self._pool.lock:
            # a crash mid-snapshot left them (each file's size), or mid-compaction (the journal's)
            for path in (self._path, self.prefix_path, self._journal_path):
                remove_temporaries(path)
            stamp = self._pool.restore(self._path) if os.path.exists(self._path) else None
            self._generation = 0 if stamp is None else stamp.generation
            journal = read_journal(self._journal_path)
            report = self._apply(stamp, journal)
            report = self._restore_prefix_cache(report)
            held = set(self._pool.slot_ids())  # before the journal opens: an expiry now is only noted
            self._open_journal()
            # With an empty journal and nothing changed, ``held`` is exactly the snapshot's slots
            # and the empty sets describe the journal. Otherwise the snapshot below sets them; if
            # it fails, the journal holds records of an earlier run the sets know nothing of, so
            # it must not be compacted until a snapshot succeeds.
            self._snapshotted, self._freed, self._advanced = held, set(), set()
            self._compactable = journal.empty
            if not journal.empty or self._changed:
                self.snapshot()
            return report

    @property
    def prefix_path(self) -> str:
        """Where the prefix cache's entries are saved beside the snapshot."""
        return self._path + prefix_snapshot.SUFFIX

    def _restore_prefix_cache(self, report: RestoreReport) -> RestoreReport:
        cache = self._prefix_cache
        if cache is None or not os.path.exists(self.prefix_path):
            return report
        try:
            loaded = prefix_snapshot.read(self.prefix_path, self._pool.geometry)
        except (SnapshotError, GeometryMismatch) as exc:
            return replace(report, prefix_problem=str(exc))
        cache.replace_all(loaded)
        return replace(report, prefix_entries=len(cache.keys()))

    def _apply(self, stamp: Optional[Stamp], journal: JournalContents) -> RestoreReport:
        live = set(self._pool.slot_ids())
        current = [r for r in journal.records if r.generation == self._generation]
        trusted = journal.intact and all(r.generation <= self._generation for r in journal.records)
        advanced: dict[str, None] = {}
        freed: dict[str, None] = {}
        if trusted:
            for record in current:
                for slot_id in record.slots:
                    if record.op == ADVANCE:
                        advanced[slot_id] = None
                    else:
                        advanced.pop(slot_id, None)
                        freed[slot_id] = None
            lost = [s for s in advanced if s in live]
            gone = [s for s in advanced if s not in live]
            refreed = [s for s in freed if s in live]
        else:
            lost, gone, refreed = sorted(live), [], []
        for slot_id in refreed:
            with contextlib.suppress(UnknownSlot):  # expired since `live` was read: freed all the same
                self._pool.free(slot_id)
        lost = self._mark_lost_while_live(lost)
        return RestoreReport(stamp, len(self._pool.slot_ids()), lost, gone, refreed, trusted)

    def _mark_lost_while_live(self, slot_ids: list[str]) -> list[str]:
        """`StatePool.mark_lost` of ``slot_ids``, less any that idled past the ttl since they
        were read as live (the pool then expires it as it resolves it: gone, its flag moot);
        returns those flagged."""
        pending = list(slot_ids)
        while True:
            try:
                self._pool.mark_lost(pending)
                return pending
            except UnknownSlot as exc:  # each try drops one id, so at most len(slot_ids) tries
                pending.remove(exc.slot_id)

    def snapshot(self) -> int:
        """Write snapshot generation n+1 atomically, then empty the journal; returns n+1.

        Raises SnapshotError when the snapshot cannot be written (the previous snapshot and
        the journal then still describe the pool), when the journal cannot be emptied (its
        records are then stale, of an older generation, and ignored at restore) or when the
        prefix cache's file cannot be written (after the pool's: the cache's older file
        stays; its entries are copies, never a slot's state). The generation moves as soon
        as the pool's file may be on disk, so every change after it is journaled under the
        new one: when the rename may not be durable (`SnapshotNotDurable`) the journal keeps
        its older records too, and a restart that finds the older file then sees records of
        a newer generation and flags every slot lost rather than serve a stale state.
        """
        with self._pool.lock:
            generation = self._generation + 1
            # The slots the snapshot will hold: a superset at most (a slot expiring in between, in
            # the pool's snapshot, is freed before it is written), which compaction allows.
            held = set(self._pool.slot_ids())
            try:
                self._pool.snapshot(self._path, generation)
            except SnapshotNotDurable:
                self._generation = generation  # announce every change anew under it; keep the journal
                self._advanced.clear()
                # The new file's slots, not the older one's: a restart that finds the new file
                # applies only the records of this generation, to it; one that finds the older
                # file distrusts a journal holding any record of this generation, which a
                # compacted journal always does (a compaction follows an append under it, and
                # writes its advance record even when empty), and flags every slot lost. The
                # older records it drops are stale to the new file and moot to the older one.
                self._snapshot_taken(held, durable=False)
                raise
            self._generation = generation
            self._advanced.clear()
            self._changed = False
            self._snapshot_taken(held, durable=True)
            prefix_error: Optional[SnapshotError] = None
            if self._prefix_cache is not None:
                try:
                    prefix_snapshot.write(self.prefix_path, self._prefix_cache)
                except SnapshotError as exc:
                    prefix_error = exc
            try:
                os.ftruncate(self._journal_fd(), 0)
                self._failed_from = None  # a failed record's bytes went with the rest
                self._journal_size, self._compact_at = 0, self._compact_min
                os.fsync(self._journal_fd())
            except OSError as exc:
                raise SnapshotError(self._journal_path, f"cannot empty the journal: {exc}") from exc
            if prefix_error is not None:
                raise prefix_error
            return generation

    def _snapshot_taken(self, held: set[str], durable: bool) -> None:
        """A snapshot holding ``held`` (or fewer) was renamed in under the new generation: no
        slot is freed since it, and the (emptied or stale) journal may be compacted."""
        self._snapshotted, self._freed = held, set()
        self._compactable = True
        if durable:  # its directory fsync made an earlier compaction's rename durable too
            self._directory_unsynced = False

    def advancing(self, slot_ids: Iterable[str]) -> None:
        """Announce that the states of ``slot_ids`` are about to change in place: journals
        (and fsyncs) those not yet announced since the latest snapshot. Raises
        SnapshotError when the journal cannot be written: then the change must not run."""
        with self._pool.lock:
            self._changed = True
            new = [s for s in dict.fromkeys(slot_ids) if s not in self._advanced]
            if new:
                self._append(ADVANCE, new)
                self._advanced.update(new)
                self._maybe_compact()

    def freeing(self, slot_id: str) -> None:
        """Announce that ``slot_id`` is about to be freed (SnapshotError as for `advancing`)."""
        with self._pool.lock:
            self._changed = True
            self._append(FREE, [slot_id])
            self._advanced.discard(slot_id)
            self._note_freed([slot_id])
            self._maybe_compact()

    def note_change(self) -> None:
        """Record a change the journal need not name (an allocation, a fork): the slots it
        creates are simply absent from the last snapshot."""
        with self._pool.lock:
            self._changed = True

    def _expiring(self, slot_ids: list[str]) -> None:
        """The pool's expiry hook: ``slot_ids`` idled past the ttl and are about to be freed,
        journaled as a free (SnapshotError as for `freeing`: then the pool frees none). Only
        noted while the journal is not open (`restore`'s own look at the slots, which then
        writes a snapshot; after `close`)."""
        with self._pool.lock:
            self._changed = True
            journaled = self._fd is not None
            if journaled:
                self._append(FREE, slot_ids)
            self._advanced.difference_update(slot_ids)
            if journaled:
                self._note_freed(slot_ids)
                self._maybe_compact()

    def _note_freed(self, slot_ids: Iterable[str]) -> None:
        """Keep, for compaction, the journaled frees of slots the snapshot holds (a slot
        created after it needs no record: its id is unknown to the snapshot, never reused)."""
        self._freed.update(s for s in slot_ids if s in self._snapshotted)

    def close(self) -> None:
        """Close the journal (the files stay)."""
        with self._pool.lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _open_journal(self) -> None:
        if self._fd is not None:
            return
        try:
            self._fd = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._journal_size = os.fstat(self._fd).st_size
            self._compact_at = self._compact_min
            fsync_directory(os.path.dirname(os.path.abspath(self._journal_path)))
        except OSError as exc:
            raise SnapshotError(self._journal_path, f"cannot open the journal: {exc}") from exc

    def _journal_fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("Persistence.restore() must run before the journal is used")
        return self._fd

    def _append(self, op: str, slot_ids: list[str]) -> None:
        """Append one record and fsync it. A record that fails midway (a full disk) is cut
        off again, now or, when that fails too, before the next record: its change never
        runs, and its bytes must not merge with the next record into an unreadable line
        (which would flag every slot lost at restart)."""
        data = memoryview(self._record(op, slot_ids))
        fd = self._journal_fd()
        try:
            self._cut_failed_record(fd)
            self._failed_from = start = os.lseek(fd, 0, os.SEEK_END)
            end = start + len(data)
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
            if self._directory_unsynced:  # the journal's name (a compaction's rename) must last too
                fsync_directory(os.path.dirname(os.path.abspath(self._journal_path)))
                self._directory_unsynced = False
            self._failed_from = None
            self._journal_size = end
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._cut_failed_record(fd)
            raise SnapshotError(self._journal_path, f"cannot write the journal: {exc}") from exc

    def _cut_failed_record(self, fd: int) -> None:
        """Truncate the journal to where a failed `_append` began, if one left bytes."""
        if self._failed_from is not None:
            os.ftruncate(fd, self._failed_from)
            self._failed_from = None

    def _record(self, op: str, slot_ids: list[str]) -> bytes:
        """One journal line, under the current generation."""
        line = json.dumps({"gen": self._generation, "op": op, "slots": slot_ids}, separators=(",", ":"))
        return (line + "\n").encode("utf-8")

    def _maybe_compact(self) -> None:
        """Compact the journal when the append just made (and taken into the sets) left it
        above the threshold. Never raises an OSError: the change announced goes ahead."""
        if (self._journal_size > self._compact_at and self._compactable
                and self._failed_from is None and self._fd is not None):
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as its net effect (module docstring, "Compaction")."""
        data = (self._record(FREE, sorted(self._freed)) if self._freed else b"") + \
            self._record(ADVANCE, sorted(self._advanced))
        threshold = max(self._compact_min, COMPACT_GROWTH * len(data))
        directory, base = os.path.split(os.path.abspath(self._journal_path))
        new_fd: Optional[int] = None
        try:
            # `remove_temporaries(journal_path)` removes what a crash leaves of this name
            temp_fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=".tmp")
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(temp_fd, view):]
                    os.fsync(temp_fd)
                finally:
                    os.close(temp_fd)
                # opened before the rename, so that once the rename is done nothing can fail
                # before appends go to the new file
                new_fd = os.open(temp, os.O_WRONLY | os.O_APPEND)
                os.replace(temp, self._journal_path)
            except BaseException:
                if new_fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(new_fd)
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
        except OSError as exc:
            self._compact_at = self._journal_size + threshold  # not on every append: once grown again
            log.warning("%s: cannot compact the journal (%s); it stays in use as it is, and compaction is "
                        "retried once it has grown by %d more bytes", self._journal_path, exc, threshold)
            return
        old_fd, self._fd = self._fd, new_fd
        self._journal_size, self._compact_at = len(data), threshold
        self._compactions += 1
        if old_fd is not None:
            with contextlib.suppress(OSError):
                os.close(old_fd)
        try:
            fsync_directory(directory)
        except OSError as exc:
            self._directory_unsynced = True  # the next append fsyncs it before its change may run
            log.warning("%s: compacted the journal, but its rename may not be durable yet (%s); the next "
                        "record retries", self._journal_path, exc)
