"""Races in the in-process `ServerCore`: work on a slot interleaved with a launch on it that
is held inside the kernels on the device thread (`_Gate`: a wrapper of
`kernels.run_problem` that blocks the armed launch on a `threading.Event`) while the loop
serves other coroutines, then released.

Each test compares bit for bit (`torch.equal`, the torch backend on the CPU) against the
same work run one request at a time on a reference slot of the same core (same initial
state, same launches), checks token counts, and that every spare row is free at the end."""
from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, Optional

import pytest
import torch
from server_harness import HV, K, LAYERS, V, make_sequence, random_state

import kernels
from service.config import Settings
from service.core.inputs import Checkpoint, PrefillInputs, PrefillParams
from service.core.prepared import PreparedPrefill
from service.core.server import ServerCore
from service.errors import InvalidRequest
from state_store import UnknownSlot

LAYER = 1
NAMES = ("q", "k", "v", "g", "beta")
WAIT_S = 10.0  # the most any step waits (a hang fails, never blocks the suite)


# -- harness -----------------------------------------------------------------------------


def _settings(**overrides: object) -> Settings:
    """Test geometry, no batch window, every launch on the device thread (inline 0)."""
    base: dict[str, object] = dict(device="cpu", backend="torch", num_layers=LAYERS, num_slots=8, num_heads=HV,
                                   head_dim=K, head_v_dim=V, batch_window_ms=0, inline_launch_tokens=0,
                                   prefix_cache_mb=4)
    base.update(overrides)
    return Settings(**base)


class _Gate:
    """`kernels.run_problem` that blocks the next armed launch on the device thread until
    `open`; counts launches and the sequences of each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = kernels.run_problem
        self.armed = 0
        self.entered = threading.Event()
        self.go = threading.Event()
        self.launches: list[tuple[str, int]] = []  # (thread name, sequences)
        monkeypatch.setattr(kernels, "run_problem", self)

    def __call__(self, problem, backend):  # noqa: ANN001
        self.launches.append((threading.current_thread().name, int(problem.indices.shape[0])))
        if self.armed and threading.current_thread().name.startswith("kda-device"):
            self.armed -= 1
            self.entered.set()
            if not self.go.wait(WAIT_S):
                raise RuntimeError("the test never opened the gate")
        return self.real(problem, backend)

    def arm(self) -> None:
        self.entered.clear()
        self.go.clear()
        self.launches.clear()
        self.armed = 1

    def open(self) -> None:
        self.armed = 0
        self.go.set()

    async def held(self) -> None:
        """Return once the armed launch is inside the kernels."""
        await _until(self.entered.is_set)


async def _until(predicate: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def _settle() -> None:
    """Let every ready coroutine run until it blocks (on the ordering, the device, ...)."""
    for _ in range(20):
        await asyncio.sleep(0)


@asynccontextmanager
async def _core(gate: Optional[_Gate] = None, warm: bool = True, **overrides: object) -> AsyncIterator[ServerCore]:
    core = ServerCore(_settings(**overrides))
    await core.start()
    try:
        if warm:
            assert (await core.warmup()).passed
        yield core
    finally:
        if gate is not None:
            gate.open()
        await core.close()


def _run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))


def _prefill(slot: Optional[str], seq: tuple[torch.Tensor, ...], layer: int = LAYER,
             checkpoints: Optional[list[list[Checkpoint]]] = None) -> PrefillInputs:
    return PrefillInputs.of(PrefillParams(layer=layer), [slot], [seq[0].shape[0]], dict(zip(NAMES, seq)),
                            checkpoints=checkpoints)


async def _prepare(core: ServerCore, slots: list[str], gen: torch.Generator, layer: int = LAYER) -> PreparedPrefill:
    """A prepared decode step (one token per slot, fixed values: every run applies the same step)."""
    step = [make_sequence(1, gen) for _ in slots]
    buffers = {name: torch.cat([s[i] for s in step]) for i, name in enumerate(NAMES)}
    inputs = PrefillInputs.of(PrefillParams(layer=layer), list(slots), [1] * len(slots), buffers)
    return await core.prepare(inputs, lambda: None, lambda result: None)


async def _twins(core: ServerCore, gen: torch.Generator, n: int = 1) -> tuple[list[str], list[str]]:
    """n slots to race on and n reference slots, pairwise holding the same random state."""
    slots = await core.alloc(2 * n)
    for i, state in enumerate(random_state(gen, n)):
        await core.put_state(slots[i], state)
        await core.put_state(slots[n + i], state)
    return slots[:n], slots[n:]


async def _same(core: ServerCore, a: str, b: str) -> None:
    """Slots a and b hold the same state bit for bit and the same token counts."""
    assert torch.equal(await core.get_state(a), await core.get_state(b))
    assert (await core.slot_info(a)).tokens_per_layer == (await core.slot_info(b)).tokens_per_layer


# -- slot operations queued behind a launch on the slot: each sees the launch whole -------


@pytest.mark.parametrize("op", ["get_state", "export", "fork", "put_state", "free"])
def test_slot_operations_wait_for_the_launch_in_flight_on_the_slot(op: str, gen: torch.Generator,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """While a prefill on slot a is held inside the kernels, an operation on a waits (its
    keys held); it then sees the whole update, never half of it, and what it does lands
    after it: the same as a reference slot run one request at a time."""
    seq = make_sequence(70, gen)  # two chunks
    new_state = random_state(gen)[0]

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False) as core:
            (a,), (ref,) = await _twins(core, gen)
            await core.prefill(_prefill(ref, seq))
            gate.arm()
            launch = asyncio.create_task(core.prefill(_prefill(a, seq)))
            await gate.held()
            ops: dict[str, Callable[[str], Awaitable[object]]] = {
                "get_state": core.get_state, "export": core.export_state, "fork": core.fork,
                "put_state": lambda s: core.put_state(s, new_state), "free": core.free,
            }
            racing = asyncio.create_task(ops[op](a))
            await _settle()
            assert not racing.done()  # it waits for the launch on its slot
            gate.open()
            result = await launch
            got = await racing
            assert result.slots == [a]
            if op == "get_state":
                assert torch.equal(got, await core.get_state(ref))
            elif op == "export":
                assert got == await core.export_state(ref)
            elif op == "fork":
                await _same(core, got, ref)
                await _same(core, a, ref)
            elif op == "put_state":
                assert torch.equal(await core.get_state(a), new_state)
                assert (await core.slot_info(a)).tokens_per_layer == (await core.slot_info(ref)).tokens_per_layer
            elif op == "free":
                assert not core.has_slot(a)
                with pytest.raises(UnknownSlot):
                    await core.get_state(a)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_publish_waits_for_the_launch_in_flight(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish of a slot held inside a launch on each layer waits for it: the entry holds
    the updated state (every layer at 70 tokens), bit for bit the reference's."""
    seqs = [make_sequence(70, gen) for _ in range(LAYERS)]

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False) as core:
            (a,), (ref,) = await _twins(core, gen)
            for layer in range(LAYERS):
                await core.prefill(_prefill(ref, seqs[layer], layer))
            for layer in range(LAYERS - 1):
                await core.prefill(_prefill(a, seqs[layer], layer))
            gate.arm()
            launch = asyncio.create_task(core.prefill(_prefill(a, seqs[-1], LAYERS - 1)))
            await gate.held()
            publish = asyncio.create_task(core.publish(a, "p"))
            await _settle()
            assert not publish.done()
            gate.open()
            await launch
            info = await publish
            assert info.tokens == 70 and info.complete
            (restored,), match = await core.alloc_prefix(["p"])
            assert match.tokens == 70
            await _same(core, restored, ref)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


@pytest.mark.parametrize("op", ["get_state", "fork", "put_state", "free"])
def test_slot_operations_wait_for_a_prepared_run_in_flight(op: str, gen: torch.Generator,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a prepared run held inside the kernels; a run after a free is refused."""
    new_state = random_state(gen)[0]

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate) as core:
            (a,), (ref,) = await _twins(core, gen)
            prepared = await _prepare(core, [a], gen)
            gate.arm()
            run = asyncio.create_task(core.run_prepared(prepared))
            await gate.held()
            racing = asyncio.create_task({"get_state": core.get_state, "fork": core.fork, "free": core.free,
                                          "put_state": lambda s: core.put_state(s, new_state)}[op](a))
            await _settle()
            assert not racing.done()
            gate.open()
            await run
            got = await racing
            # the reference: the same run, alone
            ref_prepared = await core.prepare(
                PrefillInputs.of(PrefillParams(layer=LAYER), [ref], [1], dict(zip(NAMES, (
                    getattr(prepared.valid.inputs, n) for n in NAMES)))), lambda: None, lambda r: None)
            await core.run_prepared(ref_prepared)
            if op == "get_state":
                assert torch.equal(got, await core.get_state(ref))
            elif op == "fork":
                await _same(core, got, ref)
                await _same(core, a, ref)
            elif op == "put_state":
                assert torch.equal(await core.get_state(a), new_state)
                assert (await core.slot_info(a)).tokens_per_layer[LAYER] == 1
            else:
                with pytest.raises(UnknownSlot):
                    await core.run_prepared(prepared)
            await core.release_prepared(prepared)
            await core.release_prepared(ref_prepared)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


# -- prepared runs and prefills sharing a slot ---------------------------------------------


@pytest.mark.parametrize("prepared_first", [True, False], ids=["prepared first", "prefill first"])
def test_a_prepared_run_and_a_prefill_on_one_slot_apply_in_arrival_order(prepared_first: bool,
                                                                         gen: torch.Generator,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepared run and a batched prefill on the same (slot, layer), the second arriving
    while the first is held inside the kernels: applied in arrival order, one launch each."""
    seq = make_sequence(70, gen)

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate) as core:
            (a,), (ref,) = await _twins(core, gen)
            prepared = await _prepare(core, [a], gen)
            ref_prepared = await core.prepare(
                PrefillInputs.of(PrefillParams(layer=LAYER), [ref], [1],
                                 {n: getattr(prepared.valid.inputs, n) for n in NAMES}), lambda: None, lambda r: None)
            if prepared_first:
                await core.run_prepared(ref_prepared)
                await core.prefill(_prefill(ref, seq))
            else:
                await core.prefill(_prefill(ref, seq))
                await core.run_prepared(ref_prepared)
            gate.arm()
            first = asyncio.create_task(core.run_prepared(prepared) if prepared_first
                                        else core.prefill(_prefill(a, seq)))
            await gate.held()
            second = asyncio.create_task(core.prefill(_prefill(a, seq)) if prepared_first
                                         else core.run_prepared(prepared))
            await _settle()
            assert not second.done()
            gate.open()
            await first
            await second
            assert [n for _, n in gate.launches] == [1, 1]
            await _same(core, a, ref)
            assert (await core.slot_info(a)).tokens_per_layer[LAYER] == 71
            for p in (prepared, ref_prepared):
                await core.release_prepared(p)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_two_prepared_prefills_sharing_a_slot_run_one_at_a_time(gen: torch.Generator,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared prefills on [a, b] and [b, c], run concurrently (the first held inside the
    kernels): b advances by both, in arrival order; a and c by one each."""
    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate) as core:
            (a, b, c), (ra, rb, rc) = await _twins(core, gen, 3)
            p1, p2 = await _prepare(core, [a, b], gen), await _prepare(core, [b, c], gen)

            def twin(p: PreparedPrefill, slots: list[str]) -> Awaitable[PreparedPrefill]:
                return core.prepare(PrefillInputs.of(PrefillParams(layer=LAYER), slots, [1, 1],
                                                     {n: getattr(p.valid.inputs, n) for n in NAMES}),
                                    lambda: None, lambda r: None)
            r1, r2 = await twin(p1, [ra, rb]), await twin(p2, [rb, rc])
            await core.run_prepared(r1)
            await core.run_prepared(r2)
            gate.arm()
            first = asyncio.create_task(core.run_prepared(p1))
            await gate.held()
            second = asyncio.create_task(core.run_prepared(p2))
            await _settle()
            assert not second.done()
            gate.open()
            await asyncio.gather(first, second)
            for s, r in ((a, ra), (b, rb), (c, rc)):
                await _same(core, s, r)
            assert (await core.slot_info(b)).tokens_per_layer[LAYER] == 2
            for p in (p1, p2, r1, r2):
                await core.release_prepared(p)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_two_prefills_on_one_slot_pending_together_are_not_merged(gen: torch.Generator,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With a batch window, prefills on slot b (twice) and slot c arrive while a launch on
    slot a holds the device: b's second waits for its first (its key held), so no launch
    names b twice; every slot ends as its reference, b with both updates in order."""
    s1, s2, s3 = (make_sequence(9, gen) for _ in range(3))

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False, batch_window_ms=5) as core:
            (a, b, c), (ra, rb, rc) = await _twins(core, gen, 3)
            for slot, seq in ((ra, s1), (rb, s1), (rb, s2), (rc, s3)):
                await core.prefill(_prefill(slot, seq))
            gate.arm()
            held = asyncio.create_task(core.prefill(_prefill(a, s1)))
            await gate.held()
            tasks = [asyncio.create_task(core.prefill(_prefill(slot, seq))) for slot, seq in
                     ((b, s1), (b, s2), (c, s3))]
            await _settle()
            gate.open()
            await held
            await asyncio.gather(*tasks)
            sizes = [n for _, n in gate.launches]
            assert sum(sizes) == 4 and max(sizes) <= 2  # [a], [b, c], [b]: b never twice in one launch
            for s, r in ((a, ra), (b, rb), (c, rc)):
                await _same(core, s, r)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


# -- cancellation ------------------------------------------------------------------------


def test_a_request_cancelled_while_it_waits_for_its_slot_changes_nothing(gen: torch.Generator,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill and a prepared run on slot a cancelled while they wait in the slot
    ordering (a launch on a held in the kernels) and a prefill on slot b cancelled in the
    batcher's queue (window) change nothing, leave no key held, and later work proceeds."""
    seq = make_sequence(9, gen)

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, batch_window_ms=200) as core:
            (a, b), (ra, rb) = await _twins(core, gen, 2)
            prepared = await _prepare(core, [a], gen)
            await core.prefill(_prefill(ra, seq))
            gate.arm()
            held = asyncio.create_task(core.prefill(_prefill(a, seq)))
            await gate.held()
            waiting = [asyncio.create_task(core.prefill(_prefill(a, seq))),
                       asyncio.create_task(core.run_prepared(prepared))]
            queued = asyncio.create_task(core.prefill(_prefill(b, seq)))
            await _settle()
            assert core.ordering.queued((a, LAYER)) == 3 and not queued.done()
            for task in (*waiting, queued):
                task.cancel()
            await asyncio.gather(*waiting, queued, return_exceptions=True)
            assert all(t.cancelled() for t in (*waiting, queued))
            assert core.ordering.queued((a, LAYER)) == 1 and core.ordering.queued((b, LAYER)) == 0
            gate.open()
            await held
            await _same(core, a, ra)
            await _same(core, b, rb)
            await core.prefill(_prefill(a, seq))
            await core.prefill(_prefill(ra, seq))
            await _same(core, a, ra)
            await core.release_prepared(prepared)
            assert core.ordering.queued((a, LAYER)) == 0 and core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_a_prefill_cancelled_while_queued_on_the_device_thread_changes_nothing(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device thread is busy (a prepared run on slot b held in the kernels): a prefill
    on slot a is taken by the batcher and queued on the device thread behind it. Its
    caller is cancelled there, before its launch started: the slot must not change."""
    seq = make_sequence(9, gen)

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate) as core:
            a, b = await core.alloc(2)
            await core.put_state(a, random_state(gen)[0])
            before = await core.get_state(a)
            prepared = await _prepare(core, [b], gen)
            gate.arm()
            busy = asyncio.create_task(core.run_prepared(prepared))
            await gate.held()
            cancelled = asyncio.create_task(core.prefill(_prefill(a, seq)))
            await _settle()
            assert core.ordering.queued((a, LAYER)) == 1
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            gate.open()
            await busy
            await core.release_prepared(prepared)
            assert (await core.slot_info(a)).tokens_per_layer == [0, 0]
            assert torch.equal(await core.get_state(a), before)

    _run(main)


def test_a_prefill_cancelled_mid_launch_keeps_its_slot_until_the_launch_is_done(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill 1 (64 tokens) on slot a is cancelled while held inside the kernels; the
    launch runs on and commits (64 tokens counted). Prefill 2 (64 more, a checkpoint at
    its end) arrives then: it must wait for that launch (the cancelled submitter keeps its
    slot until the launch has ended), so its checkpoint at offset 128 is valid and the
    entry holds a's state at 128 tokens (checked at once against a count of 0, offset 128
    would be refused and offset 64 would store a 128-token state labelled 64)."""
    s1, s2 = make_sequence(64, gen), make_sequence(64, gen)

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False) as core:
            (a,) = await core.alloc(1)
            gate.arm()
            first = asyncio.create_task(core.prefill(_prefill(a, s1)))
            await gate.held()
            first.cancel()
            await _settle()
            assert not first.done()  # it waits for its launch, holding its slot
            second = asyncio.create_task(core.prefill(_prefill(a, s2, checkpoints=[[Checkpoint(128, "k")]])))
            await _settle()
            gate.open()
            await asyncio.gather(first, return_exceptions=True)
            await second
            assert (await core.slot_info(a)).tokens_per_layer[LAYER] == 128
            info = core.prefix_cache.info("k")
            assert info is not None and info.tokens == 128

    _run(main)


def test_a_call_cancelled_while_queued_on_the_device_thread_leaves_it_idle_after(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET state cancelled while it waits behind other device work (its executor job is
    cancelled before it starts): once the thread has drained, it is idle again, so a small
    prefill runs inline on the event loop as before."""
    seq = make_sequence(4, gen)

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False, inline_launch_tokens=None) as core:
            (a,) = await core.alloc(1)
            gate.launches.clear()
            await core.prefill(_prefill(a, seq))
            assert gate.launches[-1][0] == threading.current_thread().name  # inline, on the loop
            release = threading.Event()
            busy = asyncio.create_task(core.worker.run(release.wait, WAIT_S))
            await _settle()
            waiting = asyncio.create_task(core.get_state(a))
            await _settle()
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            release.set()
            await busy
            assert core.worker.idle
            await core.prefill(_prefill(a, seq))
            assert gate.launches[-1][0] == threading.current_thread().name

    _run(main)


def test_a_prefill_cancelled_while_its_slot_is_allocated_leaves_no_slot(gen: torch.Generator,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    seq = make_sequence(4, gen)

    async def main() -> None:
        async with _core(warm=False) as core:
            entered, go = threading.Event(), threading.Event()
            real_alloc = core.pool.alloc

            def slow_alloc(count: int = 1) -> list[str]:
                entered.set()
                go.wait(WAIT_S)
                return real_alloc(count)

            monkeypatch.setattr(core.pool, "alloc", slow_alloc)
            task = asyncio.create_task(core.prefill(_prefill(None, seq)))
            await _until(entered.is_set)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            go.set()
            await core.worker.run(lambda: None)  # the allocation is done: its slot exists
            await _until(lambda: core.stats().used == 0)  # and is freed

    _run(main)


# -- releasing a prepared prefill ----------------------------------------------------------


def test_releasing_a_prepared_prefill_during_its_run_lets_the_run_finish(gen: torch.Generator,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """release_prepared while a run is inside the kernels: the run finishes and stands,
    the release after it; a later run is refused and changes nothing."""
    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate) as core:
            (a,) = await core.alloc(1)
            prepared = await _prepare(core, [a], gen)
            gate.arm()
            run = asyncio.create_task(core.run_prepared(prepared))
            await gate.held()
            release = asyncio.create_task(core.release_prepared(prepared))
            await _settle()
            assert not prepared.closed
            gate.open()
            await run
            await release
            assert prepared.closed
            after = await core.get_state(a)
            with pytest.raises(InvalidRequest):
                await core.run_prepared(prepared)
            assert torch.equal(await core.get_state(a), after)
            assert (await core.slot_info(a)).tokens_per_layer[LAYER] == 1 and core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_a_run_queued_when_its_prepared_prefill_is_released_never_runs(gen: torch.Generator,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Run 1 of a prepared prefill is held inside the kernels; run 2 of it waits for its
    slot; then the prefill is released. Run 1 stands; run 2 must be refused (400) with
    nothing changed: the slot counts one token."""
    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate) as core:
            (a,) = await core.alloc(1)
            prepared = await _prepare(core, [a], gen)
            gate.arm()
            first = asyncio.create_task(core.run_prepared(prepared))
            await gate.held()
            second = asyncio.create_task(core.run_prepared(prepared))
            await _settle()
            release = asyncio.create_task(core.release_prepared(prepared))
            await _settle()
            gate.open()
            await first
            await release
            outcome = (await asyncio.gather(second, return_exceptions=True))[0]
            assert (await core.slot_info(a)).tokens_per_layer[LAYER] == 1
            assert isinstance(outcome, InvalidRequest), outcome

    _run(main)


# -- snapshots and the ttl ------------------------------------------------------------------


def test_a_snapshot_while_a_launch_runs_holds_the_slot_before_or_after_it_whole(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """A checkpoint requested while a launch is held inside the kernels waits for it: the
    snapshot restores (in a new core) to the state after the launch, bit for bit, with its
    token count."""
    seq = make_sequence(70, gen)
    path = str(tmp_path / "pool.snap")

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False, snapshot_path=path, snapshot_interval_s=0) as core:
            (a,), (ref,) = await _twins(core, gen)
            await core.prefill(_prefill(ref, seq))
            gate.arm()
            launch = asyncio.create_task(core.prefill(_prefill(a, seq)))
            await gate.held()
            snap = asyncio.create_task(core.checkpoint(force=True))
            await _settle()
            assert not snap.done()
            gate.open()
            await launch
            await snap
            expected = await core.get_state(ref)
            os_path = path
        async with _core(warm=False, snapshot_path=os_path, snapshot_interval_s=0) as restored:
            assert torch.equal(await restored.get_state(a), expected)
            info = await restored.slot_info(a)
            assert info.tokens_per_layer[LAYER] == 70 and not info.state_lost

    _run(main)


def test_a_slot_expiring_during_its_launch_does_not_half_apply_the_request(gen: torch.Generator,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill on [a, b] held inside the kernels while the (fake) clock passes b's ttl;
    meanwhile a is used (a prepare resolves it on the loop), b is not. The request must
    stand whole or change nothing; here it fails with UnknownSlot(b) while a's state
    advanced without its tokens being counted."""
    seq_a, seq_b = make_sequence(5, gen), make_sequence(5, gen)
    now = [1000.0]

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, slot_ttl_s=100.0) as core:
            monkeypatch.setattr(core.pool, "_clock", lambda: now[0])
            a, b = await core.alloc(2)
            before = await core.get_state(a)
            inputs = PrefillInputs.of(PrefillParams(layer=LAYER), [a, b], [5, 5],
                                      {n: torch.cat([x, y]) for n, x, y in zip(NAMES, seq_a, seq_b)})
            gate.arm()
            launch = asyncio.create_task(core.prefill(inputs))
            await gate.held()
            now[0] += 60.0
            preparing = asyncio.create_task(_prepare(core, [a], gen))  # resolves a on the loop: a use
            await _settle()  # (its build waits for the device thread)
            now[0] += 90.0  # b idle 150 s, past the ttl; a 90 s
            gate.open()
            outcome = (await asyncio.gather(launch, return_exceptions=True))[0]
            prepared = await preparing
            tokens = (await core.slot_info(a)).tokens_per_layer[LAYER]
            changed = not torch.equal(await core.get_state(a), before)
            await core.release_prepared(prepared)
            assert core.pool.free_spare_rows == core.pool.spare_rows
            # whole (a advanced and counted) or nothing (a unchanged, nothing counted)
            assert (changed, tokens) in ((True, 5), (False, 0)), (outcome, changed, tokens)

    _run(main)


def test_a_sweep_requested_during_a_launch_frees_only_the_idle_slot(gen: torch.Generator,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """ttl 100 s on a fake clock: b idles since t=900, a launch on a starts at t=1000 and is
    held in the kernels while the clock reaches 1050 and a sweep is asked for. The sweep
    runs after the launch: it frees b alone; a stands whole, as its reference."""
    seq = make_sequence(9, gen)
    now = [900.0]

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False, slot_ttl_s=100.0) as core:
            monkeypatch.setattr(core.pool, "_clock", lambda: now[0])
            (b,) = await core.alloc(1)
            now[0] = 1000.0
            (a,), (ref,) = await _twins(core, gen)
            await core.prefill(_prefill(ref, seq))
            gate.arm()
            launch = asyncio.create_task(core.prefill(_prefill(a, seq)))
            await gate.held()
            now[0] = 1050.0
            sweep = asyncio.create_task(core.sweep())
            await _settle()
            gate.open()
            await launch
            assert await sweep == [b]
            await _same(core, a, ref)
            assert core.slot_ids() and b not in core.slot_ids() and core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_work_queued_behind_a_free_finds_the_slot_gone(gen: torch.Generator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A free and then a prefill, a GET state and a fork of slot a arrive while a launch on
    a is held in the kernels: the free lands after the launch, the three after it answer
    404 and change nothing; no id is issued twice."""
    seq = make_sequence(9, gen)

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False) as core:
            (a,) = await core.alloc(1)
            gate.arm()
            launch = asyncio.create_task(core.prefill(_prefill(a, seq)))
            await gate.held()
            free = asyncio.create_task(core.free(a))
            after = [asyncio.create_task(coro) for coro in
                     (core.prefill(_prefill(a, seq)), core.get_state(a), core.fork(a))]
            await _settle()
            gate.open()
            await launch
            await free
            outcomes = await asyncio.gather(*after, return_exceptions=True)
            assert all(isinstance(o, UnknownSlot) for o in outcomes), outcomes
            assert core.stats().used == 0 and core.stats().frees == 1
            fresh = await core.alloc(8)
            assert a not in fresh and core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)


def test_restoring_a_prefix_while_its_last_layer_is_checkpointed_sees_it_whole(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """alloc_prefix of key k while the launch writing k's last layer (a checkpoint) is held
    in the kernels: it waits, then restores the complete entry, bit for bit the state of
    the slot that wrote it."""
    seqs = [make_sequence(64, gen) for _ in range(LAYERS)]

    async def main() -> None:
        gate = _Gate(monkeypatch)
        async with _core(gate, warm=False) as core:
            (a,) = await core.alloc(1)
            marks = [[Checkpoint(64, "k")]]
            for layer in range(LAYERS - 1):
                await core.prefill(_prefill(a, seqs[layer], layer, checkpoints=marks))
            assert core.prefix_peek(["k"]).matched == 0  # incomplete
            gate.arm()
            launch = asyncio.create_task(core.prefill(_prefill(a, seqs[-1], LAYERS - 1, checkpoints=marks)))
            await gate.held()
            restore = asyncio.create_task(core.alloc_prefix(["k"]))
            await _settle()
            assert not restore.done()
            gate.open()
            await launch
            (restored,), match = await restore
            assert match.matched == 1 and match.tokens == 64
            await _same(core, restored, a)
            assert core.pool.free_spare_rows == core.pool.spare_rows

    _run(main)
