"""`ShardServer`: one shard of a sharded deployment -- a `ServerCore` (its own pool,
batcher and kernels on one device) whose slot ids name the shard, with the operations
a move needs. No Ray in here: `service.ray_serve.deploy` makes it a Serve deployment.

Ids: the pool hands out bare tokens; this class shows the world ``{shard}.{incarnation}
.{token}`` (`service.ray_serve.ids`) and reports every error about a token as the id it
was asked about: `UnknownSlot` (404) for a slot freed in this chain of clean stops,
`SlotGone` (410) for one that may have died with an earlier process, `SlotMoving` (503)
for one a move has taken out and not yet landed.

Moves use only `ServerCore`'s public operations (so its journal sees every change, and
every change runs on its device thread): a `take` first turns new requests for the
slot away (SlotMoving), waits until the requests already inside this shard for it are
done, then reads its state and frees it; a `put` is `ServerCore.restore_slot`. A `copy_out`
reads what a `take` reads and leaves the slot in place: a fork onto another shard.

Every public coroutine returns a `ShardFault` instead of raising an expected error.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional, Sequence, TypeVar, Union

import numpy as np

from service.config import Settings
from service.core.server import ServerCore
from service.errors import ServiceError, StateLost
from state_store import PoolError, PrefixInfo, PrefixMatch, SlotInfo, UnknownSlot

from .errors import ShardFault, SlotGone, SlotMoving
from .ids import SlotName, check_shard_name, parse_slot_id
from .incarnation import Incarnation, ShardFiles
from .payload import Array, ShardPrefill, ShardResult, ShardStatus, SlotCargo, TakeFailed

log = logging.getLogger("kda_serve.ray.shard")
_T = TypeVar("_T")
Reply = Union[_T, ShardFault]


def _faults(method: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[Reply[_T]]]:
    """Return expected errors (`ServiceError`, `PoolError`) as a `ShardFault`."""

    @functools.wraps(method)
    async def wrapper(self: "ShardServer", *args: Any) -> Reply[_T]:
        try:
            return await method(self, *args)
        except (ServiceError, PoolError) as e:
            return ShardFault.of(e)

    return wrapper


class ShardServer:
    """Shard ``name``: a `ServerCore` built from ``settings``, whose ``snapshot_path`` is
    replaced: with ``state_dir`` the shard keeps ``{state_dir}/{name}.snapshot`` (and the
    core's journal) and its incarnation record there; without, nothing survives the
    process. Call `start` in the serving loop before use and `close` at the end."""

    def __init__(self, name: str, settings: Settings, state_dir: Optional[str], lock_timeout_s: float = 120.0) -> None:
        self.name = check_shard_name(name)
        self._files = ShardFiles(state_dir, name) if state_dir else None
        snapshot_path = self._files.snapshot_path if self._files else None
        self.core = ServerCore(dataclasses.replace(settings, snapshot_path=snapshot_path))
        self._lock_timeout_s = lock_timeout_s
        self._ttl = settings.slot_ttl_s
        self._incarnation = Incarnation(0, -1)  # replaced by start()
        self._moved_out: set[str] = set()
        self._busy: dict[str, int] = {}  # token -> requests inside this shard for it
        self._quiet = asyncio.Condition()
        self._sweeper: Optional[asyncio.Task[None]] = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Begin an incarnation, start the core (it restores its snapshot), warm the
        kernels and run their self-test (RuntimeError when it fails), and sweep idle slots
        when a ttl is set."""
        if self._files is not None:
            self._incarnation = await asyncio.to_thread(self._files.open, self._lock_timeout_s)
        else:
            self._incarnation = Incarnation.fresh()
        await self.core.start()
        report = await self.core.warmup()  # and the kernels' self-test
        if not report.passed:  # a shard whose kernels compute wrong numbers must not serve
            raise RuntimeError(f"shard {self.name}: {report.describe()}")
        if self._ttl is not None:
            self._sweeper = asyncio.create_task(self._sweep_forever(min(max(self._ttl / 4, 0.05), 10.0)))
        log.info("shard %s up: incarnation %d, %d slot(s) restored", self.name, self._incarnation.number,
                 self.core.stats().used)

    async def close(self) -> None:
        """Finish queued work, let the core write its last snapshot, mark the stop clean."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.core.close()
        if self._files is not None:
            self._files.close()

    async def _sweep_forever(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.core.sweep()
            except Exception:
                log.exception("idle sweep failed; retrying in %.2f s", period)

    # -- ids ---------------------------------------------------------------------------

    def _issue(self, token: str) -> str:
        return str(SlotName(self.name, self._incarnation.number, token))

    def _token(self, slot_id: str) -> str:
        """The pool token of one of this shard's ids (UnknownSlot for anything else)."""
        parsed = parse_slot_id(slot_id)
        if parsed is None or parsed.shard != self.name:
            raise UnknownSlot(slot_id)
        return parsed.token

    def _missing(self, slot_id: str) -> Exception:
        """Why the pool lacks ``slot_id``: moving, lost with an earlier process, or unknown."""
        parsed = parse_slot_id(slot_id)
        if parsed is None:
            return UnknownSlot(slot_id)
        if parsed.token in self._moved_out:
            return SlotMoving(slot_id)
        if self._incarnation.lost(parsed.incarnation):
            return SlotGone(slot_id, f"slot {slot_id!r} is gone: it was issued by an earlier process of shard "
                                     f"{self.name!r}, which stopped without a clean shutdown; whatever its state "
                                     f"was then cannot be recovered")
        return UnknownSlot(slot_id)

    @contextlib.asynccontextmanager
    async def _using(self, ids: Mapping[str, str]) -> AsyncIterator[None]:
        """Run a request on the slots ``ids`` (token -> id): turned away while a move has
        them, counted as inside the shard meanwhile (a move waits for them), an unknown
        token reported as the id it was asked for."""
        for token, slot_id in ids.items():
            if token in self._moved_out:
                raise SlotMoving(slot_id)
        for token in ids:
            self._busy[token] = self._busy.get(token, 0) + 1
        try:
            yield
        except UnknownSlot as e:
            if e.slot_id not in ids:
                raise
            raise self._missing(ids[e.slot_id]) from None
        except StateLost as e:  # the core names the pool's token: name the id the shard was asked about
            if e.slot not in ids:
                raise
            raise StateLost(ids[e.slot]) from None
        finally:
            for token in ids:
                self._busy[token] -= 1
                if not self._busy[token]:
                    del self._busy[token]
            async with self._quiet:
                self._quiet.notify_all()

    def _one(self, slot_id: str) -> tuple[str, dict[str, str]]:
        token = self._token(slot_id)
        return token, {token: slot_id}

    # -- operations (each returns a ShardFault for an expected error) -------------------

    @_faults
    async def status(self) -> ShardStatus:
        stats = self.core.stats()
        return ShardStatus(self.name, self._incarnation.number, stats.capacity, stats.free, stats.used,
                           str(self.core.geometry.device), self.core.backend, os.getpid())

    @_faults
    async def metrics(self) -> bytes:
        return await self.core.render_metrics()

    @_faults
    async def alloc(self, count: int) -> list[str]:
        return [self._issue(token) for token in await self.core.alloc(count)]

    @_faults
    async def free(self, slot_id: str) -> None:
        token, ids = self._one(slot_id)
        async with self._using(ids):
            await self.core.free(token)

    @_faults
    async def fork(self, slot_id: str) -> str:
        token, ids = self._one(slot_id)
        async with self._using(ids):
            return self._issue(await self.core.fork(token))

    @_faults
    async def slot_info(self, slot_id: str) -> SlotInfo:
        token, ids = self._one(slot_id)
        async with self._using(ids):
            return await self.core.slot_info(token)

    @_faults
    async def check(self, slot_ids: list[str]) -> None:
        """Raise (as a fault) for the first of ``slot_ids`` that cannot be used now."""
        self._check(slot_ids)

    def _check(self, slot_ids: list[str]) -> None:
        for slot_id in slot_ids:
            token = self._token(slot_id)
            if token in self._moved_out or not self.core.has_slot(token):
                raise self._missing(slot_id)

    @_faults
    async def check_prefill(self, slot_ids: list[str], layer: int) -> list[int]:
        """What `check` checks, and that none of ``slot_ids`` is flagged state_lost
        (StateLost, 409): a split prefill's part that this shard would refuse. Returns each
        slot's tokens in ``layer`` (for the ingress to plan the request's checkpoints)."""
        self._check(slot_ids)
        tokens = []
        for slot_id in slot_ids:
            info = await self.core.slot_info(self._token(slot_id))
            if info.state_lost:
                raise StateLost(slot_id)
            tokens.append(info.tokens_per_layer[layer])
        return tokens

    @_faults
    async def get_state(self, slot_id: str) -> Array:
        token, ids = self._one(slot_id)
        async with self._using(ids):
            return Array.of(await self.core.get_state(token))

    @_faults
    async def export_state(self, slot_id: str) -> np.ndarray:
        """The slot's export (safetensors bytes) as a uint8 array: out of band through Ray."""
        token, ids = self._one(slot_id)
        async with self._using(ids):
            return np.frombuffer(await self.core.export_state(token), dtype=np.uint8)

    @_faults
    async def put_state(self, slot_id: str, state: Array) -> None:
        token, ids = self._one(slot_id)
        async with self._using(ids):
            await self.core.put_state(token, state.tensor())

    @_faults
    async def prefill(self, request: ShardPrefill) -> ShardResult:
        tokens = [None if slot_id is None else self._token(slot_id) for slot_id in request.slots]
        ids = {token: slot_id for token, slot_id in zip(tokens, request.slots) if token is not None and slot_id}
        async with self._using(ids):
            result = await self.core.prefill(request.inputs(tokens))
        issued = {token: self._issue(token) for token in result.allocated}
        return ShardResult(
            slots=[ids.get(token) or issued[token] for token in result.slots], lengths=result.lengths,
            o=Array.of(result.o), final_state=None if result.final_state is None else Array.of(result.final_state),
            allocated=[issued[token] for token in result.allocated], kernel_s=result.kernel_s,
        )

    # -- prefix cache: entries live on the shard whose prefill or publish stored them ---

    @_faults
    async def prefix_peek(self, prefix: list[str]) -> PrefixMatch:
        return self.core.prefix_peek(prefix)

    @_faults
    async def alloc_prefix(self, prefix: list[str], count: int) -> tuple[list[str], PrefixMatch]:
        tokens, match = await self.core.alloc_prefix(prefix, count)
        return [self._issue(token) for token in tokens], match

    @_faults
    async def prefix_state(self, key: str) -> tuple[Array, int]:
        """An entry's bytes, for a restore on another shard."""
        state, tokens = await self.core.prefix_state(key)
        return Array.of(state), tokens

    @_faults
    async def publish(self, slot_id: str, key: str) -> PrefixInfo:
        token, ids = self._one(slot_id)
        async with self._using(ids):
            return await self.core.publish(token, key)

    @_faults
    async def prefix_info(self, key: str) -> PrefixInfo:
        return await self.core.prefix_info(key)

    @_faults
    async def drop_prefix(self, key: str) -> bool:
        return await self.core.drop_prefix(key)

    @_faults
    async def drop_prefixes(self, keys: Sequence[str]) -> int:
        """Remove the entries ``keys`` (each once, however often named); how many there were."""
        return sum([await self.core.drop_prefix(key) for key in dict.fromkeys(keys)])

    # -- moves -------------------------------------------------------------------------

    @_faults
    async def slot_ids(self) -> list[str]:
        """An id for each live slot not being moved (this incarnation's form: any
        incarnation reaches a live token)."""
        return [self._issue(token) for token in self.core.slot_ids() if token not in self._moved_out]

    @_faults
    async def take(self, slot_id: str) -> SlotCargo:
        """Take the slot out for a move: turn new requests for it away, wait for those
        inside, read its state, free it. Until `release`, requests for it get SlotMoving."""
        token, ids = self._one(slot_id)
        if token in self._moved_out:
            raise SlotMoving(slot_id)
        self._moved_out.add(token)
        try:
            async with self._quiet:
                await self._quiet.wait_for(lambda: token not in self._busy)
            try:
                cargo = await self._cargo(token)
                await self.core.free(token)
            except UnknownSlot:
                raise UnknownSlot(slot_id) from None
        except BaseException:
            self._moved_out.discard(token)
            raise
        return cargo

    @_faults
    async def copy_out(self, slot_id: str) -> SlotCargo:
        """The slot's state, token counts and lost flag, the slot left in place: a fork
        that `put` lands on another shard (the two are independent afterwards)."""
        token, ids = self._one(slot_id)
        async with self._using(ids):
            return await self._cargo(token)

    async def _cargo(self, token: str) -> SlotCargo:
        """The slot's state after the work queued on it before this call, with the token
        counts and lost flag of that same moment: the counts are read with no suspension
        after the ordered state read, so no later prefill can run in between."""
        state = await self.core.get_state(token)
        info = await self.core.slot_info(token)
        return SlotCargo(Array.of(state), info.tokens_per_layer, info.state_lost)

    @_faults
    async def put(self, cargo: Union[SlotCargo, ShardFault]) -> Union[str, TakeFailed]:
        """Place a taken (or copied out) slot in a new slot here, bit for bit, with its
        token counts; its new id. A lost state is not copied: the new slot stays flagged
        lost. A fault from the `take` chained into this call comes back as `TakeFailed`."""
        if isinstance(cargo, ShardFault):
            return TakeFailed(cargo)
        token = await self.core.restore_slot(cargo.state.tensor(), cargo.tokens_per_layer, cargo.state_lost)
        return self._issue(token)

    @_faults
    async def release(self, slot_id: str) -> None:
        """The move of ``slot_id`` has landed (or failed for good): stop answering SlotMoving."""
        self._moved_out.discard(self._token(slot_id))
