"""SlotOrdering: FIFO per key, mutual exclusion, concurrency across keys, no deadlock,
and cancellation that leaks nothing."""
from __future__ import annotations

import asyncio
import random

import pytest

from state_store import SlotOrdering


def _run(main) -> None:
    """Run a test's coroutine, failing (not hanging) if the ordering wedges."""
    asyncio.run(asyncio.wait_for(main, timeout=10))


async def _settle() -> None:
    """Let every runnable task run until it blocks."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_holders_of_a_key_run_one_at_a_time_in_arrival_order():
    async def main() -> None:
        ordering = SlotOrdering()
        log: list[tuple[str, int]] = []

        async def holder(n: int) -> None:
            async with ordering.hold([("slot", 0)]):
                log.append(("in", n))
                for _ in range(random.Random(n).randint(0, 3)):
                    await asyncio.sleep(0)
                log.append(("out", n))

        tasks = [asyncio.create_task(holder(n)) for n in range(12)]
        await asyncio.sleep(0)
        assert ordering.queued(("slot", 0)) == 12
        await asyncio.gather(*tasks)
        assert log == [entry for n in range(12) for entry in (("in", n), ("out", n))]
        assert ordering.queued(("slot", 0)) == 0

    _run(main())


def test_disjoint_keys_run_concurrently():
    async def main() -> None:
        ordering = SlotOrdering()
        a_in, b_in = asyncio.Event(), asyncio.Event()

        async def holder(key, mine: asyncio.Event, theirs: asyncio.Event) -> None:
            async with ordering.hold([key]):
                mine.set()
                await theirs.wait()  # only returns if the other holds its key meanwhile

        await asyncio.wait_for(
            asyncio.gather(holder(("s1", 0), a_in, b_in), holder(("s1", 1), b_in, a_in)), timeout=5
        )

    _run(main())


def test_multi_key_holds_are_fifo_per_key_and_never_deadlock():
    async def main() -> None:
        ordering = SlotOrdering()
        keys = [("slot", i) for i in range(4)]
        active: set = set()
        entered: dict = {key: [] for key in keys}
        arrived: dict = {key: [] for key in keys}

        async def holder(n: int, wanted: list) -> None:
            for key in wanted:
                arrived[key].append(n)
            async with ordering.hold(reversed(wanted)):
                assert not active & set(wanted)  # mutual exclusion
                active.update(wanted)
                for key in wanted:
                    entered[key].append(n)
                await asyncio.sleep(0)
                active.difference_update(wanted)

        rng = random.Random(3)
        requests = [rng.sample(keys, rng.randint(1, 3)) for _ in range(60)]
        await asyncio.wait_for(
            asyncio.gather(*(holder(n, wanted) for n, wanted in enumerate(requests))), timeout=5
        )
        assert entered == arrived
        assert all(ordering.queued(key) == 0 for key in keys)

    _run(main())


def test_cancelling_a_waiter_does_not_block_those_behind_it():
    async def main() -> None:
        ordering = SlotOrdering()
        release = asyncio.Event()
        ran: list[str] = []

        async def holder(name: str, keys, until: asyncio.Event | None = None) -> None:
            async with ordering.hold(keys):
                ran.append(name)
                if until is not None:
                    await until.wait()

        first = asyncio.create_task(holder("first", ["k2"], release))
        await _settle()
        # "middle" waits on k2 while first in line on k1; "last" is behind it on k1.
        middle = asyncio.create_task(holder("middle", ["k1", "k2"]))
        last = asyncio.create_task(holder("last", ["k1"]))
        await _settle()
        assert ran == ["first"] and ordering.queued("k1") == 2
        middle.cancel()
        await asyncio.wait_for(last, timeout=5)  # runs while first still holds k2
        assert ran == ["first", "last"] and middle.cancelled()
        release.set()
        await first
        assert ordering.queued("k1") == ordering.queued("k2") == 0

    _run(main())


def test_cancelling_a_waiter_just_granted_its_turn_passes_the_turn_on():
    async def main() -> None:
        ordering = SlotOrdering()
        release = asyncio.Event()
        ran: list[str] = []

        async def first() -> None:
            async with ordering.hold(["k"]):
                ran.append("first")
                await release.wait()
            second.cancel()  # in the step that granted second its turn, before it resumes

        async def holder(name: str) -> None:
            async with ordering.hold(["k"]):
                ran.append(name)

        first_task = asyncio.create_task(first())
        await _settle()
        second = asyncio.create_task(holder("second"))
        third = asyncio.create_task(holder("third"))
        await _settle()
        release.set()
        await asyncio.wait_for(asyncio.gather(first_task, third), timeout=5)
        assert ran == ["first", "third"] and second.cancelled()
        assert ordering.queued("k") == 0

    _run(main())


def test_an_exception_in_the_body_releases_the_keys():
    async def main() -> None:
        ordering = SlotOrdering()
        with pytest.raises(RuntimeError):
            async with ordering.hold(["k", "j"]):
                raise RuntimeError("kernel failed")
        assert ordering.queued("k") == ordering.queued("j") == 0
        async with ordering.hold(["k"]):
            async with ordering.hold([]):  # no keys: runs at once
                assert ordering.queued("k") == 1

    _run(main())
