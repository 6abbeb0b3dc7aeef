"""Helpers for the state pool tests: a small geometry, an injectable clock, random states,
and bit-exact comparison of a whole pool (tensor and id map).

(A module of its own, not conftest.py, so that tests import it by a name no other test
folder uses.)"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from state_store import SlotInfo, StatePool

# V != K so that a transposed [K, V] state can never pass for a [V, K] one.
GEOMETRY = dict(num_layers=3, num_slots=6, num_heads=2, head_k_dim=8, head_v_dim=4)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_pool(**overrides) -> StatePool:
    return StatePool(**{**GEOMETRY, **overrides})


def random_state(pool: StatePool, seed: int) -> torch.Tensor:
    """A random, nowhere-zero state [L, HV, V, K] of the pool's dtype."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.rand(pool.geometry.slot_shape, generator=gen) + 0.5
    sign = torch.randint(0, 2, pool.geometry.slot_shape, generator=gen) * 2 - 1
    return (state * sign).to(pool.geometry.dtype)


def fill_random(pool: StatePool, seed: int = 0) -> None:
    """Fill the whole storage (free slot rows and spare rows too) with random non-zero data."""
    gen = torch.Generator().manual_seed(seed)
    pool.storage.copy_((torch.rand(pool.storage.shape, generator=gen) + 0.5).to(pool.geometry.dtype))


def populated_pool(clock: FakeClock, seed: int) -> tuple[StatePool, list[str]]:
    """A pool (ttl 100 s on ``clock``) with random data everywhere and three live slots
    holding random states and token counts, all drawn from ``seed``."""
    pool = make_pool(clock=clock, ttl=100.0)
    fill_random(pool, seed=seed)
    ids = pool.alloc(3)
    for i, slot_id in enumerate(ids):
        pool.write_state(slot_id, random_state(pool, 10 * seed + i))
        pool.record_tokens(slot_id, i, 32 + i)
    return pool, ids


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern, for exact comparison (-0.0 != 0.0, NaN == NaN)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[tensor.dtype]
    return tensor.detach().cpu().contiguous().view(as_int)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a), bits(b))


@dataclass
class PoolImage:
    """Everything observable about a pool, to prove that a refused operation changed nothing."""

    tensor: torch.Tensor
    slots: dict[str, SlotInfo]
    free: int
    allocations: int

    @classmethod
    def of(cls, pool: StatePool) -> "PoolImage":
        stats = pool.stats()
        slots = {slot_id: pool.slot_info(slot_id) for slot_id in pool.slot_ids()}
        return cls(pool.image(), slots, stats.free, stats.allocations)

    def assert_same(self, pool: StatePool) -> None:
        after = PoolImage.of(pool)
        assert_bit_equal(after.tensor, self.tensor)
        assert after.slots == self.slots
        assert (after.free, after.allocations) == (self.free, self.allocations)
