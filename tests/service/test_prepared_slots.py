"""A prepared run's slots on the core (`ServerCore.run_prepared`): checked again whenever
the pool no longer vouches for them (`StatePool.group_live`: a slot freed or lost, or one
idle past the ttl, which expires lazily without moving the generation), so such a run is
refused before it launches; the front end's answer given once the run stands, before the
token counts when the run is on the event loop (the reply leaves while the server counts);
each run timed in ``kda_kernel_seconds``."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest
import torch
from server_harness import HV, K, LAYERS, V, make_sequence, metric

from service.config import Settings
from service.core.inputs import PrefillInputs, PrefillParams
from service.core.prepared import PreparedPrefill, PreparedRun
from service.core.server import ServerCore
from service.errors import InvalidRequest
from state_store import UnknownSlot

LAYER = 1


def _inputs(slots: list[str], gen: torch.Generator) -> PrefillInputs:
    """A decode step of one token per slot, its packed tensors the buffers runs read."""
    step = [make_sequence(1, gen) for _ in slots]
    buffers = {name: torch.cat([s[i] for s in step]) for i, name in enumerate(("q", "k", "v", "g", "beta"))}
    return PrefillInputs.of(PrefillParams(layer=LAYER), list(slots), [1] * len(slots), buffers)


def _settings(**overrides: object) -> Settings:
    return Settings(device="cpu", num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                    **overrides)


@asynccontextmanager
async def _prepared_pair(inline: bool, gen: torch.Generator
                         ) -> AsyncIterator[tuple[ServerCore, list[str], PrefillInputs, PreparedPrefill]]:
    """A started core (its launches on the event loop when ``inline``, else on the device
    thread) with two slots and a prepared decode step over them, closed after."""
    core = ServerCore(_settings(inline_launch_tokens=None if inline else 0))
    await core.start()
    try:
        assert (await core.warmup()).passed
        slots = await core.alloc(2)
        inputs = _inputs(slots, gen)
        yield core, slots, inputs, await core.prepare(inputs, lambda: None, lambda result: None)
    finally:
        await core.close()


def test_a_run_with_a_slot_idle_past_the_ttl_is_refused_before_it_launches(gen: torch.Generator) -> None:
    """Slot a idles past the ttl (no sweep runs: nothing moved the pool's generation) while
    slot b is used: the run answers 404 for a, and b neither advanced nor counted a token."""
    async def main() -> None:
        core = ServerCore(_settings(slot_ttl_s=0.5))
        await core.start()
        try:
            assert (await core.warmup()).passed
            a, b = await core.alloc(2)
            prepared = await core.prepare(_inputs([a, b], gen), lambda: None, lambda result: None)
            await core.run_prepared(prepared)
            await asyncio.sleep(0.3)
            before = await core.get_state(b)  # a use: b stays live
            await asyncio.sleep(0.3)  # a idle 0.6 s
            with pytest.raises(UnknownSlot):
                await core.run_prepared(prepared)
            assert torch.equal(await core.get_state(b), before)
            assert core.pool.slot_info(b).tokens_per_layer[LAYER] == 1
            await core.release_prepared(prepared)
        finally:
            await core.close()

    asyncio.run(main())


@pytest.mark.parametrize("inline", [True, False], ids=["on the event loop", "on the device thread"])
def test_the_answer_comes_once_per_run_that_stands(inline: bool, gen: torch.Generator) -> None:
    """`answer` gets each standing run once, none for a refused one; a run on the event
    loop answers before its slots move onto their new rows and count its tokens, one on
    the device thread after; both are done when `run_prepared` returns either way."""
    async def main() -> None:
        async with _prepared_pair(inline, gen) as (core, slots, inputs, prepared):
            seen: list[tuple[PreparedRun, int, list[int]]] = []

            def storage_rows() -> list[int]:
                return core.pool.layer_rows(LAYER, core.pool.rows(slots)).tolist()

            def answer(run: PreparedRun) -> None:
                seen.append((run, core.pool.slot_info(slots[0]).tokens_per_layer[LAYER], storage_rows()))

            for step in range(3):
                before = storage_rows()
                ran = await core.run_prepared(prepared, answer)
                assert seen[-1][0] is ran and len(seen) == step + 1
                assert seen[-1][1] == (step if inline else step + 1)
                assert (seen[-1][2] == before) == inline  # the slots moved after the answer, or before it
                assert core.pool.slot_info(slots[0]).tokens_per_layer[LAYER] == step + 1
                assert storage_rows() != before
            inputs.q[0, 0, 0] = float("nan")
            with pytest.raises(InvalidRequest):
                await core.run_prepared(prepared, answer)
            assert len(seen) == 3 and core.pool.slot_info(slots[0]).tokens_per_layer[LAYER] == 3
            await core.release_prepared(prepared)

    asyncio.run(main())


async def _kernel_seconds(core: ServerCore) -> tuple[float, float]:
    """``kda_kernel_seconds``' count and sum on the core's page."""
    page = (await core.render_metrics()).decode()
    return metric(page, "kda_kernel_seconds_count"), metric(page, "kda_kernel_seconds_sum")


@pytest.mark.parametrize("inline", [True, False], ids=["on the event loop", "on the device thread"])
def test_each_prepared_run_is_timed_in_kda_kernel_seconds(inline: bool, gen: torch.Generator) -> None:
    """A run that stands and one refused (a NaN input: 400) each count once in
    ``kda_kernel_seconds``, as the batcher times its launches refused or not, their
    seconds within the time `run_prepared` took."""
    async def main() -> None:
        async with _prepared_pair(inline, gen) as (core, slots, inputs, prepared):
            count, seconds = await _kernel_seconds(core)
            started = time.perf_counter()
            await core.run_prepared(prepared)
            inputs.q[0, 0, 0] = float("nan")
            with pytest.raises(InvalidRequest):
                await core.run_prepared(prepared)
            took = time.perf_counter() - started
            after_count, after_seconds = await _kernel_seconds(core)
            assert after_count == count + 2
            assert 0 < after_seconds - seconds <= took
            await core.release_prepared(prepared)

    asyncio.run(main())
