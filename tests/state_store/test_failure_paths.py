"""Device copies that fail midway (out of memory, a device error found when the copy runs):
a slot whose rows may be partly written is flagged state_lost, never served as whole; a
write that fails before it touches any row changes nothing; a prefix entry enters the cache
only once its copy succeeded, so a failed copy leaves the cache as it was."""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch
from pool_helpers import FakeClock, PoolImage, assert_bit_equal, make_pool, populated_pool, random_state

from state_store import PrefixCache, StatePool

SIMULATED = "CUDA out of memory (simulated)"


def _write_over(pool: StatePool, op: str, slot_id: str, seed: int) -> Callable[[], object]:
    """A write of a whole new random state over the live slot ``slot_id`` by ``op``, ready to run
    (an export's bytes made now)."""
    state = random_state(pool, seed)
    if op == "write_state":
        return lambda: pool.write_state(slot_id, state)
    donor, = pool.alloc(1)
    pool.write_state(donor, state)
    data = pool.export(donor)
    pool.free(donor)
    return lambda: pool.import_(data, slot_id)


def _storage_copy_fails_midway(monkeypatch: pytest.MonkeyPatch, pool: StatePool, method: str) -> None:
    """Make ``method`` (index_copy_ or copy_) on the pool's storage, or a view of it, write
    its first row (the first layer of a slot, a part of the pool) and then raise, as a device
    copy whose error shows only after it started would."""
    real = getattr(torch.Tensor, method)
    base = pool.storage.data_ptr()

    def fails(self: torch.Tensor, *args):
        if self.data_ptr() != base:
            return real(self, *args)
        if method == "index_copy_":
            dim, index, source = args
            real(self, dim, index[:1], source[:1])
        else:
            source, = args
            real(self[:1], source[:1])
        raise RuntimeError(SIMULATED)

    monkeypatch.setattr(torch.Tensor, method, fails)


# -- the pool: a whole slot's state written over a live slot ---------------------------------


@pytest.mark.parametrize("op", ["write_state", "import_over"])
def test_a_write_over_a_slot_failing_before_its_rows_are_touched_changes_nothing(op, monkeypatch):
    clock = FakeClock()
    pool, ids = populated_pool(clock, 5)
    write = _write_over(pool, op, ids[1], seed=77)
    clock.advance(2.0)  # a failed write is no use of the slot either
    image = PoolImage.of(pool)

    def fails(rows):  # the index upload fails: out of memory
        raise RuntimeError(SIMULATED)

    monkeypatch.setattr(pool, "_slot_index", fails)
    with pytest.raises(RuntimeError, match="simulated"):
        write()
    monkeypatch.undo()
    image.assert_same(pool)


@pytest.mark.parametrize("op", ["write_state", "import_over"])
def test_a_write_over_a_slot_failing_midway_flags_it_lost(op, monkeypatch):
    clock = FakeClock()
    pool, ids = populated_pool(clock, 5)
    clock.advance(4.0)
    before = {slot_id: pool.read_state(slot_id) for slot_id in ids}
    infos = {slot_id: pool.slot_info(slot_id) for slot_id in ids}
    write = _write_over(pool, op, ids[1], seed=78)
    free, generation = pool.stats().free, pool.generation
    group, lost = pool.group(ids)
    assert lost is None and pool.group_live(group)

    _storage_copy_fails_midway(monkeypatch, pool, "index_copy_")
    with pytest.raises(RuntimeError, match="simulated"):
        write()
    monkeypatch.undo()

    assert pool.slot_info(ids[1]) == dataclasses.replace(infos[ids[1]], state_lost=True)  # what GET shows
    assert pool.first_lost(ids) == ids[1] and pool.stats().state_lost == 1
    assert pool.generation != generation and not pool.group_live(group)  # a prepared run sees it
    assert pool.stats().free == free
    for slot_id in (ids[0], ids[2]):  # the others untouched
        assert pool.slot_info(slot_id) == infos[slot_id]
        assert_bit_equal(pool.read_state(slot_id), before[slot_id])
    replaced = random_state(pool, 79)
    pool.write_state(ids[1], replaced)  # the client replaces the state: whole again
    assert not pool.slot_info(ids[1]).state_lost
    assert_bit_equal(pool.read_state(ids[1]), replaced)


def test_a_restore_whose_copy_fails_midway_flags_every_slot_lost(tmp_path, monkeypatch):
    clock = FakeClock()
    source, _ = populated_pool(clock, 5)
    source.snapshot(tmp_path / "s")
    pool, ids = populated_pool(clock, 5)
    pool.free(ids[0])
    infos = {slot_id: pool.slot_info(slot_id) for slot_id in ids[1:]}
    free, generation = pool.stats().free, pool.generation

    _storage_copy_fails_midway(monkeypatch, pool, "copy_")
    with pytest.raises(RuntimeError, match="simulated"):
        pool.restore(tmp_path / "s")
    monkeypatch.undo()

    assert pool.slot_ids() == ids[1:] and pool.stats().free == free
    for slot_id in ids[1:]:
        assert pool.slot_info(slot_id) == dataclasses.replace(infos[slot_id], state_lost=True)
    assert pool.generation != generation
    pool.restore(tmp_path / "s")  # it can be retried
    assert pool.stats().state_lost == 0


# -- the prefix cache: an entry enters only once its copy succeeded ---------------------------


def _cache(pool: StatePool, entries: int = 4, host_entries: int = 0) -> PrefixCache:
    entry = pool.geometry.bytes_per_slot
    return PrefixCache(pool.geometry, entries * entry, host_entries * entry, clock=FakeClock())


def _copy_from_fails(monkeypatch: pytest.MonkeyPatch, source: torch.Tensor) -> None:
    """Make a ``copy_`` from ``source`` (or a view of it) write part of its target and then raise."""
    real = torch.Tensor.copy_
    base = source.data_ptr()

    def fails(self: torch.Tensor, src: torch.Tensor, *args):
        if src.data_ptr() != base:
            return real(self, src, *args)
        real(self[:1], src[:1])
        raise RuntimeError(SIMULATED)

    monkeypatch.setattr(torch.Tensor, "copy_", fails)


@dataclasses.dataclass
class _CacheImage:
    """Everything observable about a cache: its keys in LRU order, each entry's info and
    state, and the tiers' entries and bytes."""

    keys: list
    infos: dict
    states: dict
    stats: dict

    @classmethod
    def of(cls, cache: PrefixCache) -> "_CacheImage":
        entries = cache.entries()
        return cls([e.key for e in entries], {e.key: cache.info(e.key) for e in entries},
                   {e.key: e.state.clone() for e in entries}, cache.stats())

    def assert_same(self, cache: PrefixCache) -> None:
        after = _CacheImage.of(cache)
        assert (after.keys, after.infos, after.stats) == (self.keys, self.infos, self.stats)
        for key, state in self.states.items():
            assert_bit_equal(after.states[key], state)


def _filled_cache(pool: StatePool, **budgets: int) -> PrefixCache:
    """A cache holding a complete entry "a" at 64 tokens, "b" at 128 with layer 0 only, and
    "c" at 192, least recently used first."""
    cache = _cache(pool, **budgets)
    cache.publish("a", 64, random_state(pool, 1))
    cache.store_layer("b", 128, 0, random_state(pool, 2)[0])
    cache.publish("c", 192, random_state(pool, 3))
    return cache


@pytest.mark.parametrize("key,tokens", [("new", 64), ("a", 64), ("a", 256), ("b", 128)])
def test_a_publish_whose_copy_fails_leaves_the_cache_as_it_was(key, tokens, monkeypatch):
    pool = make_pool()
    cache = _filled_cache(pool)
    image = _CacheImage.of(cache)
    state = random_state(pool, 9)
    _copy_from_fails(monkeypatch, state)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.publish(key, tokens, state)
    monkeypatch.undo()
    image.assert_same(cache)


@pytest.mark.parametrize("key,tokens", [("new", 64), ("a", 256), ("b", 64)])
def test_a_layer_stored_into_a_new_entry_whose_copy_fails_leaves_the_cache_as_it_was(key, tokens, monkeypatch):
    pool = make_pool()
    cache = _filled_cache(pool)
    image = _CacheImage.of(cache)
    state = random_state(pool, 9)[1]
    _copy_from_fails(monkeypatch, state)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.store_layer(key, tokens, 1, state)
    monkeypatch.undo()
    image.assert_same(cache)


def test_a_layer_stored_while_its_entry_is_restored_leaves_it_whole_when_the_copy_fails(monkeypatch):
    pool = make_pool()
    cache = _filled_cache(pool)
    with cache.restoring(["a"]) as held:  # pinned: the store makes a new entry, a copy of its layers
        image = _CacheImage.of(cache)
        _copy_from_fails(monkeypatch, held.state)
        with pytest.raises(RuntimeError, match="simulated"):
            cache.store_layer("a", 64, 1, random_state(pool, 9)[1])
        monkeypatch.undo()
        image.assert_same(cache)
    assert cache.peek(["a"]).key == "a"


def test_a_stored_layer_rewritten_in_place_is_unstored_when_the_copy_fails(monkeypatch):
    pool = make_pool()
    cache = _filled_cache(pool)
    stats = cache.stats()
    state = random_state(pool, 9)[1]
    _copy_from_fails(monkeypatch, state)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.store_layer("c", 192, 1, state)  # its layer 1 is partly written
    monkeypatch.undo()
    info = cache.info("c")
    assert (info.layers, info.complete) == (pool.geometry.num_layers - 1, False)  # never served
    assert cache.peek(["c"]).matched == 0 and cache.stats() == stats
    cache.store_layer("c", 192, 1, state)  # stored again: complete
    assert cache.peek(["c"]).key == "c"


def test_a_promotion_whose_copy_fails_leaves_the_entry_on_the_host(monkeypatch):
    pool = make_pool()
    cache = _filled_cache(pool, entries=2, host_entries=2)  # "a" moved down to the host tier
    assert cache.info("a").tier == "host"
    image = _CacheImage.of(cache)
    host, = [e.state for e in cache.entries() if e.key == "a"]
    _copy_from_fails(monkeypatch, host)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.promote("a")
    monkeypatch.undo()
    image.assert_same(cache)
    with cache.restoring(["a"]) as held:
        assert_bit_equal(held.state, random_state(pool, 1))
