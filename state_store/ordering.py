"""`SlotOrdering`: per-key FIFO mutual exclusion for asyncio tasks.

Work on one key, e.g. ``(slot_id, layer)``, must run in arrival order and never twice at
once (a sequence's state on a layer is read and written in place). Independent of the pool.
"""
from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Hashable, Iterable


@dataclass(eq=False)
class _Ticket:
    """One holder: its keys and the future that resolves when it is at the head of all."""

    keys: frozenset[Hashable]
    turn: asyncio.Future[None] = field(repr=False)


class SlotOrdering:
    """Grants each `hold` its keys in arrival order.

    A hold enqueues itself on all its keys at once, at arrival, and runs when it is first in
    every one of those queues. So holders of a key run one at a time in arrival order,
    holders of disjoint keys run concurrently, and there is no deadlock (the oldest waiting
    holder is always first on all its keys). A holder cancelled while waiting leaves every
    queue. Use from one event loop; not thread-safe.
    """

    def __init__(self) -> None:
        self._first: dict[Hashable, _Ticket] = {}  # each key's first holder (running, or waiting on other keys)
        self._behind: dict[Hashable, deque[_Ticket]] = {}  # those queued after it, for contended keys only

    @asynccontextmanager
    async def hold(self, keys: Iterable[Hashable]) -> AsyncIterator[None]:
        """``async with ordering.hold([(slot_id, layer), ...]):`` run the body holding those keys."""
        ticket = _Ticket(frozenset(keys), asyncio.get_running_loop().create_future())
        first, behind = self._first, self._behind
        if first.keys().isdisjoint(ticket.keys):  # first on every key: no one to wait for (the common case;
            first.update(dict.fromkeys(ticket.keys, ticket))  # a decode step names hundreds: C loops only)
            ticket.turn.set_result(None)
        else:
            for key in ticket.keys:
                if key in first:
                    behind.setdefault(key, deque()).append(ticket)
                else:
                    first[key] = ticket
            self._grant_if_first(ticket)
        try:
            await ticket.turn
            yield
        finally:
            self._leave(ticket)

    def queued(self, key: Hashable) -> int:
        """Holders of ``key``, running or waiting."""
        return (key in self._first) + len(self._behind.get(key, ()))

    def _grant_if_first(self, ticket: _Ticket) -> None:
        if not ticket.turn.done() and all(self._first.get(key) is ticket for key in ticket.keys):
            ticket.turn.set_result(None)

    def _leave(self, ticket: _Ticket) -> None:
        """Remove ``ticket`` from its queues and grant whoever that puts first everywhere."""
        first, behind, successors = self._first, self._behind, []
        if not behind:  # no one queued on any key: ``ticket`` is first on all of its own, and no one follows
            for key in ticket.keys:
                del first[key]
            return
        for key in ticket.keys:
            queue = behind.get(key)
            if first.get(key) is ticket:
                if queue:
                    first[key] = queue.popleft()
                    successors.append(first[key])
                else:
                    del first[key]
            else:
                assert queue is not None
                queue.remove(ticket)
            if queue is not None and not queue:
                del behind[key]
        for successor in successors:
            self._grant_if_first(successor)
