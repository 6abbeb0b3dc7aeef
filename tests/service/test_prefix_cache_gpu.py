"""The prefix cache on a GPU, through `ServerCore` (one process, no HTTP): checkpoint states
written inside the launch into freed memory poisoned with NaN, on a varlen batch holding a
65536-token sequence, each within 1e-5 of a plain prefill of its prefix; restore plus the
rest within 1e-5 of the uninterrupted prefill."""
from __future__ import annotations

import asyncio

import pytest
import torch
from server_harness import HV, K, V, make_sequence

from service.config import Settings
from service.core.inputs import Checkpoint, PrefillInputs, PrefillParams
from service.core.server import ServerCore

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(slots, seqs, checkpoints=None) -> PrefillInputs:
    tensors = {name: torch.cat([s[i] for s in seqs]) for i, name in enumerate(("q", "k", "v", "g", "beta"))}
    return PrefillInputs.of(PrefillParams(layer=0), slots, [s[0].shape[0] for s in seqs], tensors,
                            checkpoints=checkpoints)


def _poison_cache() -> None:
    """Leave NaN in memory the caching allocator hands out next."""
    junk = torch.full((1 << 28,), float("nan"), device="cuda")
    del junk


def test_checkpoints_in_the_launch_and_restore_on_a_varlen_batch() -> None:
    asyncio.run(_run())


async def _run() -> None:
    settings = Settings(device="cuda", num_layers=1, num_slots=16, num_heads=HV, head_dim=K, head_v_dim=V,
                        batch_window_ms=0.0)
    core = ServerCore(settings)
    await core.start()
    try:
        gen = torch.Generator().manual_seed(65536)
        lengths = (65536, 1000, 64, 130, 1)
        seqs = [make_sequence(n, gen) for n in lengths]
        marks = [[Checkpoint(j, f"long.{j}") for j in (64, 4096, 32768, 65536)], [Checkpoint(1000, "mid.end"),
                 Checkpoint(960, "mid.960")], [Checkpoint(64, "exact")], [Checkpoint(128, "partial.128")],
                 [Checkpoint(1, "one")]]
        _poison_cache()
        full = await core.prefill(_inputs([None] * len(seqs), seqs, marks))
        for seq, seq_marks in zip(seqs, marks):
            for mark in seq_marks:
                prefix = tuple(t[:mark.offset] for t in seq)
                plain = await core.prefill(_inputs([None], [prefix]))
                (slot,), match = await core.alloc_prefix([mark.key])
                assert match.tokens == mark.offset
                got = await core.get_state(slot)
                assert torch.isfinite(got).all()
                assert _rel(got[0], plain.final_state[0]) < TOL, mark
                await core.free(slot)
                await core.free(plain.slots[0])
        long_o = full.o[:lengths[0]]
        (slot,), _ = await core.alloc_prefix(["long.4096"])
        rest = await core.prefill(_inputs([slot], [tuple(t[4096:] for t in seqs[0])]))
        assert _rel(rest.o, long_o[4096:]) < TOL
        assert _rel(rest.final_state[0], full.final_state[0]) < TOL
    finally:
        await core.close()
