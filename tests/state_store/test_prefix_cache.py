"""The prefix cache on its own: complete entries only, copies, LRU within byte budgets,
demotion to the host tier, pins during a restore, geometry checks, and its snapshot file."""
from __future__ import annotations

import threading

import pytest
import torch
from pool_helpers import GEOMETRY, FakeClock, assert_bit_equal, make_pool

from state_store import GeometryMismatch, Persistence, PrefixCache, SnapshotError, key_problem
from state_store import prefix_snapshot
from state_store.geometry import PoolGeometry

G = PoolGeometry(GEOMETRY["num_layers"], GEOMETRY["num_slots"], GEOMETRY["num_heads"], GEOMETRY["head_k_dim"],
                 GEOMETRY["head_v_dim"], torch.float32, torch.device("cpu"))
ENTRY = G.bytes_per_slot


def _state(seed: int) -> torch.Tensor:
    return torch.randn(G.slot_shape, generator=torch.Generator().manual_seed(seed))


def _cache(entries: float, host_entries: float = 0, clock: FakeClock | None = None, **kw) -> PrefixCache:
    return PrefixCache(G, int(entries * ENTRY), int(host_entries * ENTRY), clock=clock or FakeClock(), **kw)


def test_only_complete_entries_match_and_they_are_copies():
    cache = _cache(4)
    state = _state(1)
    for layer in range(G.num_layers - 1):
        cache.store_layer("a", 128, layer, state[layer])
    with cache.restoring(["a"]) as held:
        assert held.match.matched == 0 and held.state is None  # a layer is missing: never served
    info = cache.info("a")
    assert (info.layers, info.complete, info.tokens, info.bytes, info.tier) == (G.num_layers - 1, False, 128,
                                                                                ENTRY, "device")
    cache.store_layer("a", 128, G.num_layers - 1, state[-1])
    kept = state.clone()
    state += 1  # the entry is a copy
    with cache.restoring(["x", "a", "y"]) as held:
        assert (held.match.matched, held.match.key, held.match.tokens) == (2, "a", 128)
        assert_bit_equal(held.state, kept)


def test_longest_complete_entry_wins_and_another_offset_replaces():
    cache = _cache(4)
    cache.publish("short", 64, _state(1))
    cache.publish("long", 192, _state(2))
    with cache.restoring(["short", "long", "missing"]) as held:
        assert (held.match.matched, held.match.key, held.match.tokens) == (2, "long", 192)
    cache.store_layer("long", 256, 0, _state(3)[0])  # a checkpoint at another offset starts a new entry
    assert (cache.info("long").tokens, cache.info("long").complete) == (256, False)
    with cache.restoring(["short", "long"]) as held:
        assert held.match.key == "short"
    cache.publish("short", 64, _state(4))  # re-publishing replaces
    with cache.restoring(["short"]) as held:
        assert_bit_equal(held.state, _state(4))


def test_checkpoints_placed_in_entries_are_seen_only_once_committed():
    """`place` hands out a new entry's layer or a present entry's unstored layer to write
    into; nothing shows (info, keys, bytes, matches) until `commit`."""
    cache = _cache(4)
    state = _state(1)
    new, = cache.place(0, [("k", 128)])
    assert new.state is not None and tuple(new.state.shape) == G.slot_shape[1:]
    new.state.copy_(state[0])  # the launch writes it
    assert cache.info("k") is None and cache.keys() == [] and cache.stats()["device"].bytes == 0
    cache.commit(new)
    cache.release([new])
    assert (cache.info("k").layers, cache.info("k").tokens) == (1, 128)
    for layer in range(1, G.num_layers):
        with cache.restoring(["k"]) as held:
            assert held.state is None  # still incomplete
        target, = cache.place(layer, [("k", 128)])
        assert target.state.data_ptr() == cache.entries()[-1].state[layer].data_ptr()  # in place: no copy
        target.state.copy_(state[layer])
        assert cache.info("k").layers == layer  # written, not yet stored
        cache.commit(target)
        cache.release([target])
    with cache.restoring(["k"]) as held:
        assert_bit_equal(held.state, state)
    assert cache.stats()["device"].bytes == ENTRY


def test_released_checkpoints_store_nothing():
    """A launch rolled back: its new entries go, an in-place layer stays unstored (never
    served), and a key's entry at another offset stays as it was."""
    cache = _cache(4)
    cache.publish("old", 64, _state(1))
    for layer in range(G.num_layers - 1):
        cache.store_layer("part", 64, layer, _state(2)[layer])
    targets = cache.place(G.num_layers - 1, [("old", 128), ("part", 64), ("fresh", 64)])
    assert all(t.state is not None for t in targets)
    for t in targets:
        t.state.fill_(float("nan"))  # the launch wrote them, then was rolled back
    cache.release(targets)
    assert cache.keys() == ["old", "part"]
    with cache.restoring(["old"]) as held:
        assert held.match.tokens == 64
        assert_bit_equal(held.state, _state(1))
    assert not cache.info("part").complete and cache.info("part").layers == G.num_layers - 1
    assert cache.stats()["device"].bytes == 2 * ENTRY
    with pytest.raises(ValueError, match="released"):
        cache.commit(targets[0])


def test_checkpoints_without_a_place_are_stored_from_what_the_launch_wrote():
    """A stored layer rewritten, a host-tier or pinned entry and a key named twice get no
    place; commit stores the state written elsewhere, as store_layer does."""
    cache = _cache(3, host_entries=1)
    for key in ("host", "f1", "f2", "f3"):  # "host" moves down
        cache.publish(key, 64, _state(1))
    for key in ("f1", "f2", "f3"):
        cache.drop(key)
    cache.publish("pinned", 64, _state(2))
    cache.publish("stored", 64, _state(3))
    assert cache.info("host").tier == "host"
    with cache.restoring(["pinned"]):
        targets = cache.place(0, [("stored", 64), ("host", 64), ("pinned", 64), ("twice", 64), ("twice", 128)])
    assert [t.state is None for t in targets] == [True, True, True, False, True]
    written = _state(9)[0]
    for t in targets:
        cache.commit(t, written if t.state is None else None)
    cache.release(targets)
    for key in ("stored", "host", "pinned"):
        assert cache.info(key).complete
        with cache.restoring([key]) as held:
            assert_bit_equal(held.state[0], written)
    assert cache.info("twice").tokens == 128  # named twice: the later one wins, as in order
    with pytest.raises(ValueError, match="no place"):
        cache.commit(cache.place(0, [("stored", 64)])[0])


def test_placing_makes_room_within_the_budget():
    """New entries placed count against the budget until committed or released: the
    least recently used entries make room for them, and no more are placed than fit."""
    cache = _cache(2)
    cache.publish("a", 64, _state(1))
    cache.publish("b", 64, _state(2))
    targets = cache.place(0, [("x", 64), ("y", 64), ("z", 64)])
    assert [t.state is not None for t in targets] == [True, True, False]
    assert cache.keys() == [] and cache.evictions()["device"] == 2
    for t in targets[:2]:
        cache.commit(t)
    cache.commit(targets[2], _state(3)[0])  # stored by store_layer: it evicts the least recent
    cache.release(targets)
    assert cache.keys() == ["y", "z"] and cache.stats()["device"].bytes == 2 * ENTRY


def test_lru_order_and_the_byte_budget():
    clock = FakeClock()
    cache = _cache(2, clock=clock)
    cache.publish("a", 64, _state(1))
    clock.advance(1)
    cache.publish("b", 64, _state(2))
    clock.advance(1)
    with cache.restoring(["a"]):  # a use: "b" is now the least recently used
        pass
    cache.publish("c", 64, _state(3))
    assert cache.keys() == ["a", "c"]
    assert cache.info("b") is None
    assert cache.stats()["device"].bytes == 2 * ENTRY <= cache.stats()["device"].budget
    assert cache.evictions() == {"device": 1, "host": 0}
    cache.info("a")  # not a use
    cache.publish("d", 64, _state(4))
    assert cache.keys() == ["c", "d"]


def test_demotion_to_the_host_tier_and_restore_from_it():
    cache = _cache(1, host_entries=1)
    cache.publish("a", 64, _state(1))
    cache.publish("b", 64, _state(2))  # "a" moves down
    assert (cache.info("a").tier, cache.info("b").tier) == ("host", "device")
    with cache.restoring(["a"]) as held:
        assert held.tier == "host" and held.state.device.type == "cpu"
        assert_bit_equal(held.state, _state(1))
    cache.publish("c", 64, _state(3))  # "b" moves down, "a" (host's least recent) is dropped
    assert cache.info("a") is None and cache.info("b").tier == "host"
    assert cache.evictions() == {"device": 2, "host": 1}
    stats = cache.stats()
    assert (stats["device"].entries, stats["host"].entries, stats["host"].bytes) == (1, 1, ENTRY)


def test_a_host_tier_hit_moves_up_and_the_least_recent_moves_down():
    clock = FakeClock()
    cache = _cache(2, host_entries=1, clock=clock)
    for seed, key in enumerate("abc", start=1):  # "a" moves down
        cache.publish(key, 64, _state(seed))
        clock.advance(1)
    with cache.restoring(["a"]) as held:  # a hit: "a" is the most recent, "b" the least
        assert held.tier == "host"
        assert not cache.promote("a")  # not while it is being restored
    assert cache.promote("a")
    assert [cache.info(k).tier for k in "abc"] == ["device", "host", "device"]
    assert cache.evictions() == {"device": 2, "host": 0}  # "a", then "b" moved down; nothing dropped
    for seed, key in enumerate("abc", start=1):
        with cache.restoring([key]) as held:
            assert_bit_equal(held.state, _state(seed))
    stats = cache.stats()
    assert (stats["device"].bytes, stats["host"].bytes) == (2 * ENTRY, ENTRY)
    assert not cache.promote("a") and not cache.promote("missing")  # on the device already; none


def test_no_promotion_when_every_device_entry_is_pinned():
    cache = _cache(1, host_entries=1)
    cache.publish("a", 64, _state(1))
    cache.publish("b", 64, _state(2))  # "a" moves down
    with cache.restoring(["b"]):
        assert not cache.promote("a")
    assert (cache.info("a").tier, cache.info("b").tier) == ("host", "device")
    with cache.restoring(["a"]) as held:
        assert_bit_equal(held.state, _state(1))
    assert cache.stats()["device"].bytes == ENTRY


def test_a_pinned_entry_is_not_evicted_while_restored():
    cache = _cache(1)
    cache.publish("a", 64, _state(1))
    with cache.restoring(["a"]) as held:
        assert cache.publish("b", 64, _state(2)) is None  # no room: "a" is pinned
        assert_bit_equal(held.state, _state(1))
    assert cache.keys() == ["a"]
    cache.publish("b", 64, _state(2))
    assert cache.keys() == ["b"]


def test_an_entry_over_every_budget_is_not_kept():
    cache = PrefixCache(G, ENTRY - 1, clock=FakeClock())
    assert cache.publish("a", 64, _state(1)) is None
    cache.store_layer("a", 64, 0, _state(1)[0])
    assert cache.keys() == []


def test_budget_zero_is_off_and_host_tier_needs_a_device_tier():
    assert not PrefixCache(G, 0, 10 * ENTRY).enabled
    assert PrefixCache(G, 0, 10 * ENTRY).stats()["host"].budget == 0
    with pytest.raises(ValueError):
        PrefixCache(G, -1)


@pytest.mark.parametrize("bad", ["", "x" * 129, 5, None, "a\ud800b"])
def test_keys_are_valid_unicode_strings_of_1_to_128_characters(bad):
    """A lone surrogate (JSON can carry one) would be stored under a key no reply or URL
    can name."""
    assert key_problem(bad) is not None
    with pytest.raises(ValueError):
        _cache(1).publish(bad, 64, _state(1))
    assert key_problem("x" * 128) is None and key_problem("é" * 128) is None


def test_geometry_and_dtype_are_checked():
    cache = _cache(2)
    with pytest.raises(ValueError, match="float32"):
        cache.publish("a", 64, _state(1).to(torch.bfloat16))
    with pytest.raises(ValueError):
        cache.publish("a", 64, _state(1)[:, :, :, :-1])
    with pytest.raises(ValueError):
        cache.store_layer("a", 64, G.num_layers, _state(1)[0])
    with pytest.raises(ValueError):
        cache.store_layer("a", -1, 0, _state(1)[0])
    assert cache.keys() == []


def test_concurrent_publish_restore_and_drop():
    cache = _cache(3, host_entries=2)
    errors: list[BaseException] = []
    states = {k: _state(i) for i, k in enumerate("abcdef")}

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(200):
                key = "abcdef"[int(torch.randint(6, (1,), generator=gen))]
                op = int(torch.randint(3, (1,), generator=gen))
                if op == 0:
                    cache.publish(key, 64 * (1 + "abcdef".index(key)), states[key])
                elif op == 1:
                    with cache.restoring([key]) as held:
                        if held.state is not None:
                            assert held.match.tokens == 64 * (1 + "abcdef".index(key))
                            assert_bit_equal(held.state, states[key])
                else:
                    cache.drop(key)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = cache.stats()
    assert stats["device"].bytes <= 3 * ENTRY and stats["host"].bytes <= 2 * ENTRY


def test_snapshot_file_round_trip(tmp_path):
    clock = FakeClock()
    cache = _cache(2, host_entries=1, clock=clock)
    cache.publish("a", 64, _state(1))
    clock.advance(5)
    cache.publish("b", 128, _state(2))
    cache.publish("c", 192, _state(3))  # "a" moves to the host tier
    cache.store_layer("d", 256, 1, _state(4)[1])  # partial; "b" moves down, "a" is dropped
    path = tmp_path / "cache.prefix"
    prefix_snapshot.write(path, cache)
    other = _cache(2, host_entries=1)
    other.replace_all(prefix_snapshot.read(path, G))
    assert other.keys() == cache.keys()
    for key in cache.keys():
        a, b = cache.info(key), other.info(key)
        assert (a.tokens, a.layers, a.complete, a.tier) == (b.tokens, b.layers, b.complete, b.tier)
    with other.restoring(["b", "c"]) as held:
        assert held.match.key == "c"
        assert_bit_equal(held.state, _state(3))
    with other.restoring(["b"]) as held:
        assert_bit_equal(held.state, _state(2))


def test_snapshot_file_is_verified(tmp_path):
    cache = _cache(2)
    cache.publish("a", 64, _state(1))
    path = tmp_path / "cache.prefix"
    prefix_snapshot.write(path, cache)
    wrong = PoolGeometry(G.num_layers, G.num_slots, G.num_heads, G.head_k_dim, G.head_v_dim, torch.bfloat16,
                         G.device)
    with pytest.raises(GeometryMismatch):
        prefix_snapshot.read(path, wrong)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="checksum"):
        prefix_snapshot.read(path, G)


def test_persistence_saves_and_restores_the_cache(tmp_path):
    pool = make_pool()
    cache = PrefixCache(pool.geometry, 4 * ENTRY)
    path = tmp_path / "pool.safetensors"
    persistence = Persistence(pool, path, prefix_cache=cache)
    persistence.restore()
    cache.publish("a", 64, _state(1))
    persistence.snapshot()
    persistence.close()

    again = PrefixCache(pool.geometry, 4 * ENTRY)
    restarted = Persistence(make_pool(), path, prefix_cache=again)
    report = restarted.restore()
    restarted.close()
    assert report.prefix_entries == 1 and report.prefix_problem is None
    with again.restoring(["a"]) as held:
        assert_bit_equal(held.state, _state(1))

    (tmp_path / "pool.safetensors.prefix").write_bytes(b"not a file")
    empty = PrefixCache(pool.geometry, 4 * ENTRY)
    broken = Persistence(make_pool(), path, prefix_cache=empty)
    report = broken.restore()
    broken.close()
    assert report.prefix_problem and empty.keys() == []
