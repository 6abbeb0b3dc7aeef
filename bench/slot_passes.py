"""The per-slot passes of one launch's bookkeeping, each timed alone (issue 19).

A decode step names hundreds of slots, and the server walks them in Python several times
around the kernels: the slot ordering's hold and release, the pool's rows and lost-slot
check, the token counts. On the H200 host the server spends ~1 ms of a 256-sequence step
between its phases (bench/RESULTS.md); this prints each pass's host time for ``--slots``
slots (medians of ``--calls`` calls, microseconds), and the two ways to take a launch's rows
side by side (`StatePool.rows` then `first_lost`, against `StatePool.group`).

    python bench/slot_passes.py [--slots 256] [--calls 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from state_store import SlotOrdering, StatePool  # noqa: E402


def median_us(fn: Callable[[], object], calls: int) -> float:
    """Median wall time of ``fn`` in microseconds over ``calls`` calls (after 50 untimed)."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def _ordering_us(keys: list[tuple[str, int]], calls: int) -> float:
    ordering = SlotOrdering()
    times = []
    for i in range(calls + 50):
        t0 = time.perf_counter()
        async with ordering.hold(keys):
            pass
        if i >= 50:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    pool = StatePool(1, args.slots, 2, 16, 16)
    ids = pool.alloc(args.slots)
    counts = [1] * args.slots
    figures = {
        "SlotOrdering.hold and release": asyncio.run(_ordering_us([(s, 0) for s in ids], args.calls)),
        "StatePool.first_lost (the request's pre-check)": median_us(lambda: pool.first_lost(ids), args.calls),
        "StatePool.rows, then first_lost": median_us(lambda: (pool.rows(ids), pool.first_lost(ids)), args.calls),
        "StatePool.group (the launch's)": median_us(lambda: pool.group(ids), args.calls),
        "StatePool.record_tokens_many": median_us(lambda: pool.record_tokens_many(ids, 0, counts), args.calls),
    }
    print(f"per-slot passes over {args.slots} slots, median us of {args.calls} calls:")
    for name, us in figures.items():
        print(f"  {name}: {us:.1f}")


if __name__ == "__main__":
    main()
