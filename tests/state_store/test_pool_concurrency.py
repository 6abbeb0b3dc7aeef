"""Concurrent allocation and free from asyncio tasks and from threads: no id handed out
twice, no row shared by two live ids, no sequence ever sees another's state."""
from __future__ import annotations

import asyncio
import random
import threading

import torch
from pool_helpers import assert_bit_equal, make_pool, random_state

from state_store import PoolFull, StatePool


def _check_live_rows(pool: StatePool) -> None:
    with pool.lock:
        ids = pool.slot_ids()
        rows = pool.rows(ids)
    assert len(set(rows)) == len(rows) == len(ids)


def test_fifty_asyncio_tasks_allocating_and_freeing():
    pool = make_pool(num_slots=16)
    issued: list[str] = []

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        for step in range(20):
            try:
                ids = pool.alloc(rng.choice([1, 2]))
            except PoolFull:
                await asyncio.sleep(0)
                continue
            issued.extend(ids)
            mine = {slot_id: random_state(pool, seed * 1000 + step * 2 + i) for i, slot_id in enumerate(ids)}
            for slot_id, state in mine.items():
                pool.write_state(slot_id, state)
            await asyncio.sleep(0)  # everyone else allocates, writes and frees here
            _check_live_rows(pool)
            if rng.random() < 0.5 and pool.stats().free:
                forked = pool.fork(ids[0])  # no await since the check: the row is still free
                issued.append(forked)
                mine[forked] = mine[ids[0]]
            await asyncio.sleep(0)
            for slot_id, state in mine.items():
                assert_bit_equal(pool.read_state(slot_id), state)
                pool.free(slot_id)

    async def main() -> None:
        await asyncio.gather(*(worker(seed) for seed in range(50)))

    asyncio.run(main())
    assert len(issued) == len(set(issued)) > 200
    stats = pool.stats()
    assert (stats.used, stats.free) == (0, 16)
    assert stats.allocations == stats.frees == len(issued)


def test_threads_allocating_and_freeing():
    pool = make_pool(num_slots=8)
    issued: list[list[str]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for step in range(150):
                try:
                    (slot_id,) = pool.alloc(1)
                except PoolFull:
                    continue
                issued[index].append(slot_id)
                state = random_state(pool, index * 10_000 + step)
                pool.write_state(slot_id, state)
                _check_live_rows(pool)
                assert_bit_equal(pool.read_state(slot_id), state)
                pool.free(slot_id)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads) and errors == []
    everything = [slot_id for ids in issued for slot_id in ids]
    assert len(everything) == len(set(everything)) == 600
    assert pool.stats().free == 8 and torch.count_nonzero(pool.image()) > 0
