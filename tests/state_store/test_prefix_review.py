"""Review of the prefix cache against docs/PREFIX_CACHE.md: a checkpoint committed into a
new entry while the key gained an entry at the same offset (re)writes that layer of it, as a
checkpoint at the same offset must, instead of replacing the entry."""
from __future__ import annotations

import torch
from pool_helpers import FakeClock, assert_bit_equal, make_pool, random_state

from state_store import PrefixCache

POOL = make_pool()
G = POOL.geometry
ENTRY = G.bytes_per_slot
L = G.num_layers


def _state(seed: int) -> torch.Tensor:
    """A random, nowhere-zero state [L, HV, V, K] (float32)."""
    return random_state(POOL, seed)


def _cache(entries: int = 4) -> PrefixCache:
    return PrefixCache(G, entries * ENTRY, clock=FakeClock())


def test_a_new_entry_committed_over_a_publish_at_the_same_offset_rewrites_only_its_layer():
    cache = _cache()
    target, = cache.place(0, [("k", 128)])  # nothing under "k" yet: a new entry
    assert target.new
    launch = _state(1)[0]
    target.state.copy_(launch)  # the launch writes it
    published = _state(2)
    cache.publish("k", 128, published)  # meanwhile the whole entry arrives at the same offset
    cache.commit(target)
    cache.release([target])
    info = cache.info("k")
    assert (info.tokens, info.layers, info.complete) == (128, L, True)  # still complete: served
    expected = published.clone()
    expected[0] = launch  # the checkpoint (re)wrote its layer
    with cache.restoring(["k"]) as held:
        assert held.match.key == "k"
        assert_bit_equal(held.state, expected)
    stats = cache.stats()
    assert (stats["device"].entries, stats["device"].bytes) == (1, ENTRY) and cache._pending == 0


def test_two_launches_placing_new_entries_for_one_key_and_offset_store_both_layers():
    cache = _cache()
    state = _state(3)
    first, = cache.place(0, [("k", 64)])
    second, = cache.place(1, [("k", 64)])  # the first is not committed yet: a new entry too
    first.state.copy_(state[0])
    second.state.copy_(state[1])
    for target in (first, second):
        cache.commit(target)
        cache.release([target])
    entry, = cache.entries()
    assert (entry.key, entry.tokens, entry.have) == ("k", 64, [True, True] + [False] * (L - 2))
    assert_bit_equal(entry.state[:2], state[:2])
    stats = cache.stats()
    assert (stats["device"].entries, stats["device"].bytes) == (1, ENTRY) and cache._pending == 0
