"""`StatePool`: the GPU-resident (or CPU) pool of KDA recurrent states behind opaque slot ids."""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import operator
import threading
import time
from typing import Callable, Optional, Sequence, TypeVar, Union

import numpy as np
import torch

from . import snapshot, transfer
from .errors import GeometryMismatch, PoolError, PoolFull, UnknownSlot
from .geometry import PoolGeometry
from .ids import check_prefix, new_slot_id
from .memory import available_bytes
from .records import PoolStats, SlotInfo
from .row_map import RowMap, Rows

_T = TypeVar("_T")


SNAPSHOT_PART_BYTES = 64 << 20
"""The most bytes of the pool a snapshot brings to the host in one copy."""


def consecutive_runs(rows: Sequence[int], most: int) -> list[tuple[int, int]]:
    """``rows`` as [first, end) ranges of consecutive ascending values, in order, each at
    most ``most`` long: a whole-pool copy takes one slice per range instead of one per row."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and row == runs[-1][1] and row - runs[-1][0] < most:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


@dataclasses.dataclass(eq=False)  # identity: `_resolve_all` looks for None among hundreds in C
class _Slot:
    """A live slot: ``created`` in unix seconds, ``last_used`` on the pool's clock (its token
    counts are the pool's, by row: `StatePool._tokens`)."""

    row: int
    created: float
    last_used: float
    state_lost: bool = False


_ROW, _LAST_USED, _STATE_LOST = (operator.attrgetter(name) for name in ("row", "last_used", "state_lost"))


@dataclasses.dataclass(eq=False)
class SlotGroup:
    """Slots a caller names run after run (a prepared prefill's), resolved once
    (`StatePool.group`): their ``ids`` and slot ``rows`` in order (and as an int64 array,
    ``index``: the pool's passes over hundreds of slots take it). Opaque otherwise: the pool
    says whether it still vouches for them (`StatePool.group_live`) and counts their tokens
    without resolving them again (`StatePool.record_group_tokens`)."""

    ids: tuple[str, ...]
    rows: list[int]
    index: np.ndarray
    _slots: list[_Slot] = dataclasses.field(repr=False)
    _generation: int = dataclasses.field(repr=False)  # the pool's generation when they were resolved
    _used_at: float = dataclasses.field(repr=False)  # the pool clock's time when all were last marked used


def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` holding the pool's lock."""

    @functools.wraps(method)
    def wrapper(self: "StatePool", *args, **kwargs) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class StatePool:
    """Recurrent states of many sequences in one tensor, handed out as slots.

    A slot is one slot row (0..num_slots-1) across all layers; its public id is an opaque
    string, ``id_prefix`` then 128 random bits, never equal to a live id (reissuing a dead
    one has probability 2**-128). A slot row is never mapped by two live ids. The states
    live in ``storage``, [R, num_heads, head_v_dim, head_k_dim] (V-first, K contiguous),
    float32 or bfloat16, on ``device``, allocated once: R = num_layers * num_slots storage
    rows hold the slots' states (where each (layer, slot row) lives: a `RowMap`) and
    ``spare_rows`` more (default num_slots) let a launch write new states beside the old
    ones and commit by moving the slots' rows (`take_spares` or `launch_rows`,
    `commit_rows`, `return_spares`). `image` is the logical pool [L, S, HV, V, K].

    Slots idle (not used by rows, read_state, write_state, fork, export, import_,
    record_tokens) for more than ``ttl`` seconds of ``clock`` are freed: lazily, on access
    to the id, and by `sweep`; an expiry hook (`set_expiry_hook`) hears of them first.
    Every method holds ``lock`` (a re-entrant lock the caller may also hold, e.g. across a
    kernel launch on `storage`).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        ttl: Optional[float] = None,
        clock: Callable[[], float] = time.monotonic,
        id_prefix: str = "",
        spare_rows: Optional[int] = None,
    ) -> None:
        geometry = PoolGeometry(
            num_layers, num_slots, num_heads, head_k_dim, head_v_dim, dtype, torch.device(device)
        )
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < math.inf
        ):
            raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        self._id_prefix = check_prefix(id_prefix)
        spares = num_slots if spare_rows is None else spare_rows
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"spare_rows must be a non-negative integer or None, got {spare_rows!r}")
        _check_fits(geometry, num_layers * num_slots + spares)  # before the row map's host arrays of that size
        self._map = RowMap(num_layers, num_slots, spares)
        self._storage = torch.zeros((self._map.storage_rows, *geometry.shape[2:]), dtype=dtype,
                                    device=geometry.device)
        self._geometry = dataclasses.replace(geometry, device=self._storage.device)
        self._ttl = ttl
        self._clock = clock
        self._wall_offset = time.time() - clock()
        self._lock = threading.RLock()
        self._slots: dict[str, _Slot] = {}
        self._tokens = np.zeros((num_slots, num_layers), dtype=np.int64)  # [slot row, layer]: a live slot's counts
        self._free_rows = list(range(num_slots))  # a min-heap: lowest free row first
        self._allocations = self._frees = self._expiries = 0
        self._generation = 0  # `generation`
        self._expiry_hook: Optional[Callable[[list[str]], None]] = None

    def set_expiry_hook(self, hook: Optional[Callable[[list[str]], None]]) -> None:
        """Have ``hook(slot_ids)`` called, holding the lock, before slots idle past the ttl
        are freed (lazily or by `sweep`): a journal announces them as it does a free. When
        it raises, none of them is freed and the error propagates from the method that
        found them (they expire at a later look). None: no hook."""
        self._expiry_hook = hook

    @property
    def generation(self) -> int:
        """A counter that moves whenever a live slot stops being live (freed, swept, the id
        map restored) or is flagged lost: slots found live and sound (`group`) at one
        generation still are while it has not moved and none has idled past the ttl (an
        idle slot expires lazily, when next resolved: no generation moves before), so a
        caller checking the same slots again and again (a prepared prefill's runs) may skip
        the check until then: `group_live` checks both. Read it before the check it vouches
        for."""
        return self._generation

    @property
    def geometry(self) -> PoolGeometry:
        return self._geometry

    @property
    def storage(self) -> torch.Tensor:
        """The storage rows, [R, HV, V, K] (the kernels' pool): a layer's slot rows are
        `layer_rows` of it; kernels update them in place or write new states to spares."""
        return self._storage

    @property
    def spare_rows(self) -> int:
        """How many spare rows the pool has (free or taken): the most one launch can take."""
        return self._map.num_spares

    @property
    def free_spare_rows(self) -> int:
        """How many spare rows are free now (all of them between launches)."""
        return self._map.spare_count

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @_locked
    def image(self) -> torch.Tensor:
        """A copy of the logical pool, [L, S, HV, V, K], on the pool's device: what a whole-pool
        snapshot holds (free slot rows too)."""
        return self._storage.index_select(0, self._slot_index(self._map.all_rows())).view(self._geometry.shape)

    @_locked
    def layer_rows(self, layer: int, rows: Rows) -> np.ndarray:
        """Storage rows of slot ``rows`` (`rows`) on ``layer``, in order (int64): the kernels' indices."""
        return self._map.rows_of_layer(self._layer_index(layer), rows)

    @_locked
    def launch_rows(self, layer: int, rows: Rows, spares: bool = True) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """A launch's rows under one lock: the storage rows of slot ``rows`` on ``layer``
        (`layer_rows`) and, with ``spares``, as many spare rows for it to write its new
        states to (`take_spares`: each goes back by `commit_rows` or `return_spares`), else
        None (also when fewer are free: the launch then updates rows in place)."""
        read = self._map.rows_of_layer(self._layer_index(layer), rows)
        return read, self._map.take_spares(len(read)) if spares else None

    @_locked
    def take_spares(self, count: int) -> Optional[np.ndarray]:
        """``count`` spare storage rows (int64) for a launch to write new states to, or None when
        fewer are free (the launch then updates rows in place). Each goes back by
        `commit_rows` or `return_spares`."""
        return self._map.take_spares(count)

    @_locked
    def return_spares(self, spares: Rows) -> None:
        """Spare rows of `take_spares` that no slot takes (a refused launch's)."""
        self._map.give_back(spares)

    @_locked
    def commit_rows(self, layer: int, rows: Rows, read: Rows, written: Rows) -> None:
        """Slot ``rows`` of ``layer`` now hold the states a launch wrote to the spare rows
        ``written``; the rows ``read`` (their `layer_rows` when the launch took them)
        become spare. No copy. ValueError, nothing committed and ``written`` handed back,
        when a row moved in between (the caller keeps the slots from other updates:
        `SlotOrdering`). Does not count as a use (the launch's `rows` did)."""
        self._map.commit(self._layer_index(layer), rows, read, written)

    @_locked
    def alloc(self, count: int = 1) -> list[str]:
        """Allocate ``count`` slots with zero state on every layer, all or none."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        rows = self._filled_rows(count, lambda rows: self._storage.index_fill_(
            0, self._slot_index([r for row in rows for r in self._map.rows_of_slot(row)]), 0))
        return [self._issue(row, 0) for row in rows]

    @_locked
    def alloc_copies(self, state: torch.Tensor, count: int, tokens_per_layer: Sequence[int]) -> list[str]:
        """Allocate ``count`` slots each holding ``state`` [L, HV, V, K] (pool dtype, any
        device) on every layer and counting ``tokens_per_layer``, all or none: a restore.
        The copy writes every layer of the rows, so they are not zeroed first. Shape and
        dtype are checked first (GeometryMismatch); a copy that fails hands the rows back
        unissued (a row's old contents never show: every allocation writes all of a row
        before its id exists)."""
        self._check_state(state)
        tokens = [int(n) for n in tokens_per_layer]
        if len(tokens) != self._geometry.num_layers or any(n < 0 for n in tokens):
            raise ValueError(f"tokens_per_layer must be {self._geometry.num_layers} non-negative counts, got {tokens}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")

        def fill(rows: list[int]) -> None:
            self._write_slot(rows[0], state)
            if rows[1:]:  # from the pool's own copy (one transfer from a host state)
                first = self._storage.index_select(0, self._slot_index(self._map.rows_of_slot(rows[0])))
                for row in rows[1:]:
                    self._storage.index_copy_(0, self._slot_index(self._map.rows_of_slot(row)), first)

        return [self._issue(row, tokens) for row in self._filled_rows(count, fill)]

    @_locked
    def free(self, slot_id: str) -> None:
        """Free a slot; its row returns to the free list. UnknownSlot if it is not live."""
        self._resolve(slot_id)
        self._release(slot_id)
        self._frees += 1

    @_locked
    def fork(self, slot_id: str) -> str:
        """A new slot holding a copy of ``slot_id``'s state on every layer (and its token
        counts): prefix reuse. The two are independent afterwards. A fork refused (PoolFull)
        or whose copy fails changes nothing, not even the source's last use."""
        source = self._resolve(slot_id)
        last_used, source.last_used = source.last_used, self._clock()  # not idle while rows are found
        try:
            row, = self._filled_rows(1, lambda rows: self._write_slot(rows[0], self._read_slot(source.row)))
        except BaseException:
            source.last_used = last_used
            raise
        return self._issue(row, self._tokens[source.row], source.state_lost)

    @_locked
    def contains(self, slot_id: str) -> bool:
        """Whether ``slot_id`` is live (does not count as a use)."""
        try:
            self._resolve(slot_id)
        except UnknownSlot:
            return False
        return True

    @_locked
    def slot_ids(self) -> list[str]:
        """The live slot ids."""
        self._expire_idle()
        return list(self._slots)

    @_locked
    def rows(self, slot_ids: Sequence[str]) -> list[int]:
        """Pool rows of ``slot_ids``, in order (the kernels' ``initial_state_indices``).

        Raises UnknownSlot for the first id that is not live, having resolved none;
        otherwise marks every slot used.
        """
        if isinstance(slot_ids, str):
            raise TypeError("rows() takes a sequence of slot ids, not one id")
        slots = self._resolve_all(slot_ids)
        now = self._clock()
        for slot in slots:
            slot.last_used = now
        return list(map(_ROW, slots))

    @_locked
    def read_state(self, slot_id: str) -> torch.Tensor:
        """A copy of the slot's state, [L, HV, V, K] in the pool dtype, on the pool device."""
        return self._read_slot(self._touch(slot_id).row)

    @_locked
    def write_state(self, slot_id: str, state: torch.Tensor) -> None:
        """Copy ``state`` [L, HV, V, K] (pool dtype, any device) into the slot.

        Shape and dtype are checked first (GeometryMismatch). Token counts are left alone.
        A copy that fails changes nothing when it failed before writing the slot's rows,
        else flags the slot lost (`_overwrite`).
        """
        self._check_state(state)
        self._overwrite(slot_id, state)

    @_locked
    def export(self, slot_id: str) -> bytes:
        """The slot's state as safetensors bytes (see `state_store.transfer`)."""
        slot = self._touch(slot_id)
        layers = [self._storage[r] for r in self._map.rows_of_slot(slot.row)]
        return transfer.encode(self._geometry, layers, self._tokens[slot.row].tolist())

    @_locked
    def import_(self, data: Union[bytes, bytearray, memoryview], slot_id: Optional[str] = None) -> str:
        """Load an `export` into a new slot (``slot_id`` None) or over a live slot; returns
        the slot id. Everything is checked first: on any error nothing changes
        (UnknownSlot, GeometryMismatch, SnapshotError for bytes that are not an export,
        PoolFull). A copy over a live slot that fails once it may have written some of the
        slot's rows flags the slot lost, its token counts left alone (`_overwrite`)."""
        if slot_id is not None:
            self._resolve(slot_id)
        state, tokens = transfer.decode(data, self._geometry)
        tokens = tokens if tokens is not None else [0] * self._geometry.num_layers
        if slot_id is None:
            row, = self._filled_rows(1, lambda rows: self._write_slot(rows[0], state))
            return self._issue(row, tokens)
        self._tokens[self._overwrite(slot_id, state).row] = tokens
        return slot_id

    @_locked
    def group(self, slot_ids: Sequence[str]) -> tuple[SlotGroup, Optional[str]]:
        """The slots of ``slot_ids`` resolved in one pass under one lock (a launch's check of
        hundreds of slots), as a `SlotGroup` (every one marked used now; its ``rows`` are the
        launch's slot rows), and the first of them flagged state_lost, or None. UnknownSlot
        for the first id that is not live, having resolved none."""
        if isinstance(slot_ids, str):
            raise TypeError("a sequence of slot ids is needed, not one id")
        slots = self._resolve_all(slot_ids)  # (an expiry found here raises, having moved the generation)
        now = self._clock()
        for slot in slots:
            slot.last_used = now
        lost = list(map(_STATE_LOST, slots))
        rows = list(map(_ROW, slots))
        return (SlotGroup(tuple(slot_ids), rows, np.array(rows, dtype=np.int64), slots, self._generation, now),
                slot_ids[lost.index(True)] if True in lost else None)

    def group_live(self, group: SlotGroup) -> bool:
        """Whether every slot of ``group`` is still live and sound as `group` found it: no
        slot of the pool stopped being live or was flagged lost since (the `generation`
        stands) and none can have idled past the ttl (all were used at once, no longer than
        the ttl ago). When False, resolve them again (`group`: UnknownSlot or the lost one)."""
        return group._generation == self._generation and (
            self._ttl is None or self._clock() - group._used_at <= self._ttl)

    @_locked
    def use_group(self, group: SlotGroup) -> bool:
        """`group_live`, and when it holds, with a ttl, every slot of ``group`` marked used
        now: work that found its group live then cannot see one of its slots expire under
        it (another request's lazy expiry, `sweep`) before it counts its tokens
        (`record_group_tokens`). Without a ttl nothing expires: no pass over the slots."""
        if not self.group_live(group):
            return False
        if self._ttl is not None:
            now = self._clock()
            for slot in group._slots:
                slot.last_used = now
            group._used_at = now
        return True

    @_locked
    def record_group_tokens(self, group: SlotGroup, layer: int, counts: Rows) -> None:
        """`record_tokens_many` for a `group` the pool vouched for (`group_live`) at the start
        of the work it counts (whose caller held its slots since): ``counts[i]`` tokens
        (non-negative ints, one per slot, the caller's promise: a sequence or an int64
        array) added on ``layer`` to slot i, every slot marked used. Resolves nothing, so it
        raises nothing for a slot."""
        layer = self._layer_index(layer)
        if len(group.rows) == 1:  # a lone slot (a one-sequence launch): a scalar add, no ufunc set up
            self._tokens[group.rows[0], layer] += counts[0]
        else:  # rows distinct: one add each (half the time of a fancy index's `+=`)
            np.add.at(self._tokens[:, layer], group.index, counts)
        now = self._clock()
        for slot in group._slots:
            slot.last_used = now
        group._used_at = now

    @_locked
    def record_tokens(self, slot_id: str, layer: int, count: int) -> None:
        """Add ``count`` tokens to the slot's count on ``layer``."""
        layer = self._layer_index(layer)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        self._tokens[self._touch(slot_id).row, layer] += count

    @_locked
    def record_tokens_many(self, slot_ids: Sequence[str], layer: int, counts: Sequence[int]) -> None:
        """`record_tokens` for each of ``slot_ids`` with its ``counts`` entry, under one lock
        (a decode step names hundreds of slots). Checks every count and resolves every id
        before it changes any."""
        layer = self._layer_index(layer)
        if len(slot_ids) != len(counts):
            raise ValueError(f"{len(slot_ids)} slot ids but {len(counts)} counts")
        if counts and (not set(map(type, counts)) <= {int} or min(counts) < 0):  # C loops: hundreds of counts
            raise ValueError(f"counts must be non-negative integers, got {list(counts)[:8]}")
        slots = self._resolve_all(slot_ids)
        now = self._clock()
        for slot in slots:
            slot.last_used = now
        n = len(slots)  # distinct slots (a launch's): one add each; arrays built in C loops
        self._tokens[np.fromiter(map(_ROW, slots), np.int64, n), layer] += np.fromiter(counts, np.int64, n)

    @_locked
    def first_lost(self, slot_ids: Sequence[str]) -> Optional[str]:
        """The first of ``slot_ids`` flagged state_lost (`mark_lost`), or None; UnknownSlot
        for the first id that is not live (every id is resolved first, like `rows`). One
        lock for all of them; not a use."""
        lost = list(map(_STATE_LOST, self._resolve_all(slot_ids)))
        return slot_ids[lost.index(True)] if True in lost else None

    @_locked
    def mark_lost(self, slot_ids: Sequence[str]) -> None:
        """Flag slots whose state can no longer be trusted (an in-place update on their rows
        failed midway). Resolves all ids first, like `rows`; does not count as a use."""
        if isinstance(slot_ids, str):
            raise TypeError("mark_lost() takes a sequence of slot ids, not one id")
        for slot in [self._resolve(slot_id) for slot_id in slot_ids]:
            slot.state_lost = True
        self._generation += 1

    @_locked
    def slot_info(self, slot_id: str) -> SlotInfo:
        """The slot's metadata (does not count as a use)."""
        return self._info(slot_id, self._resolve(slot_id))

    @_locked
    def sweep(self) -> list[str]:
        """Free every slot idle for more than ttl; returns their ids ([] when ttl is None)."""
        return self._expire_idle()

    @_locked
    def snapshot(self, path: snapshot.PathLike, generation: int = 0) -> None:
        """Write the whole pool and its id map to ``path`` atomically, numbered
        ``generation`` (see `state_store.snapshot`)."""
        self._expire_idle()
        infos = [self._info(slot_id, slot) for slot_id, slot in self._slots.items()]
        row_bytes = self._storage[0].numel() * self._storage.element_size()
        runs = consecutive_runs(self._map.all_rows(), max(1, SNAPSHOT_PART_BYTES // row_bytes))
        parts = [self._storage[first:end] for first, end in runs]
        snapshot.write(path, self._geometry, parts, infos, self._wall(self._clock()), generation)

    @_locked
    def restore(self, path: snapshot.PathLike) -> snapshot.Stamp:
        """Replace the pool's contents and id map with a snapshot's, verified in full first:
        on any error (SnapshotError, GeometryMismatch) the pool is left as it was. Returns
        the snapshot's stamp (when it was taken, its generation). Only a copy into the
        storage that fails midway (on the device) leaves it partly overwritten: then every
        live slot keeps its id, flagged lost, and the error propagates (a later restore may
        succeed).

        Each slot keeps the idle time it had when the snapshot was taken; time between
        snapshot and restore does not count towards its ttl.

        PoolError, nothing changed, while a launch holds spare rows (`take_spares` not yet
        committed or returned): the map's reset would free them under it, and its commit or
        return would then hand one storage row out twice.
        """
        if self._map.spare_count != self._map.num_spares:
            raise PoolError(f"cannot restore while a launch holds {self._map.num_spares - self._map.spare_count} "
                            "spare row(s): commit or return them first")
        read = snapshot.read(path, self._geometry)
        infos, saved_at = read.slots, read.stamp.saved_at
        self._map.reset()
        L, S = self._geometry.num_layers, self._geometry.num_slots
        try:
            self._storage[:L * S].view(self._geometry.shape).copy_(read.pool)
        except BaseException:
            for slot in self._slots.values():
                slot.state_lost = True
            self._generation += 1
            raise
        now = self._clock()
        self._slots = {
            info.slot_id: _Slot(
                row=info.row,
                created=info.created,
                last_used=now - max(0.0, saved_at - info.last_used),
                state_lost=info.state_lost,
            )
            for info in infos
        }
        for info in infos:
            self._tokens[info.row] = info.tokens_per_layer
        used = {info.row for info in infos}
        self._free_rows = [row for row in range(self._geometry.num_slots) if row not in used]
        self._generation += 1
        return read.stamp

    @_locked
    def stats(self) -> PoolStats:
        """Capacity and counters (expired slots are freed first)."""
        self._expire_idle()
        return PoolStats(
            capacity=self._geometry.num_slots,
            free=len(self._free_rows),
            used=len(self._slots),
            allocations=self._allocations,
            frees=self._frees,
            expiries=self._expiries,
            bytes_per_slot=self._geometry.bytes_per_slot,
            state_lost=sum(slot.state_lost for slot in self._slots.values()),
        )

    def _layer_index(self, layer: int) -> int:
        if isinstance(layer, bool):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        try:
            index = operator.index(layer)
        except TypeError:
            raise ValueError(f"layer must be an integer, got {layer!r}") from None
        if not 0 <= index < self._geometry.num_layers:
            raise IndexError(f"layer {index} out of range: the pool has {self._geometry.num_layers} layers")
        return index

    def _resolve(self, slot_id: str) -> _Slot:
        """The live slot ``slot_id``; an idle-expired one is freed and reported unknown."""
        slot = self._slots.get(slot_id) if isinstance(slot_id, str) else None
        if slot is None:
            raise UnknownSlot(slot_id)
        if self._ttl is not None and self._clock() - slot.last_used > self._ttl:
            self._expire([slot_id])
            raise UnknownSlot(slot_id)
        return slot

    def _resolve_all(self, slot_ids: Sequence[str]) -> list[_Slot]:
        """`_resolve` of each of ``slot_ids``, in order, in C loops (a launch names hundreds):
        one `map` of the id dict's ``get``; only when an id is missing or not hashable, or a
        slot has been idle past the ttl, the per-id `_resolve`, which raises for the first."""
        try:
            slots = list(map(self._slots.get, slot_ids))
        except TypeError:  # an unhashable id
            slots = [None]
        if None in slots or (self._ttl is not None and slots
                             and self._clock() - min(map(_LAST_USED, slots)) > self._ttl):
            return [self._resolve(slot_id) for slot_id in slot_ids]
        return slots

    def _touch(self, slot_id: str) -> _Slot:
        slot = self._resolve(slot_id)
        slot.last_used = self._clock()
        return slot

    def _check_state(self, state: torch.Tensor) -> None:
        """TypeError unless a tensor; GeometryMismatch unless [L, HV, V, K] in the pool dtype."""
        expected = {"shape": list(self._geometry.slot_shape), "dtype": self._geometry.dtype_name}
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state must be a torch.Tensor, got {type(state).__name__}")
        if tuple(state.shape) != self._geometry.slot_shape or state.dtype != self._geometry.dtype:
            got = {"shape": list(state.shape), "dtype": str(state.dtype).removeprefix("torch.")}
            raise GeometryMismatch(expected, got)

    def _slot_index(self, storage_rows: list[int]) -> torch.Tensor:
        """``storage_rows`` as an index tensor on the pool's device (on a GPU from page-locked
        memory, without waiting for the work queued before it)."""
        host = torch.tensor(storage_rows, dtype=torch.int64)
        return host.pin_memory().to(self._storage.device, non_blocking=True) if self._storage.is_cuda else host

    def _read_slot(self, row: int) -> torch.Tensor:
        """A copy of slot row ``row``'s state on every layer, [L, HV, V, K], on the pool's device."""
        return self._storage.index_select(0, self._slot_index(self._map.rows_of_slot(row)))

    def _write_slot(self, row: int, state: torch.Tensor,
                    on_scatter_failure: Optional[Callable[[], None]] = None) -> None:
        """Copy ``state`` [L, HV, V, K] (pool dtype, any device) into slot row ``row``, complete
        when this returns: one scatter into its rows on every layer, from the host after one
        transfer to the pool's device (a transient [L, HV, V, K]: one copy per layer straight
        into its row paid the copy engine's gap between transfers L times, 0.26 ms over the
        PCIe time at 48 layers on the H200). What can fail before the scatter (the index's
        upload, the transfer) fails before any row is written; when the scatter, or the wait
        for it, raises, some of the rows may hold the new state and others the old, and
        ``on_scatter_failure()`` (when given) runs before the error propagates."""
        rows = self._slot_index(self._map.rows_of_slot(row))
        on_host = state.device != self._storage.device
        source = state.to(self._storage.device, non_blocking=True) if on_host else state
        try:
            self._storage.index_copy_(0, rows, source)
            if on_host and self._storage.is_cuda:
                torch.cuda.current_stream(self._storage.device).synchronize()  # the host state may change after
        except BaseException:
            if on_scatter_failure is not None:
                on_scatter_failure()
            raise

    def _overwrite(self, slot_id: str, state: torch.Tensor) -> _Slot:
        """Write ``state`` (checked) over the live slot ``slot_id`` (`_write_slot`) and mark it
        used and sound; returns it. A copy that fails before the slot's rows are written
        changes nothing (no use either); one that fails after may have written some of its
        layers, so the slot is flagged lost (as `mark_lost` does) before the error propagates:
        never served as whole until a write succeeds."""
        slot = self._resolve(slot_id)

        def flag_lost() -> None:
            slot.state_lost = True
            self._generation += 1

        self._write_slot(slot.row, state, flag_lost)
        slot.last_used = self._clock()
        slot.state_lost = False
        return slot

    def _take_rows(self, count: int) -> list[int]:
        """Pop ``count`` free rows (freeing idle slots if short), or raise PoolFull."""
        if count > len(self._free_rows):
            self._expire_idle()
        if count > len(self._free_rows):
            raise PoolFull(count, len(self._free_rows))
        return [heapq.heappop(self._free_rows) for _ in range(count)]

    def _filled_rows(self, count: int, fill: Callable[[list[int]], object]) -> list[int]:
        """``count`` free rows (`_take_rows`) once ``fill(rows)`` has written their state on
        every layer, before any id maps them. When ``fill`` raises (a device copy out of
        memory), the rows go back to the free list unissued and the error propagates: a row's
        old contents never show, since every allocation writes all of a row first."""
        rows = self._take_rows(count)
        try:
            fill(rows)
        except BaseException:
            for row in rows:
                heapq.heappush(self._free_rows, row)
            raise
        return rows

    def _issue(self, row: int, tokens_per_layer: Union[int, Sequence[int], np.ndarray], state_lost: bool = False) -> str:
        """Map a new id to ``row`` (whose state the caller has set), counting
        ``tokens_per_layer`` (one count for every layer, or one per layer)."""
        slot_id = new_slot_id(self._id_prefix, self._slots)
        now = self._clock()
        self._tokens[row] = tokens_per_layer
        self._slots[slot_id] = _Slot(row, self._wall(now), now, state_lost)
        self._allocations += 1
        return slot_id

    def _release(self, slot_id: str) -> None:
        heapq.heappush(self._free_rows, self._slots.pop(slot_id).row)
        self._generation += 1

    def _expire_idle(self) -> list[str]:
        if self._ttl is None:
            return []
        now = self._clock()
        expired = [sid for sid, slot in self._slots.items() if now - slot.last_used > self._ttl]
        if expired:
            self._expire(expired)
        return expired

    def _expire(self, slot_ids: list[str]) -> None:
        """Free ``slot_ids`` (live, idle past the ttl) once the expiry hook has heard of them."""
        if self._expiry_hook is not None:
            self._expiry_hook(slot_ids)
        for slot_id in slot_ids:
            self._release(slot_id)
        self._expiries += len(slot_ids)

    def _wall(self, clock_time: float) -> float:
        """Unix seconds of a time on the pool's clock."""
        return clock_time + self._wall_offset

    def _info(self, slot_id: str, slot: _Slot) -> SlotInfo:
        return SlotInfo(
            slot_id=slot_id,
            row=slot.row,
            created=slot.created,
            last_used=self._wall(slot.last_used),
            tokens_per_layer=self._tokens[slot.row].tolist(),
            state_lost=slot.state_lost,
        )


def _check_fits(geometry: PoolGeometry, storage_rows: int) -> None:
    """Refuse, before allocating, a pool of ``storage_rows`` rows larger than the device's free memory."""
    needed = storage_rows * geometry.bytes_per_slot // geometry.num_layers
    available = available_bytes(geometry.device)
    if available is not None and needed > available:
        raise PoolError(
            f"a {geometry.dtype_name} pool of shape {list(geometry.shape)} and "
            f"{storage_rows - geometry.num_layers * geometry.num_slots} spare rows needs {needed} bytes "
            f"({needed / 2**30:.2f} GiB) on {geometry.device}, but only {available} bytes "
            f"({available / 2**30:.2f} GiB) are available"
        )
