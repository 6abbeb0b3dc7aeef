"""Fixtures for the state pool tests."""
from __future__ import annotations

import sys
from pathlib import Path

# Make the repository root importable when the package is not installed. This belongs in
# pyproject's pytest `pythonpath = ["."]`; until then this folder carries it.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402
from pool_helpers import FakeClock, fill_random, make_pool, random_state  # noqa: E402

from state_store import StatePool  # noqa: E402


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def populated(clock: FakeClock) -> StatePool:
    """A pool with random data everywhere, four live slots (one with a gap before it),
    token counts recorded, and one slot flagged lost."""
    pool = make_pool(clock=clock, id_prefix="shard0.")
    fill_random(pool, seed=1)
    ids = pool.alloc(5)
    for seed, slot_id in enumerate(ids):
        pool.write_state(slot_id, random_state(pool, seed + 10))
        pool.record_tokens(slot_id, seed % 3, 64 + seed)
        clock.advance(1.5)
    pool.free(ids[1])
    pool.mark_lost([ids[4]])
    return pool
