"""ModelStreamInfer: inference requests and their responses on one bidirectional stream.

Requests are read in order and started as they arrive, up to `MAX_IN_FLIGHT` at once per
stream (then reading waits: HTTP/2 flow control pushes back on the client). The requests of
one sequence (its ``sequence_id``), or of one REST ``slot``, run one after another in the
order they came, and so do a sequence's requests and ``slot`` requests naming the slot
the sequence held when they were read; others run concurrently and share kernel launches. Each response is
written as soon as its request is done, so responses of different sequences may overtake
each other (Triton's stream does the same; clients match them by ``id``). A refused
request gets a response with ``error_message`` (the message HTTP would give) and the stream
goes on; so does one that is not a valid message (`decode.Malformed`).

A request once read runs whole (`Calls.whole`): a client that drops the stream leaves
each request it sent applied completely or, if it was not read yet, not at all. While the
server drains, a stream stops reading, lets its requests finish and ends with UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Hashable, Optional, Union

import grpc

from ..endpoint import KServeEndpoint
from .calls import Calls
from .codec import model_infer
from .decode import Malformed
from .messages import pb
from ..options import SequenceId
from .status import rpc_status

log = logging.getLogger("kda_serve.grpc")
METHOD = "ModelStreamInfer"
MAX_IN_FLIGHT = 64
Request = Union[pb.ModelInferRequest, Malformed]


def order_key(request: Request) -> Optional[Hashable]:
    """What the request must keep its place behind: its sequence id (42 and "42" differ), or
    its REST slot; None for a request on a scratch slot or one that did not parse. Read
    without checking (the parse refuses bad values)."""
    if isinstance(request, Malformed):
        return None
    for name in ("sequence_id", "slot"):
        entry = request.parameters.get(name)
        choice = entry.WhichOneof("parameter_choice") if entry is not None else None
        if choice is not None and getattr(entry, choice) not in (0, ""):
            return (name, getattr(entry, choice))
    return None


def order_keys(request: Request, slot_of: Callable[[SequenceId], Optional[str]]) -> list[Hashable]:
    """Every key the request must keep its place behind: its `order_key` and, for a
    request of a sequence that holds a slot (``slot_of``), that slot's key too, so it keeps
    its place among ``slot`` requests naming the same state."""
    key = order_key(request)
    if key is None:
        return []
    if key[0] == "sequence_id" and (slot := slot_of(key[1])) is not None:
        return [key, ("slot", slot)]
    return [key]


class StreamSession:
    """One ModelStreamInfer call: its requests in flight, the last one of each order key,
    and the writer (one write at a time)."""

    def __init__(self, endpoint: KServeEndpoint, calls: Calls, context: grpc.aio.ServicerContext) -> None:
        self.endpoint = endpoint
        self.calls = calls
        self.context = context
        self._write_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._last: dict[Hashable, asyncio.Future] = {}  # the last request of each order key
        self._tasks: set[asyncio.Future] = set()

    async def submit(self, request: Request) -> None:
        """Start ``request`` behind the previous one of each of its keys (waits while the
        stream has `MAX_IN_FLIGHT` requests running)."""
        await self._slots.acquire()
        keys = order_keys(request, self.endpoint.table.slot)
        previous = [self._last[k] for k in keys if k in self._last]
        task = asyncio.ensure_future(self.calls.whole(self._run(request, previous)))
        self._tasks.add(task)
        task.add_done_callback(self._done)
        for key in keys:
            self._last[key] = task

    def _done(self, task: asyncio.Future) -> None:
        self._tasks.discard(task)
        self._slots.release()
        for key in [k for k, t in self._last.items() if t is task]:
            del self._last[key]
        if not task.cancelled():
            task.exception()

    async def _run(self, request: Request, previous: list[asyncio.Future]) -> None:
        if previous:
            await asyncio.wait(previous)
        start, code = time.monotonic(), grpc.StatusCode.OK
        try:
            if isinstance(request, Malformed):
                raise request.error()
            response = pb.ModelStreamInferResponse(infer_response=await model_infer(self.endpoint, request))
        except Exception as e:
            code, message = rpc_status(e)
            response = _refusal(request, message)
        self.calls.count(METHOD, code, time.monotonic() - start)
        await self._write(response)

    async def _write(self, response: pb.ModelStreamInferResponse) -> None:
        async with self._write_lock:
            try:
                await self.context.write(response)
            except Exception as e:  # the client is gone: the request was applied all the same
                log.info("a ModelStreamInfer response found its stream closed (%s)", type(e).__name__)

    async def finish(self) -> None:
        """Wait for every request started on this stream and for its response to be written."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))


def _refusal(request: Request, message: str) -> pb.ModelStreamInferResponse:
    """The response refusing ``request`` with ``message``, echoing its id and model (none
    for a request that did not parse)."""
    echo = pb.ModelInferResponse() if isinstance(request, Malformed) else pb.ModelInferResponse(
        id=request.id, model_name=request.model_name, model_version=request.model_version)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=echo)


def _retrieved(future: asyncio.Future) -> None:
    """Mark the outcome of a read nobody waits for as seen (no "never retrieved" log)."""
    if not future.cancelled():
        future.exception()


async def serve_stream(session: StreamSession, requests: AsyncIterator[Request],
                       draining: Callable[[], Awaitable[None]]) -> bool:
    """Read ``requests`` into ``session`` until the client closes its side (True) or the
    server drains (False), then wait for the requests started and their responses. When
    the client drops the stream (this is cancelled) they finish on their own."""
    stop = asyncio.ensure_future(draining())
    reading: Optional[asyncio.Future] = None
    try:
        while True:
            reading = asyncio.ensure_future(requests.__anext__())
            await asyncio.wait([reading, stop], return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                closed = False
                break
            try:
                request = reading.result()
            except StopAsyncIteration:
                closed = True
                break
            await session.submit(request)
    finally:
        stop.cancel()
        if reading is not None:  # the client dropped the stream or the server drains: stop reading
            reading.cancel()
            reading.add_done_callback(_retrieved)
    await session.finish()
    return closed
