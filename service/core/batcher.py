"""`Batcher`: merges concurrent prefills that can share a kernel launch.

Submissions with the same key (layer and options: `ValidPrefill.batch_key`) that are
pending together go into one varlen launch. Batching is adaptive: with ``window_s`` 0 (the
default) a submission reaching an idle device launches at once, and what arrives while a
launch runs joins the next one (continuous batching); a ``window_s`` > 0 makes the oldest
pending submission wait at most that long after its arrival for company, less when
``max_tokens`` fill up first. Launches run one at a time on the `DeviceWorker`; the event
loop only collects and distributes.

A lone submission of at most ``inline_tokens`` tokens that finds the device idle (nothing
pending, no launch running, the device thread idle, no window) runs on the event loop
itself (`DeviceWorker.run_inline`): no hop to the device thread and back, no batcher task
wake-up. It first yields to the loop once, so requests already received reach `submit` too
and merge with it through the device thread instead.

Callers hold their (slot, layer) keys in `state_store.SlotOrdering` before submitting, so a
slot appears at most once among pending submissions, hence once per launch, and work on
one (slot, layer) reaches the device in arrival order.

A submitter cancelled while its submission is pending drops it: it never runs. Once taken
into a launch, a submission cancelled before the device thread starts that launch is left
out of it; one cancelled later runs, and its submitter waits for the launch to end before
it lets go (so the keys it holds are not released under a launch still updating them).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Optional, Sequence, TypeVar, Union

from ..errors import NotReady
from .metrics import Metrics
from .worker import DeviceWorker

J = TypeVar("J")
R = TypeVar("R")
log = logging.getLogger("kda_serve.batcher")

RunBatch = Callable[[Sequence[J]], Sequence[Union[R, BaseException]]]


@dataclass(eq=False)
class _Entry(Generic[J, R]):
    key: Hashable
    tokens: int
    job: J
    future: "asyncio.Future[R]" = field(repr=False)
    enqueued: float
    launch: "Optional[asyncio.Future[None]]" = field(default=None, repr=False)  # done when its launch has ended
    started: bool = False  # its launch took it (the device thread, under `Batcher._claims`)
    withdrawn: bool = False  # its submitter was cancelled before that (the loop, under `Batcher._claims`)


class Batcher(Generic[J, R]):
    """``await submit(key, tokens, job)`` -> that job's outcome from ``run_batch(jobs)``.

    ``run_batch`` runs on the device thread with every job of one launch and returns one
    outcome per job, in order: a result, or an exception raised to that job's submitter
    alone. An exception from ``run_batch`` itself fails every job of the launch.
    """

    def __init__(
        self, run_batch: RunBatch, worker: DeviceWorker, metrics: Metrics, *, window_s: float, max_tokens: int,
        inline_tokens: int = 0,
    ) -> None:
        self._run_batch = run_batch
        self._worker = worker
        self._metrics = metrics
        self._window_s = window_s
        self._max_tokens = max_tokens
        self._inline_tokens = inline_tokens
        self._launching = False  # the loop's launch is on the device thread
        self._pending: list[_Entry[J, R]] = []
        self._arrived = asyncio.Event()
        self._task: Optional[asyncio.Task[None]] = None
        self._closed = False
        self._claims = threading.Lock()  # an entry is started by its launch or withdrawn by its submitter, not both

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kda-batcher")

    async def submit(self, key: Hashable, tokens: int, job: J) -> R:
        if self._task is None or self._closed:
            raise NotReady("the batcher is not running (server starting or stopping)")
        entry = _Entry(key, tokens, job, asyncio.get_running_loop().create_future(), time.monotonic())
        self._pending.append(entry)
        try:
            if self._pending == [entry] and self._may_inline(tokens):
                await asyncio.sleep(0)  # requests already received submit now, and merge with this one
                if self._pending == [entry] and self._may_inline(tokens):
                    self._pending.clear()
                    return self._run_inline(entry)
            self._arrived.set()
            return await entry.future
        except asyncio.CancelledError:
            await self._let_go(entry)
            raise
        finally:
            if entry in self._pending:  # cancelled before its launch: it never runs
                self._pending.remove(entry)

    async def _let_go(self, entry: _Entry[J, R]) -> None:
        """For a cancelled submitter: a pending ``entry`` is simply dropped (`submit`'s
        ``finally``); one taken into a launch the device thread has not started is withdrawn
        (left out of it); one that launch already took is waited for until the launch has
        ended (through further cancellations: the launch is bounded)."""
        if entry.launch is None:
            return
        with self._claims:
            if not entry.started:
                entry.withdrawn = True
                return
        while not entry.launch.done():
            try:
                await asyncio.shield(entry.launch)
            except asyncio.CancelledError:
                continue

    def _may_inline(self, tokens: int) -> bool:
        return (tokens <= self._inline_tokens and self._window_s == 0 and not self._launching and not self._closed
                and self._worker.idle)

    def _run_inline(self, entry: _Entry[J, R]) -> R:
        """``entry``'s launch on the event loop (the device thread idle)."""
        start = time.monotonic()
        self._metrics.queue_seconds.observe(start - entry.enqueued)
        self._metrics.batch_requests.observe(1)
        try:
            (outcome,) = self._worker.run_inline(self._run_batch, [entry.job])
        except Exception:
            log.exception("kernel launch of 1 request failed")
            raise
        finally:
            self._metrics.kernel_seconds.observe(time.monotonic() - start)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def close(self) -> None:
        """Finish the launch in progress, then stop; submissions still pending fail with NotReady."""
        self._closed = True
        self._arrived.set()
        if self._task is not None:
            await self._task
        for entry in self._pending:
            if not entry.future.done():
                entry.future.set_exception(NotReady("the server is shutting down"))
        self._pending.clear()

    async def _loop(self) -> None:
        while True:
            while not self._pending and not self._closed:
                self._arrived.clear()
                await self._arrived.wait()
            if self._closed:
                return
            first = self._pending[0]
            await self._gather(first)
            if self._closed:
                return
            if first in self._pending:  # else its submitter gave up while it waited
                await self._launch(self._take(first.key))
            del first  # its inputs (views of its request body) go now, not when the next request arrives

    async def _gather(self, first: _Entry[J, R]) -> None:
        """Wait until ``first``'s window ends or its key's pending tokens reach max_tokens."""
        while not self._closed and self._key_tokens(first.key) < self._max_tokens:
            remaining = first.enqueued + self._window_s - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _key_tokens(self, key: Hashable) -> int:
        return sum(e.tokens for e in self._pending if e.key == key)

    def _take(self, key: Hashable) -> list[_Entry[J, R]]:
        """The oldest pending entries of ``key`` in arrival order, within max_tokens (at least one)."""
        batch, tokens = [], 0
        for entry in self._pending:
            if entry.key != key:
                continue
            if batch and tokens + entry.tokens > self._max_tokens:
                break
            batch.append(entry)
            tokens += entry.tokens
        for entry in batch:
            self._pending.remove(entry)
        return batch

    def _run_submitted(self, batch: list[_Entry[J, R]]) -> list[Any]:
        """On the device thread: ``batch``'s launch without the entries their submitters
        withdrew while it waited for the thread (`_let_go`; their outcome None: never run)."""
        with self._claims:
            wanted = [not entry.withdrawn for entry in batch]
            for entry in batch:
                entry.started = not entry.withdrawn
        jobs = [entry.job for entry, keep in zip(batch, wanted) if keep]
        outcomes = iter(self._run_batch(jobs) if jobs else ())
        return [next(outcomes) if keep else None for keep in wanted]

    async def _launch(self, batch: list[_Entry[J, R]]) -> None:
        start = time.monotonic()
        for entry in batch:
            self._metrics.queue_seconds.observe(start - entry.enqueued)
        self._metrics.batch_requests.observe(len(batch))
        self._launching = True
        ended = asyncio.get_running_loop().create_future()
        for entry in batch:
            entry.launch = ended
        try:
            outcomes: Sequence[Any] = await self._worker.run(self._run_submitted, batch)
        except Exception as e:  # the launch failed as a whole
            log.exception("kernel launch of %d request(s) failed", len(batch))
            outcomes = [e] * len(batch)
        finally:
            self._launching = False
            ended.set_result(None)
        self._metrics.kernel_seconds.observe(time.monotonic() - start)
        for entry, outcome in zip(batch, outcomes):
            if entry.future.done():  # the submitter was cancelled mid-launch
                continue
            if isinstance(outcome, BaseException):
                entry.future.set_exception(outcome)
            else:
                entry.future.set_result(outcome)
