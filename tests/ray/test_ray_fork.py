"""`POST /slots/{id}/fork` through the ingress: a single server answers 503 only when its
whole pool is full, so a fork whose source's shard is full copies the source (state bit
for bit, token counts, lost flag) onto a shard with room. In-process scenarios
(`local_shards.run_local`): no Ray cluster."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray.serve")  # the ray extra; CI installs it

from ray_helpers import LAYERS, make_sequence, shard_of  # noqa: E402
from local_shards import SETTINGS, Local, fill_layers, prefill_inputs, run_local, slots_on  # noqa: E402

from state_store import PoolFull  # noqa: E402

pytestmark = pytest.mark.timeout(240)


async def _assert_same(local: Local, first: str, second: str) -> None:
    """``first`` and ``second`` hold the same state bit for bit and the same token counts."""
    assert torch.equal(await local.core.get_state(first), await local.core.get_state(second))
    first_info, second_info = await local.core.slot_info(first), await local.core.slot_info(second)
    assert first_info.tokens_per_layer == second_info.tokens_per_layer
    assert first_info.state_lost == second_info.state_lost


def test_a_fork_from_a_full_shard_lands_on_one_with_room() -> None:
    """The source's shard proves full (the figures were stale: slots taken behind this
    replica's back): the fork is a copy on the other shard, as of the prefill answered
    before it, and the two slots are independent afterwards."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(21)
        (source,) = await slots_on(local, "a")
        await fill_layers(local, source, 9, gen)
        await local.core._free_slots()  # figures read now: shard a has 3 free
        await local.links["a"].shard.alloc(SETTINGS.num_slots - 1)  # behind this replica's back
        child = await local.core.fork(source)
        assert shard_of(child) == "b" and child != source
        assert torch.count_nonzero(await local.core.get_state(child)) > 0
        assert (await local.core.slot_info(child)).tokens_per_layer == [9] * LAYERS
        await _assert_same(local, source, child)
        before = await local.core.get_state(source)
        await local.core.prefill(prefill_inputs([child], [make_sequence(5, gen)]))
        assert torch.equal(await local.core.get_state(source), before)
        assert (await local.core.slot_info(source)).tokens_per_layer == [9] * LAYERS
        child_before = await local.core.get_state(child)
        await local.core.prefill(prefill_inputs([source], [make_sequence(3, gen)], layer=1))
        assert torch.equal(await local.core.get_state(child), child_before)
        assert (await local.core.slot_info(child)).tokens_per_layer == [14, 9]

    run_local(scenario, status_max_age_s=60.0)


def test_a_fork_of_a_lost_slot_from_a_full_shard_stays_lost() -> None:
    """As `StatePool.fork` does, the copy of a slot flagged state_lost is flagged lost too,
    with the source's token counts (the figures say the source's shard is full)."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(22)
        (source,) = await slots_on(local, "a")
        await fill_layers(local, source, 4, gen)
        await slots_on(local, "a", SETTINGS.num_slots - 1)
        local.links["a"].shard.core.pool.mark_lost([local.pool_token(source)])
        child = await local.core.fork(source)
        info = await local.core.slot_info(child)
        assert shard_of(child) == "b"
        assert info.state_lost and info.tokens_per_layer == [4] * LAYERS

    run_local(scenario)


def test_a_fork_is_503_only_while_every_shard_is_full() -> None:
    """With no room anywhere the fork is PoolFull (503), as on a full single server, and
    no slot was made or changed; once a slot is freed on another shard (behind this
    replica's back: its figures still say full) the same fork lands there."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(23)
        (source,) = await slots_on(local, "a")
        await fill_layers(local, source, 6, gen)
        await slots_on(local, "a", SETTINGS.num_slots - 1)
        taken = await slots_on(local, "b", SETTINGS.num_slots)
        before = await local.core.get_state(source)
        with pytest.raises(PoolFull):
            await local.core.fork(source)
        info = await local.core.info()
        assert (info["used_slots"], info["free_slots"]) == (2 * SETTINGS.num_slots, 0)
        assert torch.equal(await local.core.get_state(source), before)
        assert (await local.core.slot_info(source)).tokens_per_layer == [6] * LAYERS
        await local.links["b"].shard.free(taken[0])
        child = await local.core.fork(source)
        assert shard_of(child) == "b"
        await _assert_same(local, source, child)

    run_local(scenario, status_max_age_s=60.0)
