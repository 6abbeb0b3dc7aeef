"""`ShardedCore`: the ingress's brain. Routes each request to the shards that hold its
slots, splits a prefill by shard and reassembles it, places new slots, moves and drains.

It implements `service.core.api.CoreAPI` with `ServerCore`'s signatures (alloc, free,
fork, slot_info, get_state, export_state, put_state, prefill, info, render_metrics,
check_ready), so the REST routes on top of it are the single server's own
(`service.http.routes`). What a client sees is the single server's contract:

- ids are opaque; a moved slot keeps the id its client holds (`SlotDirectory` maps its
  token to where it lives now; this class caches that map and refreshes an entry when a
  shard says the slot is not there);
- a prefill is validated whole (400s and their field names are the single server's),
  then every named slot is checked on its shard (404 in request order) and new slots
  placed (503 when full) before any shard runs; shards then run concurrently and the
  outputs come back in request order;
- a slot on a shard whose process died answers 410 (`SlotGone`), never a zeroed state.

One gap a single process does not have: if a shard dies while the parts of a split
prefill run, the parts on other shards have run (their slots advanced); the request
fails with 410 for the dead shard's slot.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, NoReturn, Optional, Sequence, TypeVar, Union

import numpy as np
import torch

from service.config import Settings
from service.errors import InvalidRequest, NotReady, ServiceError, StateLost, UnknownPrefix
from service.core.checkpoints import plan_checkpoints
from service.core.gate_params import Gate, load_gate_params
from service.core.inputs import REQUIRED_TENSORS, PrefillInputs, PrefillResult
from service.core.metrics import Metrics
from service.core.validation import validate_prefill
from service.version import __version__
from service.core.worker import off_loop
from state_store import (
    GeometryMismatch, PoolError, PoolFull, PoolGeometry, PrefixInfo, PrefixMatch, SlotInfo, UnknownSlot, key_problem,
)

from .errors import SlotGone, SlotMoving, UnknownShard
from .ids import parse_slot_id
from .links import DirectoryLink, ShardLink, ShardUnavailable
from .metrics import merge_metrics
from .payload import Array, ShardPrefill, ShardResult, ShardStatus, SlotCargo, TakeFailed

log = logging.getLogger("kda_serve.ray.router")
STATUS_TIMEOUT_S = 5.0
"""How long /info, /shards, /health/ready and placement wait for a shard's figures."""
RESTORE_ATTEMPTS = 3
"""How often a restore looks for its entry again when the one it found was dropped before its
bytes were read (then it is a miss, as on a single server that dropped it first)."""
_SlotError = Union[UnknownSlot, SlotMoving, SlotGone]
_Made = TypeVar("_Made")


@dataclass
class _Part:
    """One shard's share of a prefill: request sequence indices (ascending) and their
    slots as that shard knows them (None: allocate there)."""

    shard: str
    indices: list[int]
    slots: list[Optional[str]]


class _Reroute(Exception):
    """A slot moved under a request that had changed nothing yet: route it again."""


def plan_placement(free: Mapping[str, int], count: int) -> dict[str, int]:
    """Where ``count`` new slots go: all on the shard with the most free slots when it has
    room, else spread over the emptiest shards in turn. PoolFull when all together lack room."""
    total = sum(free.values())
    if count > total:
        raise PoolFull(count, total)
    plan: dict[str, int] = {}
    for shard, n in sorted(free.items(), key=lambda item: (-item[1], item[0])):
        if count == 0:
            break
        take = min(n, count)
        if take:
            plan[shard] = take
            count -= take
    return plan


def _rows(t: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows [a, b) of ``t`` for each bound, concatenated (a view when there is one range)."""
    merged: list[tuple[int, int]] = []
    for a, b in bounds:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    if len(merged) == 1:
        return t[merged[0][0]:merged[0][1]]
    return torch.cat([t[a:b] for a, b in merged])


class ShardedCore:
    """Serves the API over ``shards`` (name -> link), with ``directory`` for moved slots.
    ``settings`` give the geometry and gates every shard shares (validation happens here
    too, so a split request is refused whole). ``move_wait_s``: how long a request waits
    for a slot that is mid-move before answering 503. ``metrics``: the ingress's own
    (HTTP requests, abandoned responses; free slots as of the last placement figures)."""

    slot_missing: tuple[type[Exception], ...] = (UnknownSlot, SlotGone)

    def __init__(self, settings: Settings, shards: Mapping[str, ShardLink], directory: DirectoryLink,
                 move_wait_s: float = 10.0, status_max_age_s: float = 0.5) -> None:
        if not shards:
            raise ValueError("a sharded deployment needs at least one shard")
        self.geometry = PoolGeometry(settings.num_layers, settings.num_slots, settings.num_heads, settings.head_dim,
                                     settings.v_dim, settings.torch_state_dtype, torch.device("cpu"))
        self.gates: dict[int, Gate] = (load_gate_params(settings.gate_params, self.geometry)
                                       if settings.gate_params else {})
        self.shards = dict(shards)
        self.directory = directory
        self._move_wait_s = move_wait_s
        self._status_max_age_s = status_max_age_s
        self._moved: dict[str, str] = {}  # public token -> current id: a cache of the directory
        self._free: dict[str, int] = {}  # placement figures, refreshed every status_max_age_s
        self._free_at = -float("inf")
        self._draining_seen: set[str] = set()  # the directory's draining set at the last placement
        self.metrics = Metrics(free_slots=self.free_slots_seen)

    # -- routing -----------------------------------------------------------------------

    def _current(self, public: str) -> str:
        """Where ``public`` lives now, as far as this replica knows."""
        parsed = parse_slot_id(public)
        if parsed is None or parsed.shard not in self.shards:
            raise UnknownSlot(public)
        return self._moved.get(parsed.token, public)

    @staticmethod
    def _shard_of(slot_id: str) -> str:
        parsed = parse_slot_id(slot_id)
        assert parsed is not None, slot_id  # every id routed was parsed by _current
        return parsed.shard

    @staticmethod
    def _token(slot_id: str) -> str:
        parsed = parse_slot_id(slot_id)
        assert parsed is not None, slot_id
        return parsed.token

    async def _refresh(self, publics: Sequence[str]) -> bool:
        """Reread ``publics`` from the directory; whether any now lives elsewhere."""
        tokens = [self._token(p) for p in publics]
        found = await self.directory.lookup(tokens)
        changed = False
        for token in tokens:
            before, after = self._moved.get(token), found.get(token)
            if after is None:
                self._moved.pop(token, None)
            else:
                self._moved[token] = after
            changed |= before != after
        return changed

    @staticmethod
    def _slot_named(error: BaseException) -> Optional[str]:
        """The slot id ``error`` is about, if any (StateLost keeps it as ``slot``)."""
        slot_id = error.slot if isinstance(error, StateLost) else getattr(error, "slot_id", None)
        return slot_id if isinstance(slot_id, str) else None

    @classmethod
    def _public(cls, error: Exception, names: Mapping[str, str]) -> Exception:
        """``error`` about a current id, told about the id its client holds."""
        slot_id = cls._slot_named(error)
        public = names.get(slot_id) if slot_id is not None else None
        if public is None or public == slot_id:
            return error
        if isinstance(error, StateLost):
            return StateLost(public)
        if isinstance(error, UnknownSlot):
            return UnknownSlot(public)
        if isinstance(error, SlotMoving):
            return SlotMoving(public)
        if isinstance(error, SlotGone):
            return SlotGone(public, f"slot {public!r} had moved to {slot_id!r}: {error.detail}")
        return error

    @staticmethod
    def _gone(public: str, down: ShardUnavailable) -> SlotGone:
        return SlotGone(public, f"slot {public!r} lived on shard {down.shard!r}, whose process failed: "
                                f"its state is lost ({down.detail})")

    async def _retry(self, publics: Sequence[str], error: _SlotError, deadline: float) -> bool:
        """After ``error`` on a request that changed nothing: whether to route it again
        (a slot moved, or a move is landing and there is time to wait for it)."""
        if await self._refresh(publics):
            return True
        if isinstance(error, SlotMoving) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            return True
        return False

    async def _on_slot(self, public: str, method: str, *args: Any) -> Any:
        """``method(current id, *args)`` on the shard holding ``public``, following moves."""
        deadline = time.monotonic() + self._move_wait_s
        while True:
            current = self._current(public)
            shard = self._shard_of(current)
            try:
                return await self.shards[shard].call(method, current, *args)
            except ShardUnavailable as down:
                if await self._refresh([public]):  # it had moved off the dead shard
                    continue
                raise self._gone(public, down) from None
            except (UnknownSlot, SlotMoving, SlotGone) as e:
                if await self._retry([public], e, deadline):
                    continue
                raise self._public(e, {current: public}) from None

    # -- figures and placement ---------------------------------------------------------

    async def statuses(self) -> dict[str, Union[ShardStatus, ShardUnavailable]]:
        """Every shard's figures, or why it did not answer within STATUS_TIMEOUT_S."""
        names = list(self.shards)
        replies = await asyncio.gather(*(self.shards[n].call("status", timeout_s=STATUS_TIMEOUT_S) for n in names),
                                       return_exceptions=True)
        out: dict[str, Union[ShardStatus, ShardUnavailable]] = {}
        for name, reply in zip(names, replies):
            if isinstance(reply, ShardStatus):
                out[name] = reply
            elif isinstance(reply, ShardUnavailable):
                out[name] = reply
            else:
                raise reply
        return out

    async def _free_slots(self) -> dict[str, int]:
        """Free slots of the shards that take new slots: up, with figures at most
        status_max_age_s old, and not draining. The draining set is asked of the directory
        every time, so a drain run through another ingress replica holds at once."""
        if time.monotonic() - self._free_at > self._status_max_age_s:
            statuses, draining = await asyncio.gather(self.statuses(), self.directory.draining())
            self._free = {name: s.free for name, s in statuses.items() if isinstance(s, ShardStatus)}
            self._free_at = time.monotonic()
        else:
            draining = await self.directory.draining()
        self._draining_seen = set(draining)
        return {name: n for name, n in self._free.items() if name not in draining}

    def free_slots_seen(self) -> float:
        """Free slots over the shards taking new slots, as of the last placement figures."""
        return float(sum(n for name, n in self._free.items() if name not in self._draining_seen))

    def _figures_stale(self) -> None:
        """Read the placement figures anew at the next placement (slots came or went
        other than through this ingress, or a shard proved fuller than they said)."""
        self._free_at = -float("inf")

    def _placed(self, shard: str, count: int) -> None:
        """Count ``count`` slots placed on ``shard`` until the next refresh."""
        if shard in self._free:
            self._free[shard] = max(0, self._free[shard] - count)

    async def _plan(self, count: int, exclude: Sequence[str] = ()) -> dict[str, int]:
        free = {name: n for name, n in (await self._free_slots()).items() if name not in exclude}
        plan = plan_placement(free, count)
        for shard, n in plan.items():
            self._placed(shard, n)
        return plan

    async def _free_quietly(self, slot_ids: Sequence[str]) -> None:
        """Free slots this request allocated and will not hand out (failures only logged)."""
        async def one(slot_id: str) -> None:
            try:
                await self.shards[self._shard_of(slot_id)].call("free", slot_id)
            except Exception as e:
                log.warning("could not free %s after a failed request: %s", slot_id, e)
        await asyncio.gather(*(one(s) for s in slot_ids))

    # -- slots -------------------------------------------------------------------------

    async def _check_count(self, count: int) -> None:
        """The single server's check of a new slot count against its pool: InvalidRequest
        (400, field ``count``) unless 1 <= ``count`` <= the slots of the shards that answer."""
        statuses = await self.statuses()
        capacity = sum(s.capacity for s in statuses.values() if isinstance(s, ShardStatus))
        if not 1 <= count <= capacity:
            raise InvalidRequest(f"count must be in 1..{capacity} (the pool's slots), got {count}", field="count")

    async def alloc(self, count: int = 1) -> list[str]:
        """``count`` new slots, all or none, on the emptiest shards."""
        await self._check_count(count)
        return await self._new_slots(count)

    async def _new_slots(self, count: int) -> list[str]:
        """`alloc` of a checked ``count``."""
        async def place(plan: dict[str, int]) -> list[Union[list[str], BaseException]]:
            return await asyncio.gather(*(self.shards[s].call("alloc", n) for s, n in plan.items()),
                                        return_exceptions=True)

        return await self._placed_slots(count, place)

    async def _placed_slots(self, count: int,
                            place: Callable[[dict[str, int]], Awaitable[Sequence[object]]]) -> list[str]:
        """The slots ``place(plan)`` makes on a placement plan of ``count`` (its replies: a
        slot id, a list of them, or a failure each), all or none. The plan comes from cached
        figures (`_free_slots`), which may be stale either way: when they leave no room
        (slots freed since, through another replica), or every failure is PoolFull (what was
        made is then freed), they are read anew for one more plan before PoolFull reaches
        the caller."""
        fresh = False
        while True:
            try:
                plan = await self._plan(count)
            except PoolFull:
                if fresh:
                    raise
                fresh = True
                self._figures_stale()
                continue
            replies = await place(plan)
            ids = [r for reply in replies for r in (reply if isinstance(reply, list) else [reply]) if isinstance(r, str)]
            failures = [r.fault.error() if isinstance(r, TakeFailed) else r for r in replies
                        if isinstance(r, (BaseException, TakeFailed))]
            if not failures:
                return ids
            await self._free_quietly(ids)
            if fresh or not all(isinstance(f, PoolFull) for f in failures):
                raise failures[0]
            fresh = True
            self._figures_stale()

    async def free(self, slot_id: str) -> None:
        """Free the slot (``slot_id``: the id its client holds) on the shard that holds it."""
        await self._on_slot(slot_id, "free")
        token = self._token(slot_id)
        if self._moved.pop(token, None) is not None:
            await self.directory.forget(token)

    async def fork(self, slot_id: str) -> str:
        """A copy of the slot: on the shard that holds it when that has room (by the
        placement figures, and in fact), else its state, token counts and lost flag are
        read there (`ShardServer.copy_out`, ordered after the work already queued on the
        slot) and put where `alloc` would place a slot. PoolFull (503) only when no shard
        has room, as on a single server."""
        home = self._shard_of(self._current(slot_id))
        child: Optional[str] = await self._at_home(home, 1, lambda: self._on_slot(slot_id, "fork"))
        return child if child is not None else await self._copy(slot_id)

    async def _at_home(self, shard: str, count: int, make: Callable[[], Awaitable[_Made]]) -> Optional[_Made]:
        """What ``make()`` makes on ``shard`` (``count`` new slots there) when the placement
        figures give ``shard`` room for them and it proves to have it; None otherwise (the
        caller moves bytes to a shard with room), with the figures marked stale when the
        shard proved full."""
        if (await self._free_slots()).get(shard, 0) < count:
            return None
        try:
            made = await make()
        except PoolFull:
            self._figures_stale()
            return None
        self._placed(shard, count)
        return made

    async def _copy(self, slot_id: str) -> str:
        """A fork of ``slot_id`` through the ingress: its cargo put on a shard with room."""
        cargo: SlotCargo = await self._on_slot(slot_id, "copy_out")

        async def place(plan: dict[str, int]) -> list[object]:
            return await asyncio.gather(*(self.shards[s].call("put", cargo) for s in plan), return_exceptions=True)

        (child,) = await self._placed_slots(1, place)
        return child

    async def slot_info(self, slot_id: str) -> SlotInfo:
        """The slot's metadata from its shard, named by the id its client holds."""
        info: SlotInfo = await self._on_slot(slot_id, "slot_info")
        info.slot_id = slot_id
        return info

    async def get_state(self, slot_id: str) -> torch.Tensor:
        """The slot's state, [L, HV, V, K] in the pool dtype (a view of the bytes received)."""
        array: Array = await self._on_slot(slot_id, "get_state")
        return array.tensor()

    async def export_state(self, slot_id: str) -> bytes:
        """The slot's export (safetensors); it travels from the shard as a uint8 array."""
        exported: np.ndarray = await self._on_slot(slot_id, "export_state")
        return exported.tobytes()

    async def put_state(self, slot_id: str, state: torch.Tensor) -> None:
        """Replace the slot's state on its shard with ``state`` [L, HV, V, K]."""
        await self._on_slot(slot_id, "put_state", Array.of(state))

    # -- prefill -----------------------------------------------------------------------

    # -- prefix cache --------------------------------------------------------------------

    async def _each_shard(self, method: str, *args: Any) -> dict[str, Any]:
        """``method(*args)`` on every shard: its value or the exception, by shard."""
        names = list(self.shards)
        replies = await asyncio.gather(*(self.shards[n].call(method, *args) for n in names), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, (ServiceError, PoolError)):
                raise reply
        return dict(zip(names, replies))

    async def alloc_prefix(self, prefix: Sequence[str], count: int = 1) -> tuple[list[str], PrefixMatch]:
        """``count`` new slots from the longest complete entry among ``prefix`` on any shard:
        on the entry's shard when it has room for them all, else its bytes are read from
        there (`ShardServer.prefix_state`) and restored into slots placed as `alloc` places
        them. Zero state when nothing matches (a shard that does not answer has no match).
        The count is checked first, against the whole pool, as on a single server."""
        await self._check_count(count)
        for i, key in enumerate(prefix):
            if (why := key_problem(key)) is not None:
                raise InvalidRequest(why, field=f"prefix[{i}]")
        for _ in range(RESTORE_ATTEMPTS):
            found = await self._longest_entry(prefix)
            if found is None:
                break
            try:
                return await self._restore(prefix, count, *found)
            except UnknownPrefix:
                continue  # dropped after the look and before its bytes were read: look again
        slots = await self._new_slots(count)
        self.metrics.prefix_misses.inc()
        return slots, PrefixMatch()

    async def _longest_entry(self, prefix: Sequence[str]) -> Optional[tuple[str, PrefixMatch]]:
        """The shard holding the longest complete entry among ``prefix`` and its match (most
        tokens, the later key on a tie, as on one server); None when no shard has one."""
        peeks = {shard: m for shard, m in (await self._each_shard("prefix_peek", list(prefix))).items()
                 if isinstance(m, PrefixMatch) and m.matched}
        if not peeks:
            return None
        return max(peeks.items(), key=lambda item: (item[1].tokens, item[1].matched))

    async def _restore(self, prefix: Sequence[str], count: int, shard: str,
                       match: PrefixMatch) -> tuple[list[str], PrefixMatch]:
        """``count`` slots from ``match`` on ``shard``: restored there when it has room (by
        the placement figures, and in fact), else its bytes restored where `alloc` would
        place them. UnknownPrefix when the entry went before its bytes were read."""
        restored: Optional[tuple[list[str], PrefixMatch]] = await self._at_home(
            shard, count, lambda: self.shards[shard].call("alloc_prefix", list(prefix), count))
        if restored is not None:
            return restored
        assert match.key is not None
        state, tokens = await self.shards[shard].call("prefix_state", match.key)
        cargo = SlotCargo(state, [tokens] * self.geometry.num_layers, False)

        async def place(plan: dict[str, int]) -> list[object]:
            return await asyncio.gather(*(self.shards[s].call("put", cargo) for s, n in plan.items() for _ in range(n)),
                                        return_exceptions=True)

        slots = await self._placed_slots(count, place)
        self.metrics.prefix_hits.inc()  # the shard that lent the bytes counted no hit (`ServerCore.prefix_state`)
        self.metrics.prefix_hit_tokens.inc(tokens * count)
        return slots, PrefixMatch(match.matched, match.key, tokens)

    async def publish(self, slot_id: str, key: str) -> PrefixInfo:
        """The slot's state as the entry ``key`` on the slot's shard; an entry of that key on
        any other shard is dropped, so a key lives on one shard."""
        info: PrefixInfo = await self._on_slot(slot_id, "publish", key)
        await self._drop_elsewhere({self._shard_of(self._current(slot_id)): [key]})
        return info

    async def _drop_elsewhere(self, stored: Mapping[str, Sequence[str]]) -> None:
        """After entries were stored (``stored``: shard -> keys), drop those keys' entries on
        every other shard, one call per shard, so a key lives on one shard (a shard that
        fails is skipped: its copy may linger until it is dropped or evicted)."""
        drops = {n: [key for home, keys in stored.items() if home != n for key in keys] for n in self.shards}
        await asyncio.gather(*(self.shards[n].call("drop_prefixes", keys) for n, keys in drops.items() if keys),
                             return_exceptions=True)

    async def prefix_info(self, key: str) -> PrefixInfo:
        """The entry ``key`` from the shard that holds it (UnknownPrefix when none does)."""
        found = [r for r in (await self._each_shard("prefix_info", key)).values() if isinstance(r, PrefixInfo)]
        if not found:
            raise UnknownPrefix(key)
        return max(found, key=lambda info: info.last_used)

    async def drop_prefix(self, key: str) -> bool:
        """Remove the entry ``key`` from every shard; whether one held it (no entry is no
        error). A shard that does not answer fails the call with its error, since the entry
        may live there (the call is idempotent: retrying it is safe)."""
        if (why := key_problem(key)) is not None:
            raise InvalidRequest(why, field="key")
        replies = await self._each_shard("drop_prefix", key)
        failed = [r for r in replies.values() if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        return any(replies.values())

    async def prefill(self, inputs: PrefillInputs) -> PrefillResult:
        """Validate whole, then run on the shards holding the slots (see the module docstring).
        The result's kernel_s is the longest launch among the shards that ran it."""
        start = time.perf_counter()
        await off_loop(validate_prefill, inputs, self.geometry, self.gates, nbytes=self._nbytes(inputs))
        validate_s = time.perf_counter() - start
        deadline = time.monotonic() + self._move_wait_s
        while True:
            try:
                result = await self._prefill_once(inputs, deadline)
            except _Reroute:
                continue
            result.validate_s = validate_s
            return result

    def _routable(self, public: str) -> bool:
        parsed = parse_slot_id(public)
        return parsed is not None and parsed.shard in self.shards

    async def _unroutable(self, slots: Sequence[Optional[str]]) -> NoReturn:
        """The 404 a single server would give when some slot names no shard of this
        deployment: the first missing slot in request order, maybe a routable one before it."""
        first = next(i for i, s in enumerate(slots) if s is not None and not self._routable(s))
        routable = [p for p in slots[:first] if p is not None]
        if routable:
            await self._refresh(routable)  # an error path: ask the directory rather than trust the cache
        earlier = {self._current(p): p for p in routable}
        by_shard: dict[str, list[str]] = {}
        for current in earlier:
            by_shard.setdefault(self._shard_of(current), []).append(current)
        replies = await asyncio.gather(*(self.shards[shard].call("check", ids) for shard, ids in by_shard.items()),
                                       return_exceptions=True)
        errors = [r for r in replies if isinstance(r, (UnknownSlot, SlotMoving, SlotGone))]
        if errors:
            order = {current: i for i, current in enumerate(earlier)}
            raise self._public(self._first_error(errors, order), earlier)  # type: ignore[arg-type]
        raise UnknownSlot(slots[first])

    async def _prefill_once(self, x: PrefillInputs, deadline: float) -> PrefillResult:
        try:
            currents = [None if s is None else self._current(s) for s in x.slots]
        except UnknownSlot:
            await self._unroutable(x.slots)
        names = {c: p for c, p in zip(currents, x.slots) if c is not None and p is not None}
        order = {**{p: i for i, p in enumerate(x.slots) if p is not None},
                 **{c: i for i, c in enumerate(currents) if c is not None}}
        nulls = [i for i, c in enumerate(currents) if c is None]
        plan = await self._plan(len(nulls)) if nulls else {}
        placement = [None if c is None else self._shard_of(c) for c in currents]
        fill = iter([shard for shard, n in plan.items() for _ in range(n)])
        for i in nulls:
            placement[i] = next(fill)
        parts: dict[str, _Part] = {}
        for i, (shard, slot) in enumerate(zip(placement, currents)):
            assert shard is not None
            part = parts.setdefault(shard, _Part(shard, [], []))
            part.indices.append(i)
            part.slots.append(slot)
        if len(parts) == 1:
            result = await self._prefill_one(x, next(iter(parts.values())), names, deadline)
        else:
            allocated = await self._prepare(x, parts, names, order, deadline)
            try:
                result = await self._prefill_split(x, parts, names, order, allocated)
            except BaseException:
                await self._free_quietly(allocated)
                raise
        if x.checkpoints:
            marks = x.checkpoint_list()
            await self._drop_elsewhere({p.shard: [m.key for i in p.indices for m in marks[i]] for p in parts.values()})
        return result

    @staticmethod
    def _shard_request(x: PrefillInputs, part: _Part) -> ShardPrefill:
        starts = list(itertools.accumulate(x.lengths, initial=0))
        bounds = [(starts[i], starts[i + 1]) for i in part.indices]
        whole = len(part.indices) == len(x.lengths)

        def pick(name: str, t: torch.Tensor) -> Array:  # the part's tokens of a packed tensor; gate tensors whole
            return Array.of(t if whole or name not in REQUIRED_TENSORS else _rows(t, bounds))

        marks = [list(x.checkpoint_list()[i]) for i in part.indices] if x.checkpoints else []
        return ShardPrefill(part.slots, [x.lengths[i] for i in part.indices], x.params,
                            {name: pick(name, t) for name, t in x.tensors().items()}, marks)

    @staticmethod
    def _nbytes(x: PrefillInputs) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(x, name) for name in REQUIRED_TENSORS))

    async def _prefill_one(self, x: PrefillInputs, part: _Part, names: dict[str, str],
                           deadline: float) -> PrefillResult:
        """The whole request on one shard: its own checks make it all or nothing."""
        request = self._shard_request(x, part)  # whole: views, no copy
        try:
            result: ShardResult = await self.shards[part.shard].call("prefill", request)
        except ShardUnavailable as down:
            named = [p for p in x.slots if p is not None]
            if named:
                raise self._gone(named[0], down) from None
            raise
        except (UnknownSlot, SlotMoving, SlotGone) as e:
            if await self._retry(list(names.values()), e, deadline):
                raise _Reroute() from None
            raise self._public(e, names) from None
        o = result.o.tensor()
        final = None if result.final_state is None else result.final_state.tensor()
        slots = [names.get(s, s) for s in result.slots]
        return PrefillResult(slots, list(x.lengths), o, final, list(result.allocated), result.kernel_s)

    @classmethod
    def _first_error(cls, errors: Sequence[BaseException], order: Mapping[str, int]) -> BaseException:
        """Of failures from several shards, the one the single server would have raised:
        slot errors in request order first, then the rest."""
        def rank(e: BaseException) -> tuple[int, int]:
            slot_id = cls._slot_named(e)
            return (0, order[slot_id]) if slot_id is not None and slot_id in order else (1, 0)
        return min(errors, key=rank)

    def _part_errors(self, parts: Sequence[_Part], replies: Sequence[Any],
                     names: Mapping[str, str]) -> list[BaseException]:
        """The failures among ``replies`` (one per part), a dead shard as 410 for its first slot."""
        errors: list[BaseException] = []
        for part, reply in zip(parts, replies):
            if isinstance(reply, ShardUnavailable) and part.slots[0] is not None:
                errors.append(self._gone(names.get(part.slots[0], part.slots[0]), reply))
            elif isinstance(reply, BaseException):
                errors.append(reply)
        return errors

    async def _prepare(self, x: PrefillInputs, parts: dict[str, _Part], names: dict[str, str],
                       order: Mapping[str, int], deadline: float) -> list[str]:
        """Before a split prefill runs anything: every named slot exists (404 in request
        order) and is not flagged lost (409), the new slots are allocated (their ids fill
        the parts), and the checkpoints fit the slots' token counts (400, fields in request
        order): what a shard would refuse is refused before any shard runs."""
        checks = [_Part(p.shard, [i for i, s in zip(p.indices, p.slots) if s is not None],
                        [s for s in p.slots if s is not None]) for p in parts.values()]
        checks = [c for c in checks if c.slots]
        allocs = [p for p in parts.values() if None in p.slots]
        replies = await asyncio.gather(
            *(self.shards[c.shard].call("check_prefill", c.slots, x.params.layer) for c in checks),
            *(self.shards[p.shard].call("alloc", p.slots.count(None)) for p in allocs),
            return_exceptions=True,
        )
        alloc_replies = replies[len(checks):]
        allocated = [s for reply in alloc_replies if isinstance(reply, list) for s in reply]
        errors = self._part_errors(checks, replies[:len(checks)], names)
        errors += [reply for reply in alloc_replies if isinstance(reply, BaseException)]
        if errors:
            await self._free_quietly(allocated)
            first = self._first_error(errors, order)
            if isinstance(first, (UnknownSlot, SlotMoving, SlotGone)) and await self._retry(
                    list(names.values()), first, deadline):
                raise _Reroute()
            raise self._public(first, names) if isinstance(first, Exception) else first
        if x.checkpoints:
            try:
                plan_checkpoints(x, self._tokens_before(len(x.lengths), checks, replies[:len(checks)]))
            except InvalidRequest:
                await self._free_quietly(allocated)
                raise
        for part, reply in zip(allocs, alloc_replies):
            fresh = iter(reply)
            part.slots = [s if s is not None else next(fresh) for s in part.slots]
        return allocated

    @staticmethod
    def _tokens_before(n: int, checks: Sequence[_Part], counts: Sequence[list[int]]) -> list[int]:
        """Each sequence's slot's tokens in the layer (0 for a new slot), in request order."""
        before = [0] * n
        for check, tokens in zip(checks, counts):
            for i, t in zip(check.indices, tokens):
                before[i] = t
        return before

    async def _prefill_split(self, x: PrefillInputs, parts: dict[str, _Part], names: dict[str, str],
                             order: Mapping[str, int], allocated: list[str]) -> PrefillResult:
        """Run the parts concurrently and put the outputs back in request order."""
        plist = list(parts.values())
        requests = [await off_loop(self._shard_request, x, part, nbytes=self._nbytes(x)) for part in plist]
        replies = await asyncio.gather(*(self.shards[part.shard].call("prefill", request)
                                         for part, request in zip(plist, requests)), return_exceptions=True)
        errors = self._part_errors(plist, replies, names)
        if errors:
            first = self._first_error(errors, order)
            raise self._public(first, names) if isinstance(first, Exception) else first
        n = len(x.lengths)
        o_parts: list[Optional[torch.Tensor]] = [None] * n
        finals: list[Optional[torch.Tensor]] = [None] * n
        slots: list[str] = [""] * n
        for part, result in zip(plist, replies):
            assert isinstance(result, ShardResult)
            outputs = result.o.tensor().split(result.lengths)
            final = result.final_state.tensor() if result.final_state is not None else None
            for j, i in enumerate(part.indices):
                o_parts[i] = outputs[j]
                slots[i] = names.get(result.slots[j], result.slots[j])
                if final is not None:
                    finals[i] = final[j:j + 1]
        o = torch.cat([t for t in o_parts if t is not None])
        final_state = torch.cat([t for t in finals if t is not None]) if x.params.return_final_state else None
        kernel_s = max(result.kernel_s for result in replies if isinstance(result, ShardResult))
        return PrefillResult(slots, list(x.lengths), o, final_state, allocated, kernel_s)

    # -- moves -------------------------------------------------------------------------

    async def move(self, public: str, target: Optional[str]) -> tuple[str, str]:
        """Move the slot to shard ``target`` (None: the emptiest other shard that takes
        new slots); returns (its id, unchanged, and the shard it is on now)."""
        if target is not None and target not in self.shards:
            raise UnknownShard(target, sorted(self.shards))
        deadline = time.monotonic() + self._move_wait_s
        while True:
            current = self._current(public)
            source = self._shard_of(current)
            if target == source:
                return public, source
            try:
                await self.shards[source].call("check", [current])
            except ShardUnavailable as down:
                raise self._gone(public, down) from None
            except (UnknownSlot, SlotMoving, SlotGone) as e:
                if await self._retry([public], e, deadline):
                    continue
                raise self._public(e, {current: public}) from None
            destination = target or next(iter(await self._plan(1, exclude=[source])))
            try:
                return public, await self._move_current(self._token(public), public, current, destination)
            except (UnknownSlot, SlotMoving, SlotGone) as e:
                if await self._retry([public], e, deadline):
                    continue
                raise self._public(e, {current: public}) from None

    async def _move_current(self, token: str, public: str, current: str, destination: str) -> str:
        """Take the slot at ``current`` out of its shard and put it on ``destination``,
        the state going through the object store; on a refusal there (full), put it back
        where it was. Records the new place; returns the shard it is on."""
        source = self._shard_of(current)
        taken = self.shards[source].send("take", current)
        try:
            placed = await self.shards[destination].result(self.shards[destination].send("put", taken))
            refusal: Optional[BaseException] = None
        except (PoolFull, GeometryMismatch, ShardUnavailable) as e:
            refusal = e
            try:
                placed = await self.shards[source].result(self.shards[source].send("put", taken))
            except Exception as back:
                with contextlib.suppress(Exception):
                    await self.shards[source].call("release", current)
                log.error("slot %s lost in a move: %s there, %s putting it back", public, e, back)
                raise SlotGone(public, f"slot {public!r} was lost in a move to {destination!r}: {e}; putting it "
                                       f"back failed: {back}") from None
        if isinstance(placed, TakeFailed):
            raise placed.fault.error()
        await self.directory.record(token, placed)
        self._moved[token] = placed
        await self.shards[source].call("release", current)
        if refusal is not None:
            raise refusal
        log.info("moved slot %s: %s -> %s", public, current, placed)
        return self._shard_of(placed)

    async def drain(self, shard: str) -> dict[str, Any]:
        """Stop placing new slots on ``shard`` and move all of its slots to the others."""
        if shard not in self.shards:
            raise UnknownShard(shard, sorted(self.shards))
        await self.directory.set_draining(shard, True)
        self._figures_stale()
        ids: list[str] = await self.shards[shard].call("slot_ids")
        origins = await self.directory.origins([self._token(s) for s in ids])
        moved, failed = 0, []
        for current in ids:
            token = self._token(current)
            public_token = origins.get(token, token)
            try:
                destination = next(iter(await self._plan(1, exclude=[shard])))
                await self._move_current(public_token, current, current, destination)
                moved += 1
            except UnknownSlot:
                continue  # freed meanwhile
            except Exception as e:
                failed.append({"slot": current, "detail": str(e)})
        return {"shard": shard, "moved": moved, "failed": failed}

    async def resume(self, shard: str) -> None:
        """Let ``shard`` take new slots again."""
        if shard not in self.shards:
            raise UnknownShard(shard, sorted(self.shards))
        await self.directory.set_draining(shard, False)
        self._figures_stale()

    # -- figures -----------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """The single server's /info over all shards that answer: slot counts summed."""
        statuses = [s for s in (await self.statuses()).values() if isinstance(s, ShardStatus)]
        if not statuses:
            raise NotReady("no shard answers")
        g = self.geometry
        return {
            "version": __version__,
            "num_layers": g.num_layers, "num_slots": sum(s.capacity for s in statuses), "num_heads": g.num_heads,
            "head_k_dim": g.head_k_dim, "head_v_dim": g.head_v_dim, "state_dtype": g.dtype_name,
            "device": ",".join(sorted({s.device for s in statuses})),
            "backend": ",".join(sorted({s.backend for s in statuses})),
            "free_slots": sum(s.free for s in statuses), "used_slots": sum(s.used for s in statuses),
            "gate_layers": sorted(self.gates),
        }

    async def shard_table(self) -> list[dict[str, Any]]:
        """Each shard: up or not, its figures, whether it is draining."""
        statuses, draining = await asyncio.gather(self.statuses(), self.directory.draining())
        rows = []
        for name, s in statuses.items():
            row: dict[str, Any] = {"shard": name, "up": isinstance(s, ShardStatus), "draining": name in draining}
            if isinstance(s, ShardStatus):
                row.update(incarnation=s.incarnation, num_slots=s.capacity, free_slots=s.free, used_slots=s.used,
                           device=s.device, backend=s.backend)
            else:
                row["detail"] = s.detail
            rows.append(row)
        return rows

    async def check_ready(self) -> None:
        """Return while at least one shard answers; NotReady (503) when none does."""
        if not any(isinstance(s, ShardStatus) for s in (await self.statuses()).values()):
            raise NotReady("no shard answers")

    async def render_metrics(self) -> bytes:
        """One Prometheus page: the ingress's HTTP families and every answering shard's
        others, labelled ``shard``."""
        return merge_metrics(self.metrics.render(), await self.shard_metrics())

    async def shard_metrics(self) -> dict[str, bytes]:
        """Each answering shard's Prometheus text."""
        names = list(self.shards)
        replies = await asyncio.gather(*(self.shards[n].call("metrics", timeout_s=STATUS_TIMEOUT_S) for n in names),
                                       return_exceptions=True)
        return {name: reply for name, reply in zip(names, replies) if isinstance(reply, bytes)}
