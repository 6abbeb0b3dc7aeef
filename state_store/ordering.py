"""`SlotOrdering`: per-key FIFO mutual exclusion for asyncio tasks.

Work on one key, e.g. ``(slot_id, layer)``, must run in arrival order and never twice at
once (a sequence's state on a layer is read and written in place). Independent of the pool.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional


@dataclass(eq=False)
class _Ticket:
    """One holder: its keys, and the future that resolves when it is first on all of them
    (None for a holder that was first everywhere on arrival: nothing to wait for)."""

    keys: frozenset[Hashable]
    turn: Optional[asyncio.Future[None]] = field(default=None, repr=False)


class _Hold:
    """``async with`` one `SlotOrdering.hold`: enqueued on entry, gone from every queue on
    exit, or on a cancellation while it waits. A class, not a generator-based context
    manager: a decode step enters one per layer per step, and the uncontended entry makes
    no future and never suspends."""

    __slots__ = ("_ordering", "_keys", "_ticket")

    def __init__(self, ordering: SlotOrdering, keys: Iterable[Hashable]) -> None:
        self._ordering = ordering
        self._keys = keys
        self._ticket: Optional[_Ticket] = None

    async def __aenter__(self) -> None:
        ticket = self._ordering._enqueue(self._keys)
        self._ticket = ticket
        if ticket.turn is not None:
            try:
                await ticket.turn
            except BaseException:  # cancelled while waiting: leave every queue
                self._ordering._leave(ticket)
                raise

    async def __aexit__(self, *exc: object) -> None:
        assert self._ticket is not None
        self._ordering._leave(self._ticket)


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

    def hold(self, keys: Iterable[Hashable]) -> _Hold:
        """``async with ordering.hold([(slot_id, layer), ...]):`` run the body holding those keys
        (a frozenset is taken as it is: a caller holding the same keys often builds it once)."""
        return _Hold(self, keys)

    def _enqueue(self, keys: Iterable[Hashable]) -> _Ticket:
        """A ticket for ``keys``, queued on each; its ``turn`` is None when it is first on all
        of them at once (the common case; a decode step names hundreds of keys: C loops only),
        else a future resolved when it is."""
        ticket = _Ticket(frozenset(keys))
        first, behind = self._first, self._behind
        if first.keys().isdisjoint(ticket.keys):
            first.update(dict.fromkeys(ticket.keys, ticket))
            return ticket
        ticket.turn = asyncio.get_running_loop().create_future()
        for key in ticket.keys:
            if key in first:
                behind.setdefault(key, deque()).append(ticket)
            else:
                first[key] = ticket
        self._grant_if_first(ticket)
        return ticket

    def queued(self, key: Hashable) -> int:
        """Holders of ``key``, running or waiting."""
        return (key in self._first) + len(self._behind.get(key, ()))

    def _grant_if_first(self, ticket: _Ticket) -> None:
        """Resolve a waiting ``ticket``'s turn once it is first on every one of its keys."""
        turn = ticket.turn
        if turn is not None and not turn.done() and all(self._first.get(key) is ticket for key in ticket.keys):
            turn.set_result(None)

    def _leave(self, ticket: _Ticket) -> None:
        """Remove ``ticket`` from its queues and grant whoever that puts first everywhere."""
        first, behind, successors = self._first, self._behind, []
        if not behind:  # no one queued on any key: ``ticket`` is first on all of its own, and no one follows
            if len(first) == len(ticket.keys):  # and it is the only holder: one C call
                first.clear()
            else:
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
