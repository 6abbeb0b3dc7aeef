"""Prepared prefills: one prefill's form checked once, then run many times with new values.

An engine calls the same layer with the same batch shape step after step (a decode step of
N sequences, a prefill chunk of fixed size). `PreparedPrefill` holds everything of such a
call that does not change between its runs: the checked form (`validation.validate_form`:
layer, slots, lengths, shapes, dtypes, gate), the slots' rows, the launch's device
tensors, and where its inputs come from and its outputs go (``refill`` and ``deliver``,
given by the front end that owns them). A run is then: refill the packed inputs in place,
upload the storage rows it reads and the spare rows it writes (one small copy: rows move
as launches commit), launch, synchronize once, check, deliver, then (after the reply, when
the run is on the event loop) commit: no parsing, no validation of the form, no batching,
no other host-to-device copy.

The kernels check the inputs' values as they read them (`PrefillProblem.input_checks`:
no pass of their own); the run reads the check back with the non-finite flags, in one
copy, and when it failed rolls the launch back and scans the inputs to name the one.
On a GPU the launch is a CUDA graph captured at preparation (`capture`): the transaction
(new states to spare rows, `MovedRows`; on a pool without enough spare rows, the copy of
the rows it writes, made by the decode kernel as it reads them when every sequence is one
token: ``saved_by_launch``), the flags and checks, every kernel of the pipeline
(writing o straight into the client's region when it is on the device) and the final
states' gather (there too), replayed by one call. Each graph has a memory pool of
its own (what its replays write: o, the final states, the intermediates, the copied rows
when in place), freed when the prepared prefill is released. (One pool shared by a
core's graphs, through a pool handle, failed under torch 2.11 on the H200: an allocator
assertion, ``use_count > 0``, when a graph was captured into a handle whose earlier graphs
had been released.) When capture fails the call runs the same steps eagerly, so it stays
correct (logged).
On a CPU every run is eager.

The guarantees of every prefill hold: inputs with a NaN or Inf (or a given log decay > 0)
are refused 400 and rolled back; an update that diverges is refused 422 and rolled back; a
failed launch changes no slot (`LaunchTransaction`). The core keeps per-slot ordering,
the slots' liveness and token counts around each run (`ServerCore.run_prepared`).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

import kernels
from kernels.problem import PrefillProblem, packed_problem
from state_store import SlotGroup

from .inputs import PrefillResult
from .transaction import LaunchTransaction, MovedRows
from .validation import ValidPrefill

log = logging.getLogger("kda_serve.core")

Refill = Callable[[], None]
"""Brings a run's new input values into the prepared input tensors, in place (on a GPU:
queued ahead of the launch on the device's current stream, or on a stream it waits for)."""
Deliver = Callable[[PrefillResult], None]
"""Puts a successful run's outputs where the caller wants them (its shared memory), but
those the launch writes itself (`DeviceIO`)."""


@dataclass(frozen=True)
class DeviceIO:
    """Copies a run queues on the pool's device as part of its launch (inside its CUDA
    graph), between device memory and device or page-locked host memory: ``inputs``,
    (source, destination) uint8 tensors of one size each, before the kernels (into the
    prepared input buffers); ``o`` [T, HV, V] in v's dtype and ``final_state`` [N, HV, V,
    K] in the pool's dtype: where o and the final states are copied after the kernels
    (None: `Deliver` writes them)."""

    inputs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    o: Optional[torch.Tensor] = None
    final_state: Optional[torch.Tensor] = None


RUN_PHASES = ("refill", "rows", "queue", "wait", "settle", "deliver")
"""A run's phases, in order (`PreparedRun`)."""


@dataclass(frozen=True)
class PreparedRun:
    """One run's result and the host's seconds in each of its phases (`RUN_PHASES`), one
    after the other: ``refill`` (the new inputs queued into their buffers), ``rows`` (the
    storage rows it reads and the spare rows it writes, found and taken), ``queue`` (those
    rows uploaded, the graph or the kernels queued), ``wait`` (until the flags and checks
    are read: the device's work and the one synchronization), ``settle`` (the flags and
    checks judged: the run stands), ``deliver`` (the outputs written into place). Moving
    the slots onto their new rows and counting their tokens follow (after the reply, for a
    run on the event loop: `ServerCore.run_prepared`)."""

    result: PrefillResult
    phases: tuple[float, ...]

    def server_timing(self) -> str:
        """The phases as a ``Server-Timing`` value (milliseconds)."""
        return ", ".join(f"{name};dur={s * 1000:.3f}" for name, s in zip(RUN_PHASES, self.phases))


Answer = Callable[[PreparedRun], None]
"""A front end's reply to a run that stands, given the run (`ServerCore.run_prepared`)."""


@dataclass
class _Step:
    """What one launch leaves to read after it: o [T, HV, V] in v's dtype, the final
    states [N, HV, V, K] (None when declined), the transaction (rows copied before the
    kernels, non-finite flags, the inputs' checks)."""

    o: torch.Tensor
    finals: Optional[torch.Tensor]
    transaction: LaunchTransaction


class PreparedPrefill:
    """A checked prefill (``valid``: its inputs' tensors are the buffers ``refill`` fills)
    on the slots of ``group`` (`state_store.SlotGroup`: ``valid.inputs.slots`` resolved, one
    slot row per sequence; the core renews it when the pool no longer vouches for it) of
    the pool whose storage rows are ``storage`` [R, HV, V, K],
    with the gate tensors ``A_log`` [HV] / ``dt_bias`` [HV, K] on the pool's device (or
    None), run by ``backend``; ``io``: the copies its launch makes itself; on a GPU
    captured as a CUDA graph (`capture`). With ``moves`` every run writes its new states to
    spare rows (`MovedRows`, given per run), else over the rows it reads (copied first).
    Each run is told the storage rows it reads (they move as launches commit) and uploads
    them, with its spare rows, into one device buffer the graph reads."""

    def __init__(self, valid: ValidPrefill, group: SlotGroup, storage: torch.Tensor, moves: bool,
                 A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], backend: str,
                 refill: Refill, deliver: Deliver, io: DeviceIO) -> None:
        self.valid = valid
        self.slots: list[str] = [s for s in valid.inputs.slots if s is not None]
        self.group = group
        self.keys = frozenset((s, valid.inputs.params.layer) for s in self.slots)  # `SlotOrdering.hold` takes it as is
        self.tokens = sum(valid.inputs.lengths)
        self.counts = np.array(valid.inputs.lengths, dtype=np.int64)  # each slot's tokens per run
        self.refill, self.deliver, self.io = refill, deliver, io
        self.moves = moves
        n, device = len(self.rows), storage.device
        self._row_buffer = torch.zeros(2 * n if moves else n, dtype=torch.int64, device=device)
        self._host_rows = torch.zeros(self._row_buffer.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_view = self._host_rows.numpy()  # the same memory, written by numpy
        self._indices = self._row_buffer[:n]  # the rows read (and, in place, written)
        self.written: Optional[torch.Tensor] = self._row_buffer[n:] if moves else None  # the spare rows written
        self._storage = storage
        self._gate = (A_log, dt_bias)
        self._backend = backend
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._captured: Optional[_Step] = None
        self.closed = False

    @property
    def rows(self) -> list[int]:
        """The slot rows of its sequences, in order (a live slot's row never changes)."""
        return self.group.rows

    @property
    def graphed(self) -> bool:
        """Whether runs replay a CUDA graph."""
        return self._graph is not None

    def capture(self) -> None:
        """On a GPU (on the device thread): compile and warm the kernels on scratch rows
        (as the runs call them: to spare rows or in place), then capture the launch as a
        CUDA graph; eager runs when capture fails."""
        device = self._storage.device
        if device.type != "cuda":
            return
        n = len(self.rows)
        scratch = torch.zeros((2 * n, *self._storage.shape[1:]), dtype=self._storage.dtype, device=device)
        rows = torch.arange(2 * n, dtype=torch.int64, device=device)
        warm = _scratch_moves(rows[n:]) if self.moves else None
        self._step(self._transaction(scratch, rows[:n], True, warm), scratch, rows[:n])  # compiles, caches the plan
        torch.cuda.current_stream(device).synchronize()
        graph = torch.cuda.CUDAGraph()
        inside: Optional[Exception] = None  # what failed inside the capture (ending it may raise another error)
        placeholder = _scratch_moves(self.written) if self.written is not None else None  # renewed per run
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                try:
                    self._captured = self._step(self._transaction(self._storage, self._indices, True, placeholder),
                                                self._storage, self._indices)
                except Exception as e:
                    inside = e
                    raise
        except Exception as e:
            log.warning("a prepared prefill of %d sequence(s) could not be captured as a CUDA graph; it runs "
                        "eagerly: %s: %s", len(self.rows), type(inside or e).__name__, inside or e)
            self._captured = None
            return
        self._graph = graph

    def launch(self, read: np.ndarray, moved: Optional[MovedRows], mark_lost: Callable[[], None]
               ) -> tuple[torch.Tensor, Optional[torch.Tensor], tuple[float, float, float], LaunchTransaction]:
        """One run (where the core runs device work: its device thread, or the event loop
        while that thread is idle; after ``refill``) reading the storage rows ``read`` (one
        per sequence) and, with ``moves``, writing to ``moved`` (taken for this run, handed
        on to the transaction, which commits or gives them back in every case): o [T, HV,
        V] and the final states [N, HV, V, K] (or None), complete; the host's seconds
        queueing the launch, waiting for it and settling it (`PreparedRun`'s ``queue``,
        ``wait`` and ``settle``); and its transaction, settled: the run stands, and `commit`
        moves its slots onto their new rows. InvalidRequest (400) when an input holds a NaN
        or Inf (or a given log decay > 0), UpdateDiverged (422) when the update is not
        finite: both rolled back (their spare rows given back); LaunchFailed when the
        kernels failed (no slot changed: nothing committed, or every row restored;
        ``mark_lost`` called when that failed too)."""
        step: Optional[_Step] = None
        transaction: Optional[LaunchTransaction] = None
        start = time.perf_counter()
        try:
            if self._graph is not None:
                transaction = self._captured.transaction
                if moved is not None:
                    transaction.renew(moved)
                self._upload_rows(read, moved)
                self._graph.replay()  # queues the whole launch, or raises having queued nothing
                step = self._captured
            else:
                self._upload_rows(read, moved)  # first: in place, the transaction copies the rows it reads
                transaction = self._transaction(self._storage, self._indices, False, moved)
                step = self._step(transaction, self._storage, self._indices)
            queued = time.perf_counter()
            flags, inputs_failed = transaction.read()  # the one synchronization
            read_at = time.perf_counter()
            refusal: Optional[Exception] = None
            if inputs_failed:
                transaction.roll_back()
                refusal = self.valid.values_problem()
            elif refused := transaction.settle(step.o, flags):
                refusal = refused[0]
            if refusal is not None:
                transaction.finish()  # nothing committed: the spare rows back
        except Exception as e:
            if transaction is None:
                if moved is not None:
                    moved.give_back(list(range(len(moved.rows))))
                raise
            raise transaction.abort(e, mark_lost, started=step is not None) from e
        if refusal is not None:
            raise refusal
        return step.o, step.finals, (queued - start, read_at - queued, time.perf_counter() - read_at), transaction

    @staticmethod
    def commit(transaction: LaunchTransaction, mark_lost: Callable[[], None]) -> None:
        """A standing run's slots onto the rows it wrote (`LaunchTransaction.finish`, after
        `launch`; in place, nothing to do). Should that fail (the run's hold keeps other
        work off its slots, so it cannot but for a bug), ``mark_lost`` flags them: the
        run's reply may already be out, so the slots must say their state is not what it
        promised (logged; raised)."""
        try:
            transaction.finish()
        except Exception:
            log.exception("committing a prepared run failed; its slots are flagged state_lost")
            mark_lost()
            raise

    @staticmethod
    def refuse(transaction: LaunchTransaction, mark_lost: Callable[[], None]) -> None:
        """Undo a run that stood but is refused after `launch` (its outputs could not be
        delivered): nothing committed (its spare rows given back; in place, its rows written
        back). Should that fail, ``mark_lost`` flags its slots (logged; raised)."""
        try:
            transaction.roll_back()
            transaction.finish()
        except Exception:
            log.exception("rolling back a refused prepared run failed; its slots are flagged state_lost")
            mark_lost()
            raise

    def close(self) -> None:
        """Let go of the graph and its tensors (its memory pool is freed with them)."""
        self.closed = True
        self._graph = None
        self._captured = None

    def _upload_rows(self, read: np.ndarray, moved: Optional[MovedRows]) -> None:
        """The run's rows (read, then written) into the device buffer the launch reads,
        queued on the current stream ahead of it (from page-locked memory on a GPU: no wait;
        the previous run's copy is complete, its synchronization came after it)."""
        n = len(read)
        self._host_view[:n] = read
        if moved is not None:
            self._host_view[n:] = moved.rows
        self._row_buffer.copy_(self._host_rows, non_blocking=True)

    def _transaction(self, pool: torch.Tensor, indices: torch.Tensor, graphed: bool,
                     moved: Optional[MovedRows]) -> LaunchTransaction:
        """The launch's transaction on ``pool`` rows ``indices``: writing to ``moved``'s rows,
        or in place (in a graph the launch saves the rows it reads itself: a replay starts
        whole or not at all)."""
        return LaunchTransaction(pool, indices, [(self.valid.inputs.lengths, self.valid.inputs.slots)],
                                 saved_by_launch=graphed, checks_inputs=True, moved=moved)

    def _problem(self, pool: torch.Tensor, indices: torch.Tensor, transaction: LaunchTransaction,
                 o_out: Optional[torch.Tensor]) -> PrefillProblem:
        x, gate = self.valid.inputs, self.valid.gate
        A_log, dt_bias = self._gate
        return packed_problem(
            x.q, x.k, x.v, x.g, x.beta, bounds=[0, *itertools.accumulate(x.lengths)], pool=pool, indices=indices,
            scale=x.params.scale, A_log=A_log, dt_bias=dt_bias, lower_bound=gate.lower_bound, use_qk_l2norm=x.params.use_qk_l2norm,
            use_beta_sigmoid=x.params.use_beta_sigmoid, allow_neg_eigval=x.params.allow_neg_eigval,
            nonfinite=transaction.flags, saved_states=transaction.saved if transaction.saved_by_launch else None,
            input_checks=transaction.input_checks, o_out=o_out, write_indices=transaction.write_indices,
        )

    def _step(self, transaction: LaunchTransaction, pool: torch.Tensor, indices: torch.Tensor) -> _Step:
        """Queue one launch on ``pool`` rows ``indices`` (inside a capture, or eagerly;
        ``transaction`` made on the same rows): the kernels (which check the inputs they
        read), the final states' gather from the rows written."""
        x = self.valid.inputs
        for source, dest in self.io.inputs:
            dest.copy_(source, non_blocking=True)  # device or page-locked host memory: no synchronization
        o_out = self._o_in_place() if pool is self._storage else None  # not for the warm-up's scratch rows
        o, _ = kernels.run_problem(self._problem(pool, indices, transaction, o_out), self._backend)
        into = self.io.final_state if pool is self._storage else None  # not for the warm-up's scratch rows
        finals = None
        if x.params.return_final_state and into is not None and into.device == pool.device:
            finals = torch.index_select(pool, 0, transaction.written, out=into)  # into the client's region: one pass
        elif x.params.return_final_state:
            finals = pool.index_select(0, transaction.written)
            if into is not None:
                into.copy_(finals, non_blocking=True)
        if self.io.o is not None and pool is self._storage and o is not self.io.o:
            self.io.o.copy_(o, non_blocking=True)
        return _Step(o, finals, transaction)

    def _o_in_place(self) -> Optional[torch.Tensor]:
        """``io.o`` when the kernels can write o there themselves (device memory of the
        pool's device, v's dtype, contiguous, sharing no byte with an input the kernels
        read while they write o: inputs read in place may lie in the same region): no copy
        after them."""
        o, v = self.io.o, self.valid.inputs.v
        if o is None or o.device != self._storage.device or o.dtype != v.dtype or not o.is_contiguous():
            return None
        if o.shape != v.shape or any(share_bytes(o, t) for _, t in self.valid.packed):
            return None
        return o


def _scratch_moves(written: torch.Tensor) -> MovedRows:
    """`MovedRows` writing to ``written`` that commit nothing anywhere: the warm-up's (on
    scratch rows), and the captured transaction's until a run renews it."""
    return MovedRows([], written, lambda positions: None, lambda positions: None)


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether tensors ``a`` and ``b`` (any strides) may share a byte: on one device, the
    spans from their first to their last element's bytes intersect."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of ``t``'s elements (non-negative strides)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
