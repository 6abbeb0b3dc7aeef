"""Slots made for a client that left before learning their ids are freed again.

A request that creates slots (``POST /slots``, a fork, a prefill with new sequences) and
finds its client gone once the work is done frees them and ends with status 499 (nginx's
"client closed request", seen only in metrics and logs); nobody else could ever name them.
Where the server cancels a request whose client left (Ray Serve does), `Abandonment.made`
lets the work that makes slots finish and frees what it made.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional, Sequence, TypeVar

from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import Response

from state_store import UnknownSlot

from ..core.abandoned import release_abandoned

T = TypeVar("T")


class Abandonment:
    """Frees slots through ``free`` (a core's, single or sharded) and counts each abandoned
    response in ``counter``; ``missing``: the errors of a slot already gone, skipped.
    ``shield``: `made` shields the work from the caller's cancellation, for a server that
    cancels the request of a client that left (Ray Serve); where none does (uvicorn), it
    just awaits the work, sparing a task per request."""

    def __init__(self, free: Callable[[str], Awaitable[None]], counter: Counter,
                 missing: tuple[type[Exception], ...] = (UnknownSlot,), shield: bool = True) -> None:
        self._free = free
        self._counter = counter
        self._missing = missing
        self._shield = shield
        self._releasing: set[asyncio.Task[None]] = set()  # strong references until done

    async def release(self, created: Sequence[str]) -> None:
        """Free ``created`` (those already gone are skipped) and count the abandonment."""
        await release_abandoned(self._free, self._counter, self._missing, created)

    async def check(self, request: Request, created: Sequence[str]) -> Optional[Response]:
        """A 499 after freeing ``created`` when ``request``'s client has left; None while
        it is still there."""
        if not await request.is_disconnected():
            return None
        await self.release(created)
        return Response(status_code=499)

    async def made(self, create: Awaitable[T], slot_ids: Callable[[T], Sequence[str]]) -> T:
        """``await create`` (work that makes slots; ``slot_ids`` names them in its result)
        so that cancelling the caller cannot lose them: the work runs on, and once it is
        done the slots it made are freed (with ``shield``; else plainly awaited)."""
        if not self._shield:
            return await create
        task = asyncio.ensure_future(create)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._release_made(done, slot_ids))
            raise

    def _release_made(self, done: "asyncio.Future[T]", slot_ids: Callable[[T], Sequence[str]]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # nothing was made (the work is all or nothing)
        created = slot_ids(done.result())
        if created:
            release = asyncio.ensure_future(self.release(created))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)
