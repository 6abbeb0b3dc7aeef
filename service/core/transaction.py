"""Transactional launches: a launch applies to every slot it touches, or leaves each as it was.

Where the pool has spare rows (`state_store.StatePool.take_spares`: the common case), the
launch writes its new states to them (`MovedRows`, the problem's ``write_indices``) and
never over the rows it reads: a request that must be refused simply does not commit
(`finish` moves the standing requests' slots onto their new rows and hands the others'
spares back), nothing is copied or written back, and a failed launch changed no slot.

Otherwise (a pool without enough spare rows), before the kernels run, `LaunchTransaction`
copies the pool rows the launch will write (one [HV, V, K] row per sequence, on the pool's
device: 2 MiB at HV = 32, K = V = 128, fp32), or the launch copies them itself as it reads
them (``saved_by_launch``: the problem's ``saved_states``; the Triton decode kernel then
stores each row as it loads it, so a decode step of 256 sequences reads its 512 MiB of rows
once instead of twice).
The kernels flag the sequences whose final state or output holds a non-finite value as
they store them (`flags`, passed as the problem's ``nonfinite``: no second read of o or
of the states); `diverged` reads the flags, the launch's one synchronization. A request
with such a sequence is rolled back (`roll_back`: not committed, or its rows written back),
so it changes nothing and is refused with `UpdateDiverged` (422) while the other requests
of the launch stand; when the launch itself fails, no slot changed (`abort`: nothing
committed, or every row written back), and only when even that fails are the slots
flagged ``state_lost``.

Finite inputs can still diverge: the recurrence multiplies the state by about |k|^2 per
token without l2norm, and v near float32's largest value overflows the update; a given log
decay > 0 (a growing state) is refused earlier, by validation.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ServiceError

log = logging.getLogger("kda_serve.core")


class UpdateDiverged(ServiceError):
    """The request's update would leave non-finite values (NaN or Inf) in a state or in o;
    it was rolled back, so its slots hold what they held before."""

    status = 422
    slug = "update-diverged"
    title = "Update diverged"

    def __init__(self, sequences: Sequence[int], slots: Sequence[Optional[str]]) -> None:
        named = [f"{i} (slot {slot!r})" if slot else str(i) for i, slot in zip(sequences, slots)]
        super().__init__(
            f"the update of sequence(s) {', '.join(named)} leaves non-finite values (NaN or Inf) in the state or o, "
            "though every input is finite (values too large, q/k without l2norm over many tokens, ...); it was "
            "rolled back: no slot of this request changed", field="sequences")
        self.sequences = list(sequences)

    def extra(self) -> dict[str, object]:
        return {**super().extra(), "sequences": self.sequences}


class LaunchFailed(ServiceError):
    """The kernels failed; every slot of the launch was restored from its copy (or, when
    that failed too, flagged state_lost: ``restored`` says which)."""

    status = 500
    slug = "launch-failed"
    title = "Kernel launch failed"

    def __init__(self, cause: BaseException, restored: bool) -> None:
        outcome = ("its slots were restored: nothing changed" if restored
                   else "its slots could not be restored and are flagged state_lost")
        super().__init__(f"the kernel launch failed ({type(cause).__name__}: {cause}); {outcome}")
        self.restored = restored


@dataclass(frozen=True)
class MovedRows:
    """Where a launch writes its N new states instead of over the rows it reads: ``rows``,
    spare rows of the pool taken for it (host ints: a list or an int64 array), and ``written`` [N] int64 on the pool's
    device holding them (or about to: a prepared launch uploads them itself); ``commit``
    moves the slots of the given sequence positions onto their new rows (the rows they
    were read from become spare), ``give_back`` returns the spare rows of the given
    positions."""

    rows: Union[Sequence[int], np.ndarray]
    written: torch.Tensor
    commit: Callable[[list[int]], None]
    give_back: Callable[[list[int]], None]


class LaunchTransaction:
    """The launch on the rows ``indices`` [N] (int64, on the pool's device) of ``layer`` (the
    pool's rows, [R, HV, V, K]). ``requests`` are the launch's requests in order, each as
    (its sequences' lengths, the slot each names, None for a new one): together N
    sequences, packed along tokens in that order.

    With ``moved`` the launch writes its new states to ``moved.written`` (`write_indices`,
    for the problem): nothing is copied, `roll_back` only marks sequences not to commit,
    and `finish` (after every refusal is known) commits the rest. Without it, copies of
    the rows are taken at construction, to write back.

    With ``saved_by_launch`` nothing is copied here: the launch must receive `saved` as its
    problem's ``saved_states`` (it fills it before it writes any row), and a launch that
    raised before it started is aborted with ``started=False`` (its rows are untouched and
    `saved` holds nothing yet). Only a launch that starts all at once or not at all (a CUDA
    graph's replay) can say which.

    With ``checks_inputs`` the flags have room for the launch's input check as well
    (`input_checks`, the problem's ``input_checks``), so that `read` brings back both in
    one copy."""

    def __init__(self, layer: torch.Tensor, indices: torch.Tensor,
                 requests: Sequence[tuple[Sequence[int], Sequence[Optional[str]]]],
                 saved_by_launch: bool = False, checks_inputs: bool = False,
                 moved: Optional[MovedRows] = None) -> None:
        self._layer = layer
        self._indices = indices
        self._requests = requests
        self._bounds = (0, *itertools.accumulate(n for lengths, _ in requests for n in lengths))
        n = len(self._bounds) - 1
        self.moved = moved
        self._dropped: set[int] = set()  # moved: positions not to commit
        self._finished = False  # moved: committed and given back
        self.saved_by_launch = saved_by_launch and moved is None
        self.saved: Optional[torch.Tensor] = None  # in place: the rows as they were, [N, HV, V, K]
        if self.saved_by_launch:  # filled by the launch
            self.saved = torch.empty((n, *layer.shape[1:]), dtype=layer.dtype, device=layer.device)
        elif moved is None:
            self.saved = layer.index_select(0, indices)  # a copy, on the device
        self._read = torch.zeros(n + 1 + checks_inputs, dtype=torch.int32, device=layer.device)
        self.flags = self._read[:n + 1]  # the launch's `nonfinite`
        self.input_checks = self._read[n + 1:] if checks_inputs else None  # its `input_checks`
        self._host_read: Optional[torch.Tensor] = None  # on a GPU: where `read` copies them (made at the first)

    @property
    def bounds(self) -> tuple[int, ...]:
        """The host offsets [0, ..., T] of the launch's N sequences (the problem's ``bounds``)."""
        return self._bounds

    @property
    def indices(self) -> torch.Tensor:
        """[N] int64 on the device: the rows the launch reads (the problem's ``indices``)."""
        return self._indices

    @property
    def write_indices(self) -> Optional[torch.Tensor]:
        """The problem's ``write_indices``: the spare rows it writes, or None (in place)."""
        return None if self.moved is None else self.moved.written

    @property
    def written(self) -> torch.Tensor:
        """[N] int64 on the device: the rows holding the launch's new states after it."""
        return self._indices if self.moved is None else self.moved.written

    def renew(self, moved: MovedRows) -> None:
        """The same transaction (its flags, captured in a graph) for the next run, writing to
        ``moved``: a prepared launch's spare rows change from run to run."""
        assert self.moved is not None and moved.written is self.moved.written, "a graph's rows stay where captured"
        self.moved, self._dropped, self._finished = moved, set(), False

    def finish(self) -> None:
        """After the launch and every refusal (`roll_back`): with moved rows, the sequences
        not rolled back committed (their slots on their new rows), the others' spare rows
        handed back. In place, nothing to do (the rows were written, or written back)."""
        if self.moved is None or self._finished:
            return
        self._finished = True  # a second finish does nothing
        n = len(self._bounds) - 1
        standing = [i for i in range(n) if i not in self._dropped] if self._dropped else list(range(n))
        dropped = sorted(self._dropped)
        try:
            if standing:
                self.moved.commit(standing)
        finally:
            if dropped:
                self.moved.give_back(dropped)

    def read(self) -> tuple[list[int], bool]:
        """`flags` as host ints and whether the input check failed (False without one), in
        one copy: the launch's one synchronization (a kernel's asynchronous failure
        surfaces here). On a GPU the copy goes to page-locked memory (kept for the next
        read: a prepared run's transaction is read once per run), queued behind the
        launch while the device still works, and the host then waits for the stream (a
        copy to pageable memory, as ``tolist`` makes, goes through the driver's staging
        buffer with the host in the loop once the device is done)."""
        if self._read.is_cuda:
            if self._host_read is None:
                self._host_read = torch.empty(self._read.shape, dtype=self._read.dtype, pin_memory=True)
            self._host_read.copy_(self._read, non_blocking=True)
            torch.cuda.current_stream(self._read.device).synchronize()
            values = self._host_read.tolist()
        else:
            values = self._read.tolist()
        n = self.flags.shape[0]
        return values[:n], any(values[n:])

    def settle(self, o: torch.Tensor, flags: Optional[list[int]] = None) -> dict[int, UpdateDiverged]:
        """After the kernels wrote o [T, HV, V], the rows and `flags` (read here, or
        given as `read` returned them): each request with a diverged sequence (`diverged`)
        rolled back, and its error, by request index."""
        refused: dict[int, UpdateDiverged] = {}
        if flags is not None and not any(flags):  # the common case: nothing flagged, no walk over the sequences
            return refused
        bad = set(self.diverged(o, flags))
        if not bad:
            return refused
        n0 = 0
        for j, (lengths, slots) in enumerate(self._requests):
            n1 = n0 + len(lengths)
            mine = [n - n0 for n in range(n0, n1) if n in bad]
            if mine:
                self.roll_back(range(n0, n1))
                refused[j] = UpdateDiverged(mine, [slots[i] for i in mine])
            n0 = n1
        return refused

    def diverged(self, o: torch.Tensor, flags: Optional[list[int]] = None) -> list[int]:
        """Positions (0..N-1) of the sequences the kernels flagged: a final state or tokens
        of ``o`` [T, HV, V] holding a non-finite value. Reading the flags (`read`, unless
        given) is the launch's one synchronization; only when a stage flagged o without
        knowing whose (flags[N]), a pass over o finds which sequences."""
        *per_sequence, unattributed = self.read()[0] if flags is None else flags
        bad = {n for n, flag in enumerate(per_sequence) if flag} if any(per_sequence) else set()
        if unattributed:
            bad |= set(self._sequences_with_nonfinite_o(o))
        return sorted(bad)

    def _sequences_with_nonfinite_o(self, o: torch.Tensor) -> list[int]:
        """Positions of the sequences whose tokens of ``o`` [T, HV, V] hold a NaN or Inf."""
        bad_tokens = (~_finite_rows(o.reshape(o.shape[0], -1))).to(torch.int64)
        counts = torch.cat([bad_tokens.new_zeros(1), torch.cumsum(bad_tokens, 0)])  # [T + 1]
        bounds = torch.tensor(self._bounds, dtype=torch.int64, device=o.device)
        flags = ((counts[bounds[1:]] - counts[bounds[:-1]]) > 0).tolist()
        return [i for i, bad in enumerate(flags) if bad]

    def roll_back(self, positions: Optional[Iterable[int]] = None) -> None:
        """Undo the launch for ``positions`` (every sequence when None): write back their
        copied rows, or with moved rows, mark them not to commit (`finish`)."""
        if self.moved is not None:
            self._dropped.update(range(len(self._bounds) - 1) if positions is None else positions)
            return
        if positions is None:
            self._layer.index_copy_(0, self._indices, self.saved)
            return
        which = torch.tensor(list(positions), dtype=torch.int64, device=self._indices.device)
        if which.numel():
            self._layer.index_copy_(0, self._indices.index_select(0, which), self.saved.index_select(0, which))

    def abort(self, cause: BaseException, mark_lost: Callable[[], None], started: bool = True) -> LaunchFailed:
        """After a failed launch: every row written back, synchronized; when that fails
        too, ``mark_lost`` flags the slots. The error to raise (logged here). A launch that
        saves the rows itself and never ``started`` wrote none: nothing to write back. With
        moved rows no slot's row was written: once the device is done with them, every
        spare row goes back."""
        try:
            if self.moved is None and (started or not self.saved_by_launch):
                self.roll_back()
            if self._layer.is_cuda:
                torch.cuda.current_stream(self._layer.device).synchronize()
            if self.moved is not None:
                self.roll_back()
                self.finish()
            restored = True
        except Exception:
            log.exception("restoring the rows of a failed launch failed")
            mark_lost()
            restored = False
        log.error("launch of %d sequence(s) failed (%s: %s); their slots %s", len(self._bounds) - 1,
                  type(cause).__name__, cause, "were restored" if restored else "are flagged state_lost")
        return LaunchFailed(cause, restored)


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[R] bool: whether row r of ``x`` [R, C] is all finite. min and max propagate NaN
    and are infinite when any value is: one pass, nothing of x's size allocated."""
    if x.numel() == 0:
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    lo, hi = torch.aminmax(x, dim=1)
    return torch.isfinite(lo) & torch.isfinite(hi)
