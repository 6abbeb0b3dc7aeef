"""Checkpoint arguments of `chunk_kda` / `kda_prefill`: what is rejected (before anything
runs: the pool stays bit-identical), and `kda_prefill` passing them through, on the torch
backend against the float64 reference. The kernels' checkpoint values are tested per
backend in tests/triton/test_triton_checkpoints.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import chunk_kda, kda_prefill, naive_recurrent_kda

H, HV, K, V = 2, 2, 16, 8
CU = [0, 130, 131, 200]  # a 130-token, a 1-token and a 69-token sequence


def inputs(T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
        v=torch.randn(1, T, HV, V, generator=gen), g=-F.softplus(torch.randn(1, T, HV, K, generator=gen)),
        beta=torch.randn(1, T, HV, generator=gen),
    )


def call(tokens, states, pool: torch.Tensor):
    x = inputs(CU[-1])
    return chunk_kda(**x, initial_state=pool, initial_state_indices=torch.tensor([0, 1, 2]),
                     cu_seqlens=torch.tensor(CU), use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     backend="torch", checkpoint_tokens=tokens, checkpoint_states=states)


def pool_of() -> torch.Tensor:
    return torch.randn(3, HV, V, K, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tokens,message", [
    ([0], "cu_seqlens[n] + 64 j"),  # j = 0: the initial state is not a checkpoint
    ([100], "cu_seqlens[n] + 64 j"),  # inside a chunk
    ([194], "cu_seqlens[n] + 64 j"),  # 64 past the 1-token sequence's start: inside the next one
    ([201], "cu_seqlens[n] + 64 j"),  # past the last token
    ([64, 64], "repeats a position"),
])
def test_bad_positions_are_rejected_before_anything_runs(tokens: list[int], message: str) -> None:
    pool = pool_of()
    before = pool.clone()
    states = torch.zeros(len(tokens), HV, V, K)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("+", r"\+")):
        call(torch.tensor(tokens, dtype=torch.int64), states, pool)
    assert torch.equal(pool, before)


def test_bad_tensors_are_rejected() -> None:
    pool = pool_of()
    good = torch.tensor([64, 130], dtype=torch.int64)
    cases = [
        (good, None, "given together"),
        (None, torch.zeros(2, HV, V, K), "given together"),
        (good.int(), torch.zeros(2, HV, V, K), "1-D int64"),
        (good, torch.zeros(3, HV, V, K), r"shape \(2, 2, 8, 16\)"),
        (good, torch.zeros(2, HV, K, V), r"shape \(2, 2, 8, 16\)"),
        (good, torch.zeros(2, HV, V, K, dtype=torch.bfloat16), "float32"),
        (good, [torch.zeros(HV, V, K)], r"2 tensors of shape \(2, 8, 16\)"),
        (good, [torch.zeros(HV, V, K), torch.zeros(HV, K, V)], r"2 tensors of shape \(2, 8, 16\)"),
        (good, [torch.zeros(HV, V, K), torch.zeros(HV, V, K, dtype=torch.bfloat16)], "float32"),
        (good, [torch.zeros(HV, V, K), torch.zeros(HV, K, V).transpose(1, 2)], "one set of strides"),
    ]
    for tokens, states, message in cases:
        with pytest.raises(ValueError, match=message):
            call(tokens, states, pool)


def test_allowed_positions_are_accepted() -> None:
    """Chunk ends of each sequence, its exact end, and a 1-token sequence's end."""
    pool = pool_of()
    tokens = torch.tensor([64, 128, 130, 131, 195, 200], dtype=torch.int64)
    states = torch.full((6, HV, V, K), float("nan"))
    call(tokens, states, pool)
    assert not torch.isnan(states).any()


def test_targets_may_be_separate_tensors() -> None:
    """A sequence of [HV, V, K] targets anywhere in memory takes the same states as the
    rows of one [C, HV, V, K] tensor, and nothing around them changes."""
    tokens = torch.tensor([64, 130, 131, 200], dtype=torch.int64)
    rows = torch.full((4, HV, V, K), float("nan"))
    call(tokens, rows, pool_of())
    homes = [torch.full((3, HV, V, K), float("nan")) for _ in range(4)]
    call(tokens, [h[1] for h in homes], pool_of())
    for c, home in enumerate(homes):
        assert torch.equal(home[1], rows[c])
        assert torch.isnan(home[0]).all() and torch.isnan(home[2]).all()


def test_kda_prefill_passes_checkpoints_through() -> None:
    x = inputs(CU[-1], seed=3)
    init = pool_of()
    tokens = torch.tensor([131, 64, 200], dtype=torch.int64)
    states = torch.full((3, HV, V, K), float("nan"))
    _, final = kda_prefill(**x, initial_state=init, cu_seqlens=torch.tensor(CU), use_qk_l2norm_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, backend="torch", checkpoint_tokens=tokens,
                           checkpoint_states=states)
    opts = dict(use_qk_l2norm=True, use_beta_sigmoid=True)
    _, prefix = naive_recurrent_kda(*(t[0, :64] for t in x.values()), initial_state=init[:1], **opts)
    assert torch.allclose(states[1].double(), prefix[0], rtol=0, atol=1e-4)
    assert torch.allclose(states[0], final[1]) and torch.allclose(states[2], final[2])
