"""Crash consistency of `state_store.Persistence` at each point a crash can hit: a child
process runs the pool and its persistence up to a chosen point and dies there with
``os._exit`` (no cleanup, no final snapshot: what ``kill -9`` leaves), then a fresh pool
restores from the files it left. Failed writes (a full disk) are simulated in-process.

After every restart a slot either holds the state it last held, unflagged, or is flagged
``state_lost``; a freed slot stays freed; a restart restores what it can."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from journal_faults import HalfWrites

from state_store import Persistence, PrefixCache, SnapshotError, StatePool
from state_store import snapshot as snapshot_module

GEOMETRY = dict(num_layers=2, num_slots=6, num_heads=2, head_k_dim=8, head_v_dim=4)
ENTRY_BYTES = 2 * 2 * 8 * 4 * 4  # one prefix cache entry of this geometry, fp32
REPO = Path(__file__).resolve().parents[2]
CRASHED = 9  # the child's exit status at the crash point


def state(seed: int) -> torch.Tensor:
    """A fresh random state [L, HV, V, K], nowhere zero."""
    gen = torch.Generator().manual_seed(1000 + seed)
    s = torch.rand(GEOMETRY["num_layers"], GEOMETRY["num_heads"], GEOMETRY["head_v_dim"],
                   GEOMETRY["head_k_dim"], generator=gen) + 0.5
    return s * torch.where(torch.rand(s.shape, generator=gen) < 0.5, -1.0, 1.0)


def fresh(path: Path) -> tuple[StatePool, PrefixCache, Persistence]:
    """A new process's pool, prefix cache and persistence at ``path``, restored."""
    pool = StatePool(**GEOMETRY)
    cache = PrefixCache(pool.geometry, 4 * ENTRY_BYTES)
    persistence = Persistence(pool, path, prefix_cache=cache)
    persistence.restore()
    return pool, cache, persistence


def write(pool: StatePool, persistence: Persistence, slot: str, seed: int) -> None:
    """An in-place change, announced first (as the service's device thread does)."""
    persistence.advancing([slot])
    pool.write_state(slot, state(seed))


def crash() -> None:
    """Die at once: no finally blocks, no atexit, no buffers flushed."""
    os._exit(CRASHED)


# -- the child: a pool run up to a crash point ---------------------------------------------

def _after_nth(target: object, name: str, n: int, before: bool) -> None:
    """Replace ``target.name`` so that its ``n``-th call crashes, before or after it runs."""
    real = getattr(target, name)
    calls = [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n and before:
            crash()
        result = real(*args, **kwargs)
        if calls[0] == n:
            crash()
        return result

    setattr(target, name, patched)


def _journal_fsync_then_crash(persistence: Persistence) -> None:
    """Crash once the journal's next record is fsynced (before the change it announces)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        if fd == persistence._fd:
            crash()

    os.fsync = fsync


def child(path: str, point: str) -> None:
    """Generation 1 holds slots a (state 1) and b (state 2) and prefix entry "k" (state 1);
    then a advances to state 3, b is freed, and the next snapshot is taken: the crash
    hits at ``point`` on the way."""
    pool, cache, persistence = fresh(Path(path))
    a, b = pool.alloc(2)
    write(pool, persistence, a, 1)
    write(pool, persistence, b, 2)
    cache.publish("k", 0, state(1))
    assert persistence.snapshot() == 1
    print(a, b, flush=True)
    if point == "journal record fsynced, state not written":
        _journal_fsync_then_crash(persistence)
    write(pool, persistence, a, 3)
    persistence.freeing(b)
    pool.free(b)
    cache.publish("k", 0, state(3))
    if point == "pool file's temporary written, not renamed":
        _after_nth(os, "replace", 1, before=True)
    elif point == "pool file renamed, directory not fsynced":
        _after_nth(snapshot_module, "fsync_directory", 1, before=True)
    elif point == "prefix file's temporary written, not renamed":
        _after_nth(os, "replace", 2, before=True)
    elif point == "prefix file renamed, journal not emptied":
        _after_nth(os, "replace", 2, before=False)
    elif point == "journal emptied, not fsynced":
        _after_nth(os, "ftruncate", 1, before=False)
    persistence.snapshot()
    crash()


def run_child(path: Path, point: str) -> tuple[str, str]:
    """Run `child` in a new interpreter; the ids of slots a and b it printed."""
    code = f"import test_crash_points as t; t.child({str(path)!r}, {point!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == CRASHED, done.stderr
    a, b = done.stdout.split()
    return a, b


BEFORE_THE_RENAME = ["journal record fsynced, state not written", "pool file's temporary written, not renamed"]
AFTER_THE_RENAME = ["pool file renamed, directory not fsynced", "prefix file's temporary written, not renamed",
                    "prefix file renamed, journal not emptied", "journal emptied, not fsynced"]


@pytest.mark.parametrize("point", BEFORE_THE_RENAME + AFTER_THE_RENAME)
def test_a_crash_at_each_point_restores_current_or_flagged_states_and_never_resurrects_a_free(tmp_path, point):
    path = tmp_path / "pool.snapshot"
    a, b = run_child(path, point)
    pool, cache, persistence = fresh(path)
    persistence.close()
    if point in AFTER_THE_RENAME:  # generation 2 holds a's new state and not b; older records are stale
        assert torch.equal(pool.read_state(a), state(3)) and not pool.slot_info(a).state_lost
        assert pool.slot_ids() == [a]
    else:  # generation 1: a advanced after it (flagged, its snapshot state), b freed again or never freed
        assert torch.equal(pool.read_state(a), state(1)) and pool.slot_info(a).state_lost
        freed = point != "journal record fsynced, state not written"
        assert (b not in pool.slot_ids()) if freed else torch.equal(pool.read_state(b), state(2))
    with cache.restoring(["k"]) as held:
        assert held.state is not None  # the older or the newer file: an entry, whole


@pytest.mark.parametrize("point", ["pool file's temporary written, not renamed",
                                   "prefix file's temporary written, not renamed"])
def test_a_restart_removes_the_temporary_files_a_crash_left_mid_snapshot(tmp_path, point):
    """Each crash mid-snapshot leaves a pool-sized temporary file: unless a restart removes
    them, repeated crashes fill the disk, and then every snapshot and journal write fails."""
    path = tmp_path / "pool.snapshot"
    run_child(path, point)
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "the crash left no temporary file"
    unrelated = tmp_path / ".pool.snapshot.b.0a1b2c3d.tmp"  # a temporary of another path, pool.snapshot.b
    unrelated.write_bytes(b"x")
    fresh(path)[2].close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == [unrelated.name]


# -- a journal write that fails midway (a full disk) -------------------------------------------

AFTER_THE_FAILURE: dict[str, Callable[[StatePool, Persistence, str], None]] = {
    "a later record": lambda pool, persistence, b: write(pool, persistence, b, 4),
    "a snapshot, then a later record": lambda pool, persistence, b: (persistence.snapshot(),
                                                                     write(pool, persistence, b, 4)),
}


@pytest.mark.parametrize("cut_back_fails", [False, True], ids=["cut back at once", "cut back fails once"])
@pytest.mark.parametrize("then", list(AFTER_THE_FAILURE))
def test_a_journal_record_cut_short_by_a_full_disk_flags_only_what_advanced(tmp_path, monkeypatch,
                                                                            cut_back_fails, then):
    """The refused change never ran, so its half record must not merge with the next one
    into an unreadable line: that makes the whole journal untrusted, and the restart then
    flags every slot lost instead of the one that advanced."""
    path = tmp_path / "pool.snapshot"
    pool, _, persistence = fresh(path)
    a, b, c = pool.alloc(3)
    for seed, slot in enumerate((a, b, c)):
        write(pool, persistence, slot, seed)
    assert persistence.snapshot() == 1
    HalfWrites(persistence, monkeypatch).arm(cut_back_fails)
    with pytest.raises(SnapshotError, match="cannot write the journal"):
        write(pool, persistence, a, 3)  # refused: a keeps state 0
    AFTER_THE_FAILURE[then](pool, persistence, b)
    persistence.close()  # kill -9

    again, _, restarted = fresh(path)
    restarted.close()
    flagged = sorted(s for s in (a, b, c) if again.slot_info(s).state_lost)
    assert flagged == [b], "slots that did not advance are flagged lost"
    assert torch.equal(again.read_state(a), state(0)) and torch.equal(again.read_state(c), state(2))
