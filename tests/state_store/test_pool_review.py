"""Review of the pool's lifecycle edges: an allocation that fails (no free row, or a copy
that fails on the device) leaves the pool exactly as it was, its rows free again."""
from __future__ import annotations

import pytest
from pool_helpers import FakeClock, PoolImage, populated_pool

from state_store import PoolFull


def test_a_fork_refused_for_a_full_pool_leaves_the_source_untouched():
    clock = FakeClock()
    pool, ids = populated_pool(clock, 3)
    pool.alloc(pool.stats().free)
    clock.advance(7.0)  # the refusal comes later than the source's last use
    image = PoolImage.of(pool)
    with pytest.raises(PoolFull):
        pool.fork(ids[0])
    image.assert_same(pool)  # the source's last use is that of before: a refused fork is no use


@pytest.mark.parametrize("op", ["alloc", "fork", "import_new"])
def test_an_allocation_whose_device_copy_fails_hands_its_row_back(op, monkeypatch):
    clock = FakeClock()
    pool, ids = populated_pool(clock, 3)
    data = pool.export(ids[1])
    clock.advance(3.0)
    image = PoolImage.of(pool)

    def fails(rows):  # the index upload (or anything on the device) fails: out of memory
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(pool, "_slot_index", fails)
    run = {"alloc": lambda: pool.alloc(2), "fork": lambda: pool.fork(ids[0]),
           "import_new": lambda: pool.import_(data)}[op]
    with pytest.raises(RuntimeError, match="simulated"):
        run()
    monkeypatch.undo()
    image.assert_same(pool)  # every row taken is free again, no slot issued, no use recorded
    assert len(pool.alloc(pool.stats().free)) == pool.geometry.num_slots - len(ids)
