"""Allocation, free, fork, state reads and writes, metadata and capacity figures."""
from __future__ import annotations

import pytest
import torch
from pool_helpers import PoolImage, assert_bit_equal, fill_random, make_pool, random_state

import state_store.pool
from state_store import (
    GeometryMismatch,
    PoolError,
    PoolFull,
    PoolGeometry,
    PoolStats,
    StatePool,
    UnknownSlot,
)


def test_geometry_and_tensor_layout():
    pool = make_pool()
    assert pool.geometry == PoolGeometry(3, 6, 2, 8, 4, torch.float32, torch.device("cpu"))
    assert pool.storage.shape == (3 * 6 + 6, 2, 4, 8)  # [R, HV, V, K]: L * S rows and S spares
    assert pool.storage.dtype == torch.float32 and pool.storage.is_contiguous()
    assert pool.storage.stride()[-1] == 1
    assert pool.image().shape == (3, 6, 2, 4, 8)  # [L, S, HV, V, K]
    assert make_pool(spare_rows=0).storage.shape[0] == 3 * 6
    with pytest.raises(AttributeError):
        pool.geometry.num_slots = 7  # frozen


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_layers": 0},
        {"num_slots": -1},
        {"num_heads": 0},
        {"head_k_dim": 2.0},
        {"head_v_dim": True},
        {"dtype": torch.float16},
        {"dtype": torch.float64},
        {"ttl": 0},
        {"ttl": -5.0},
        {"ttl": float("nan")},
        {"id_prefix": "has/slash"},
        {"id_prefix": "x" * 65},
        {"spare_rows": -1},
        {"spare_rows": 1.5},
        {"spare_rows": True},
    ],
)
def test_constructor_refuses_bad_arguments(overrides):
    with pytest.raises(ValueError):
        make_pool(**overrides)


def test_oversized_geometry_is_refused_before_allocating(monkeypatch):
    huge = dict(num_layers=64, num_slots=2**20, num_heads=64, head_k_dim=256, head_v_dim=256)
    needed = (64 + 1) * 2**20 * 64 * 256 * 256 * 4  # L * S rows and S spares
    with pytest.raises(PoolError) as caught:
        StatePool(**huge)
    assert str(needed) in str(caught.value) and "available" in str(caught.value)

    monkeypatch.setattr(state_store.pool, "available_bytes", lambda device: 1000)
    with pytest.raises(PoolError) as caught:
        make_pool(spare_rows=2)
    message = str(caught.value)
    assert f"needs {(3 * 6 + 2) * 2 * 4 * 8 * 4} bytes" in message and "only 1000 bytes" in message


def test_alloc_gives_distinct_ids_and_zeroed_rows():
    pool = make_pool(id_prefix="gpu0.")
    fill_random(pool)
    before = pool.image()
    ids = pool.alloc(3)
    rows = pool.rows(ids)
    assert len(set(ids)) == 3 and sorted(rows) == [0, 1, 2]
    for slot_id in ids:
        assert slot_id.startswith("gpu0.") and len(slot_id) >= len("gpu0.") + 22
        assert pool.contains(slot_id)
        assert torch.count_nonzero(pool.read_state(slot_id)) == 0
    assert torch.count_nonzero(pool.image()[:, rows]) == 0
    assert_bit_equal(pool.image()[:, 3:], before[:, 3:])  # other rows untouched
    assert pool.slot_ids() == ids


@pytest.mark.parametrize("count", [0, -1, True, 1.0, "2"])
def test_alloc_count_must_be_positive_int(count):
    pool = make_pool()
    with pytest.raises(ValueError):
        pool.alloc(count)
    assert pool.stats().used == 0


def test_exhaustion_is_all_or_nothing():
    pool = make_pool()
    held = pool.alloc(4)
    with pytest.raises(PoolFull) as caught:
        pool.alloc(3)
    assert (caught.value.requested, caught.value.free) == (3, 2)
    assert "3" in str(caught.value) and "2 free" in str(caught.value)
    assert pool.slot_ids() == held
    assert (pool.stats().free, pool.stats().allocations) == (2, 4)
    assert len(pool.alloc(2)) == 2
    with pytest.raises(PoolFull) as caught:
        pool.fork(held[0])
    assert (caught.value.requested, caught.value.free) == (1, 0)


def test_free_returns_the_row_and_never_reuses_the_id():
    pool = make_pool()
    a, b, c = pool.alloc(3)
    row_b = pool.rows([b])[0]
    pool.free(b)
    assert not pool.contains(b) and pool.slot_ids() == [a, c]
    (d,) = pool.alloc(1)
    assert d not in (a, b, c) and pool.rows([d]) == [row_b]
    with pytest.raises(UnknownSlot):
        pool.read_state(b)


def test_double_free_and_unknown_ids_raise_unknown_slot():
    pool = make_pool()
    (a,) = pool.alloc(1)
    pool.free(a)
    with pytest.raises(UnknownSlot) as caught:
        pool.free(a)
    assert caught.value.slot_id == a and a in str(caught.value)
    state = random_state(pool, 0)
    for call in (
        lambda: pool.read_state("nope"),
        lambda: pool.write_state("nope", state),
        lambda: pool.fork("nope"),
        lambda: pool.export("nope"),
        lambda: pool.record_tokens("nope", 0, 1),
        lambda: pool.slot_info("nope"),
        lambda: pool.mark_lost(["nope"]),
        lambda: pool.rows(["nope"]),
        lambda: pool.free(None),
    ):
        with pytest.raises(UnknownSlot):
            call()
    assert not pool.contains("nope") and not pool.contains(a)
    assert pool.stats().frees == 1


def test_rows_resolves_none_when_one_id_is_unknown(clock):
    pool = make_pool(clock=clock)
    a, b = pool.alloc(2)
    used_before = pool.slot_info(a).last_used
    clock.advance(7.0)
    with pytest.raises(UnknownSlot) as caught:
        pool.rows([a, "missing", b, "other"])
    assert caught.value.slot_id == "missing"
    assert pool.slot_info(a).last_used == used_before  # not touched
    with pytest.raises(TypeError):
        pool.rows(a)  # one id, not a sequence
    assert pool.rows([b, a, b]) == [1, 0, 1]
    assert pool.slot_info(a).last_used == pytest.approx(used_before + 7.0)


def test_read_and_write_state_copy_bit_exactly():
    pool = make_pool()
    fill_random(pool)
    a, b = pool.alloc(2)
    state = random_state(pool, 1)
    pool.write_state(a, state)
    assert_bit_equal(pool.read_state(a), state)
    assert torch.count_nonzero(pool.read_state(b)) == 0
    state.mul_(2)  # the pool took a copy
    read = pool.read_state(a)
    assert not torch.equal(read, state)
    read.zero_()  # and gave one
    assert torch.count_nonzero(pool.read_state(a)) == read.numel()


@pytest.mark.parametrize(
    "bad",
    [
        lambda g: torch.ones(g.num_layers, g.num_heads, g.head_k_dim, g.head_v_dim),  # K-first
        lambda g: torch.ones(g.num_layers - 1, g.num_heads, g.head_v_dim, g.head_k_dim),
        lambda g: torch.ones(g.slot_shape, dtype=torch.bfloat16),
        lambda g: torch.ones(g.slot_shape, dtype=torch.float64),
    ],
)
def test_write_state_refuses_wrong_shape_or_dtype(bad):
    pool = make_pool()
    fill_random(pool)
    (a,) = pool.alloc(1)
    pool.write_state(a, random_state(pool, 3))
    image = PoolImage.of(pool)
    state = bad(pool.geometry)
    with pytest.raises(GeometryMismatch) as caught:
        pool.write_state(a, state)
    assert caught.value.expected == {"shape": [3, 2, 4, 8], "dtype": "float32"}
    assert caught.value.got["shape"] == list(state.shape)
    assert "[3, 2, 4, 8]" in str(caught.value) and str(list(state.shape)) in str(caught.value)
    with pytest.raises(GeometryMismatch):
        pool.write_state("unknown", state)  # geometry is checked first
    image.assert_same(pool)


def test_fork_copies_every_layer_and_stays_independent():
    pool = make_pool()
    fill_random(pool)
    (a,) = pool.alloc(1)
    original = random_state(pool, 4)
    pool.write_state(a, original)
    pool.record_tokens(a, 1, 100)
    b = pool.fork(a)
    assert b != a and pool.rows([a]) != pool.rows([b])
    assert_bit_equal(pool.read_state(b), original)
    assert pool.slot_info(b).tokens_per_layer == [0, 100, 0]

    pool.write_state(b, random_state(pool, 5))
    assert_bit_equal(pool.read_state(a), original)
    pool.storage[pool.layer_rows(2, pool.rows([a]))[0]].add_(1.0)  # a kernel updating a in place
    assert_bit_equal(pool.read_state(b), random_state(pool, 5))
    pool.record_tokens(a, 0, 3)
    assert pool.slot_info(b).tokens_per_layer == [0, 100, 0]


class _CopyFails(torch.Tensor):
    """A state of the right shape and dtype whose copy into the pool fails midway: its
    first layer lands, then the copy raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.index_copy_:  # (storage, dim 0, storage rows, state)
            with torch._C.DisableTorchFunctionSubclass():
                args[0][int(args[2][0])].copy_(args[3][0])
            raise RuntimeError("copy failed")
        return super().__torch_function__(func, types, args, kwargs or {})


def _ops(fn) -> set[str]:
    """The aten ops ``fn()`` runs (CPU profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


def test_alloc_copies_writes_every_layer_without_a_zero_fill():
    pool = make_pool()
    fill_random(pool)  # every free row holds old data
    state = random_state(pool, 6)
    tokens = [64, 64, 64]
    got: list[str] = []
    ops = _ops(lambda: got.extend(pool.alloc_copies(state, 3, tokens)))
    assert not {op for op in ops if "fill" in op or "zero" in op}, ops  # the copy alone writes the rows
    assert len(set(pool.rows(got))) == 3
    for slot in got:
        assert_bit_equal(pool.read_state(slot), state)
        assert pool.slot_info(slot).tokens_per_layer == tokens
    assert pool.stats().allocations == 3
    assert {op for op in _ops(lambda: pool.alloc(1)) if "fill" in op}  # a plain allocation still zeroes


def test_alloc_copies_is_all_or_none_and_a_failed_copy_shows_no_old_state():
    pool = make_pool()
    fill_random(pool)
    image = PoolImage.of(pool)
    state = random_state(pool, 7)
    with pytest.raises(GeometryMismatch):
        pool.alloc_copies(state.double(), 1, [0, 0, 0])
    with pytest.raises(ValueError):
        pool.alloc_copies(state, 1, [0, 0])
    with pytest.raises(PoolFull):
        pool.alloc_copies(state, 7, [0, 0, 0])
    image.assert_same(pool)  # refused before anything was written
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.alloc_copies(state.clone().as_subclass(_CopyFails), 2, [1, 1, 1])
    stats = pool.stats()
    assert (stats.used, stats.free, stats.allocations, pool.slot_ids()) == (0, 6, 0, [])  # no slot was issued
    assert not torch.equal(pool.image(), image.tensor)  # the copy did land partly in a free row ...
    for slot in pool.alloc(6):  # ... which the next allocation zeroes: no slot shows it
        assert not pool.read_state(slot).any()


def test_layer_rows_address_the_storage_and_check_the_layer():
    pool = make_pool()
    a, b = pool.alloc(2)
    rows = pool.layer_rows(1, pool.rows([a, b]))
    assert len(set(rows)) == 2 and all(0 <= r < pool.storage.shape[0] for r in rows)
    state = random_state(pool, 6)
    pool.storage[rows[0]] = state[1]
    assert_bit_equal(pool.read_state(a)[1], state[1])
    assert torch.count_nonzero(pool.read_state(a)[0]) == 0 and torch.count_nonzero(pool.read_state(b)) == 0
    for layer in (-1, 3):
        with pytest.raises(IndexError):
            pool.layer_rows(layer, [0])
    for layer in ("0", 1.0, True, None):
        with pytest.raises(ValueError):
            pool.layer_rows(layer, [0])


def test_record_tokens_and_slot_info(clock):
    pool = make_pool(clock=clock)
    (a,) = pool.alloc(1)
    info = pool.slot_info(a)
    clock.advance(2.5)
    pool.record_tokens(a, 0, 64)
    pool.record_tokens(a, 0, 1)
    pool.record_tokens(a, 2, 10)
    later = pool.slot_info(a)
    assert (later.slot_id, later.row, later.created) == (a, 0, info.created)
    assert later.tokens_per_layer == [65, 0, 10]
    assert later.last_used == pytest.approx(info.last_used + 2.5)
    assert later.state_lost is False
    later.tokens_per_layer.append(1)  # a copy
    assert pool.slot_info(a).tokens_per_layer == [65, 0, 10]
    with pytest.raises(IndexError):
        pool.record_tokens(a, 3, 1)
    for count in (-1, 1.5, True):
        with pytest.raises(ValueError):
            pool.record_tokens(a, 0, count)
    assert pool.slot_info(a).tokens_per_layer == [65, 0, 10]


def test_record_tokens_many_adds_each_count_or_nothing(clock):
    pool = make_pool(clock=clock)
    a, b = pool.alloc(2)
    before = pool.slot_info(b).last_used
    clock.advance(1.5)
    pool.record_tokens_many([a, b], 1, [5, 1])
    assert pool.slot_info(a).tokens_per_layer == [0, 5, 0] and pool.slot_info(b).tokens_per_layer == [0, 1, 0]
    assert pool.slot_info(b).last_used == pytest.approx(before + 1.5)  # a use
    for ids, counts, error in (([a, "gone"], [1, 1], UnknownSlot), ([a, b], [1, -1], ValueError),
                               ([a, b], [1, True], ValueError), ([a, b], [1], ValueError)):
        with pytest.raises(error):
            pool.record_tokens_many(ids, 1, counts)
    assert pool.slot_info(a).tokens_per_layer == [0, 5, 0] and pool.slot_info(b).tokens_per_layer == [0, 1, 0]
    with pytest.raises(IndexError):
        pool.record_tokens_many([a], 3, [1])


def test_first_lost_names_the_first_flagged_slot():
    pool = make_pool()
    a, b, c = pool.alloc(3)
    assert pool.first_lost([a, b, c]) is None and pool.first_lost([]) is None
    pool.mark_lost([c, b])
    assert pool.first_lost([a, b, c]) == b and pool.first_lost([c, a]) == c
    with pytest.raises(UnknownSlot):
        pool.first_lost([a, "gone", b])


def test_group_gives_the_rows_and_the_first_lost_slot_and_marks_them_used(clock):
    pool = make_pool(clock=clock)
    a, b, c = pool.alloc(3)
    expected = pool.rows([a, c, b])
    before = pool.slot_info(b).last_used
    group, lost = pool.group([a, c, b])
    assert (group.rows, group.index.tolist(), group.ids, lost) == (expected, expected, (a, c, b), None)
    pool.mark_lost([c, b])
    clock.advance(5.0)
    group, lost = pool.group([a, c, b])
    assert (group.rows, lost) == (expected, c)
    assert all(pool.slot_info(s).last_used == before + 5.0 for s in (a, b, c))
    with pytest.raises(UnknownSlot):
        pool.group([a, "gone"])
    with pytest.raises(TypeError):
        pool.group(a)


def test_generation_moves_exactly_when_a_live_slot_may_no_longer_check(clock, tmp_path):
    """`generation` moves on a free, an expiry, a slot flagged lost and a restore (a slot
    checked before may be gone or unsound), and stays on everything else."""
    pool = make_pool(clock=clock, ttl=10.0)
    a, b, c = pool.alloc(3)
    pool.snapshot(tmp_path / "pool.snap")
    seen = pool.generation
    pool.alloc(1)
    pool.fork(a)
    pool.group([a, b])
    pool.record_tokens_many([a, b], 0, [1, 1])
    pool.write_state(a, random_state(pool, 0))
    pool.import_(pool.export(a), b)
    assert pool.generation == seen, "nothing that keeps every live slot live and sound moves it"
    for change in (lambda: pool.free(c), lambda: pool.mark_lost([b]), lambda: pool.restore(tmp_path / "pool.snap")):
        change()
        assert pool.generation != seen
        seen = pool.generation
    clock.advance(11.0)
    assert pool.sweep() and pool.generation != seen  # expired


def test_mark_lost_flags_until_the_state_is_replaced():
    pool = make_pool()
    a, b = pool.alloc(2)
    with pytest.raises(UnknownSlot):
        pool.mark_lost([a, "gone"])
    assert not pool.slot_info(a).state_lost  # resolved none
    pool.mark_lost([a, b])
    assert pool.slot_info(a).state_lost and pool.slot_info(b).state_lost
    assert pool.slot_info(pool.fork(a)).state_lost  # a fork of a lost state is lost too
    pool.write_state(a, random_state(pool, 0))
    assert not pool.slot_info(a).state_lost
    pool.import_(pool.export(a), b)
    assert not pool.slot_info(b).state_lost


def test_stats_figures_move():
    pool = make_pool()
    bytes_per_slot = 3 * 2 * 4 * 8 * 4
    assert pool.stats() == PoolStats(6, 6, 0, 0, 0, 0, bytes_per_slot, 0)
    a, b, c = pool.alloc(3)
    pool.free(b)
    pool.fork(a)
    pool.import_(pool.export(c))
    stats = pool.stats()
    assert (stats.capacity, stats.free, stats.used) == (6, 2, 4)
    assert (stats.allocations, stats.frees, stats.expiries) == (5, 1, 0)
    assert stats.state_lost == 0
    pool.mark_lost([a, c])
    assert pool.stats().state_lost == 2
    pool.write_state(a, pool.read_state(a))  # a state written in full is current again
    pool.free(c)
    assert pool.stats().state_lost == 0
    assert make_pool(dtype=torch.bfloat16).stats().bytes_per_slot == bytes_per_slot // 2
