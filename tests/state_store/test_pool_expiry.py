"""Idle expiry on an injected clock: lazily on access and by sweep()."""
from __future__ import annotations

import time

import pytest
from pool_helpers import make_pool, random_state

from state_store import UnknownSlot


def test_expired_slot_behaves_as_unknown_on_access(clock):
    pool = make_pool(clock=clock, ttl=10.0)
    a, b = pool.alloc(2)
    row_a = pool.rows([a])[0]
    clock.advance(5.0)
    pool.rows([b])
    clock.advance(5.0)  # a idle exactly ttl: still live
    assert pool.contains(a)
    clock.advance(0.5)
    with pytest.raises(UnknownSlot):
        pool.read_state(a)
    assert not pool.contains(a) and pool.contains(b)
    stats = pool.stats()
    assert (stats.used, stats.free, stats.expiries, stats.frees) == (1, 5, 1, 0)
    assert pool.alloc(1) and row_a in pool.rows(pool.slot_ids())  # its row went back


def test_sweep_frees_every_idle_slot_and_returns_their_ids(clock):
    pool = make_pool(clock=clock, ttl=30.0)
    a, b, c, d = pool.alloc(4)
    clock.advance(20.0)
    pool.record_tokens(c, 0, 1)
    clock.advance(15.0)
    assert sorted(pool.sweep()) == sorted([a, b, d])
    assert pool.slot_ids() == [c] and pool.sweep() == []
    assert pool.stats().expiries == 3
    clock.advance(31.0)
    assert pool.sweep() == [c] and pool.stats().used == 0


def test_no_ttl_means_no_expiry(clock):
    pool = make_pool(clock=clock)
    ids = pool.alloc(3)
    clock.advance(1e9)
    assert pool.sweep() == [] and pool.slot_ids() == ids
    assert pool.stats().expiries == 0


TOUCHES = {
    "rows": lambda pool, s: pool.rows([s]),
    "read_state": lambda pool, s: pool.read_state(s),
    "write_state": lambda pool, s: pool.write_state(s, random_state(pool, 1)),
    "fork": lambda pool, s: pool.fork(s),
    "export": lambda pool, s: pool.export(s),
    "import_": lambda pool, s: pool.import_(pool.export(s), s),
    "record_tokens": lambda pool, s: pool.record_tokens(s, 1, 5),
}


@pytest.mark.parametrize("use", sorted(TOUCHES))
def test_each_use_keeps_a_slot_alive(clock, use):
    pool = make_pool(clock=clock, ttl=10.0)
    used, idle = pool.alloc(2)
    clock.advance(8.0)
    TOUCHES[use](pool, used)
    clock.advance(8.0)
    assert pool.sweep() == [idle]
    assert pool.contains(used)


@pytest.mark.parametrize("look", ["contains", "slot_info"])
def test_looking_is_not_using(clock, look):
    pool = make_pool(clock=clock, ttl=10.0)
    (a,) = pool.alloc(1)
    clock.advance(8.0)
    getattr(pool, look)(a)
    clock.advance(8.0)
    assert pool.sweep() == [a]


def test_alloc_reclaims_expired_slots_when_full(clock):
    pool = make_pool(clock=clock, ttl=10.0)
    old = pool.alloc(6)
    clock.advance(11.0)
    new = pool.alloc(6)
    assert not set(old) & set(new)
    assert pool.stats().expiries == 6


def test_times_are_reported_in_unix_seconds(clock):
    pool = make_pool(clock=clock, ttl=100.0)
    (a,) = pool.alloc(1)
    info = pool.slot_info(a)
    assert abs(info.created - time.time()) < 60 and info.last_used == info.created
    clock.advance(42.0)
    pool.rows([a])
    assert pool.slot_info(a).last_used == pytest.approx(info.created + 42.0)


BATCH_USES = {
    "rows": lambda pool, ids: pool.rows(ids),
    "group": lambda pool, ids: pool.group(ids),
    "record_tokens_many": lambda pool, ids: pool.record_tokens_many(ids, 0, [1] * len(ids)),
    "first_lost": lambda pool, ids: pool.first_lost(ids),
}


@pytest.mark.parametrize("use", sorted(BATCH_USES))
@pytest.mark.parametrize("odd", ["expired", "unknown", "unhashable"])
def test_a_batch_with_one_bad_id_among_many_changes_nothing(clock, use, odd):
    """The launch-sized methods resolve their ids in one pass and fall back to one id at a
    time for a batch holding an expired, unknown or unhashable id: UnknownSlot naming that
    id (an expired one freed), the others neither used nor counted."""
    pool = make_pool(clock=clock, ttl=10.0, num_slots=64)
    ids = pool.alloc(40)
    clock.advance(8.0)
    pool.rows(ids[:20] + ids[21:] if odd == "expired" else ids)  # used at t = 8 (ids[20] not, to expire it)
    clock.advance(5.0)  # ids[20] idle 13 s > ttl when expiring; the others 5 s
    bad = {"expired": ids[20], "unknown": "missing", "unhashable": ["not", "an", "id"]}[odd]
    batch = ids if odd == "expired" else ids[:20] + [bad] + ids[21:]
    others = [s for s in ids if s != ids[20]]
    before = {s: (pool.slot_info(s).last_used, pool.slot_info(s).tokens_per_layer) for s in others}
    with pytest.raises(UnknownSlot) as caught:
        BATCH_USES[use](pool, batch)
    assert caught.value.slot_id == bad
    assert pool.contains(ids[20]) == (odd != "expired")
    assert {s: (pool.slot_info(s).last_used, pool.slot_info(s).tokens_per_layer) for s in others} == before


def test_a_group_is_vouched_for_only_while_no_slot_can_have_expired(clock):
    """`group_live` holds while the generation stands and the group's slots were used at
    most ttl ago: a slot idle past the ttl but not yet swept is not live (the lazy expiry
    of `_resolve`), so the generation alone cannot vouch for it."""
    pool = make_pool(clock=clock, ttl=10.0)
    a, b = pool.alloc(2)
    group, lost = pool.group([a, b])
    assert lost is None and group.rows == pool.rows([a, b]) and group.ids == (a, b)
    clock.advance(10.0)
    assert pool.group_live(group)  # idle exactly ttl: still live
    clock.advance(0.5)
    assert not pool.group_live(group), "idle past the ttl, though no sweep moved the generation"
    with pytest.raises(UnknownSlot):
        pool.group([a, b])


def test_counting_a_groups_tokens_marks_its_slots_used(clock):
    pool = make_pool(clock=clock, ttl=10.0)
    a, b, c = pool.alloc(3)
    group, _ = pool.group([a, b])
    for _ in range(3):
        clock.advance(6.0)
        assert pool.group_live(group)
        pool.record_group_tokens(group, 1, [1, 2])
    assert [pool.slot_info(s).tokens_per_layer for s in (a, b)] == [[0, 3, 0], [0, 6, 0]]
    assert pool.contains(a) and pool.contains(b) and not pool.contains(c)  # c idled 18 s
    pool.free(b)
    assert not pool.group_live(group), "a slot freed: the generation moved"
