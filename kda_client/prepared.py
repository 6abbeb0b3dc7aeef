"""`PreparedPrefill` (and `AsyncPreparedPrefill`): a prefill prepared on the server's framed
socket (`KDAClient.prepare`, `AsyncKDAClient.prepare`),
then run step after step with new inputs of the same shapes, as an engine calls a layer.

It owns a shared memory region of its own (POSIX, or GPU memory with ``transport="cuda"``),
laid out once: `run` copies the packed inputs into it and sends one RUN frame (a 4-byte id);
the server refills its buffers from those bytes, replays its launch (a CUDA graph on a GPU
server) and writes o and the final states behind them, so nothing is encoded, parsed or
validated per step. The prepared prefill lives on the client's framed socket connection:
a connection that closed (a server restart, a failed request) takes it along, and the next
`run` raises `SlotNotFound` (404, ``unknown-prepared``) without sending anything (ids
count from 1 on every connection: the same id on a later one is another prefill): prepare
again.

Release each (`release`, or a ``with`` block). Closing the client releases those still
alive, and one dropped unreleased is released (on the server, its region unregistered) at
the client's next `prepare` or at its close. Once the client is closed `run` raises
`ClientClosed` without sending anything, and `release` does nothing.
"""
from __future__ import annotations

import weakref
from collections import deque
from contextlib import suppress
from typing import Awaitable, Callable, Optional

import torch

from service.wire.frames import PREPARED_ID, Op

from .errors import ClientClosed
from .framed import AsyncFramedExchange, FramedExchange
from .outputs import PrefillOutput
from .shm import Arena, Placed
from .small import Response


class _Prepared:
    """What `PreparedPrefill` and `AsyncPreparedPrefill` share: ``slots`` and ``lengths``
    as prepared, its ``number`` on its connection, its inputs' and outputs' ``places`` in
    ``arena``'s region; ``finish`` raises the client's error for a refused answer and
    returns its phases. ``connection``: the number of the framed connection it lives on;
    ``orphans``: where (arena, connection, number) goes when it is garbage-collected
    unreleased, for its client to release; ``closed``: whether its client is closed."""

    def __init__(self, arena: Arena, places: dict[str, Placed], slots: list[str], lengths: list[int], number: int,
                 finish: Callable[[Response], dict[str, float]], connection: int,
                 orphans: deque[tuple[Arena, int, int]], closed: Callable[[], bool]) -> None:
        self.slots, self.lengths = slots, lengths
        self._arena, self._places = arena, places
        self._id = PREPARED_ID.pack(number)
        self._connection = connection
        self._finish = finish
        self._closed = closed
        self._released = False
        # No network at collection time (any thread, any lock held): only a note for the client.
        self._orphaned = weakref.finalize(self, orphans.append, (arena, connection, number))
        self._orphaned.atexit = False

    def _releasing(self) -> bool:
        """Mark it released; whether it was not already."""
        if self._released:
            return False
        self._released = True
        self._orphaned.detach()
        return True

    def _put(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """Copy a step's inputs in (ClientClosed once the client is closed, ValueError once
        released)."""
        if self._closed():
            raise ClientClosed("its prepared prefills are released")
        if self._released:
            raise ValueError("this prepared prefill was released")
        self._arena.put({"q": q, "k": k, "v": v, "g": g, "beta": beta}, self._places)

    def _output(self, answer: Response) -> PrefillOutput:
        timing = self._finish(answer)
        final: Optional[torch.Tensor] = None
        if "final_state" in self._places:
            final = self._arena.read(self._places["final_state"])
        return PrefillOutput(self.slots, self.lengths, self._arena.read(self._places["o"]), final, timing)


class PreparedPrefill(_Prepared):
    """One prepared prefill on the sync client's framed socket ``exchange``;
    ``unregister`` lets go of its region (`release`)."""

    def __init__(self, exchange: FramedExchange, arena: Arena, places: dict[str, Placed], slots: list[str],
                 lengths: list[int], number: int, finish: Callable[[Response], dict[str, float]],
                 unregister: Callable[[], None], connection: int, orphans: deque[tuple[Arena, int, int]],
                 closed: Callable[[], bool]) -> None:
        super().__init__(arena, places, slots, lengths, number, finish, connection, orphans, closed)
        self._exchange, self._unregister = exchange, unregister

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> PrefillOutput:
        """One step: q, k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV], the sequences'
        tokens packed in order, of the shapes and dtypes prepared (ValueError otherwise; on
        the host or any device). Returns o and the final states (unless declined when
        prepared), copies unless the client was made with ``shm_views``; the server's errors
        as `KDAClient.prefill` raises them (a refused step changes no slot); ClientClosed,
        before anything is sent, once the client is closed."""
        self._put(q, k, v, g, beta)
        return self._output(self._exchange.request(Op.RUN, self._id, self._connection))

    def release(self) -> None:
        """Release it on the server and unregister its region (once; later calls do nothing)."""
        if not self._releasing():
            return
        try:
            self._finish(self._exchange.request(Op.RELEASE, self._id, self._connection))
        finally:
            self._unregister()

    def __enter__(self) -> "PreparedPrefill":
        return self

    def __exit__(self, exc_type: Optional[type], *exc: object) -> None:
        """Release it; when the block raised, a failure to release (say, on the connection
        that failed with it) does not hide the block's error."""
        if exc_type is None:
            self.release()
            return
        with suppress(Exception):
            self.release()


class AsyncPreparedPrefill(_Prepared):
    """`PreparedPrefill` for `AsyncKDAClient` (its ``exchange`` and ``unregister`` awaited)."""

    def __init__(self, exchange: AsyncFramedExchange, arena: Arena, places: dict[str, Placed], slots: list[str],
                 lengths: list[int], number: int, finish: Callable[[Response], dict[str, float]],
                 unregister: Callable[[], Awaitable[None]], connection: int,
                 orphans: deque[tuple[Arena, int, int]], closed: Callable[[], bool]) -> None:
        super().__init__(arena, places, slots, lengths, number, finish, connection, orphans, closed)
        self._exchange, self._unregister = exchange, unregister

    async def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> PrefillOutput:
        """`PreparedPrefill.run`, awaited."""
        self._put(q, k, v, g, beta)
        return self._output(await self._exchange.request(Op.RUN, self._id, self._connection))

    async def release(self) -> None:
        """`PreparedPrefill.release`, awaited."""
        if not self._releasing():
            return
        try:
            self._finish(await self._exchange.request(Op.RELEASE, self._id, self._connection))
        finally:
            await self._unregister()

    async def __aenter__(self) -> "AsyncPreparedPrefill":
        return self

    async def __aexit__(self, exc_type: Optional[type], *exc: object) -> None:
        """`PreparedPrefill.__exit__`, awaited."""
        if exc_type is None:
            await self.release()
            return
        with suppress(Exception):
            await self.release()
