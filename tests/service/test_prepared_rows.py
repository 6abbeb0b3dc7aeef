"""Prepared runs on the core, writing their new states to spare rows (`ServerCore.prepare`,
`run_prepared`): every run gives its spare rows back, committed or refused, so a pool with
exactly as many spare rows as the run has sequences serves run after run; the slots move
from row to row and still hold what the float64 reference says; a refused run (a NaN in
q) changes no slot. And the same on a pool without spare rows (in place, rows copied).
On the CPU, and on the GPU where there is one (marked ``gpu``: there each run replays a
CUDA graph that reads the rows uploaded for it)."""
from __future__ import annotations

import asyncio
from typing import Optional

import pytest
import torch
from server_harness import HV, K, LAYERS, TOL, V, make_sequence, reference, rel

from service.config import Settings
from service.core.inputs import PrefillInputs, PrefillParams, PrefillResult
from service.core.server import ServerCore
from service.errors import InvalidRequest

N = 3  # sequences of one token: a decode step
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs a CUDA device")]),
]


@pytest.mark.parametrize("spare_rows", [N, 0], ids=["as many spare rows as sequences", "in place"])
@pytest.mark.parametrize("device", DEVICES)
def test_prepared_decode_steps_move_rows_and_give_every_spare_back(device: str, spare_rows: Optional[int],
                                                                   gen: torch.Generator) -> None:
    settings = Settings(device=device, num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                        spare_rows=spare_rows)
    steps = [[make_sequence(1, gen) for _ in range(N)] for _ in range(6)]
    bad_step = 3  # this step's run is refused (a NaN in q) before the good values come back

    async def main() -> list[tuple[list[torch.Tensor], list[list[int]]]]:
        core = ServerCore(settings)
        await core.start()
        try:
            assert (await core.warmup()).passed  # compiles, runs the self-test: ready
            slots = await core.alloc(N)
            buffers = {name: torch.cat([s[i] for s in steps[0]]).to(device)
                       for i, name in enumerate(("q", "k", "v", "g", "beta"))}
            inputs = PrefillInputs.of(PrefillParams(layer=1), list(slots), [1] * N, buffers)
            delivered: list[PrefillResult] = []
            prepared = await core.prepare(inputs, lambda: None, delivered.append)
            assert prepared.graphed == (device == "cuda")
            seen = []
            for i, step in enumerate(steps):
                for j, name in enumerate(("q", "k", "v", "g", "beta")):
                    buffers[name].copy_(torch.cat([s[j] for s in step]))
                if i == bad_step:
                    before = [(await core.get_state(s)).cpu() for s in slots]
                    buffers["q"][1, 0, 0] = float("nan")
                    with pytest.raises(InvalidRequest) as refused:
                        await core.run_prepared(prepared)
                    assert refused.value.field == "q"
                    for slot, state in zip(slots, before):
                        assert torch.equal((await core.get_state(slot)).cpu(), state)
                    buffers["q"].copy_(torch.cat([s[0] for s in step]))
                await core.run_prepared(prepared)
                rows = [core.pool.layer_rows(1, core.pool.rows(slots))]
                seen.append(([(await core.get_state(s))[1].cpu() for s in slots], rows))
                assert core.pool.free_spare_rows == core.pool.spare_rows  # every spare row free again
            assert len(delivered) == len(steps)
            await core.release_prepared(prepared)
            return seen
        finally:
            await core.close()

    seen = asyncio.run(main())
    state = None
    for step, (finals, _) in zip(steps, seen):
        _, state = reference(step, initial=state)
        assert rel(torch.stack(finals), state) < TOL
    moved = len({tuple(rows[0]) for _, rows in seen}) > 1
    assert moved == (spare_rows > 0)  # with spare rows the slots live in other rows after each step


@pytest.mark.parametrize("spare_rows", [None, 0, 7])
def test_info_reports_the_spare_rows(spare_rows: Optional[int]) -> None:
    settings = Settings(num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V, spare_rows=spare_rows)
    info = asyncio.run(ServerCore(settings).info())
    assert info["spare_rows"] == (4 if spare_rows is None else spare_rows)
