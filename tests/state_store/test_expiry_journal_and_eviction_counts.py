"""Two counts that must be right across a crash and a load.

- A slot that idles past the ttl and expires (lazily, when next looked at, or by a sweep)
  is journaled like a free, before it is freed: a restart from the snapshot before it and
  the journal after it does not bring the slot back, and every other slot comes back bit
  for bit. A crash is simulated as in the other persistence tests: the journal is closed
  without a snapshot, and a new pool restores from the same files.
- The prefix cache's eviction counters (`PrefixCache.evictions`, ``on_evict``: the
  ``kda_prefix_evictions_total{tier}`` metric, "entries that left a tier for lack of
  room") count only entries that left a tier to make room: not a new entry refused for
  lack of room, and nothing a load of the cache's file (`PrefixCache.replace_all`) does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from pool_helpers import FakeClock, assert_bit_equal, make_pool, random_state

from state_store import Persistence, PrefixCache, SnapshotError, StatePool, UnknownSlot
from state_store import prefix_snapshot

TTL = 10.0
ENTRY = make_pool().geometry.bytes_per_slot


# -- expiries in the journal --------------------------------------------------------------------

def _restored(path: Path, clock: Callable[[], float]) -> tuple[StatePool, Persistence]:
    """A new process's pool (ttl `TTL` on ``clock``) and its persistence at ``path``, restored."""
    pool = make_pool(clock=clock, ttl=TTL)
    persistence = Persistence(pool, path)
    persistence.restore()
    return pool, persistence


def _journal(persistence: Persistence) -> list[dict]:
    return [json.loads(line) for line in Path(persistence.journal_path).read_text().splitlines()]


def _expire_lazily(pool: StatePool, slot_id: str) -> None:
    with pytest.raises(UnknownSlot):
        pool.read_state(slot_id)


LOOKS: dict[str, Callable[[StatePool, str], object]] = {
    "read_state": _expire_lazily,
    "rows": lambda pool, slot_id: pytest.raises(UnknownSlot, pool.rows, [slot_id]),
    "free": lambda pool, slot_id: pytest.raises(UnknownSlot, pool.free, slot_id),
    "contains": lambda pool, slot_id: pool.contains(slot_id),
    "slot_ids": lambda pool, slot_id: pool.slot_ids(),
    "sweep": lambda pool, slot_id: pool.sweep(),
}


@pytest.mark.parametrize("look", sorted(LOOKS))
def test_an_expired_slot_does_not_come_back_after_a_crash(tmp_path, look):
    path, clock = tmp_path / "pool.safetensors", FakeClock()
    pool, persistence = _restored(path, clock)
    keep, doomed, other = pool.alloc(3)
    for seed, slot_id in enumerate((keep, doomed, other)):
        persistence.advancing([slot_id])
        pool.write_state(slot_id, random_state(pool, seed))
        pool.record_tokens(slot_id, seed, 16 + seed)
    assert persistence.snapshot() == 1
    kept = {slot_id: (pool.read_state(slot_id), pool.slot_info(slot_id)) for slot_id in (keep, other)}
    clock.advance(TTL - 1)
    pool.rows([keep, other])  # a use: these two stay live
    clock.advance(2)  # `doomed` idles TTL + 1 s
    LOOKS[look](pool, doomed)
    assert not pool.contains(doomed) and pool.stats().expiries == 1
    journal = _journal(persistence)
    persistence.close()  # kill -9: no snapshot after the expiry

    again, restarted = _restored(path, FakeClock(start=50_000.0))
    restarted.close()
    assert sorted(again.slot_ids()) == sorted([keep, other])
    assert journal == [{"gen": 1, "op": "free", "slots": [doomed]}]  # journaled like a free
    assert not again.contains(doomed)
    for slot_id, (state, info) in kept.items():
        assert_bit_equal(again.read_state(slot_id), state)
        got = again.slot_info(slot_id)
        assert (got.row, got.tokens_per_layer, got.state_lost) == (info.row, info.tokens_per_layer, False)


def test_a_sweep_journals_every_expired_slot_in_one_record(tmp_path):
    path, clock = tmp_path / "pool.safetensors", FakeClock()
    pool, persistence = _restored(path, clock)
    ids = pool.alloc(4)
    assert persistence.snapshot() == 1
    clock.advance(TTL + 1)
    assert sorted(pool.sweep()) == sorted(ids)
    assert [sorted(r["slots"]) for r in _journal(persistence)] == [sorted(ids)]
    persistence.close()

    again, restarted = _restored(path, FakeClock())
    restarted.close()
    assert again.slot_ids() == [] and again.stats().free == again.geometry.num_slots


def test_an_expiry_that_cannot_be_journaled_does_not_happen(tmp_path, monkeypatch):
    """As for a free: the journal's fsync fails, so the slot is not freed (the look raises
    SnapshotError); once the journal can be written again, the next look expires it."""
    path, clock = tmp_path / "pool.safetensors", FakeClock()
    pool, persistence = _restored(path, clock)
    (doomed,) = pool.alloc(1)
    persistence.snapshot()
    clock.advance(TTL + 1)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(SnapshotError, match="cannot write the journal"):
        pool.read_state(doomed)
    monkeypatch.undo()
    assert pool.stats().expiries == 1 and not pool.contains(doomed)  # journaled, then expired
    persistence.close()

    again, restarted = _restored(path, FakeClock())
    restarted.close()
    assert again.slot_ids() == []


class SteppingClock(FakeClock):
    """A clock that moves ``step`` seconds every time it is read."""

    def __init__(self, start: float, step: float) -> None:
        super().__init__(start)
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_an_expiry_during_the_restore_is_in_the_snapshot_it_writes(tmp_path):
    """The restore's own look at the slots expires one (the journal is not open yet, and
    was empty): the restore writes a snapshot, so another crash does not bring it back."""
    path, clock = tmp_path / "pool.safetensors", FakeClock()
    pool, persistence = _restored(path, clock)
    (doomed,) = pool.alloc(1)
    clock.advance(TTL - 0.5)  # idle just under the ttl when the snapshot is taken
    assert persistence.snapshot() == 1
    persistence.close()

    again, restarted = _restored(path, SteppingClock(start=0.0, step=1.0))
    restarted.close()
    assert restarted.generation == 2 and again.slot_ids() == []
    third, last = _restored(path, FakeClock())
    last.close()
    assert third.slot_ids() == []



@pytest.mark.parametrize("journaled", ["advance", "free"])
def test_a_slot_expiring_while_the_restore_applies_the_journal_is_skipped(tmp_path, monkeypatch, journaled):
    """A slot the journal names (advanced: to flag lost; freed: to free again) that idles
    past the ttl between the restore's look at the live slots and its use of them is
    expired, not an error: the restore goes on, and another crash does not bring it back."""
    path, clock = tmp_path / "pool.safetensors", FakeClock()
    pool, persistence = _restored(path, clock)
    named, other = pool.alloc(2)
    assert persistence.snapshot() == 1
    if journaled == "advance":
        persistence.advancing([named])
    else:
        persistence.freeing(named)
        pool.free(named)
    persistence.close()  # kill -9

    restart_clock = FakeClock()
    again = make_pool(clock=restart_clock, ttl=TTL)
    restarted = Persistence(again, path)
    looked = again.slot_ids

    def slot_ids_then_idle() -> list[str]:  # the first look at the slots, then the ttl passes
        ids = looked()
        monkeypatch.setattr(again, "slot_ids", looked)
        restart_clock.advance(TTL + 1)
        return ids

    monkeypatch.setattr(again, "slot_ids", slot_ids_then_idle)
    report = restarted.restore()
    restarted.close()
    assert report.lost == []  # expired, not flagged: the report names no slot that is gone
    assert again.slot_ids() == [] and again.stats().expiries == 2
    third, last = _restored(path, FakeClock())
    last.close()
    assert third.slot_ids() == [] and not third.contains(named) and not third.contains(other)


# -- prefix cache eviction counts ----------------------------------------------------------------

def _cache(device_entries: int, host_entries: int = 0) -> tuple[PrefixCache, list[str]]:
    """A cache holding ``device_entries`` and ``host_entries`` entries, and the tiers its
    ``on_evict`` was called with, in order."""
    calls: list[str] = []
    cache = PrefixCache(make_pool().geometry, device_entries * ENTRY, host_entries * ENTRY,
                        clock=FakeClock(), on_evict=calls.append)
    return cache, calls


def _state(seed: int) -> torch.Tensor:
    return random_state(make_pool(), seed)


def test_a_new_entry_refused_for_lack_of_room_is_no_eviction():
    cache, calls = _cache(1)
    cache.publish("a", 64, _state(1))
    with cache.restoring(["a"]):  # pinned: nothing can make room
        assert cache.publish("b", 64, _state(2)) is None
        cache.store_layer("c", 64, 0, _state(3)[0])
    assert cache.keys() == ["a"]
    assert cache.evictions() == {"device": 0, "host": 0} and calls == []


def test_an_entry_over_every_budget_is_refused_without_an_eviction():
    calls: list[str] = []
    cache = PrefixCache(make_pool().geometry, ENTRY - 1, clock=FakeClock(), on_evict=calls.append)
    assert cache.publish("a", 64, _state(1)) is None
    assert cache.evictions() == {"device": 0, "host": 0} and calls == []


def test_loading_the_cache_file_counts_no_eviction(tmp_path):
    """Saved least recently used first, a load used to store each entry as a new one, the
    older ones moving down (and counted) to make room; the tiers it ends with are those
    saved, and no entry leaves a tier for lack of room."""
    saved, _ = _cache(2, host_entries=2)
    for seed, key in enumerate("abcd"):  # "a", "b" move down
        saved.publish(key, 64, _state(seed))
    path = tmp_path / "pool.safetensors.prefix"
    prefix_snapshot.write(path, saved)
    loaded = prefix_snapshot.read(path, saved.geometry)

    cache, calls = _cache(2, host_entries=2)
    cache.replace_all(loaded)
    assert cache.keys() == list("abcd")
    assert [cache.info(k).tier for k in "abcd"] == ["host", "host", "device", "device"]
    assert cache.evictions() == {"device": 0, "host": 0} and calls == []
    held = {e.key: e for e in cache.entries()}
    for seed, key in enumerate("abcd"):
        assert_bit_equal(held[key].state.cpu(), _state(seed))

    smaller, smaller_calls = _cache(1)  # the budgets shrank: the most recent is kept, nothing evicted
    smaller.replace_all(loaded)
    assert smaller.keys() == ["d"] and smaller.evictions() == {"device": 0, "host": 0} and smaller_calls == []

    cache.publish("e", 64, _state(9))  # after the load, room made counts as before
    assert cache.evictions() == {"device": 1, "host": 1} and calls == ["device", "host"]
    assert cache.keys() == list("bcde")
