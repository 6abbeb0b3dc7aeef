"""The pool's storage rows: a launch writes new states to spare rows and commits by moving
the slots' rows (`StatePool.take_spares`, `commit_rows`, `return_spares`); every slot
operation and the snapshots follow the moved rows."""
from __future__ import annotations

import random

import pytest
import torch
from pool_helpers import PoolImage, assert_bit_equal, fill_random, make_pool, random_state

from state_store import StatePool
from state_store.row_map import RowMap


def _update(pool: StatePool, layer: int, slots: list[str], values: torch.Tensor) -> list[int]:
    """A launch's update of ``slots`` on ``layer`` to ``values`` [N, HV, V, K], written to
    spare rows and committed; returns the rows it read (now spare)."""
    rows = pool.rows(slots)
    read = pool.layer_rows(layer, rows)
    spares = pool.take_spares(len(slots))
    assert spares is not None and not set(spares) & set(read)
    pool.storage[spares] = values
    pool.commit_rows(layer, rows, read, spares)
    return read


def test_a_committed_update_moves_the_rows_and_changes_only_that_layer() -> None:
    pool = make_pool()
    fill_random(pool)
    slots = pool.alloc(3)
    states = {s: random_state(pool, i) for i, s in enumerate(slots)}
    for s, state in states.items():
        pool.write_state(s, state)
    spare_before = pool.storage.shape[0] - 3 * 6
    new = torch.randn(2, *pool.storage.shape[1:])
    read = _update(pool, 1, slots[:2], new)
    assert pool.layer_rows(1, pool.rows(slots[:2])).tolist() != list(read)  # the slots live elsewhere now
    for i, s in enumerate(slots):
        want = states[s].clone()
        if i < 2:
            want[1] = new[i]
        assert_bit_equal(pool.read_state(s), want)
    assert pool.take_spares(spare_before) is not None  # the rows read went back: as many spares as before


def test_a_returned_update_changes_nothing() -> None:
    pool = make_pool()
    fill_random(pool)
    pool.alloc(4)
    image = PoolImage.of(pool)
    spares = pool.take_spares(4)
    assert spares is not None
    pool.storage[spares] = float("nan")  # a refused launch's new states
    pool.return_spares(spares)
    image.assert_same(pool)
    assert pool.take_spares(pool.storage.shape[0] - 3 * 6) is not None


def test_too_few_spares_take_none() -> None:
    pool = make_pool(spare_rows=2)
    assert pool.take_spares(3) is None
    taken = pool.take_spares(2)
    assert taken is not None and len(set(taken)) == 2 and pool.take_spares(1) is None
    assert (pool.spare_rows, pool.free_spare_rows) == (2, 0)
    pool.return_spares(taken[:1])
    assert pool.free_spare_rows == 1
    with pytest.raises(ValueError):  # more back than were taken: a row would be spare twice
        pool.return_spares([taken[1], taken[1]])
    assert pool.free_spare_rows == 1


def test_a_commit_of_rows_that_moved_changes_nothing() -> None:
    pool = make_pool()
    (a,) = pool.alloc(1)
    rows = pool.rows([a])
    read = pool.layer_rows(0, rows)
    _update(pool, 0, [a], torch.ones(1, *pool.storage.shape[1:]))  # another update in between
    image = PoolImage.of(pool)
    spares = pool.take_spares(1)
    with pytest.raises(ValueError, match="moved"):
        pool.commit_rows(0, rows, read, spares)
    image.assert_same(pool)
    assert pool.take_spares(pool.storage.shape[0] - 3 * 6) is not None  # the spare went back


def test_slot_operations_and_snapshots_follow_moved_rows(tmp_path) -> None:
    pool = make_pool()
    fill_random(pool)
    a, b = pool.alloc(2)
    pool.write_state(a, random_state(pool, 1))
    for layer in (0, 2, 0):
        _update(pool, layer, [a, b], torch.randn(2, *pool.storage.shape[1:]))
    want_a, want_b = pool.read_state(a), pool.read_state(b)
    c = pool.fork(a)
    assert_bit_equal(pool.read_state(c), want_a)
    d = pool.import_(pool.export(b))
    assert_bit_equal(pool.read_state(d), want_b)
    assert_bit_equal(pool.image()[:, pool.rows([a])[0]], want_a)
    pool.snapshot(tmp_path / "pool.kda")
    restored = make_pool()
    restored.restore(tmp_path / "pool.kda")
    assert_bit_equal(restored.image(), pool.image())
    assert_bit_equal(restored.read_state(a), want_a) and restored.layer_rows(0, [0]).tolist() == [0]  # the map starts over
    pool.free(a)
    (e,) = pool.alloc(1)  # a's slot row, its moved storage rows zeroed
    assert pool.rows([e]) == [0] and not pool.read_state(e).any()
    (f,) = pool.alloc_copies(want_b, 1, [5, 5, 5])
    assert_bit_equal(pool.read_state(f), want_b)


def test_random_commits_keep_every_slot_and_no_row_shared() -> None:
    """Many updates on random layers and slots, some committed, some returned: each slot
    holds exactly what a plain model of the pool says, and no storage row serves two
    (layer, slot) places or is both spare and in use."""
    rng = random.Random(7)
    pool = make_pool(spare_rows=4)
    slots = pool.alloc(6)
    model = {s: torch.zeros(pool.geometry.slot_shape) for s in slots}
    for step in range(200):
        layer = rng.randrange(3)
        chosen = rng.sample(slots, rng.randint(1, 4))
        values = torch.randn(len(chosen), *pool.storage.shape[1:])
        rows = pool.rows(chosen)
        read = pool.layer_rows(layer, rows)
        spares = pool.take_spares(len(chosen))
        assert spares is not None
        pool.storage[spares] = values
        if rng.random() < 0.7:
            pool.commit_rows(layer, rows, read, spares)
            for s, v in zip(chosen, values):
                model[s][layer] = v
        else:
            pool.return_spares(spares)
    for s in slots:
        assert_bit_equal(pool.read_state(s), model[s])
    used = [r for layer in range(3) for r in pool.layer_rows(layer, range(6))]
    spare = pool.take_spares(4)
    assert spare is not None and len(set(used)) == 18 and not set(used) & set(spare)
    assert set(used) | set(spare) == set(range(pool.storage.shape[0]))


def test_row_map_refuses_negative_spares() -> None:
    with pytest.raises(ValueError):
        RowMap(2, 3, -1)


def test_consecutive_runs_cover_the_rows_in_order_and_stay_within_the_cap() -> None:
    from state_store.pool import consecutive_runs

    rows = [0, 1, 2, 3, 4, 9, 10, 5, 6, 20]
    assert consecutive_runs(rows, 100) == [(0, 5), (9, 11), (5, 7), (20, 21)]
    assert consecutive_runs(rows, 2) == [(0, 2), (2, 4), (4, 5), (9, 11), (5, 7), (20, 21)]
    assert consecutive_runs(rows, 1) == [(r, r + 1) for r in rows]
    assert consecutive_runs([], 4) == []
