"""`ServerCore`: the pool, the per-slot ordering, the batcher and the kernels, with no HTTP.

The FastAPI app is one front end; a KServe v2 endpoint, a shared-memory transport or a Ray
Serve shard call the same methods (front ends never reach into the pool). It implements
`service.core.api.CoreAPI`, the operations behind the REST routes; the small queries
`has_slot`, `slot_ids`, `stats` and `restore_slot` (a slot moved in from another shard)
serve the other front ends. Every method is for one asyncio loop.

Threads: every pool call that touches pool memory (alloc, free, fork, state reads and
writes, restores, launches, sweeps, snapshots) runs on the core's one `DeviceWorker`
thread, in order; only metadata reads (has_slot, slot_ids, slot_info, stats) run inline
on the loop. Work on a slot first holds its (slot, layer) keys in a `SlotOrdering`, so it
runs in arrival order.

Order of a prefill: validate (400) -> named slots exist (404) and are not flagged
state_lost (409) -> allocate the null slots (503 when full) -> hold (slot, layer) of every
slot in arrival order -> batcher -> journal (with a snapshot path) -> one launch -> results.
A request rejected at any step changes no slot; slots it allocated are freed again if a
later step fails.

Durability (with ``snapshot_path``; `state_store.Persistence`): the start restores the
snapshot and applies its journal; every in-place state change (launch, state upload) and
every free is journaled and fsynced on the device thread before it runs; a snapshot is
written every ``snapshot_interval_s`` when anything changed (on the device thread, so
between launches) and at close. Callbacks registered with `on_checkpoint` run after each
snapshot is written, so state kept beside the pool (the KServe sequence table) is saved at
the same points and restores consistent with it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

import kernels
from kernels.problem import packed_problem
from state_store import (
    HOST, CheckpointTarget, Persistence, PoolStats, PrefixCache, PrefixInfo, PrefixMatch, Rows, SlotGroup, SlotInfo,
    SlotOrdering, SnapshotError, StatePool, UnknownSlot, key_problem,
)

from .batcher import Batcher
from ..config import Settings
from ..errors import InvalidRequest, NotReady, PrefixCacheOff, PrefixConflict, PrefixTooLarge, StateLost, UnknownPrefix
from .checkpoints import Planned, check_checkpoint_keys, plan_checkpoints
from ..version import __version__
from .gate_params import DeviceGates, Gate, load_gate_params
from .inputs import REQUIRED_TENSORS, PrefillInputs, PrefillResult
from .metrics import Metrics, build_info
from .self_test import SelfTestReport, run_self_test
from .staging import PinnedStaging, host_ints_pair_to, host_ints_to
from .transaction import LaunchTransaction, MovedRows
from .prepared import Answer, Deliver, DeviceIO, PreparedPrefill, PreparedRun, Refill
from .validation import (ValidPrefill, changed_inputs_problem, first_value_problem, validate_form, validate_prefill,
                         validate_state)
from .worker import DeviceWorker, off_loop

log = logging.getLogger("kda_serve.core")
_WARMUP_LENGTHS = (1, 67)  # the one-token (recurrent) path and two chunks of the chunked path


@dataclass
class _Job:
    """One validated prefill in the batcher: its slots (all ids now), those it created, and
    its checkpoints (positions in its own packed tokens)."""

    valid: ValidPrefill
    slots: list[str]
    allocated: list[str]
    checkpoints: list[Planned]
    group: Optional[SlotGroup] = None  # its slots as resolved for its launch (on the device thread)


@dataclass(frozen=True)
class _Launched:
    """A settled launch (`ServerCore._queue_and_settle`): o [T, HV, V] and the final states
    [N, HV, V, K] (None when no job wants them) on the pool's device, their host copies
    when a job wants them there (else None), and the refused jobs' errors by job index."""

    o: torch.Tensor
    finals: Optional[torch.Tensor]
    o_host: Optional[torch.Tensor]
    finals_host: Optional[torch.Tensor]
    refused: dict[int, Exception]


def _packed(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The jobs' ``parts`` of one input concatenated along tokens, on ``device`` (host
    bodies merged with CUDA shared memory come to the device first)."""
    if len(parts) == 1:
        return parts[0].to(device)
    if any(p.device != parts[0].device for p in parts):
        parts = [p.to(device) for p in parts]
    return torch.cat(parts).to(device)


class ServerCore:
    """Serves prefills and slot operations on one device.

    ``settings`` gives the pool geometry, device, backend, gate parameters, batching, ttl,
    snapshot path and interval. Metrics go to the core's own registry (``metrics.registry``).
    Call `start` in the serving loop before use and `close` at the end; it is ready
    (`check_ready`) once `warmup` has run and the kernel self-test passed.
    """

    slot_missing: tuple[type[Exception], ...] = (UnknownSlot,)

    def __init__(self, settings: Settings) -> None:
        device = settings.torch_device()
        self.pool = StatePool(
            settings.num_layers, settings.num_slots, settings.num_heads, settings.head_dim, settings.v_dim,
            dtype=settings.torch_state_dtype, device=device, ttl=settings.slot_ttl_s, spare_rows=settings.spare_rows,
        )
        self.geometry = self.pool.geometry
        self.backend = kernels.default_backend(self.geometry.device) if settings.backend == "auto" else settings.backend
        self.gates: dict[int, Gate] = load_gate_params(settings.gate_params, self.geometry) if settings.gate_params else {}
        self.self_test_report: Optional[SelfTestReport] = None  # set by `self_test`
        self._self_test_fault = settings.self_test_fault
        self.snapshot_path = settings.snapshot_path
        self.snapshot_interval_s = settings.snapshot_interval_s
        self._restored = False  # whether `restore` has run
        self.metrics = Metrics(free_slots=lambda: self.pool.stats().free)
        self.metrics.add_pool(self.stats, build_info(self.backend, self.geometry.device))
        self.prefix_cache = PrefixCache(self.geometry, settings.prefix_cache_bytes, settings.prefix_cache_host_bytes,
                                        on_evict=lambda tier: self.metrics.prefix_evictions.labels(tier).inc())
        self.metrics.watch_prefix_cache(self.prefix_cache.stats)
        self.persistence = (Persistence(self.pool, settings.snapshot_path, prefix_cache=self.prefix_cache)
                            if settings.snapshot_path else None)
        if self.persistence is not None:
            self.metrics.watch_journal(self.persistence)
        self._snapshot_task: Optional[asyncio.Task[None]] = None
        self._background: set[asyncio.Task[None]] = set()  # `_in_background`'s tasks
        self._checkpoint_hooks: list[Callable[[], None]] = []
        self._not_ready: Optional[str] = "warming the kernels"  # why `check_ready` refuses; None once ready
        self.ordering = SlotOrdering()
        self.worker = DeviceWorker(self.geometry.device)
        # host inputs reach a GPU through pinned memory (`_launch`, on the worker thread only)
        self._staging = PinnedStaging(device) if device.type == "cuda" else None
        self._device_gates = DeviceGates(device)  # requests' gate tensors, copied once per distinct gate
        self._inline_tokens = settings.inline_tokens(device)  # prepared runs this small launch on the loop when idle
        self.batcher: Batcher[_Job, PrefillResult] = Batcher(
            self._run_batch, self.worker, self.metrics,
            window_s=settings.batch_window_ms / 1000.0, max_tokens=settings.max_batch_tokens,
            inline_tokens=settings.inline_tokens(device),
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def restore(self) -> None:
        """Restore the snapshot and apply its journal (with a snapshot path; once: later
        calls, and `start` after this one, do nothing). Raises SnapshotError or
        GeometryMismatch when the snapshot cannot be used; the pool is then as it was."""
        if self.persistence is None or self._restored:
            return
        report = await self.worker.run(self.persistence.restore)
        self._restored = True
        self.metrics.snapshot_generation.set(self.persistence.generation)
        if report.lost or report.gone or not report.journal_intact:
            log.warning("%s: %s", self.persistence.path, report.describe())
        else:
            log.info("%s: %s", self.persistence.path, report.describe())

    async def start(self) -> None:
        """`restore` (unless done already), start batching and the periodic snapshots."""
        await self.restore()
        if self.persistence is not None and self.snapshot_interval_s > 0:
            self._snapshot_task = asyncio.get_running_loop().create_task(
                self._snapshot_every(self.snapshot_interval_s), name="kda-snapshots")
        self.batcher.start()

    async def warmup(self) -> SelfTestReport:
        """Run the kernels once per gate configuration on a scratch pool (never the live
        one), so compilation and autotuning happen before the first request, then their
        `self_test`; the core is ready (`check_ready`) once both ran and the test passed.
        Returns the self-test's report."""
        try:
            await self.worker.run(self._warm_kernels)
        except Exception:
            self._not_ready = "kernel warm-up failed (see the server log)"
            raise
        self._not_ready = "running the kernel self-test"
        report = await self.self_test()
        self._not_ready = None if report.passed else report.describe()
        return report

    def is_ready(self) -> bool:
        """Whether `warmup` has run and the kernel self-test passed."""
        return self._not_ready is None

    async def check_ready(self) -> None:
        """Return once `warmup` has run and the kernel self-test passed; NotReady (503)
        saying why not before (warming, testing, or the failed paths and toolchain)."""
        if self._not_ready is not None:
            raise NotReady(self._not_ready)

    async def self_test(self) -> SelfTestReport:
        """Run every kernel path this server launches against the float64 reference, on a
        scratch pool (`service.core.self_test`); the report is kept for `info`."""
        self.self_test_report = await self.worker.run(run_self_test, self.geometry, self.backend, self.gates,
                                                      self._self_test_fault)
        return self.self_test_report

    async def close(self) -> None:
        """Finish the launch in progress, write the snapshot when configured, stop the thread."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._snapshot_task
        if self._background:
            await asyncio.gather(*self._background)
        await self.batcher.close()
        if self.persistence is not None:
            await self.checkpoint(force=True)
            self.persistence.close()
        self.worker.close()

    def on_checkpoint(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` in the serving loop after every snapshot written from now on (a hook
        that raises is logged; the snapshot stands)."""
        self._checkpoint_hooks.append(hook)

    async def checkpoint(self, force: bool = False) -> Optional[int]:
        """Write the next snapshot (on the device thread, between launches) when anything
        changed since the last one, or always with ``force``; returns its generation, or
        None when there was nothing to write. Raises SnapshotError when it cannot be written
        (the previous snapshot and the journal still describe the pool)."""
        persistence = self.persistence
        if persistence is None or not (force or persistence.changed):
            return None
        try:
            generation = await self.worker.run(persistence.snapshot)
        except SnapshotError:
            self.metrics.snapshot_failures.inc()
            # a file renamed in before the failure (not durable, its prefix cache's file failed)
            # moved the generation, under which later changes are journaled: say so
            self.metrics.snapshot_generation.set(persistence.generation)
            raise
        self.metrics.snapshots.inc()
        self.metrics.snapshot_generation.set(generation)
        log.info("wrote snapshot generation %d of %d slot(s) to %s", generation, self.pool.stats().used,
                 persistence.path)
        for hook in self._checkpoint_hooks:
            try:
                hook()
            except Exception:
                log.exception("a checkpoint callback failed after snapshot generation %d", generation)
        return generation

    async def _snapshot_every(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.checkpoint()
            except Exception:  # keep snapshotting: the journal still marks what changed
                log.exception("periodic snapshot failed; retrying in %.1f s", period)

    async def sweep(self) -> list[str]:
        """Free slots idle past the ttl; returns their ids."""
        expired = await self.worker.run(self._sweep)
        if expired:
            self.metrics.expired.inc(len(expired))
            log.info("expired %d idle slot(s)", len(expired))
        return expired

    def _warm_kernels(self) -> None:
        """`warmup`'s body: each gate configuration (none, and each layer's server gate with
        l2norm and beta sigmoid, the serving setup) on a scratch pool, in each input dtype."""
        g = self.geometry
        HV, K, V = g.num_heads, g.head_k_dim, g.head_v_dim
        T, N = sum(_WARMUP_LENGTHS), len(_WARMUP_LENGTHS)
        gen = torch.Generator().manual_seed(0)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(_WARMUP_LENGTHS)], dtype=torch.int64, device=g.device)
        indices = torch.arange(N, dtype=torch.int64, device=g.device)
        dtypes = (torch.float32, torch.bfloat16) if g.device.type == "cuda" else (torch.float32,)
        configs = [(Gate(), False)] + [(gate, True) for gate in self.gates.values()]
        for dtype, (gate, flags) in itertools.product(dtypes, configs):
            q, k, g_in = (torch.randn(1, T, HV, K, generator=gen) for _ in range(3))
            v, beta = torch.randn(1, T, HV, V, generator=gen), torch.rand(1, T, HV, generator=gen)
            if not gate.fused:
                g_in = -g_in.abs()
            q, k, v, g_in, beta = (t.to(device=g.device, dtype=dtype) for t in (q, k, v, g_in, beta))
            kernels.chunk_kda(
                q, k, v, g_in, beta, initial_state=torch.zeros(N, HV, V, K, dtype=g.dtype, device=g.device),
                initial_state_indices=indices, use_qk_l2norm_in_kernel=flags, cu_seqlens=cu_seqlens,
                A_log=gate.A_log, dt_bias=gate.dt_bias, lower_bound=gate.lower_bound,
                use_beta_sigmoid_in_kernel=flags, backend=self.backend,
            )
        if g.device.type == "cuda":
            torch.cuda.synchronize(g.device)

    # -- device-thread bodies: each change announced to the journal before it runs ------

    def _sweep(self) -> list[str]:
        expired = self.pool.sweep()
        if expired and self.persistence is not None:
            self.persistence.note_change()
        return expired

    def _alloc(self, count: int) -> list[str]:
        slots = self.pool.alloc(count)
        if self.persistence is not None:
            self.persistence.note_change()
        return slots

    def _free(self, slot_id: str) -> None:
        if self.persistence is not None:
            self.pool.slot_info(slot_id)  # UnknownSlot before a useless journal record
            self.persistence.freeing(slot_id)
        self.pool.free(slot_id)

    def _fork(self, slot_id: str) -> str:
        child = self.pool.fork(slot_id)
        if self.persistence is not None:
            self.persistence.note_change()
        return child

    def _write_state(self, slot_id: str, state: torch.Tensor) -> None:
        if self.persistence is not None:
            self.pool.slot_info(slot_id)
            self.persistence.advancing([slot_id])
        self.pool.write_state(slot_id, state)

    def _restore(self, state: torch.Tensor, tokens_per_layer: list[int], state_lost: bool) -> str:
        if not state_lost:  # the copy writes every layer of the row: no zero fill before it
            (slot_id,) = self.pool.alloc_copies(state, 1, tokens_per_layer)
            if self.persistence is not None:
                self.persistence.note_change()
            return slot_id
        (slot_id,) = self._alloc(1)
        try:
            for layer, count in enumerate(tokens_per_layer):
                self.pool.record_tokens(slot_id, layer, count)
            self.pool.mark_lost([slot_id])
        except BaseException:
            self._free(slot_id)
            raise
        return slot_id

    # -- slots -------------------------------------------------------------------------

    def _all_layers(self, slot_id: str) -> list[tuple[str, int]]:
        return [(slot_id, layer) for layer in range(self.geometry.num_layers)]

    async def alloc(self, count: int = 1) -> list[str]:
        """``count`` new slots with zero state (all or none; PoolFull when short)."""
        if not 1 <= count <= self.geometry.num_slots:
            raise InvalidRequest(f"count must be in 1..{self.geometry.num_slots} (the pool's slots), got {count}",
                                 field="count")
        return await self.worker.run(self._alloc, count)

    async def free(self, slot_id: str) -> None:
        """Free a slot once the work queued on it before this call is done."""
        async with self.ordering.hold(self._all_layers(slot_id)):
            await self.worker.run(self._free, slot_id)

    async def fork(self, slot_id: str) -> str:
        """A new slot holding a copy of ``slot_id``'s state as of this call's arrival."""
        async with self.ordering.hold(self._all_layers(slot_id)):
            return await self.worker.run(self._fork, slot_id)

    async def slot_info(self, slot_id: str) -> SlotInfo:
        """The slot's metadata (read inline: it never waits)."""
        return self.pool.slot_info(slot_id)

    def has_slot(self, slot_id: str) -> bool:
        """Whether ``slot_id`` is live (does not count as a use)."""
        return self.pool.contains(slot_id)

    def slot_ids(self) -> list[str]:
        """The live slot ids."""
        return self.pool.slot_ids()

    def stats(self) -> PoolStats:
        """The pool's capacity, free and used slots and counters."""
        return self.pool.stats()

    async def get_state(self, slot_id: str) -> torch.Tensor:
        """The slot's state, [L, HV, V, K] in the pool dtype, on the host."""
        async with self.ordering.hold(self._all_layers(slot_id)):
            return await self.worker.run(lambda: self.pool.read_state(slot_id).cpu())

    async def export_state(self, slot_id: str) -> bytes:
        """The slot's state as safetensors (tensor ``state`` plus geometry metadata)."""
        async with self.ordering.hold(self._all_layers(slot_id)):
            return await self.worker.run(self.pool.export, slot_id)

    async def put_state(self, slot_id: str, state: torch.Tensor) -> None:
        """Replace the slot's state with ``state`` [L, HV, V, K] (pool dtype, finite)."""
        await off_loop(validate_state, state, self.geometry, nbytes=state.numel() * state.element_size())
        async with self.ordering.hold(self._all_layers(slot_id)):
            await self.worker.run(self._write_state, slot_id, state)

    async def restore_slot(self, state: torch.Tensor, tokens_per_layer: Sequence[int], state_lost: bool) -> str:
        """A new slot holding ``state`` [L, HV, V, K] (pool dtype, finite) bit for bit with
        ``tokens_per_layer``: a slot brought in from elsewhere (a move between shards). With
        ``state_lost`` the state is not copied: the new slot keeps zeros, flagged lost as its
        source was. All or nothing: PoolFull, GeometryMismatch, InvalidRequest (a state not
        finite) or an error on the token counts leave no new slot."""
        if not state_lost:
            await off_loop(validate_state, state, self.geometry, nbytes=state.numel() * state.element_size())
        return await self.worker.run(self._restore, state, list(tokens_per_layer), state_lost)

    async def info(self) -> dict[str, Any]:
        """The ``GET /info`` document (read inline: it never waits)."""
        g = self.geometry
        stats = self.pool.stats()
        report = self.self_test_report
        return {
            "version": __version__,
            "num_layers": g.num_layers, "num_slots": g.num_slots, "num_heads": g.num_heads,
            "head_k_dim": g.head_k_dim, "head_v_dim": g.head_v_dim, "state_dtype": g.dtype_name,
            "device": str(g.device), "backend": self.backend,
            "free_slots": stats.free, "used_slots": stats.used, "gate_layers": sorted(self.gates),
            "spare_rows": self.pool.spare_rows,
            "self_test": report.summary() if report is not None else {"status": "pending"},
        }

    async def render_metrics(self) -> bytes:
        """The Prometheus page of this core's registry."""
        return self.metrics.render()

    # -- prefill -----------------------------------------------------------------------

    async def prefill(self, inputs: PrefillInputs) -> PrefillResult:
        """Run one prefill request; see the module docstring for the order of checks. A
        server whose kernel self-test failed refuses every prefill (NotReady, 503)."""
        if self.self_test_report is not None and not self.self_test_report.passed:
            raise NotReady(self.self_test_report.describe())
        # a scan of device memory is GPU work: the loop only waits microseconds for it
        host = [t for t in (getattr(inputs, name) for name in REQUIRED_TENSORS) if not t.is_cuda]
        size = sum(t.numel() * t.element_size() for t in host)
        start = time.perf_counter()
        # GPU tensors' values are scanned there and read at the launch's synchronization
        valid = await off_loop(validate_prefill, inputs, self.geometry, self.gates, True, nbytes=size)
        validate_s = time.perf_counter() - start
        check_checkpoint_keys(inputs, self.prefix_cache.enabled)
        lost = self.pool.first_lost([slot_id for slot_id in inputs.slots if slot_id is not None])  # or UnknownSlot
        if lost is not None:
            raise StateLost(lost)
        if inputs.checkpoints and not self._queued_on(inputs.slots, inputs.params.layer):
            # refused before anything is allocated; checked again once the slots are held (the only check
            # while earlier work on a slot is queued: the counts it will have are not known yet)
            plan_checkpoints(inputs, self._tokens_before(inputs.slots, inputs.params.layer))
        count = inputs.slots.count(None)
        created = await self._alloc_for_request(count) if count else []
        try:
            fresh = iter(created)
            slots = [s if s is not None else next(fresh) for s in inputs.slots]
            async with self.ordering.hold([(s, inputs.params.layer) for s in slots]):
                planned = (plan_checkpoints(inputs, self._tokens_before(slots, inputs.params.layer))
                           if inputs.checkpoints else [])
                job = _Job(valid, slots, created, planned)
                result = await self.batcher.submit(valid.batch_key, valid.tokens, job)
                result.validate_s = validate_s  # this job's own result (`_job_results`): no copy
                return result
        except BaseException:
            if created:
                await self.worker.run(self._free_all, created)
            raise

    async def prepare(self, inputs: PrefillInputs, refill: Refill, deliver: Deliver,
                      io: DeviceIO = DeviceIO()) -> PreparedPrefill:
        """A prefill prepared to run many times (`service.core.prepared`): ``inputs``' form
        checked now (`validate_form`: 400), its slots named and live (404, 409), no
        checkpoints (400); on a GPU its launch captured as a CUDA graph. Its packed tensors
        are the buffers ``refill`` fills before each run (and ``io.inputs`` copy into, in
        the launch); ``deliver`` gets each run's result (``io``: the outputs the launch
        copies into place itself). Nothing runs and no slot changes here."""
        await self.check_ready()
        valid = validate_form(inputs, self.geometry, self.gates)
        for i, slot in enumerate(inputs.slots):
            if slot is None:
                raise InvalidRequest(f"sequence {i} has no slot: a prepared prefill runs on slots that exist "
                                     "(allocate them first)", field=f"sequences[{i}].slot")
        if any(inputs.checkpoints):
            raise InvalidRequest("a prepared prefill stores no checkpoints", field="checkpoints")
        slots = [s for s in inputs.slots if s is not None]
        group, lost = self.pool.group(slots)  # or UnknownSlot
        if lost is not None:
            raise StateLost(lost)

        def build() -> PreparedPrefill:
            A_log, dt_bias = self._device_gates.tensors(valid.gate)
            moves = self.pool.spare_rows >= len(slots)  # one launch at a time: its spare rows are always free
            prepared = PreparedPrefill(valid, group, self.pool.storage, moves, A_log, dt_bias, self.backend, refill,
                                       deliver, io)
            prepared.capture()
            return prepared

        return await self.worker.run(build)

    async def run_prepared(self, prepared: PreparedPrefill, answer: Optional[Answer] = None) -> PreparedRun:
        """One run of ``prepared`` (see `PreparedPrefill.launch` for its refusals), in
        arrival order with the other work on its slots; UnknownSlot (404) or StateLost (409)
        when a slot was freed or lost since. Its slots count the tokens, as a prefill's do.
        Like a lone prefill, a run that finds the device thread idle runs on the event loop
        when it is small (``--inline-launch-tokens``): no hop to the thread and back.

        ``answer``: the front end's reply, given the run once it stands (its flags and checks
        judged, its outputs delivered); not for a refusal or a failure (raised). A run on
        the event loop answers before it moves its slots onto their new rows, counts their
        tokens and its metrics, so the reply leaves while the server does them: nothing else
        runs on the loop until they are done, so no request sees the slots before. A run on
        the device thread answers once it returns (on the loop)."""
        if self.self_test_report is not None and not self.self_test_report.passed:
            raise NotReady(self.self_test_report.describe())
        if prepared.closed:
            raise InvalidRequest("this prepared prefill was released", field="prepared")
        async with self.ordering.hold(prepared.keys):
            if prepared.tokens <= self._inline_tokens and self.worker.idle:  # as the batcher does a lone launch
                return self.worker.run_inline(self._run_prepared, prepared, answer)
            run = await self.worker.run(self._run_prepared, prepared, None)
        if answer is not None:
            answer(run)
        return run

    def _run_prepared(self, prepared: PreparedPrefill, answer: Optional[Answer]) -> PreparedRun:
        if prepared.closed:  # released while this run waited for its slots (`close` runs on the device thread too)
            raise InvalidRequest("this prepared prefill was released", field="prepared")
        if not self.pool.use_group(prepared.group):  # a slot freed, expired or lost since the last run's check
            group, lost = self.pool.group(prepared.slots)
            if lost is not None:
                raise StateLost(lost)
            assert group.rows == prepared.rows, "a live slot's row never changes"
            prepared.group = group
        if self.persistence is not None:
            self.persistence.advancing(prepared.slots)
        t0 = time.perf_counter()
        prepared.refill()
        t1 = time.perf_counter()
        layer = prepared.valid.inputs.params.layer
        read, spares = self.pool.launch_rows(layer, prepared.group.index, spares=prepared.moves)
        if prepared.moves and spares is None:  # launches run one at a time, each giving its spare rows back
            raise RuntimeError(f"no {len(read)} spare pool rows free for a prepared run: another launch kept them")
        moved = (self._moved_rows(layer, prepared.group.index, read, spares, prepared.written)
                 if spares is not None and prepared.written is not None else None)
        t2 = time.perf_counter()
        mark_lost = partial(self.pool.mark_lost, prepared.slots)
        inputs = prepared.valid.inputs
        try:
            o, finals, launched, transaction = prepared.launch(read, moved, mark_lost)
        except BaseException:  # a refused or failed launch is a launch, as the batcher counts its own
            self.metrics.prepared_launch(len(inputs.lengths), prepared.tokens, time.perf_counter() - t0)
            raise
        t3 = time.perf_counter()
        result = PrefillResult(prepared.slots, inputs.lengths, o, finals, [], t3 - t0)
        try:
            prepared.deliver(result)
        except BaseException:  # the outputs cannot reach the client (400): the run is refused, no slot moves
            prepared.refuse(transaction, mark_lost)
            self.metrics.prepared_launch(len(inputs.lengths), prepared.tokens, time.perf_counter() - t0)
            raise
        delivered = time.perf_counter()  # the outputs in place (the launch is timed from its refill to then)
        try:
            run = PreparedRun(result, (t1 - t0, t2 - t1, *launched, delivered - t3))
            if answer is not None:
                answer(run)
        finally:  # the run stands: its slots move onto their new rows and count its tokens, whatever the reply
            prepared.commit(transaction, mark_lost)
            self.pool.record_group_tokens(prepared.group, layer, prepared.counts)
            self.metrics.tokens.inc(prepared.tokens)
            self.metrics.sequences.inc(len(inputs.lengths))
            # after the reply, off its path
            self.metrics.prepared_launch(len(inputs.lengths), prepared.tokens, delivered - t0)
        return run

    async def release_prepared(self, prepared: PreparedPrefill) -> None:
        """Let go of ``prepared``'s graph and buffers (on the device thread: never under a run)."""
        await self.worker.run(prepared.close)

    def _queued_on(self, slots: Sequence[Optional[str]], layer: int) -> bool:
        """Whether work on ``layer`` of one of ``slots`` (None: a new one) is held or waiting."""
        return any(self.ordering.queued((s, layer)) for s in slots if s is not None)

    def _tokens_before(self, slots: Sequence[Optional[str]], layer: int) -> list[int]:
        """Each slot's tokens on ``layer`` (0 for a slot still to be allocated)."""
        return [0 if s is None else self.pool.slot_info(s).tokens_per_layer[layer] for s in slots]

    def _free_all(self, slot_ids: Sequence[str]) -> None:
        for slot_id in slot_ids:
            if self.pool.contains(slot_id):
                self._free(slot_id)

    def _run_batch(self, jobs: Sequence[_Job]) -> list[Union[PrefillResult, BaseException]]:
        """One launch for ``jobs`` (same batch key), on the device thread.

        A job whose slot vanished since it was checked (expired) fails alone with
        UnknownSlot, one whose slot was flagged lost since (a failed launch before it) with
        StateLost; the others are journaled and launch together. A journal that cannot be
        written fails them all (SnapshotError) before anything changes. The launch is a
        `LaunchTransaction`: a job whose update diverged (non-finite state or o) is rolled
        back and fails alone with UpdateDiverged (422); a failed launch restores every slot
        and fails them all with LaunchFailed (slots are marked lost only when that fails).
        """
        outcomes: list[Union[PrefillResult, BaseException, None]] = [None] * len(jobs)
        live, rows = [], []
        for i, job in enumerate(jobs):
            try:
                job.group, lost = self.pool.group(job.slots)  # counted later without resolving them again
            except UnknownSlot as e:
                outcomes[i] = e
                continue
            if lost is not None:
                outcomes[i] = StateLost(lost)
                continue
            rows.extend(job.group.rows)
            live.append(job)
        if live and self.persistence is not None:
            try:
                self.persistence.advancing([s for job in live for s in job.slots])
            except SnapshotError as e:
                log.error("journal write failed; %d prefill(s) refused before launch: %s", len(live), e)
                return [e if o is None else o for o in outcomes]
        if live:
            results = iter(self._launch(live, rows))
            outcomes = [next(results) if o is None else o for o in outcomes]
        return outcomes

    def _stage(self, groups: list[list[torch.Tensor]]) -> Optional[list[torch.Tensor]]:
        """``groups`` packed on the GPU through pinned memory (`PinnedStaging`), or None for
        plain copies: no GPU, a launch it does not take, or pinned memory refused (the pool
        is untouched then, so nothing is lost)."""
        if self._staging is None:
            return None
        try:
            return self._staging.to_device(groups)
        except RuntimeError as e:
            log.warning("pinned staging failed, copying this launch's inputs directly: %s", e)
            return None

    @staticmethod
    def _refuse_inputs(jobs: Sequence[_Job], checks: dict[int, torch.Tensor],
                       transaction: LaunchTransaction) -> dict[int, Exception]:
        """The jobs whose deferred value checks (read into ``checks``, by job index, once the
        launch synchronized) fail: each rolled back, with its 400."""
        refused: dict[int, Exception] = {}
        n0 = 0
        for j, job in enumerate(jobs):
            n1 = n0 + len(job.valid.inputs.lengths)
            deferred = job.valid.deferred
            if j in checks and deferred is not None and (why := deferred.problem(checks[j])) is not None:
                transaction.roll_back(range(n0, n1))
                refused[j] = why
            n0 = n1
        return refused

    @staticmethod
    def _refuse_values(jobs: Sequence[_Job], transaction: LaunchTransaction) -> dict[int, Exception]:
        """After the launch's input check failed: the jobs it checked whose values fail, found
        by a scan of each (this path alone), each rolled back with its 400; when no scan
        finds one (inputs read in place changed during the launch) every job it checked."""
        checked = [j for j, job in enumerate(jobs) if job.valid.kernel_checked]
        refused: dict[int, Exception] = {
            j: why for j in checked if (why := first_value_problem(jobs[j].valid.packed, not jobs[j].valid.gate.fused))}
        if not refused:  # the scans found nothing: no need to scan again for each one's 400
            refused = {j: changed_inputs_problem() for j in checked}
        starts = list(itertools.accumulate((len(job.valid.inputs.lengths) for job in jobs), initial=0))
        for j in refused:
            transaction.roll_back(range(starts[j], starts[j + 1]))
        return refused

    def _launch(self, jobs: list[_Job], rows: list[int]) -> list[Union[PrefillResult, BaseException]]:
        """`_run_launch` with the jobs' checkpoints placed in the prefix cache for the launch
        to write into (`PrefixCache.place`) when the launch first asks for their targets
        (`_checkpoint_states`, its checkpoint provider: after its first stages are queued,
        so the placement's host work runs while the device works): committed for the jobs
        that stand, released in every case, so a job rolled back or a failed launch stores
        none, and a launch that failed before it asked placed none."""
        if not any(job.checkpoints for job in jobs):  # the common launch: no trip through the cache's lock
            return self._run_launch(jobs, rows, None)
        placed: list[tuple[CheckpointTarget, torch.Tensor]] = []  # (target, state written) once placed
        try:
            return self._run_launch(jobs, rows, placed)
        finally:
            self.prefix_cache.release([target for target, _ in placed])

    def _run_launch(
        self, jobs: list[_Job], rows: list[int], placed: Optional[list[tuple[CheckpointTarget, torch.Tensor]]],
    ) -> list[Union[PrefillResult, BaseException]]:
        """One launch of ``jobs`` on slot ``rows`` (one per sequence, in order): its
        transaction opened, the kernels queued and their outcome settled, the checkpoints of
        the jobs that stand stored, then each job's result or refusal."""
        layer = jobs[0].valid.inputs.params.layer
        slots = [s for job in jobs for s in job.slots]
        start = time.perf_counter()
        transaction = self._open_transaction(jobs, layer, rows)
        try:
            launched = self._queue_and_settle(jobs, transaction, placed)
        except Exception as e:
            raise transaction.abort(e, lambda: self.pool.mark_lost(slots)) from e
        if placed:
            self._store_checkpoints(jobs, launched.refused, placed)
        kernel_s = time.perf_counter() - start
        lengths = [n for job in jobs for n in job.valid.inputs.lengths]
        self.metrics.batch_sequences.observe(len(lengths))
        self.metrics.batch_tokens.observe(sum(lengths))
        return self._job_results(jobs, layer, launched, kernel_s)

    def _open_transaction(self, jobs: list[_Job], layer: int, rows: list[int]) -> LaunchTransaction:
        """The launch's `LaunchTransaction` on the storage rows of slot ``rows`` of
        ``layer``: writing to spare rows taken for it (`_moved_rows`; else the rows copied),
        with room for the kernels' input check."""
        read, spares = self.pool.launch_rows(layer, rows)  # one trip through the pool's lock
        try:
            if spares is None:
                indices, moved = host_ints_to(read, self.geometry.device), None
            else:
                indices, written = host_ints_pair_to(read, spares, self.geometry.device)
                moved = self._moved_rows(layer, rows, read, spares, written)
            return LaunchTransaction(
                self.pool.storage, indices, [(job.valid.inputs.lengths, job.valid.inputs.slots) for job in jobs],
                checks_inputs=any(job.valid.kernel_checked for job in jobs), moved=moved)
        except BaseException:
            if spares is not None:
                self.pool.return_spares(spares)
            raise

    def _queue_and_settle(self, jobs: list[_Job], transaction: LaunchTransaction,
                          placed: Optional[list[tuple[CheckpointTarget, torch.Tensor]]]) -> _Launched:
        """The kernels of one launch queued on ``transaction``'s rows (their inputs packed,
        through pinned staging on a GPU), the final states gathered, the flags read (the
        launch's one wait: an asynchronous failure raises here), each refused job rolled
        back and the others committed (`LaunchTransaction.finish`); the outputs on the host
        too when a job wants them there. The caller aborts the transaction if this raises."""
        device, storage = self.geometry.device, self.pool.storage
        first = jobs[0].valid
        x, gate = first.inputs.params, first.gate
        groups = [[getattr(job.valid.inputs, name) for job in jobs] for name in REQUIRED_TENSORS]
        q, k, v, g, beta = self._stage(groups) or [_packed(parts, device) for parts in groups]
        positions: list[int] = []
        if placed is not None:  # a job has checkpoints (`_launch`)
            starts = itertools.accumulate((job.valid.tokens for job in jobs[:-1]), initial=0)
            for job, start_t in zip(jobs, starts):
                positions.extend(start_t + pos for pos, _, _ in job.checkpoints)
        A_log, dt_bias = self._device_gates.tensors(gate)
        # the checkpoints' targets, for the launch itself to write (kernels.checkpoints), placed when it asks
        provider = None if placed is None else partial(self._checkpoint_states, jobs, storage, placed)
        problem = packed_problem(  # every job was validated (`validate_prefill`): no second check
            q, k, v, g, beta, bounds=transaction.bounds, pool=storage, indices=transaction.indices, scale=x.scale,
            A_log=A_log, dt_bias=dt_bias, lower_bound=gate.lower_bound, use_qk_l2norm=x.use_qk_l2norm,
            use_beta_sigmoid=x.use_beta_sigmoid, allow_neg_eigval=x.allow_neg_eigval,
            checkpoint_tokens=tuple(positions), nonfinite=transaction.flags,
            checkpoint_provider=provider, input_checks=transaction.input_checks,
            write_indices=transaction.write_indices,
        )
        o, _ = kernels.run_problem(problem, self.backend)
        # gathered, and the deferred input checks queued for the host, before the flags are read:
        # that read is the launch's one wait, and the checks' host copies are complete after it. A
        # request rolled back below answers with its error, never with these rows; the others'
        # rows stay as gathered
        wants_final = any(job.valid.inputs.params.return_final_state for job in jobs)
        finals = storage.index_select(0, transaction.written) if wants_final else None
        checks = {j: job.valid.deferred.read() for j, job in enumerate(jobs) if job.valid.deferred is not None}
        flags, inputs_failed = transaction.read()  # the one wait (an async failure shows here)
        refused: dict[int, Exception] = dict(transaction.settle(o, flags))  # diverged requests rolled back
        refused.update(self._refuse_inputs(jobs, checks, transaction))
        if inputs_failed:
            refused.update(self._refuse_values(jobs, transaction))
        to_host = any(not job.valid.inputs.device_outputs for job in jobs)
        o_host = o.cpu() if to_host else None  # (or here)
        finals_host = finals.cpu() if to_host and finals is not None else None
        if device.type == "cuda" and not to_host:
            torch.cuda.current_stream(device).synchronize()  # or here; results complete before any response
        transaction.finish()  # last: the standing requests' slots onto their new rows (before it, a failure changes none)
        return _Launched(o, finals, o_host, finals_host, refused)

    def _job_results(self, jobs: list[_Job], layer: int, launched: _Launched,
                     kernel_s: float) -> list[Union[PrefillResult, BaseException]]:
        """Each job's outcome of a settled launch: its refusal, or its tokens counted and its
        slice of o and the final states (on the device or the host, as it asked)."""
        results: list[Union[PrefillResult, BaseException]] = []
        t0, n0 = 0, 0
        alone = len(jobs) == 1  # a lone job's slices are the launch's outputs whole: no slicing calls
        for j, job in enumerate(jobs):
            job_lengths = job.valid.inputs.lengths
            t1, n1 = t0 + sum(job_lengths), n0 + len(job_lengths)
            if j in launched.refused:
                results.append(launched.refused[j])
            else:
                self.pool.record_group_tokens(job.group, layer, job_lengths)  # no lookup: nothing expires here
                self.metrics.tokens.inc(sum(job_lengths))
                self.metrics.sequences.inc(len(job_lengths))
                o_all, final_all = ((launched.o, launched.finals) if job.valid.inputs.device_outputs
                                    else (launched.o_host, launched.finals_host))
                final = (final_all if alone else final_all[n0:n1]) if (
                    final_all is not None and job.valid.inputs.params.return_final_state) else None
                results.append(PrefillResult(job.slots, list(job_lengths), o_all if alone else o_all[t0:t1], final,
                                             job.allocated, kernel_s))
            t0, n0 = t1, n1
        return results

    def _moved_rows(self, layer: int, rows: Rows, read: np.ndarray, spares: np.ndarray,
                    written: torch.Tensor) -> MovedRows:
        """The spare rows ``spares`` taken for a launch on slot ``rows`` of ``layer`` (read
        from the storage rows ``read``) to write its new states to, as a transaction's
        `MovedRows` (``written``: them on the device, or the buffer a prepared launch
        uploads them into itself)."""

        def commit(positions: list[int]) -> None:
            if len(positions) == len(rows):  # every sequence stands: the rows as they are
                self.pool.commit_rows(layer, rows, read, spares)
            else:
                self.pool.commit_rows(layer, np.take(rows, positions), read[positions], spares[positions])

        return MovedRows(spares, written, commit, lambda positions: self.pool.return_spares(spares[positions]))

    def _checkpoint_states(self, jobs: list[_Job], storage: torch.Tensor,
                           placed: list[tuple[CheckpointTarget, torch.Tensor]]) -> list[torch.Tensor]:
        """The launch's checkpoint provider (`kernels.problem.PrefillProblem.checkpoint_provider`):
        where it writes each of ``jobs``' checkpoints, in order, [HV, V, K] each in
        ``storage``'s dtype: its place in the prefix cache (`PrefixCache.place`, at the
        first call), or a row of one scratch tensor for those the cache placed nowhere. The
        (target, state) pairs are kept in ``placed``, for the commit and the release."""
        if not placed:
            wanted = [(key, offset) for job in jobs for _, key, offset in job.checkpoints]
            targets = self.prefix_cache.place(jobs[0].valid.inputs.params.layer, wanted)
            try:
                unplaced = sum(1 for t in targets if t.state is None)
                rows = iter(torch.empty((unplaced, *storage.shape[1:]), dtype=storage.dtype,
                                        device=storage.device).unbind(0) if unplaced else ())
                states = [t.state if t.state is not None else next(rows) for t in targets]
            except BaseException:
                self.prefix_cache.release(targets)
                raise
            placed.extend(zip(targets, states))
        return [state for _, state in placed]

    def _store_checkpoints(self, jobs: list[_Job], refused: Mapping[int, Exception],
                           placed: Sequence[tuple[CheckpointTarget, torch.Tensor]]) -> None:
        """Commit the launch's checkpoints (``placed``: each target with the state the launch
        wrote, [HV, V, K]) to the prefix cache, but those of jobs rolled back (``refused``).
        The launch has committed its slots: a checkpoint that cannot be stored (no memory
        for a new entry) is logged and left out, never failing the prefill (the cache only
        holds copies)."""
        written = iter(placed)
        for j, job in enumerate(jobs):
            for _, (target, state) in zip(job.checkpoints, written):
                if j not in refused:
                    try:
                        self.prefix_cache.commit(target, state)
                    except Exception:
                        log.exception("checkpoint %r at %d tokens was not stored", target.key, target.tokens)
        if self.persistence is not None:
            self.persistence.note_change()

    # -- prefix cache ------------------------------------------------------------------

    async def alloc_prefix(self, prefix: Sequence[str], count: int = 1) -> tuple[list[str], PrefixMatch]:
        """``count`` new slots holding the longest complete prefix cache entry among the keys
        ``prefix`` (in prompt order) in every layer, counting its tokens per layer; zero
        state when none matches. All or none (PoolFull when short). Returns the slots and
        the match."""
        if not 1 <= count <= self.geometry.num_slots:
            raise InvalidRequest(f"count must be in 1..{self.geometry.num_slots} (the pool's slots), got {count}",
                                 field="count")
        for i, key in enumerate(prefix):
            if (why := key_problem(key)) is not None:
                raise InvalidRequest(why, field=f"prefix[{i}]")
        slots, match, tier = await self.worker.run(self._alloc_prefix, list(prefix), count)
        if match.matched:
            self.metrics.prefix_hits.inc()
            self.metrics.prefix_hit_tokens.inc(match.tokens * count)
        else:
            self.metrics.prefix_misses.inc()
        if tier == HOST and match.key is not None:  # after this answer, not before it
            self._in_background(self.worker.run(self.prefix_cache.promote, match.key), f"promoting {match.key!r}")
        return slots, match

    def _alloc_prefix(self, prefix: list[str], count: int) -> tuple[list[str], PrefixMatch, Optional[str]]:
        """`alloc_prefix`'s body: the slots, the match and the tier it was restored from."""
        with self.prefix_cache.restoring(prefix) as held:
            if held.state is None:
                return self._alloc(count), held.match, None
            # the entry's copy writes every layer of the rows: no zero fill before it
            slots = self.pool.alloc_copies(held.state, count, [held.match.tokens] * self.geometry.num_layers)
            if self.persistence is not None:
                self.persistence.note_change()
            return slots, held.match, held.tier

    async def _alloc_for_request(self, count: int) -> list[str]:
        """``count`` new slots for a request. Cancelling the caller while they are made
        cannot lose them: the allocation runs on, and the slots it made are freed once it
        is done (no one could ever name them)."""
        task = asyncio.ensure_future(self.worker.run(self._alloc, count))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._free_made)
            raise

    def _free_made(self, done: "asyncio.Future[list[str]]") -> None:
        """Free the slots an abandoned allocation made (`_alloc_for_request`)."""
        if not done.cancelled() and done.exception() is None:
            self._in_background(self.worker.run(self._free_all, done.result()), "freeing abandoned slots")

    def _in_background(self, work: Awaitable[object], what: str) -> None:
        """Run ``work`` as a task of the serving loop that `close` waits for; a failure is logged."""
        async def run() -> None:
            try:
                await work
            except Exception:
                log.exception("%s failed", what)
        task = asyncio.get_running_loop().create_task(run(), name=f"kda-{what}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def prefix_peek(self, prefix: Sequence[str]) -> PrefixMatch:
        """What `alloc_prefix` would match among ``prefix`` now (read inline; not a use)."""
        return self.prefix_cache.peek(prefix)

    async def prefix_state(self, key: str) -> tuple[torch.Tensor, int]:
        """The complete entry ``key``'s state [L, HV, V, K] (a host copy) and tokens, for a
        restore elsewhere (another shard); a use of the entry (its recency), not a prefix
        hit: it restores no slot (the caller that restores the bytes counts the hit).
        UnknownPrefix (404) when there is none."""
        def read() -> Optional[tuple[torch.Tensor, int]]:
            with self.prefix_cache.restoring([key]) as held:
                return None if held.state is None else (held.state.cpu().clone(), held.match.tokens)
        found = await self.worker.run(read) if key_problem(key) is None else None
        if found is None:
            raise UnknownPrefix(key)
        return found

    async def publish(self, slot_id: str, key: str) -> PrefixInfo:
        """The slot's state (every layer, equal token counts) as the complete prefix cache
        entry ``key``, replacing any entry of that key, once the work queued on the slot
        before this call is done. PrefixCacheOff (409) without a cache, PrefixConflict (409)
        for unequal counts, StateLost (409), PrefixTooLarge (507) when it finds no room."""
        if (why := key_problem(key)) is not None:
            raise InvalidRequest(why, field="key")
        if not self.prefix_cache.enabled:
            raise PrefixCacheOff("this server keeps no prefix cache (--prefix-cache-mb 0)", field="key")
        async with self.ordering.hold(self._all_layers(slot_id)):
            return await self.worker.run(self._publish, slot_id, key)

    def _publish(self, slot_id: str, key: str) -> PrefixInfo:
        info = self.pool.slot_info(slot_id)
        if info.state_lost:
            raise StateLost(slot_id)
        counts = set(info.tokens_per_layer)
        if len(counts) != 1:
            raise PrefixConflict(f"slot {slot_id!r} holds unequal token counts per layer {info.tokens_per_layer}; "
                                 "an entry holds one offset in every layer", field="slot")
        published = self.prefix_cache.publish(key, counts.pop(), self.pool.read_state(slot_id))
        if published is None:
            raise PrefixTooLarge(f"an entry of {self.prefix_cache.entry_bytes} bytes finds no room in the prefix "
                                 f"cache's budgets (or every entry in the way is being restored)", field="key")
        if self.persistence is not None:
            self.persistence.note_change()
        return published

    async def prefix_info(self, key: str) -> PrefixInfo:
        """The entry ``key`` (UnknownPrefix, 404, when there is none); not a use."""
        info = self.prefix_cache.info(key) if key_problem(key) is None else None
        if info is None:
            raise UnknownPrefix(key)
        return info

    async def drop_prefix(self, key: str) -> bool:
        """Remove the entry ``key``; whether there was one (idempotent: no entry is no
        error). InvalidRequest (400) for a key no entry can have."""
        if (why := key_problem(key)) is not None:
            raise InvalidRequest(why, field="key")
        return await self.worker.run(self._drop_prefix, key)

    def _drop_prefix(self, key: str) -> bool:
        dropped = self.prefix_cache.drop(key)
        if dropped and self.persistence is not None:
            self.persistence.note_change()
        return dropped
