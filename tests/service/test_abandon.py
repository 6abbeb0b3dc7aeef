"""`service.http.abandon.Abandonment.made`: cancelling a request while its slots are being made
(Ray Serve cancels the request of a client that left) frees them once they exist."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from service.http.abandon import Abandonment
from state_store import UnknownSlot


def _setup(shield: bool = True) -> tuple[Abandonment, list[str], CollectorRegistry]:
    freed: list[str] = []

    async def free(slot_id: str) -> None:
        if slot_id == "already-gone":
            raise UnknownSlot(slot_id)
        freed.append(slot_id)

    registry = CollectorRegistry()
    return Abandonment(free, Counter("abandoned", "test", registry=registry), shield=shield), freed, registry


def _count(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("abandoned_total")


async def _make(slots: list[str], fail: bool = False) -> list[str]:
    await asyncio.sleep(0.05)
    if fail:
        raise RuntimeError("pool full")
    return slots


def test_made_returns_the_result_and_frees_nothing() -> None:
    left, freed, registry = _setup()
    assert asyncio.run(left.made(_make(["a", "b"]), list)) == ["a", "b"]
    assert freed == [] and _count(registry) == 0


@pytest.mark.parametrize("fail", [False, True])
def test_a_cancelled_caller_frees_what_the_work_made_once_done(fail: bool) -> None:
    left, freed, registry = _setup()

    async def scenario() -> None:
        caller = asyncio.ensure_future(left.made(_make(["a", "already-gone", "b"], fail), list))
        await asyncio.sleep(0.01)  # the work is under way
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert freed == []  # not yet made
        await asyncio.sleep(0.2)

    asyncio.run(scenario())
    if fail:  # nothing was made, nothing to free
        assert freed == [] and _count(registry) == 0
    else:
        assert freed == ["a", "b"] and _count(registry) == 1


def test_unshielded_made_just_awaits_so_a_cancel_stops_the_work() -> None:
    """Where the server never cancels a request (uvicorn), `made` runs no task of its own:
    a cancel reaches the work itself, and nothing is left running to free anything."""
    left, freed, registry = _setup(shield=False)
    finished: list[bool] = []

    async def make() -> list[str]:
        await asyncio.sleep(0.05)
        finished.append(True)
        return ["a"]

    async def scenario() -> None:
        assert await left.made(make(), list) == ["a"]
        caller = asyncio.ensure_future(left.made(make(), list))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.1)

    asyncio.run(scenario())
    assert finished == [True] and freed == [] and _count(registry) == 0
