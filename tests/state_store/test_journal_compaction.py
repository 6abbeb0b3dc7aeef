"""Journal compaction (`state_store.persistence`, "Compaction"): with no snapshot for a long
time (``--snapshot-interval-s 0``) the journal is rewritten, now and then, as the net effect
of its records, so it stays bounded by the pool's size, not by the server's uptime; and a
restart from a compacted journal restores exactly what one from the uncompacted journal of
the same history restores, whether the compaction finished, failed, or was cut by a crash.

A crash is simulated as in the other persistence tests: the journal is closed without a
snapshot, and a new pool restores from the same files."""
from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest
from journal_faults import HalfWrites
from pool_helpers import FakeClock, assert_bit_equal, make_pool, random_state

import state_store.persistence as persistence_module
from state_store import Persistence, SnapshotError, StatePool
from state_store.errors import SnapshotNotDurable
from state_store import snapshot as snapshot_module
from state_store.persistence import read_journal

NUM_SLOTS = 8
TTL = 50.0
NEVER = 1 << 62  # a threshold no journal reaches: the uncompacted twin
LOGGER = "kda_serve.state_store.persistence"


def _pool(clock: Optional[FakeClock] = None) -> StatePool:
    if clock is None:
        return make_pool(num_slots=NUM_SLOTS)
    return make_pool(num_slots=NUM_SLOTS, clock=clock, ttl=TTL)


def _persistence(pool: StatePool, path: Path, compact_min_bytes: Optional[int] = None) -> Persistence:
    if compact_min_bytes is None:
        persistence = Persistence(pool, path)
    else:
        persistence = Persistence(pool, path, compact_min_bytes=compact_min_bytes)
    persistence.restore()
    return persistence


def _advance(pool: StatePool, persistence: Persistence, slot_id: str, seed: int) -> None:
    persistence.advancing([slot_id])
    pool.write_state(slot_id, random_state(pool, seed))


def _free(pool: StatePool, persistence: Persistence, slot_id: str) -> None:
    persistence.freeing(slot_id)
    pool.free(slot_id)


def _churn(pool: StatePool, persistence: Persistence, seed: int) -> str:
    """One short-lived slot: allocated, advanced and freed (two journal records)."""
    slot_id, = pool.alloc(1)
    persistence.note_change()
    _advance(pool, persistence, slot_id, seed)
    _free(pool, persistence, slot_id)
    return slot_id


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# -- the journal stays bounded ----------------------------------------------------------------

@pytest.mark.parametrize("compact_min_bytes, bound", [(None, (1 << 20) + 2048), (4096, 4096 + 1024)],
                         ids=["default threshold", "4 KiB threshold"])
def test_the_journal_stays_bounded_without_snapshots(tmp_path, monkeypatch, compact_min_bytes, bound):
    """20k cycles of alloc + advancing + freeing on a pool of 8 slots, never a snapshot:
    ~2.4 MB of records, yet the journal never exceeds a bound set by the threshold and the
    pool's size (not the cycle count)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the sizes are the point here, not durability
    pool = _pool()
    persistence = _persistence(pool, tmp_path / "pool.snapshot", compact_min_bytes)
    keep = pool.alloc(4)
    persistence.note_change()
    for seed, slot_id in enumerate(keep):
        _advance(pool, persistence, slot_id, seed)
    persistence.snapshot()
    journal = Path(persistence.journal_path)
    largest = 0
    for cycle in range(20_000):
        _churn(pool, persistence, cycle)
        if cycle % 1000 == 0:  # a long-lived slot advances too (once per generation)
            _advance(pool, persistence, keep[(cycle // 1000) % 4], cycle)
        largest = max(largest, journal.stat().st_size)
    assert largest <= bound
    persistence.close()
    restored = _pool()
    _persistence(restored, tmp_path / "pool.snapshot").close()
    assert sorted(restored.slot_ids()) == sorted(keep)
    assert all(restored.slot_info(s).state_lost for s in keep)  # each advanced after the snapshot


# -- a restart from a compacted journal equals one from the uncompacted journal ---------------

class _Twin:
    """A pool and its persistence; two of them run one history in lockstep, one compacting
    often and one never, on the same clock. Slot ids are random, so each twin maps the
    history's slot numbers to its own ids."""

    def __init__(self, path: Path, clock: FakeClock, compact_min_bytes: int) -> None:
        self.path = path
        self.pool = _pool(clock)
        self.persistence = _persistence(self.pool, path, compact_min_bytes)
        self.ids: dict[int, str] = {}  # slot number -> id

    def number(self, slot_id: str) -> int:
        return {v: k for k, v in self.ids.items()}[slot_id]


def _run_history(seed: int, twins: list[_Twin], clock: FakeClock, steps: int) -> None:
    """Random allocs, forks, launches, frees, expiries and (rarely) snapshots, the same on
    every twin; the slots the twins hold already (``twin.ids``) take part too."""
    rng = random.Random(seed)
    live: list[int] = sorted(twins[0].ids)
    next_number = max(live, default=-1) + 1
    for step in range(steps):
        op = rng.random()
        if op < 0.05:  # time passes: idle slots expire (journaled as frees by the expiry hook)
            clock.advance(rng.uniform(0, TTL * 0.5))
            expired = [set(twin.pool.sweep()) for twin in twins]
            numbers = [{twin.number(s) for s in ids} for twin, ids in zip(twins, expired)]
            assert all(n == numbers[0] for n in numbers)
            live = [n for n in live if n not in numbers[0]]
            continue
        if op < 0.11:
            for twin in twins:
                twin.persistence.snapshot()
            continue
        if (op < 0.45 or not live) and len(live) < NUM_SLOTS:
            fork = live and rng.random() < 0.2
            source = rng.choice(live) if fork else None
            for twin in twins:
                if fork:
                    twin.ids[next_number] = twin.pool.fork(twin.ids[source])
                else:
                    twin.ids[next_number], = twin.pool.alloc(1)
                twin.persistence.note_change()
            live.append(next_number)
            next_number += 1
            continue
        if not live:
            continue
        if op < 0.8:  # a launch on a few slots (each journaled once per generation)
            chosen = rng.sample(live, rng.randint(1, min(3, len(live))))
            for twin in twins:
                twin.persistence.advancing([twin.ids[n] for n in chosen])
                for n in chosen:
                    twin.pool.write_state(twin.ids[n], random_state(twin.pool, 7919 * step + n))
            continue
        number = live.pop(rng.randrange(len(live)))
        for twin in twins:
            _free(twin.pool, twin.persistence, twin.ids[number])


def _expire_some_snapshotted_slots(twins: list[_Twin], clock: FakeClock) -> None:
    """A snapshot, then half its slots expire, then slots churn until the compacting twin
    compacts: the expiries' records live on only in the compacted journal's free record."""
    def live() -> list[int]:
        return sorted(n for n, s in twins[0].ids.items() if twins[0].pool.contains(s))

    numbers = live()
    while len(numbers) < 2 and twins[0].pool.stats().free:
        number = max(twins[0].ids, default=-1) + 1
        for twin in twins:
            twin.ids[number], = twin.pool.alloc(1)
            twin.persistence.note_change()
        numbers = live()
    for twin in twins:
        twin.pool.rows([twin.ids[n] for n in numbers])  # none idle yet
        twin.persistence.snapshot()
    clock.advance(TTL * 0.6)
    for twin in twins:
        twin.pool.rows([twin.ids[n] for n in numbers[::2]])  # these stay
    clock.advance(TTL * 0.6)
    for twin in twins:
        assert {twin.number(s) for s in twin.pool.sweep()} == set(numbers[1::2])
    compactions = twins[0].persistence.compactions
    while twins[0].persistence.compactions == compactions:
        for twin in twins:
            _churn(twin.pool, twin.persistence, 0)


def _restart(twin: _Twin, clock: FakeClock) -> tuple[StatePool, object]:
    twin.persistence.close()  # kill -9: no final snapshot
    pool = _pool(clock)
    persistence = Persistence(pool, twin.path)
    report = persistence.restore()
    persistence.close()
    return pool, report


def _assert_same_restore(twins: list[_Twin], clock: FakeClock) -> None:
    restored = [_restart(twin, clock) for twin in twins]
    views = []
    for twin, (pool, report) in zip(twins, restored):
        numbers = {twin.number(s): s for s in pool.slot_ids()}
        views.append((
            sorted(numbers),
            {n: pool.slot_info(s).state_lost for n, s in numbers.items()},
            sorted(twin.number(s) for s in report.lost),
            sorted(twin.number(s) for s in report.gone),
            sorted(twin.number(s) for s in report.refreed),
            report.journal_intact,
        ))
    assert views[0] == views[1]
    (pool_a, _), (pool_b, _) = restored
    for n in views[0][0]:
        assert_bit_equal(pool_a.read_state(twins[0].ids[n]), pool_b.read_state(twins[1].ids[n]))
    assert pool_a.slot_ids(), "a history that restores no slot proves little"


@pytest.mark.parametrize("seed", range(8))
def test_a_restart_from_a_compacted_journal_equals_one_from_the_uncompacted_journal(tmp_path, seed):
    clock = FakeClock()
    twins = []
    for name, threshold in (("compacted", 256), ("uncompacted", NEVER)):
        (tmp_path / name).mkdir()
        twins.append(_Twin(tmp_path / name / "pool.snapshot", clock, threshold))
    _run_history(seed, twins, clock, steps=600)
    _expire_some_snapshotted_slots(twins, clock)
    compacted, uncompacted = twins
    assert compacted.persistence.compactions > 0 and uncompacted.persistence.compactions == 0
    _assert_same_restore(twins, clock)


def test_a_restart_after_a_restart_from_a_compacted_journal_still_agrees(tmp_path):
    """Restarts in the middle of the history (the state a restore rebuilds: which slots the
    snapshot holds, an empty journal) keep both restores equal."""
    clock = FakeClock()
    twins = []
    for name, threshold in (("compacted", 256), ("uncompacted", NEVER)):
        (tmp_path / name).mkdir()
        twins.append(_Twin(tmp_path / name / "pool.snapshot", clock, threshold))
    for part in range(3):
        _run_history(100 + part, twins, clock, steps=300)
        for twin, threshold in zip(twins, (256, NEVER)):
            twin.persistence.close()
            twin.pool = _pool(clock)
            twin.persistence = _persistence(twin.pool, twin.path, threshold)
            live = set(twin.pool.slot_ids())
            twin.ids = {n: s for n, s in twin.ids.items() if s in live}
        # the histories go on with the slots both restored (the numbers stay aligned)
        assert sorted(twins[0].ids) == sorted(twins[1].ids)
    assert twins[0].persistence.compactions == 0  # restored: nothing compacted yet
    _run_history(999, twins, clock, steps=300)
    _assert_same_restore(twins, clock)


# -- what a restart does with a compacted journal ----------------------------------------------

def _setup_abc(tmp_path: Path, compact_min_bytes: int) -> tuple[StatePool, Persistence, list[str], dict]:
    """Slots a, b, c in snapshot 1; then a advances and b is freed."""
    pool = _pool()
    persistence = _persistence(pool, tmp_path / "pool.snapshot", compact_min_bytes)
    a, b, c = pool.alloc(3)
    persistence.note_change()
    for seed, slot_id in enumerate((a, b, c)):
        _advance(pool, persistence, slot_id, seed)
    assert persistence.snapshot() == 1
    kept = {c: (pool.read_state(c), pool.slot_info(c))}
    _advance(pool, persistence, a, 10)
    _free(pool, persistence, b)
    return pool, persistence, [a, b, c], kept


def _assert_abc_restored(tmp_path: Path, abc: list[str], kept: dict, churned: list[str]):
    a, b, c = abc
    pool = _pool()
    persistence = Persistence(pool, tmp_path / "pool.snapshot")
    report = persistence.restore()
    persistence.close()
    assert sorted(pool.slot_ids()) == sorted([a, c])
    assert pool.slot_info(a).state_lost and not pool.slot_info(c).state_lost
    assert_bit_equal(pool.read_state(c), kept[c][0])
    assert replace(pool.slot_info(c), last_used=0) == replace(kept[c][1], last_used=0)
    assert report.lost == [a] and report.refreed == [b] and report.journal_intact
    assert set(churned) & set(report.gone) == set()  # each churned slot was freed, never advanced-and-live
    return report


def test_a_freed_slot_the_snapshot_held_stays_freed_after_compaction(tmp_path):
    pool, persistence, abc, kept = _setup_abc(tmp_path, compact_min_bytes=512)
    churned = [_churn(pool, persistence, seed) for seed in range(40)]
    assert persistence.compactions > 0
    records = read_journal(persistence.journal_path).records
    assert len(records) < 2 * len(churned)  # compacted: not a record per free
    _, b, _ = abc
    assert any(r.op == "free" and b in r.slots for r in records)
    persistence.close()
    _assert_abc_restored(tmp_path, abc, kept, churned)


def test_the_compacted_journal_is_the_net_effect(tmp_path):
    pool, persistence, (a, b, c), _ = _setup_abc(tmp_path, compact_min_bytes=512)
    d, = pool.alloc(1)
    _advance(pool, persistence, d, 20)  # created after the snapshot, live: "gone" at a restart
    while persistence.compactions == 0:
        _churn(pool, persistence, 0)
    _churn(pool, persistence, 1)
    records = read_journal(persistence.journal_path).records
    free, advance = records[:2]
    assert (free.generation, free.op, set(free.slots)) == (1, "free", {b})  # c and the churned: not freed / not held
    assert (advance.generation, advance.op) == (1, "advance")
    # a and d; a churned slot too when the compaction followed its advance record (its free comes next)
    assert {a, d} <= set(advance.slots) and len(advance.slots) <= 3 and c not in advance.slots
    persistence.close()


def test_an_expired_slot_the_snapshot_held_stays_expired_after_compaction(tmp_path):
    clock = FakeClock()
    pool = _pool(clock)
    persistence = _persistence(pool, tmp_path / "pool.snapshot", 512)
    keep, doomed = pool.alloc(2)
    persistence.note_change()
    persistence.snapshot()
    clock.advance(TTL * 0.6)
    pool.rows([keep])
    clock.advance(TTL * 0.6)
    assert pool.sweep() == [doomed]  # journaled as a free by the expiry hook
    churned = []
    while persistence.compactions == 0:
        churned.append(_churn(pool, persistence, len(churned)))
    _churn(pool, persistence, 0)
    persistence.close()
    restored = _pool(clock)
    again = Persistence(restored, tmp_path / "pool.snapshot")
    report = again.restore()
    again.close()
    assert restored.slot_ids() == [keep] and report.refreed == [doomed]


def test_after_a_clean_restart_a_freed_slot_stays_freed_after_compaction(tmp_path):
    """A restore that finds an empty journal (a clean stop) writes no snapshot: the slots it
    restored are those the snapshot holds, and their frees survive a compaction."""
    path = tmp_path / "pool.snapshot"
    pool = _pool()
    persistence = _persistence(pool, path, 512)
    a, b = pool.alloc(2)
    persistence.note_change()
    persistence.snapshot()
    persistence.close()  # a clean stop: the journal is empty
    pool = _pool()
    persistence = _persistence(pool, path, 512)
    assert persistence.generation == 1
    _free(pool, persistence, b)
    while persistence.compactions == 0:
        _churn(pool, persistence, 0)
    _churn(pool, persistence, 1)
    persistence.close()
    restored = _pool()
    again = Persistence(restored, path)
    report = again.restore()
    again.close()
    assert restored.slot_ids() == [a] and report.refreed == [b]


# -- compactions that fail, and crashes during one ---------------------------------------------

def test_a_compaction_that_fails_leaves_the_old_journal_in_use_and_intact(tmp_path, monkeypatch, caplog):
    pool, persistence, abc, kept = _setup_abc(tmp_path, compact_min_bytes=512)
    journal = Path(persistence.journal_path)
    real_replace, attempts, failing = os.replace, [0], [True]

    def replace(src, dst, *args, **kwargs):
        if os.fspath(dst) == persistence.journal_path:
            attempts[0] += 1
            if failing[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    churned = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        while attempts[0] == 0:
            before = journal.read_bytes()
            churned.append(_churn(pool, persistence, len(churned)))
            after = journal.read_bytes()
            assert after.startswith(before) and len(after) > len(before)  # only ever appended to
        assert _temporaries(tmp_path) == []
        assert os.fstat(persistence._fd).st_ino == journal.stat().st_ino  # still appending to the journal
        for _ in range(3):  # not retried on every append (3 cycles: ~300 bytes, under the 512 threshold)
            churned.append(_churn(pool, persistence, len(churned)))
    assert attempts[0] == 1 and persistence.compactions == 0
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compact" in warnings[0].getMessage()
    records = read_journal(journal)
    assert records.intact and len(records.records) == 2 + 2 * len(churned)
    # a crash now restores from the old journal
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("pool.snapshot", "pool.snapshot.journal"):
        shutil.copy(tmp_path / name, copy / name)
    _assert_abc_restored(copy, abc, kept, churned)
    # retried later, once the journal has grown by the threshold again
    failing[0] = False
    while persistence.compactions == 0:
        churned.append(_churn(pool, persistence, len(churned)))
    assert attempts[0] == 2 and _temporaries(tmp_path) == []
    _churn(pool, persistence, 0)
    persistence.close()
    _assert_abc_restored(tmp_path, abc, kept, churned)


class _Crash(BaseException):
    """A kill -9 at this point: nothing after it runs (not an OSError: nothing handles it)."""


CRASH_POINTS = ["temporary written, not renamed", "renamed, directory not fsynced", "directory fsynced"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_at_each_point_of_a_compaction_restores_the_same_state(tmp_path, monkeypatch, point):
    pool, persistence, abc, kept = _setup_abc(tmp_path, compact_min_bytes=512)
    real_replace, real_fsync_directory = os.replace, persistence_module.fsync_directory

    def replace(src, dst, *args, **kwargs):
        if os.fspath(dst) != persistence.journal_path:
            return real_replace(src, dst, *args, **kwargs)
        if point == CRASH_POINTS[0]:
            os.link(src, tmp_path / ".pool.snapshot.journal.killed9.tmp")  # what a kill -9 leaves
            raise _Crash()
        real_replace(src, dst, *args, **kwargs)
        if point == CRASH_POINTS[1]:
            raise _Crash()

    def fsync_directory(directory):
        real_fsync_directory(directory)
        if point == CRASH_POINTS[2]:
            raise _Crash()

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(persistence_module, "fsync_directory", fsync_directory)
    churned = []
    with pytest.raises(_Crash):
        while True:
            churned.append(_churn(pool, persistence, len(churned)))
    monkeypatch.undo()
    persistence.close()
    if point == CRASH_POINTS[0]:
        assert _temporaries(tmp_path) == [".pool.snapshot.journal.killed9.tmp"]
    # the churned slot whose record the crash interrupted is at most "gone" (created after the snapshot)
    _assert_abc_restored(tmp_path, abc, kept, churned)
    assert _temporaries(tmp_path) == []


def test_a_restart_removes_a_temporary_journal_a_crash_left(tmp_path):
    pool, persistence, abc, kept = _setup_abc(tmp_path, compact_min_bytes=NEVER)
    persistence.close()
    leftover = tmp_path / ".pool.snapshot.journal.a1b2c3d4.tmp"
    leftover.write_bytes(b'{"gen":1,"op":"free","slots":["' + abc[0].encode() + b'"]}\n')
    unrelated = tmp_path / ".pool.snapshot.journalx.a1b2c3d4.tmp"  # a temporary of another path
    unrelated.write_bytes(b"x")
    _assert_abc_restored(tmp_path, abc, kept, [])
    assert _temporaries(tmp_path) == [unrelated.name]


def test_a_record_cut_off_after_a_failed_append_still_works_with_compaction(tmp_path, monkeypatch):
    """A record half-written when the disk filled, whose cut-back failed too, is cut off
    before the next record; a compaction right after that record leaves a readable journal."""
    pool, persistence, abc, kept = _setup_abc(tmp_path, compact_min_bytes=2048)
    faults = HalfWrites(persistence, monkeypatch)  # armed below
    churned = []
    while os.path.getsize(persistence.journal_path) < 1900:
        churned.append(_churn(pool, persistence, len(churned)))
    assert persistence.compactions == 0
    doomed, = pool.alloc(1)
    faults.arm(cut_back_fails=True)
    with pytest.raises(SnapshotError):
        persistence.advancing([doomed])  # half written, not cut back: the next record cuts it
    assert persistence._failed_from is not None
    pool.free(doomed)  # its change never ran; never journaled as advanced
    while persistence.compactions == 0:
        churned.append(_churn(pool, persistence, len(churned)))
    assert persistence._failed_from is None
    _churn(pool, persistence, 1)
    contents = read_journal(persistence.journal_path)
    assert contents.intact
    persistence.close()
    _assert_abc_restored(tmp_path, abc, kept, churned)


def test_compaction_after_a_snapshot_whose_rename_may_not_be_durable_never_serves_a_stale_state(
        tmp_path, monkeypatch):
    """Snapshot 2's rename may not survive (its directory fsync failed): a restart may find
    snapshot 1, and must then distrust the journal (it names generation 2), even when every
    record of generation 2 was compacted away (slots created and freed after snapshot 2)."""
    pool, persistence, (a, b, c), _ = _setup_abc(tmp_path, compact_min_bytes=512)
    old = tmp_path / "snapshot-1"
    shutil.copy(tmp_path / "pool.snapshot", old)
    real = snapshot_module.fsync_directory
    calls = [0]

    def failing(directory):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.EIO, "injected")
        real(directory)

    monkeypatch.setattr(snapshot_module, "fsync_directory", failing)
    with pytest.raises(SnapshotNotDurable):
        persistence.snapshot()
    monkeypatch.undo()
    churned = []
    while persistence.compactions == 0:
        churned.append(_churn(pool, persistence, len(churned)))
    _churn(pool, persistence, 0)
    persistence._compact()  # a compaction whose net effect is empty: nothing freed or advanced since snapshot 2
    persistence.close()
    assert [(r.generation, r.op, r.slots) for r in read_journal(persistence.journal_path).records] == [
        (2, "advance", ())]
    shutil.copy(old, tmp_path / "pool.snapshot")  # the rename was lost: snapshot 1 is back
    restored = _pool()
    again = Persistence(restored, tmp_path / "pool.snapshot")
    report = again.restore()
    again.close()
    assert not report.journal_intact
    assert sorted(restored.slot_ids()) == sorted([a, b, c])
    assert all(restored.slot_info(s).state_lost for s in (a, b, c))


def test_the_threshold_is_checked(tmp_path):
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises((ValueError, TypeError)):
            Persistence(_pool(), tmp_path / "pool.snapshot", compact_min_bytes=bad)
