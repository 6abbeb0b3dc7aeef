"""The storage rows (`RowMap`): every slot operation, snapshot and prefix-cache
copy follows the rows a launch moved, a refused or failed update changes nothing, and a
`SlotGroup` is vouched for only while its slots are live. Pool-level tests on CPU tensors
with fresh random non-zero states compared bit for bit, and a few on the in-process
`ServerCore`."""
from __future__ import annotations

import asyncio
import random
import zlib

import pytest
import torch
from pool_helpers import FakeClock, PoolImage, assert_bit_equal, fill_random, make_pool, random_state

import state_store.pool as pool_module
from state_store import PrefixCache, StatePool, UnknownSlot

L, S = 3, 6  # pool_helpers.GEOMETRY's layers and slots


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _launch(pool: StatePool, layer: int, slots: list[str], values: torch.Tensor, commit: bool = True) -> None:
    """A launch on ``layer`` writing ``values`` [N, HV, V, K] to spare rows, then committed
    or handed back (a refused launch)."""
    rows = pool.rows(slots)
    read = pool.layer_rows(layer, rows)
    spares = pool.take_spares(len(slots))
    assert spares is not None and not set(spares) & set(read)
    pool.storage[spares] = values
    if commit:
        pool.commit_rows(layer, rows, read, spares)
    else:
        pool.return_spares(spares)


def _garbage_spares(pool: StatePool) -> None:
    """NaN into every free spare row (a refused launch's leftovers): never to be read."""
    spares = pool.take_spares(pool.spare_rows)
    assert spares is not None, "every spare row is free between launches"
    pool.storage[spares] = float("nan")
    pool.return_spares(spares)


def _moved_pool(gen: torch.Generator, clock=None, **kwargs) -> tuple[StatePool, list[str], dict[str, torch.Tensor]]:
    """A pool whose live slots (some rows freed between) went through many committed and
    refused launches on random layers; returns it, the live slots and what each must hold."""
    pool = make_pool(**({"clock": clock} if clock is not None else {}), **kwargs)
    fill_random(pool, seed=int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    slots = pool.alloc(S)
    model = {}
    for i, s in enumerate(slots):
        model[s] = random_state(pool, 100 + i)
        pool.write_state(s, model[s])
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    for _ in range(60):
        layer = rng.randrange(L)
        chosen = rng.sample(slots, rng.randint(1, min(4, pool.spare_rows)))
        values = torch.randn(len(chosen), *pool.storage.shape[1:], generator=gen) + 3.0
        commit = rng.random() < 0.75
        _launch(pool, layer, chosen, values, commit)
        if commit:
            for s, v in zip(chosen, values):
                model[s][layer] = v
    for gone in (slots[1], slots[4]):  # rows free again, their storage rows moved
        pool.free(gone)
        del model[gone]
    _garbage_spares(pool)
    return pool, [s for s in slots if s in model], model


def _assert_holds(pool: StatePool, model: dict[str, torch.Tensor]) -> None:
    for s, want in model.items():
        assert_bit_equal(pool.read_state(s), want)


# -- snapshots ------------------------------------------------------------------------------


@pytest.mark.parametrize("part_rows", [1, 2, 5, 1000], ids=lambda n: f"parts of {n} row(s)")
def test_snapshot_after_many_moves_restores_every_layer_of_every_slot(part_rows, gen, tmp_path, monkeypatch):
    """Snapshot of a pool whose rows moved on every layer (spare rows NaN), written in runs
    of at most ``part_rows`` storage rows, restored into a new pool and into the same pool:
    each live slot bit for bit on every layer, its token counts, the logical image."""
    pool, live, model = _moved_pool(gen)
    for i, s in enumerate(live):
        pool.record_tokens(s, i % L, 7 + i)
    row_bytes = pool.storage[0].numel() * pool.storage.element_size()
    monkeypatch.setattr(pool_module, "SNAPSHOT_PART_BYTES", part_rows * row_bytes)
    image, infos = pool.image(), {s: pool.slot_info(s) for s in live}
    assert not torch.isnan(image[:, [infos[s].row for s in live]]).any()
    pool.snapshot(tmp_path / "pool.snap")
    for target in (make_pool(), pool):
        fill_random(target, seed=99)
        target.restore(tmp_path / "pool.snap")
        _assert_holds(target, model)
        assert {s: target.slot_info(s).tokens_per_layer for s in live} == {
            s: infos[s].tokens_per_layer for s in live}
        assert_bit_equal(target.image(), image)
        # and the restored pool moves rows again correctly
        (a,) = live[:1]
        new = torch.randn(1, *pool.storage.shape[1:], generator=gen)
        _launch(target, 2, [a], new)
        want = model[a].clone()
        want[2] = new[0]
        assert_bit_equal(target.read_state(a), want)


def test_a_restore_while_a_launch_holds_spare_rows_never_hands_a_row_out_twice(gen, tmp_path):
    """`restore` resets the row map, every spare row free again; the launch that held some
    (between `take_spares` and its commit or `return_spares`, under the pool's lock the
    caller may hold across it) then hands them back: the spare list held them twice, so
    the next launches took one storage row for two slots (two states in one row). Either
    the restore is refused while spare rows are out (the pool unchanged), or the rows
    handed back stay unique."""
    from state_store import PoolError

    pool, live, model = _moved_pool(gen)
    pool.snapshot(tmp_path / "pool.snap")
    image = PoolImage.of(pool)
    spares = pool.take_spares(2)
    assert spares is not None
    try:
        pool.restore(tmp_path / "pool.snap")
    except PoolError:
        image.assert_same(pool)  # refused: nothing changed
    pool.return_spares(spares)
    free = pool.take_spares(pool.spare_rows)
    assert free is not None and len(set(free)) == len(free), f"a spare row twice: {sorted(free)}"
    in_use = {r for layer in range(L) for r in pool.layer_rows(layer, range(S))}
    assert len(in_use) == L * S and not in_use & set(free)
    assert pool.take_spares(1) is None
    pool.return_spares(free)
    _assert_holds(pool, model)


def test_a_crash_after_moves_restores_the_snapshot_exactly_and_flags_what_advanced(gen, tmp_path):
    """Persistence over a pool whose rows moved: the snapshot (taken after many moves,
    spare rows NaN) comes back bit for bit after a crash; slots advanced by committed
    moves after it come back as of the snapshot, flagged lost; a refused launch after it
    (announced, never committed) flags its slot too (the safe side) but changes nothing."""
    from state_store import Persistence

    path = tmp_path / "pool.snap"
    pool, live, model = _moved_pool(gen)
    persistence = Persistence(pool, path)
    persistence.restore()
    persistence.snapshot()
    a, b, c = live[:3]
    persistence.advancing([a])
    _launch(pool, 0, [a], torch.randn(1, *pool.storage.shape[1:], generator=gen))
    persistence.advancing([b])
    _launch(pool, 2, [b], torch.full((1, *pool.storage.shape[1:]), float("nan")), commit=False)
    _garbage_spares(pool)
    persistence.close()
    del pool, persistence  # kill -9

    restored = make_pool()
    fill_random(restored, seed=5)
    report = Persistence(restored, path).restore()
    assert sorted(report.lost) == sorted([a, b]) and not report.gone
    _assert_holds(restored, model)
    assert {s for s in live if restored.slot_info(s).state_lost} == {a, b}


# -- slot copies after moves on some layers only ------------------------------------------


def test_fork_export_import_and_alloc_copies_follow_rows_moved_on_some_layers(gen):
    pool = make_pool()
    fill_random(pool, seed=3)
    a, b = pool.alloc(2)
    pool.write_state(a, random_state(pool, 1))
    pool.write_state(b, random_state(pool, 2))
    for _ in range(3):  # only layer 1 moves, a few times
        _launch(pool, 1, [a], torch.randn(1, *pool.storage.shape[1:], generator=gen))
    _garbage_spares(pool)
    want = pool.read_state(a)
    assert pool.layer_rows(0, pool.rows([a])).tolist() == [0 * S + 0] and pool.layer_rows(1, pool.rows([a])).tolist() != [1 * S + 0]
    c = pool.fork(a)
    d = pool.import_(pool.export(a))
    pool.import_(pool.export(a), b)
    e, f = pool.alloc_copies(want, 2, [1, 2, 3])
    for s in (a, b, c, d, e, f):
        assert_bit_equal(pool.read_state(s), want)
    # the copies are independent: moving a's rows again changes none of them
    _launch(pool, 1, [a], torch.randn(1, *pool.storage.shape[1:], generator=gen))
    for s in (b, c, d, e, f):
        assert_bit_equal(pool.read_state(s), want)


def test_prefix_publish_and_restore_after_moves_are_exact_copies(gen):
    pool, live, model = _moved_pool(gen)
    cache = PrefixCache(pool.geometry, device_bytes=8 * pool.geometry.bytes_per_slot)
    a = live[0]
    cache.publish("p", 5, pool.read_state(a))
    before = model[a].clone()
    _launch(pool, 0, [a], torch.randn(1, *pool.storage.shape[1:], generator=gen))  # a moves on after publishing
    with cache.restoring(["p"]) as held:
        assert held.state is not None
        copies = pool.alloc_copies(held.state, 2, [5] * L)
    for s in copies:
        assert_bit_equal(pool.read_state(s), before)
        assert pool.slot_info(s).tokens_per_layer == [5] * L


# -- a freed row reissued ------------------------------------------------------------------


def test_a_row_freed_and_reissued_after_moves_starts_from_zero_and_the_old_slot_is_gone(gen):
    pool, live, model = _moved_pool(gen)
    a = live[0]
    row = pool.rows([a])[0]
    group, _ = pool.group([a])
    pool.free(a)
    (b,) = pool.alloc(1)
    assert pool.rows([b]) == [row]
    assert not pool.group_live(group), "a freed slot's row taken by another: the generation moved"
    with pytest.raises(UnknownSlot):
        pool.group([a])
    assert not pool.read_state(b).any()
    for s in live[1:]:
        assert_bit_equal(pool.read_state(s), model[s])


def test_a_refused_launch_leaves_the_pool_bit_identical_after_moves(gen):
    pool, live, model = _moved_pool(gen, clock=FakeClock())  # a use at the same time: last_used unchanged
    image = PoolImage.of(pool)
    _launch(pool, 1, live, torch.full((len(live), *pool.storage.shape[1:]), float("nan")), commit=False)
    image.assert_same(pool)
    _assert_holds(pool, model)


# -- the server core ------------------------------------------------------------------------


class _FailsToHost(torch.Tensor):
    """o whose copy to the host fails (as a device-to-host copy can: a CUDA error, no host
    memory): the launch's last step, after its flags were read and judged."""

    def cpu(self, *args, **kwargs):
        raise RuntimeError("injected failure copying o to the host")


def test_a_launch_failing_after_its_flags_were_judged_changes_no_slot(gen, monkeypatch):
    """A launch that fails after its flags were judged (copying o to the host) is reported
    as a failed launch whose slots "were restored: nothing changed" (LaunchFailed.restored)
    and counts no token: the slot holds what it held (the slots move onto their new rows,
    `transaction.finish`, only after the host copies)."""
    from server_harness import HV, K, LAYERS, V, make_sequence

    import service.core.server as server_module
    from service.config import Settings
    from service.core.inputs import PrefillInputs, PrefillParams
    from service.core.server import ServerCore
    from service.core.transaction import LaunchFailed

    first, second = make_sequence(5, gen), make_sequence(3, gen)

    def inputs(slot: str, seq: tuple[torch.Tensor, ...]) -> PrefillInputs:
        return PrefillInputs.of(PrefillParams(layer=0), [slot], [seq[0].shape[0]],
                                dict(zip(("q", "k", "v", "g", "beta"), seq)))

    async def main() -> None:
        core = ServerCore(Settings(device="cpu", num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K,
                                   head_v_dim=V, batch_window_ms=0))
        await core.start()
        try:
            (slot,) = await core.alloc()
            await core.prefill(inputs(slot, first))
            before, info = await core.get_state(slot), await core.slot_info(slot)
            real = server_module.kernels.run_problem

            def run(problem, backend):
                o, rest = real(problem, backend)
                return o.as_subclass(_FailsToHost), rest

            monkeypatch.setattr(server_module.kernels, "run_problem", run)
            with pytest.raises(LaunchFailed) as failed:
                await core.prefill(inputs(slot, second))
            monkeypatch.setattr(server_module.kernels, "run_problem", real)
            assert failed.value.restored, "the error tells the client nothing changed"
            after, info_after = await core.get_state(slot), await core.slot_info(slot)
            assert info_after.tokens_per_layer == info.tokens_per_layer  # no token counted
            assert torch.equal(after, before), "a failed launch moved its slot onto the new state"
        finally:
            await core.close()

    asyncio.run(main())


def _decode_inputs(slots: list[str], gen: torch.Generator, layer: int):
    from server_harness import make_sequence

    from service.core.inputs import PrefillInputs, PrefillParams

    step = [make_sequence(1, gen) for _ in slots]
    buffers = {name: torch.cat([s[i] for s in step]) for i, name in enumerate(("q", "k", "v", "g", "beta"))}
    return PrefillInputs.of(PrefillParams(layer=layer), list(slots), [1] * len(slots), buffers)


def test_a_prepared_runs_slot_cannot_expire_while_the_run_is_in_flight(gen):
    """A prepared run on the device thread whose slots were used just under the ttl ago:
    a lazy expiry on the event loop during the run (`stats` for a metrics scrape,
    `has_slot`, `slot_info`, another request's `first_lost`) must not free a slot the run
    is updating (`StatePool.use_group` marks them used as the run starts, as
    `group` does for a batched prefill): the run's tokens are counted into live
    slots."""
    import threading

    from server_harness import HV, K, LAYERS, V

    from service.config import Settings
    from service.core.server import ServerCore

    clock = FakeClock()
    started, checked = threading.Event(), threading.Event()
    in_flight = {"on": False}

    def refill() -> None:  # on the device thread, inside the run, after group_live vouched for its slots
        if in_flight["on"]:
            clock.advance(0.2)  # the run's own time
            started.set()
            assert checked.wait(10)

    async def main() -> None:
        core = ServerCore(Settings(device="cpu", num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K,
                                   head_v_dim=V, slot_ttl_s=10.0, inline_launch_tokens=0))
        core.pool._clock = clock  # the test moves the pool's time by hand
        await core.start()
        try:
            assert (await core.warmup()).passed
            a, b = await core.alloc(2)
            prepared = await core.prepare(_decode_inputs([a, b], gen, 1), refill, lambda result: None)
            await core.run_prepared(prepared)
            clock.advance(9.9)  # idle 9.9 s of a 10 s ttl: the next run is vouched for
            in_flight["on"] = True
            run = asyncio.ensure_future(core.run_prepared(prepared))
            await asyncio.to_thread(started.wait, 10)
            core.stats()  # the event loop, while the run is in flight (a metrics scrape)
            checked.set()
            await run  # the run stands: its reply says both slots advanced
            assert core.has_slot(a) and core.has_slot(b), "a slot expired under a run that stood"
            assert core.pool.slot_info(a).tokens_per_layer[1] == 2
            await core.release_prepared(prepared)
        finally:
            checked.set()
            await core.close()

    asyncio.run(main())
