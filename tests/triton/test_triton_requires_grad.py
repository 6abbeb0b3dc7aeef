"""The kernels are forward only on every backend: inputs that require grad (a caller's
activations straight from a model in training mode, a pool that is a leaf parameter) are
accepted, the results equal those of the same inputs detached, and no output requires grad.

Both backends run here: "torch" on CPU tensors, and "triton" compiled on a GPU or under
the Triton interpreter on the CPU (this folder's conftest).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import chunk_kda, kda_prefill

T, H, HV, K, V = 70, 2, 4, 16, 32  # two chunks, so the inter-chunk pass runs too


def _inputs(device: str) -> dict[str, torch.Tensor]:
    """Random q, k [1, T, H, K], v [1, T, HV, V], g [1, T, HV, K] (log decay), beta
    [1, T, HV] and an initial state [1, HV, V, K], fp32 on ``device``, none requiring grad."""
    gen = torch.Generator().manual_seed(23)
    tensors = {
        "q": torch.randn(1, T, H, K, generator=gen),
        "k": torch.randn(1, T, H, K, generator=gen) / K ** 0.5,
        "v": torch.randn(1, T, HV, V, generator=gen),
        "g": -F.softplus(torch.randn(1, T, HV, K, generator=gen) - 2.0),
        "beta": torch.rand(1, T, HV, generator=gen) * 0.9 + 0.05,
        "initial_state": torch.randn(1, HV, V, K, generator=gen) * 0.3,
    }
    return {name: t.to(device) for name, t in tensors.items()}


def _requiring_grad(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone().requires_grad_() for name, t in tensors.items()}


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, device: str) -> str:
    if request.param == "torch" and device != "cpu":
        pytest.skip("the torch backend serves CPU tensors")
    return request.param


def test_kda_prefill_accepts_inputs_that_require_grad(device: str, backend: str) -> None:
    plain = _inputs(device)
    o_ref, final_ref = kda_prefill(**plain, backend=backend)
    graded = _requiring_grad(plain)
    o, final = kda_prefill(**graded, backend=backend)
    assert not o.requires_grad and not final.requires_grad
    assert o.grad_fn is None and final.grad_fn is None
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=0)
    torch.testing.assert_close(graded["initial_state"].detach(), plain["initial_state"], rtol=0, atol=0)


def test_chunk_kda_updates_a_pool_that_requires_grad(device: str, backend: str) -> None:
    """A pool that is a leaf requiring grad is updated in place, as a plain one is."""
    plain = _inputs(device)
    pool_ref = plain.pop("initial_state").repeat(3, 1, 1, 1)
    indices = torch.tensor([1], device=device)
    o_ref = chunk_kda(**plain, initial_state=pool_ref, initial_state_indices=indices, backend=backend)
    graded = _requiring_grad(plain)
    pool = _inputs(device)["initial_state"].repeat(3, 1, 1, 1).requires_grad_()
    o = chunk_kda(**graded, initial_state=pool, initial_state_indices=indices, backend=backend)
    assert not o.requires_grad
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool.detach(), pool_ref, rtol=0, atol=0)
