"""`PrefixCache`: slot states stored under the caller's keys, to start new slots from.

An entry is one state per layer, ``[L, HV, V, K]`` in the pool's dtype, all at one token
``offset`` (how many tokens of each layer it holds). It is filled a layer at a time (a
prefill's checkpoint on one layer) or whole (a slot published); it is *complete* when
every layer is stored, and only complete entries match (`restoring`). An entry is a copy:
nothing that happens to a slot later changes it.

Two tiers, each with a byte budget: entries live on the pool's device; when the device
tier is over budget its least recently used entries move to pinned host memory (the host
tier, when it has a budget) or are dropped, and the host tier drops its least recently
used entries when over its own budget; a host-tier entry that is hit can move back up
(`promote`). An entry's bytes are those of its whole ``[L, ...]``
tensor, allocated when its first layer arrives. Use (a store into it, a match) makes an
entry the most recent. An entry being restored is pinned: no eviction moves or drops it.

A launch may write its checkpoints straight into entries (`place`, then `commit` once it
succeeded, `release` always): a target is a layer not yet stored of a present entry, or a
layer of a new entry that is not in the cache until committed, so a launch rolled back
stores nothing.

Keys are the caller's strings of 1..`KEY_MAX` characters; the cache never sees tokens.
Every method holds the cache's lock; copies into slots happen outside it, under a pin.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .geometry import PoolGeometry

KEY_MAX = 128
DEVICE, HOST = "device", "host"
TIERS = (DEVICE, HOST)


def key_problem(key: Any) -> Optional[str]:
    """Why ``key`` cannot name an entry (a string of 1..`KEY_MAX` characters), or None."""
    if not isinstance(key, str):
        return f"a prefix key must be a string, got {type(key).__name__}"
    if not 1 <= len(key) <= KEY_MAX:
        return f"a prefix key must have 1..{KEY_MAX} characters, got {len(key)}"
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: JSON can carry it, no reply or URL can name it
            return "a prefix key must be valid Unicode (it holds a lone surrogate)"
    return None


def _check_key(key: Any) -> str:
    if (why := key_problem(key)) is not None:
        raise ValueError(why)
    return key


@dataclass(frozen=True)
class PrefixInfo:
    """One entry as the API shows it: ``layers`` stored of the pool's ``num_layers``,
    ``bytes`` of its tensor, ``tier`` (device or host), ``last_used`` in unix seconds."""

    key: str
    tokens: int
    layers: int
    complete: bool
    bytes: int
    tier: str
    last_used: float


@dataclass(frozen=True)
class PrefixMatch:
    """The longest complete entry among a caller's keys: ``matched`` is its 1-based
    position among them (0: none), ``key`` its key (None), ``tokens`` its offset (0)."""

    matched: int = 0
    key: Optional[str] = None
    tokens: int = 0


@dataclass(frozen=True)
class TierStats:
    """Entries and bytes held by one tier, and its budget in bytes."""

    entries: int
    bytes: int
    budget: int


@dataclass
class Entry:
    """A cache entry: ``state`` [L, HV, V, K] (pool dtype; on the device, or pinned host
    memory in the host tier), the layers stored, the token offset, last use on the cache's
    clock and how many restores hold it."""

    key: str
    tokens: int
    state: torch.Tensor
    have: list[bool]
    tier: str
    last_used: float
    pins: int = 0

    @property
    def complete(self) -> bool:
        return all(self.have)

    @property
    def nbytes(self) -> int:
        return self.state.numel() * self.state.element_size()


@dataclass(frozen=True)
class Restore:
    """A match held for copying: its `PrefixMatch` and the entry's state [L, HV, V, K]
    (None when nothing matched). Valid only inside `PrefixCache.restoring`."""

    match: PrefixMatch
    state: Optional[torch.Tensor]
    tier: Optional[str] = None


@dataclass(eq=False)
class CheckpointTarget:
    """Where a launch writes one checkpoint (`PrefixCache.place`): ``state`` [HV, V, K]
    (pool dtype, on the pool's device) is layer ``layer`` of the entry ``key`` at ``tokens``:
    a layer of a present entry that is not stored yet, or of a new entry that nothing sees
    until `PrefixCache.commit`. None: the cache has no such place for it (the launch writes
    it elsewhere and `commit` copies it in, as `PrefixCache.store_layer` does)."""

    key: str
    tokens: int
    layer: int
    state: Optional[torch.Tensor]
    entry: Optional[Entry] = field(default=None, repr=False)
    new: bool = False
    open: bool = True  # neither committed nor released yet


@dataclass
class _Counters:
    evictions: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})


class PrefixCache:
    """Entries for a pool of ``geometry`` within ``device_bytes`` on its device and
    ``host_bytes`` of pinned host memory (pinned only when the device is a GPU).
    ``device_bytes`` 0 turns the cache off (`enabled`); ``on_evict(tier)`` is called for
    each entry leaving ``tier`` for lack of room (moved down or dropped)."""

    def __init__(self, geometry: PoolGeometry, device_bytes: int, host_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Optional[Callable[[str], None]] = None) -> None:
        if device_bytes < 0 or host_bytes < 0:
            raise ValueError(f"budgets must be >= 0 bytes, got device {device_bytes}, host {host_bytes}")
        self._geometry = geometry
        self._budget = {DEVICE: int(device_bytes), HOST: int(host_bytes) if device_bytes else 0}
        self._clock = clock
        self._wall_offset = time.time() - clock()
        self._on_evict = on_evict
        self._entries: "OrderedDict[str, Entry]" = OrderedDict()  # least recently used first
        self._lock = threading.RLock()
        self._counters = _Counters()
        self._pending = 0  # bytes of new entries placed for a launch (`place`), not yet committed

    @property
    def geometry(self) -> PoolGeometry:
        return self._geometry

    @property
    def enabled(self) -> bool:
        """Whether the cache keeps anything (a device budget > 0)."""
        return self._budget[DEVICE] > 0

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry: one slot's state over every layer."""
        return self._geometry.bytes_per_slot

    # -- storing ---------------------------------------------------------------------

    def store_layer(self, key: str, tokens: int, layer: int, state: torch.Tensor) -> None:
        """Store ``state`` [HV, V, K] (pool dtype, any device) as layer ``layer`` of the
        entry ``key`` at offset ``tokens``. An entry of ``key`` at another offset is
        replaced by a new one holding only this layer; at the same offset the layer is
        (re)written. Raises ValueError for a bad key, layer, offset or state. A copy that
        raises leaves a new entry out of the cache (the present one stays, `_writable`); one
        into the present entry leaves the layer unstored (it may be partly written), so
        the entry is not complete and never served until the layer is stored again."""
        g = self._geometry
        _check_key(key)
        if not 0 <= layer < g.num_layers:
            raise ValueError(f"layer {layer} out of range: the pool has {g.num_layers} layers")
        self._check_state(state, g.slot_shape[1:])

        def fill(entry: Entry) -> None:
            entry.have[layer] = False  # until the copy has succeeded
            entry.state[layer].copy_(state)
            entry.have[layer] = True

        with self._lock:
            self._writable(key, _check_tokens(tokens), fill)

    def publish(self, key: str, tokens: int, state: torch.Tensor) -> Optional[PrefixInfo]:
        """Store ``state`` [L, HV, V, K] (pool dtype, any device) as the complete entry
        ``key`` at offset ``tokens``, replacing any entry of that key. Returns its info, or
        None when it fits in neither tier's budget (nothing is kept). A copy that raises
        leaves the present entry of the key in place (`_writable`)."""
        _check_key(key)
        self._check_state(state, self._geometry.slot_shape)

        def fill(entry: Entry) -> None:
            entry.state.copy_(state)
            entry.have = [True] * self._geometry.num_layers

        with self._lock:
            entry = self._writable(key, _check_tokens(tokens), fill, whole=True)
            return None if entry is None else self._info(entry)

    # -- checkpoints written in place by a launch -----------------------------------------

    def place(self, layer: int, wanted: Sequence[tuple[str, int]]) -> list[CheckpointTarget]:
        """Targets for a launch's checkpoints ``wanted`` (key, tokens), in order, of layer
        ``layer``, for the launch to write the states into directly (`CheckpointTarget`).
        In place: a present device entry at that offset whose layer is not stored, not
        being restored; else a new device entry when room can be made for it (room is made
        now, once for all of them: least recently used entries move down or go, as for a
        store; the new entries' bytes count against the budget until committed or
        released; the first ones in order get the room there is). Anything else (a stored
        layer rewritten, a host-tier or pinned entry, no room, a key named twice) gets no
        place. Nothing placed is visible: `commit` stores it once the launch succeeded, and
        `release` must follow in every case (it frees what was not committed, so a launch
        rolled back stores nothing)."""
        if not 0 <= layer < self._geometry.num_layers:
            raise ValueError(f"layer {layer} out of range: the pool has {self._geometry.num_layers} layers")
        with self._lock:
            placed: list[CheckpointTarget] = []
            fresh: list[CheckpointTarget] = []  # those wanting a new entry
            seen: set[str] = set()
            for key, tokens in wanted:
                target = self._in_place(_check_key(key), _check_tokens(tokens), layer, key in seen)
                if target is None:
                    target = CheckpointTarget(key, tokens, layer, None)
                    fresh.append(target)
                placed.append(target)
                seen.add(key)
            try:
                for target in fresh[:self._room_for(len(fresh))]:
                    try:
                        state = self._new_tensor(DEVICE)
                    except torch.cuda.OutOfMemoryError:
                        break  # the rest get no place: written elsewhere, stored after the launch if there is room
                    entry = Entry(target.key, target.tokens, state, [False] * self._geometry.num_layers, DEVICE,
                                  self._clock())
                    self._pending += entry.nbytes
                    target.state, target.entry, target.new = entry.state[layer], entry, True
            except BaseException:
                self.release(placed)
                raise
            return placed

    def _in_place(self, key: str, tokens: int, layer: int, repeated: bool) -> Optional[CheckpointTarget]:
        """``key``'s target when it is not a new entry: its present entry's layer, or no
        place (state None); None when it wants a new entry."""
        old = self._entries.get(key)
        if not repeated and (old is None or old.tokens != tokens):
            return None
        if repeated or old.tier != DEVICE or old.pins or old.have[layer]:
            return CheckpointTarget(key, tokens, layer, None)
        return CheckpointTarget(key, tokens, layer, old.state[layer], old)

    def _room_for(self, count: int) -> int:
        """How many of ``count`` new device entries fit, room made for as many as it can be."""
        count = min(count, self._budget[DEVICE] // self.entry_bytes)
        if count == 0 or self._make_room(DEVICE, count * self.entry_bytes):
            return count
        free = self._budget[DEVICE] - self._bytes(DEVICE) - self._pending
        return max(0, min(count, free // self.entry_bytes))

    def commit(self, target: CheckpointTarget, written: Optional[torch.Tensor] = None) -> None:
        """Store ``target`` once its launch succeeded: its layer becomes stored (a new entry
        enters the cache, replacing the key's entry at another offset; when the key gained
        an entry at the same offset since the placement, the layer is (re)written in that
        one instead, as `store_layer` does, and the new entry is let go). A target placed
        nowhere stores ``written`` [HV, V, K], the state the launch wrote elsewhere, as
        `store_layer` does; so does one whose entry changed since it was placed."""
        with self._lock:
            if not target.open:
                raise ValueError(f"checkpoint {target.key!r} was committed or released already")
            target.open = False
            if target.state is None:
                if written is None:
                    raise ValueError(f"checkpoint {target.key!r} has no place in the cache: pass the state written")
                self.store_layer(target.key, target.tokens, target.layer, written)
                return
            entry = target.entry
            assert entry is not None
            if target.new:
                self._pending -= entry.nbytes
                old = self._entries.get(target.key)
                if old is not None and old.tokens == target.tokens:  # arrived meanwhile: (re)write its layer
                    self.store_layer(target.key, target.tokens, target.layer, target.state)
                    return
                self._remove(target.key)
                self._entries[target.key] = entry  # its room was made when it was placed
            elif self._entries.get(target.key) is not entry or entry.tier != DEVICE:
                self.store_layer(target.key, target.tokens, target.layer, target.state)
                return
            entry.have[target.layer] = True
            self._touch(entry)

    def release(self, targets: Sequence[CheckpointTarget]) -> None:
        """End ``targets``' placement: the new entries of those not committed are dropped
        (a layer written in place but not committed stays unstored, so never served)."""
        with self._lock:
            for target in targets:
                if target.open and target.new and target.entry is not None:
                    self._pending -= target.entry.nbytes
                target.open = False

    def _writable(self, key: str, tokens: int, fill: Callable[[Entry], None], whole: bool = False) -> Optional[Entry]:
        """Write ``key`` at ``tokens`` by ``fill(entry)`` and return the entry written, made
        the most recent: the present one when it is at that offset on the device and not
        being restored (unless ``whole``: a ``fill`` that writes every layer always gets a
        new entry), else a new one (first a copy of the present one's layers when at the
        same offset) that enters the cache, replacing the present one, only once ``fill``
        has succeeded. None when a new entry cannot fit in either tier (the present one is
        then dropped) or its memory cannot be had. When its memory cannot be had or a copy
        into it raises (the error propagates), the present one stays, at its place in the
        LRU order, as far as its tier's budget takes it (the room made for the new one stays
        made)."""
        old = self._entries.get(key)
        if not whole and old is not None and old.tokens == tokens and old.tier == DEVICE and not old.pins:
            self._touch(old)
            fill(old)
            return old
        later: list[str] = []  # the keys more recent than the present entry
        if old is not None:
            keys = list(self._entries)
            later = keys[keys.index(key) + 1:]
            self._remove(key)
        tier = next((t for t in TIERS if self._make_room(t, self.entry_bytes)), None)
        if tier is None:  # refused: it never entered a tier, so it is no eviction
            return None
        try:
            state = self._new_tensor(tier)
        except torch.cuda.OutOfMemoryError:
            self._put_back(old, later)
            return None
        entry = Entry(key, tokens, state, [False] * self._geometry.num_layers, tier, self._clock())
        try:
            if not whole and old is not None and old.tokens == tokens:
                entry.state.copy_(old.state)
                entry.have = list(old.have)
            fill(entry)
        except BaseException:
            self._put_back(old, later)
            raise
        self._entries[key] = entry
        return entry

    def _put_back(self, old: Optional[Entry], later: list[str]) -> None:
        """Hold ``old`` (when not None) again, taken out (`_remove`) when the keys ``later``
        were the more recent ones, before those still held, as far as its tier's budget
        takes it (room is made for it: see `_make_room`)."""
        if old is None or not self._make_room(old.tier, old.nbytes):
            return
        self._entries[old.key] = old
        for key in later:
            if key in self._entries:
                self._entries.move_to_end(key)

    def _new_tensor(self, tier: str) -> torch.Tensor:
        g = self._geometry
        if tier == DEVICE:
            return torch.empty(g.slot_shape, dtype=g.dtype, device=g.device)
        return torch.empty(g.slot_shape, dtype=g.dtype, pin_memory=g.device.type == "cuda")

    def _check_state(self, state: torch.Tensor, shape: tuple[int, ...]) -> None:
        g = self._geometry
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != tuple(shape) or state.dtype != g.dtype:
            got = f"{state.dtype}{list(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"a cached state must be {g.dtype_name}{list(shape)}, got {got}")

    # -- budgets -----------------------------------------------------------------------

    def _bytes(self, tier: str) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.tier == tier)

    def _used(self, tier: str) -> int:
        """Bytes counted against ``tier``'s budget: its entries', and on the device the new
        entries placed for a launch (`place`)."""
        return self._bytes(tier) + (self._pending if tier == DEVICE else 0)

    def _make_room(self, tier: str, incoming: int) -> bool:
        """Evict least recently used, unpinned entries of ``tier`` until ``incoming`` more
        bytes fit its budget (device entries move to the host tier when it can take them);
        whether they fit. Pinned entries stay, so a tier full of them takes nothing."""
        if incoming > self._budget[tier]:
            return False
        used = self._used(tier)
        for entry in [e for e in self._entries.values() if e.tier == tier]:
            if used + incoming <= self._budget[tier]:
                break
            if entry.pins:
                continue
            used -= entry.nbytes
            self._evicted(tier)
            if tier == DEVICE and self._make_room(HOST, entry.nbytes):
                moved = self._new_tensor(HOST)
                moved.copy_(entry.state)
                entry.state, entry.tier = moved, HOST
            else:
                del self._entries[entry.key]
        return used + incoming <= self._budget[tier]

    def _evicted(self, tier: str) -> None:
        self._counters.evictions[tier] += 1
        if self._on_evict is not None:
            self._on_evict(tier)

    # -- reading -----------------------------------------------------------------------

    def _best(self, keys: Sequence[str]) -> Optional[tuple[int, Entry]]:
        for key in keys:
            _check_key(key)
        best: Optional[tuple[int, Entry]] = None
        for position, key in enumerate(keys, start=1):
            entry = self._entries.get(key)
            if entry is not None and entry.complete and (best is None or entry.tokens >= best[1].tokens):
                best = (position, entry)
        return best

    def peek(self, keys: Sequence[str]) -> PrefixMatch:
        """What `restoring` would match among ``keys`` now (not a use, nothing pinned)."""
        with self._lock:
            best = self._best(keys)
            return PrefixMatch() if best is None else PrefixMatch(best[0], best[1].key, best[1].tokens)

    @contextmanager
    def restoring(self, keys: Sequence[str]) -> Iterator[Restore]:
        """The longest complete entry among ``keys`` (the caller's keys in prompt order;
        the most tokens wins, the later key on a tie), pinned and made the most recent for
        the duration: copy ``Restore.state`` into a slot inside the ``with``."""
        with self._lock:
            best = self._best(keys)
            if best is None:
                held = Restore(PrefixMatch(), None)
            else:
                position, entry = best
                entry.pins += 1
                self._touch(entry)
                held = Restore(PrefixMatch(position, entry.key, entry.tokens), entry.state, entry.tier)
        try:
            yield held
        finally:
            if best is not None:
                with self._lock:
                    best[1].pins -= 1

    def promote(self, key: str) -> bool:
        """Move the host-tier entry ``key`` up to the device tier (a hit made it the most
        recent), the device tier's least recently used entries moving down to make room.
        The copy up is made first, so the device holds one entry over its budget for that
        long and the host tier has the promoted entry's room for what moves down. Whether it
        moved: not when there is no such host-tier entry, it is being restored, or no room
        can be made (every device entry in the way pinned)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.tier != HOST or entry.pins or entry.nbytes > self._budget[DEVICE]:
                return False
            host = entry.state
            device = self._new_tensor(DEVICE)
            device.copy_(host)  # before the entry holds it: a copy that raises leaves the entry on the host
            entry.state, entry.tier = device, DEVICE
            entry.pins += 1  # not the one to move back down
            try:
                if self._make_room(DEVICE, 0):
                    return True
                entry.state, entry.tier = host, HOST
                return False
            finally:
                entry.pins -= 1

    def info(self, key: str) -> Optional[PrefixInfo]:
        """The entry ``key``'s info (not a use), or None when there is none."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else self._info(entry)

    def drop(self, key: str) -> bool:
        """Remove the entry ``key``; whether there was one. A restore holding it finishes
        with the state it holds."""
        with self._lock:
            return self._remove(key)

    def stats(self) -> dict[str, TierStats]:
        """Entries, bytes and budget of each tier."""
        with self._lock:
            return {tier: TierStats(sum(1 for e in self._entries.values() if e.tier == tier), self._bytes(tier),
                                    self._budget[tier]) for tier in TIERS}

    def evictions(self) -> dict[str, int]:
        """Entries that left each tier for lack of room (device: moved to the host tier or
        dropped; host: dropped), since the start. Not a new entry refused for lack of room
        (it never entered a tier), nor anything `replace_all` leaves out."""
        with self._lock:
            return dict(self._counters.evictions)

    def keys(self) -> list[str]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._entries)

    # -- persistence (`state_store.prefix_snapshot`) -------------------------------------

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (for a snapshot: read, never change them)."""
        with self._lock:
            return list(self._entries.values())

    def now(self) -> float:
        """The present time on the cache's clock."""
        return self._clock()

    def wall_time(self, clock_time: float) -> float:
        """Unix seconds of a time on the cache's clock."""
        return clock_time + self._wall_offset

    def replace_all(self, loaded: Sequence[tuple[str, int, list[bool], float, torch.Tensor]]) -> None:
        """Replace every entry with ``loaded`` (key, tokens, layers stored, idle seconds,
        state [L, HV, V, K] on the host), least recently used first, as far as the budgets
        take them: the most recent first, each in the first tier with room for it (device,
        then host; a key given twice: its later entry). Nothing moves down or is dropped to
        make room, so no eviction is counted; what finds no room is left out."""
        with self._lock:
            self._entries.clear()
            now = self._clock()
            for key, tokens, have, idle, state in reversed(loaded):
                if key not in self._entries:
                    self._load(key, tokens, have, now - idle, state)

    def _load(self, key: str, tokens: int, have: list[bool], last_used: float, state: torch.Tensor) -> None:
        """Hold ``state`` [L, HV, V, K] (pool dtype, any device) as the entry ``key``, less
        recent than every entry held, in the first tier with room for it (nothing is moved
        to make room); left out when neither has room or its memory cannot be had."""
        tier = next((t for t in TIERS if self._used(t) + self.entry_bytes <= self._budget[t]), None)
        if tier is None:
            return
        try:
            tensor = self._new_tensor(tier)
        except torch.cuda.OutOfMemoryError:
            return
        tensor.copy_(state)
        self._entries[key] = Entry(key, tokens, tensor, list(have), tier, last_used)
        self._entries.move_to_end(key, last=False)

    # -- internals -----------------------------------------------------------------------

    def _touch(self, entry: Entry) -> None:
        entry.last_used = self._clock()
        self._entries.move_to_end(entry.key)

    def _remove(self, key: str) -> bool:
        return self._entries.pop(key, None) is not None

    def _info(self, entry: Entry) -> PrefixInfo:
        return PrefixInfo(entry.key, entry.tokens, sum(entry.have), entry.complete, entry.nbytes, entry.tier,
                          self.wall_time(entry.last_used))


def _check_tokens(tokens: int) -> int:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(f"an entry's tokens must be a non-negative integer, got {tokens!r}")
    return tokens
