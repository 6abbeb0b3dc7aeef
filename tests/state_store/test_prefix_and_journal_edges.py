"""Edges of the prefix cache (budgets, pins, place/commit/release, LRU, its snapshot file)
and of persistence (a snapshot step that fails half way, then a crash).

The cache is checked against a model: whatever it still holds under a key must be exactly
what was stored there (tokens, layers stored, every stored layer bit for bit), whatever
sequence of publish, store, place/commit/release, drop, restore and promote ran, and the
tiers stay within their budgets."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from pool_helpers import FakeClock, assert_bit_equal, make_pool, random_state

from state_store import Persistence, PrefixCache, SnapshotError, StatePool
from state_store import prefix_snapshot
from state_store.geometry import PoolGeometry
from state_store.prefix_cache import KEY_MAX

POOL = make_pool()
G: PoolGeometry = POOL.geometry
ENTRY = G.bytes_per_slot
L = G.num_layers


def _state(seed: int) -> torch.Tensor:
    """A fresh random, nowhere-zero state [L, HV, V, K]."""
    return random_state(POOL, seed)


def _cache(entries: float, host_entries: float = 0, clock: FakeClock | None = None) -> PrefixCache:
    return PrefixCache(G, int(entries * ENTRY), int(host_entries * ENTRY), clock=clock or FakeClock())


# -- the cache against a model ---------------------------------------------------------------

class Model:
    """What each key must hold when the cache still has it: tokens and {layer: state}."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.entries: dict[str, tuple[int, dict[int, torch.Tensor]]] = {}

    def store(self, key: str, tokens: int, layer: int, state: torch.Tensor) -> None:
        old = self.entries.get(key)
        layers = dict(old[1]) if old is not None and old[0] == tokens else {}
        layers[layer] = state.clone()
        self.entries[key] = (tokens, layers)

    def publish(self, key: str, tokens: int, state: torch.Tensor) -> None:
        self.entries[key] = (tokens, {layer: state[layer].clone() for layer in range(L)})

    def sync(self) -> None:
        """Forget what the cache let go (evicted, dropped) and check what it holds."""
        held = {e.key: e for e in self.cache.entries()}
        for key in list(self.entries):
            if key not in held:
                del self.entries[key]
        assert set(held) == set(self.entries), (sorted(held), sorted(self.entries))
        for key, entry in held.items():
            tokens, layers = self.entries[key]
            assert entry.tokens == tokens, key
            assert [bool(h) for h in entry.have] == [layer in layers for layer in range(L)], key
            for layer, state in layers.items():
                assert_bit_equal(entry.state[layer].cpu(), state)

    def check_budgets(self) -> None:
        stats = self.cache.stats()
        for tier in ("device", "host"):
            assert stats[tier].bytes <= stats[tier].budget, (tier, stats)
            assert stats[tier].bytes == stats[tier].entries * ENTRY
        assert self.cache._pending == 0  # every placement ended (committed or released)

    def best(self, keys: list[str]) -> tuple[int, str | None, int]:
        best: tuple[int, str | None, int] = (0, None, 0)
        for position, key in enumerate(keys, start=1):
            got = self.entries.get(key)
            if got is not None and len(got[1]) == L and (best[1] is None or got[0] >= best[2]):
                best = (position, key, got[0])
        return best


KEYS = [f"k{i}" for i in range(7)]
OFFSETS = [64, 128, 192]


def _run_ops(seed: int, device_entries: float, host_entries: float, steps: int = 120) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    cache = _cache(device_entries, host_entries, clock)
    model = Model(cache)
    counter = iter(range(10_000_000))

    def fresh_state() -> torch.Tensor:
        return _state(seed * 100_000 + next(counter))

    for step in range(steps):
        clock.advance(1)
        op = rng.choice(["publish", "store", "launch", "launch", "drop", "restore", "promote"])
        key, tokens = rng.choice(KEYS), rng.choice(OFFSETS)
        if op == "publish":
            state = fresh_state()
            if cache.publish(key, tokens, state) is not None:
                model.publish(key, tokens, state)
            else:
                model.entries.pop(key, None)
        elif op == "store":
            layer = rng.randrange(L)
            state = fresh_state()[layer]
            cache.store_layer(key, tokens, layer, state)
            model.store(key, tokens, layer, state)
        elif op == "launch":
            layer = rng.randrange(L)
            wanted = [(rng.choice(KEYS), rng.choice(OFFSETS)) for _ in range(rng.randint(1, 4))]
            targets = cache.place(layer, wanted)
            model.sync()  # room made now: what it evicted is gone, nothing placed shows
            written = []
            for target in targets:  # the launch writes every target (its place, or a scratch row)
                state = fresh_state()[layer]
                if target.state is not None:
                    target.state.copy_(state)
                written.append(state)
            standing = [rng.random() < 0.7 for _ in targets]  # the others were rolled back
            for target, state, stands in zip(targets, written, standing):
                if stands:
                    cache.commit(target, state if target.state is None else None)
                    model.store(target.key, target.tokens, layer, state)
                    model.sync()
            cache.release(targets)
        elif op == "drop":
            cache.drop(key)
            model.entries.pop(key, None)
        elif op == "restore":
            keys = rng.sample(KEYS, rng.randint(1, 4))
            expected = model.best(keys)
            with cache.restoring(keys) as held:
                assert (held.match.matched, held.match.key, held.match.tokens) == expected
                if held.state is not None:
                    kept = held.state.clone()
                    tier, replaced = cache.info(held.match.key).tier, False
                    for _ in range(rng.randint(0, 3)):  # others arrive meanwhile
                        other, other_tokens = rng.choice(KEYS), rng.choice(OFFSETS)
                        state = fresh_state()
                        if cache.publish(other, other_tokens, state) is not None:
                            model.publish(other, other_tokens, state)
                        else:
                            model.entries.pop(other, None)
                        model.sync()
                        replaced = replaced or other == held.match.key
                        if not replaced:  # pinned: never moved or dropped under the restore
                            info = cache.info(held.match.key)
                            assert info is not None and info.tier == tier
                    assert_bit_equal(held.state, kept)  # the restore copies what it matched
        elif op == "promote":
            cache.promote(key)
        model.sync()
        model.check_budgets()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("device_entries,host_entries", [(2, 0), (3, 2), (1, 1), (2.5, 1.5), (4, 3)])
def test_random_sequences_keep_contents_budgets_and_pins(seed, device_entries, host_entries):
    _run_ops(seed, device_entries, host_entries)


# -- persistence: a snapshot that fails half way -----------------------------------------------

def _persistence(path: Path, cache_entries: int = 4) -> tuple[StatePool, PrefixCache, Persistence]:
    pool = make_pool()
    cache = PrefixCache(pool.geometry, cache_entries * ENTRY)
    persistence = Persistence(pool, path, prefix_cache=cache)
    persistence.restore()
    return pool, cache, persistence


def _advance(pool: StatePool, persistence: Persistence, slot: str, seed: int) -> None:
    persistence.advancing([slot])  # announced first, as the device thread does
    pool.write_state(slot, _state(seed))


def test_a_prefix_file_that_fails_after_the_pool_snapshot_never_hides_a_later_change(tmp_path):
    path = tmp_path / "pool.safetensors"
    pool, cache, persistence = _persistence(path)
    a = pool.alloc()[0]
    _advance(pool, persistence, a, 1)
    assert persistence.snapshot() == 1
    Path(persistence.prefix_path).unlink()
    Path(persistence.prefix_path).mkdir()  # the prefix file's rename fails (as a full disk would fail it)
    with pytest.raises(SnapshotError):
        persistence.snapshot()  # "the previous snapshot and the journal still describe the pool"
    _advance(pool, persistence, a, 2)  # after the failed snapshot: must be journaled so a crash flags it
    persistence.close()  # kill -9
    Path(persistence.prefix_path).rmdir()

    again, _, restarted = _persistence(path)
    restarted.close()
    assert a in again.slot_ids()
    served_current = torch.equal(again.read_state(a), _state(2))
    assert served_current or again.slot_info(a).state_lost, "a stale state is served as current"


def test_a_slot_advanced_across_a_half_failed_snapshot_is_flagged(tmp_path):
    path = tmp_path / "pool.safetensors"
    pool, cache, persistence = _persistence(path)
    a = pool.alloc()[0]
    assert persistence.snapshot() == 1
    _advance(pool, persistence, a, 1)  # journaled under generation 1
    Path(persistence.prefix_path).unlink()
    Path(persistence.prefix_path).mkdir()
    with pytest.raises(SnapshotError):
        persistence.snapshot()  # the pool file now holds state 1 (generation 2)
    _advance(pool, persistence, a, 2)
    persistence.close()
    Path(persistence.prefix_path).rmdir()

    again, _, restarted = _persistence(path)
    restarted.close()
    assert torch.equal(again.read_state(a), _state(2)) or again.slot_info(a).state_lost



@pytest.mark.parametrize("durable_on_disk", [True, False])
def test_a_snapshot_whose_rename_may_not_be_durable_never_hides_a_later_change(tmp_path, monkeypatch,
                                                                               durable_on_disk):
    """The directory's fsync after the snapshot's rename fails (`SnapshotNotDurable`): after a
    crash the disk may hold the new file or the old one. A change after the failure must
    come back flagged either way, never as a stale state served as current."""
    import state_store.snapshot as snapshot_module
    from state_store.errors import SnapshotNotDurable

    path = tmp_path / "pool.safetensors"
    pool, cache, persistence = _persistence(path)
    a = pool.alloc()[0]
    _advance(pool, persistence, a, 1)
    assert persistence.snapshot() == 1
    old_file = path.read_bytes()

    def failing_fsync(directory: str) -> None:
        raise OSError("injected: the directory's fsync failed")

    monkeypatch.setattr(snapshot_module, "fsync_directory", failing_fsync)
    with pytest.raises(SnapshotNotDurable):
        persistence.snapshot()
    monkeypatch.undo()
    _advance(pool, persistence, a, 2)  # after the failure: must be journaled so a crash flags it
    persistence.close()  # kill -9
    if not durable_on_disk:
        path.write_bytes(old_file)  # the rename did not survive the crash

    again, _, restarted = _persistence(path)
    restarted.close()
    assert a in again.slot_ids()
    assert torch.equal(again.read_state(a), _state(2)) or again.slot_info(a).state_lost, \
        "a stale state is served as current"

# -- the server: a checkpoint stored after its launch -----------------------------------------

def _sequence(T: int, gen: torch.Generator, heads: int, K: int, V: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(T, heads, K, generator=gen)
    k = torch.randn(T, heads, K, generator=gen) / K ** 0.5
    v = torch.randn(T, heads, V, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(T, heads, K, generator=gen) - 2.0)
    beta = torch.rand(T, heads, generator=gen) * 0.9 + 0.05
    return q, k, v, g, beta


def test_a_checkpoint_that_cannot_be_stored_after_the_launch_leaves_the_slot_consistent(monkeypatch):
    import asyncio

    from service.config import Settings
    from service.core.inputs import Checkpoint, PrefillInputs, PrefillParams
    from service.core.server import ServerCore

    layers, heads, K, V = 2, 2, 8, 8
    entry_mb = layers * heads * V * K * 4 / 2**20
    settings = Settings(device="cpu", num_layers=layers, num_slots=4, num_heads=heads, head_dim=K, head_v_dim=V,
                        batch_window_ms=0, prefix_cache_mb=entry_mb, prefix_cache_host_mb=entry_mb)
    gen = torch.Generator().manual_seed(7)
    seqs = [_sequence(64, gen, heads, K, V) for _ in range(layers)]

    def request(layer: int, slot: str, marks: list[tuple[int, str]]) -> PrefillInputs:
        tensors = dict(zip(("q", "k", "v", "g", "beta"), seqs[layer]))
        return PrefillInputs.of(PrefillParams(layer=layer), [slot], [64], tensors,
                                checkpoints=[[Checkpoint(o, key) for o, key in marks]])

    async def main() -> None:
        core = ServerCore(settings)
        await core.start()
        try:
            src, other, slot = await core.alloc(3)
            for layer in range(layers):
                await core.prefill(request(layer, src, []))
            await core.publish(src, "old")  # at 64 tokens
            await core.publish(other, "other")  # "old" moves to the host tier
            assert (await core.prefix_info("old")).tier == "host"
            before = await core.get_state(slot)

            real = PrefixCache._new_tensor

            def no_device_memory(self, tier):
                if tier == "device":
                    raise torch.cuda.OutOfMemoryError("injected: no device memory for a new entry")
                return real(self, tier)

            monkeypatch.setattr(PrefixCache, "_new_tensor", no_device_memory)
            # layer 0 of "old" at 64 is a host-tier entry: no place, stored after the launch
            try:
                await core.prefill(request(0, slot, [(64, "old")]))
                failed = False
            except Exception:  # noqa: BLE001 - either outcome is checked below
                failed = True
            monkeypatch.setattr(PrefixCache, "_new_tensor", real)
            info = await core.slot_info(slot)
            after = await core.get_state(slot)
            if failed:  # a refused request changes nothing
                assert info.tokens_per_layer == [0, 0] and torch.equal(after, before)
            else:  # the prefill stands, counted
                assert info.tokens_per_layer == [64, 0]
            kept = await core.prefix_info("old")  # no memory for its new entry: the present one stays
            assert kept is not None and kept.tier == "host" and kept.tokens == 64
        finally:
            await core.close()

    asyncio.run(main())


# -- passing edges the suite lacked ---------------------------------------------------------

def test_snapshot_round_trip_keeps_every_stored_layer_order_idle_time_and_tier(tmp_path):
    """Both tiers, an incomplete entry, keys of the longest length (non-ASCII too): read back
    bit for bit, least recently used first, with their idle times and, budgets being the
    same and the device tier holding the most recent entries, their tiers."""
    clock = FakeClock()
    cache = _cache(2, host_entries=2, clock=clock)
    keys = ["h" * KEY_MAX, "é" * KEY_MAX, "a/b?c", "part"]
    states = {key: _state(50 + i) for i, key in enumerate(keys)}
    for key in keys[:3]:
        cache.publish(key, 64 * (1 + keys.index(key)), states[key])
        clock.advance(3)
    cache.store_layer("part", 320, 1, states["part"][1])  # incomplete; the first key moves down
    clock.advance(2)
    assert [cache.info(k).tier for k in keys] == ["host", "host", "device", "device"]
    path = tmp_path / "cache.prefix"
    prefix_snapshot.write(path, cache)
    before = {k: cache.info(k) for k in keys}

    other_clock = FakeClock(start=50_000.0)
    other = _cache(2, host_entries=2, clock=other_clock)
    other.replace_all(prefix_snapshot.read(path, G))
    assert other.keys() == cache.keys() == keys
    now_a, now_b = cache.wall_time(cache.now()), other.wall_time(other.now())
    for key in keys:
        a, b = before[key], other.info(key)
        assert (a.tokens, a.layers, a.complete, a.tier, a.bytes) == (b.tokens, b.layers, b.complete, b.tier, b.bytes)
        assert abs((now_a - a.last_used) - (now_b - b.last_used)) < 1e-3  # the same idle time
    held = {e.key: e for e in other.entries()}
    for key in keys[:3]:
        assert_bit_equal(held[key].state.cpu(), states[key])
    assert_bit_equal(held["part"].state[1].cpu(), states["part"][1])
    assert held["part"].have == [layer == 1 for layer in range(L)]
    with other.restoring(keys) as got:  # the longest complete entry, incomplete "part" skipped
        assert (got.match.matched, got.match.key) == (3, "a/b?c")
        assert_bit_equal(got.state.cpu(), states["a/b?c"])


def test_host_budget_zero_drops_instead_of_demoting_and_counts_each_eviction():
    cache = _cache(2, host_entries=0)
    for seed, key in enumerate("abcd"):
        cache.publish(key, 64, _state(seed))
    assert cache.keys() == ["c", "d"]
    assert cache.stats()["host"].entries == 0 and cache.evictions() == {"device": 2, "host": 0}


def test_peek_and_info_are_not_uses_but_a_match_is():
    clock = FakeClock()
    cache = _cache(2)
    cache.publish("a", 64, _state(1))
    clock.advance(1)
    cache.publish("b", 64, _state(2))
    clock.advance(1)
    assert cache.peek(["a"]).key == "a" and cache.info("a") is not None  # neither is a use
    cache.publish("c", 64, _state(3))
    assert cache.keys() == ["b", "c"]
    with cache.restoring(["b"]):  # a use
        pass
    cache.publish("d", 64, _state(4))
    assert cache.keys() == ["b", "d"]


def test_a_rolled_back_checkpoint_over_a_demoted_entry_stores_nothing():
    """The entry a launch writes in place moves down to the host tier while the launch
    runs (room made for another checkpoint of the same launch); rolled back, the host
    copy keeps exactly the layers it had, the layer the launch wrote stays unstored."""
    cache = _cache(1, host_entries=1)
    state = _state(9)
    cache.store_layer("k", 64, 0, state[0])
    targets = cache.place(1, [("k", 64), ("new", 64)])
    assert targets[0].state is not None and targets[1].state is not None  # "k" moved down for "new"
    assert cache.info("k").tier == "host"
    for t in targets:
        t.state.fill_(float("nan"))
    cache.release(targets)
    assert cache.keys() == ["k"] and cache.info("k").layers == 1
    (entry,) = cache.entries()
    assert_bit_equal(entry.state[0], state[0])
    assert cache.stats()["device"].bytes == 0 and cache._pending == 0
