"""`state_store.Persistence` on a pool in this process: numbered snapshots, the journal of
what changed after the latest one, and what a restart makes of them (a crash is simulated
by dropping the objects without a final snapshot; a real ``kill -9`` is in test_faults.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from state_store import Persistence, SnapshotError, StatePool
from state_store.persistence import read_journal

GEOMETRY = dict(num_layers=2, num_slots=6, num_heads=2, head_k_dim=8, head_v_dim=4)


def state(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(GEOMETRY["num_layers"], GEOMETRY["num_heads"], GEOMETRY["head_v_dim"],
                       GEOMETRY["head_k_dim"], generator=gen)


def fresh(path: Path) -> tuple[StatePool, Persistence]:
    """A new process's pool and persistence at ``path``, restored."""
    pool = StatePool(**GEOMETRY)
    persistence = Persistence(pool, path)
    persistence.restore()
    return pool, persistence


def write(pool: StatePool, persistence: Persistence, slot: str, seed: int) -> None:
    """An in-place change, announced first (as the service's device thread does)."""
    persistence.advancing([slot])
    pool.write_state(slot, state(seed))


def journal_lines(persistence: Persistence) -> list[dict]:
    return [json.loads(line) for line in Path(persistence.journal_path).read_text().splitlines()]


def test_a_restart_brings_back_the_snapshot_and_flags_what_advanced_after_it(tmp_path):
    path = tmp_path / "pool.snapshot"
    pool, persistence = fresh(path)
    a, b, c, d = pool.alloc(4)
    for seed, slot in enumerate((a, b, c, d)):
        write(pool, persistence, slot, seed)
    assert persistence.snapshot() == 1 and journal_lines(persistence) == []
    write(pool, persistence, b, 10)  # after the snapshot: its new state dies with the crash
    write(pool, persistence, b, 11)  # announced once per generation
    persistence.freeing(c)
    pool.free(c)
    e = pool.alloc()[0]
    write(pool, persistence, e, 12)
    assert journal_lines(persistence) == [{"gen": 1, "op": "advance", "slots": [b]},
                                          {"gen": 1, "op": "free", "slots": [c]},
                                          {"gen": 1, "op": "advance", "slots": [e]}]
    del pool, persistence  # kill -9: no final snapshot

    pool, persistence = fresh(path)
    assert sorted(pool.slot_ids()) == sorted([a, b, d])
    assert torch.equal(pool.read_state(a), state(0)) and torch.equal(pool.read_state(d), state(3))
    assert torch.equal(pool.read_state(b), state(1))  # as of the snapshot ...
    assert pool.slot_info(b).state_lost  # ... and flagged, never passed off as current
    assert not pool.slot_info(a).state_lost and not pool.slot_info(d).state_lost
    assert persistence.generation == 2  # the restore wrote the flags down at once
    assert journal_lines(persistence) == []


def test_the_report_names_lost_gone_and_refreed_slots(tmp_path):
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a, b, c = pool.alloc(3)
    persistence.snapshot()
    write(pool, persistence, a, 1)
    persistence.freeing(b)
    pool.free(b)
    e = pool.alloc()[0]
    write(pool, persistence, e, 2)
    persistence.close()

    report = Persistence(StatePool(**GEOMETRY), path).restore()
    assert (report.lost, report.gone, report.refreed, report.journal_intact) == ([a], [e], [b], True)
    assert report.stamp is not None and report.stamp.generation == 1 and report.restored == 2
    text = report.describe()
    assert a in text and e in text and "state_lost" in text


def test_a_restore_survives_another_crash(tmp_path):
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a = pool.alloc()[0]
    persistence.snapshot()
    write(pool, persistence, a, 1)
    del pool, persistence
    fresh(path)  # flags a, writes generation 2, crashes before doing anything else
    pool, _ = fresh(path)
    assert pool.slot_info(a).state_lost


def test_a_snapshot_taken_after_the_change_keeps_it(tmp_path):
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a = pool.alloc()[0]
    write(pool, persistence, a, 1)
    assert persistence.changed
    persistence.snapshot()
    assert not persistence.changed
    pool, _ = fresh(path)
    assert torch.equal(pool.read_state(a), state(1)) and not pool.slot_info(a).state_lost


def test_stale_records_of_an_older_generation_are_ignored(tmp_path):
    """A crash between a snapshot's rename and the journal's truncation."""
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a = pool.alloc()[0]
    persistence.snapshot()
    write(pool, persistence, a, 1)
    stale = Path(persistence.journal_path).read_bytes()
    persistence.snapshot()  # generation 2 holds a's new state
    Path(persistence.journal_path).write_bytes(stale)
    pool, _ = fresh(path)
    assert torch.equal(pool.read_state(a), state(1)) and not pool.slot_info(a).state_lost


def test_a_torn_last_record_is_dropped(tmp_path):
    """The crash hit mid-append: the change it announced never started."""
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a, b = pool.alloc(2)
    persistence.snapshot()
    write(pool, persistence, a, 1)
    with open(persistence.journal_path, "ab") as f:
        f.write(b'{"gen": 1, "op": "adv')
    report = Persistence(StatePool(**GEOMETRY), path).restore()
    assert report.journal_intact and report.lost == [a]
    assert read_journal(path.with_name("s.journal")).empty  # rewritten by the restore's snapshot


@pytest.mark.parametrize("damage", ["garbage line", "newer generation"])
def test_a_journal_that_cannot_be_trusted_flags_every_slot(tmp_path, damage):
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    slots = pool.alloc(3)
    persistence.snapshot()
    line = b"\x00\xffnot json\n" if damage == "garbage line" else b'{"gen": 7, "op": "free", "slots": []}\n'
    with open(persistence.journal_path, "ab") as f:
        f.write(line)
    pool, _ = fresh(path)
    assert all(pool.slot_info(s).state_lost for s in slots)


def test_no_snapshot_yet_names_the_slots_a_crash_took(tmp_path):
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a = pool.alloc()[0]
    write(pool, persistence, a, 1)
    report = Persistence(StatePool(**GEOMETRY), path).restore()
    assert report.stamp is None and report.gone == [a] and report.restored == 0
    assert os.path.exists(path)  # an empty generation 1, so the journal could be emptied


def test_a_journal_that_cannot_be_written_refuses_the_change(tmp_path, monkeypatch):
    pool, persistence = fresh(tmp_path / "s")
    a = pool.alloc()[0]

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(SnapshotError, match="cannot write the journal"):
        persistence.advancing([a])


def test_a_snapshot_that_cannot_be_written_keeps_the_journal(tmp_path):
    path = tmp_path / "s"
    pool, persistence = fresh(path)
    a = pool.alloc()[0]
    persistence.snapshot()
    write(pool, persistence, a, 1)
    saved = path.read_bytes()
    path.unlink()
    (path / "in-the-way").mkdir(parents=True)  # the atomic rename onto `path` fails
    with pytest.raises(SnapshotError):
        persistence.snapshot()
    assert persistence.generation == 1 and journal_lines(persistence) == [{"gen": 1, "op": "advance", "slots": [a]}]
    (path / "in-the-way").rmdir()
    path.rmdir()
    path.write_bytes(saved)
    pool, _ = fresh(path)
    assert pool.slot_info(a).state_lost
