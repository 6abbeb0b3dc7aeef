"""Checkpoints (`chunk_kda(checkpoint_tokens=..., checkpoint_states=...)`): the state after
every allowed position, written by the prefill's own launch, against the float64
reference, into a NaN-poisoned buffer whose rows outside the checkpoints must stay
bit-identical (`triton_cases.check_checkpoints`).

Interpreted on the CPU without CUDA (CI), compiled on a GPU; the last tests run only
there, at serving shapes.
"""
from __future__ import annotations

import pytest
import torch

from kernels.triton_kernels import config
from triton_cases import Case, check_checkpoints

FP32_TOL = 1e-4
BF16_TOL = 1e-2
LENGTHS = (130, 1, 64, 200, 5)  # partial, decode, exact, multi-chunk, short; one index -1


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_checkpoints_match_reference(device: str, output_path: str, gate: str) -> None:
    check_checkpoints(Case(LENGTHS, gate=gate), device, seed=21, tol=FP32_TOL)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_into_scattered_targets(device: str, output_path: str, pool_dtype: torch.dtype) -> None:
    """Each checkpoint into a tensor of its own (a cache entry's layer), by its address."""
    tol = FP32_TOL if pool_dtype == torch.float32 else BF16_TOL
    check_checkpoints(Case(LENGTHS, gate="lower_bound", pool_dtype=pool_dtype), device, seed=27, tol=tol,
                      scattered=True)


def override_config(monkeypatch: pytest.MonkeyPatch, **overrides: object) -> None:
    """Run the Triton backend with its shape-chosen launch config changed by ``overrides``."""
    import kernels.triton_backend as backend

    real = backend.select_config
    monkeypatch.setattr(backend, "select_config",
                        lambda K, V, interpret: real(K, V, interpret).with_overrides(**overrides))


@pytest.fixture
def at_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state pass loading each checkpoint address right before its store, not a chunk
    ahead (`LaunchConfig.state_ckpt_prefetch` off)."""
    override_config(monkeypatch, state_ckpt_prefetch=False, state_ckpt_levels=0)


@pytest.mark.parametrize("pieces", [False, True], ids=["one piece", "pieces"])
def test_checkpoints_with_addresses_loaded_at_the_store(device: str, output_path: str, pieces: bool, at_the_store: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(LENGTHS, gate="lower_bound", intermediate=pieces)
    if pieces:  # segments of one chunk
        monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", case.HV)
    check_checkpoints(case, device, seed=29, tol=FP32_TOL, scattered=True)


STORE_PATHS = {"segments end at checkpoints": 1 << 20, "in the chunk loop": 0}


@pytest.mark.parametrize("store", list(STORE_PATHS))
@pytest.mark.parametrize("pieces", [False, True], ids=["one piece", "pieces"])
def test_checkpoints_each_store_path(device: str, output_path: str, pieces: bool, store: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways the state pass stores checkpoints (`LaunchConfig.state_ckpt_levels`):
    segments cut at every checkpoint, each stored after its segment's chunk loop (a launch
    per level, states carried between them), or from inside the chunk loop."""
    case = Case(LENGTHS, gate="lower_bound", intermediate=pieces)
    if pieces:  # pieces of two chunks: cuts inside pieces and at their boundaries
        monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", 2 * case.HV)
    override_config(monkeypatch, state_ckpt_levels=STORE_PATHS[store])
    check_checkpoints(case, device, seed=31, tol=FP32_TOL, scattered=True)
    check_checkpoints(Case((70, 1, 129), v_first=False, K=16, V=32, pool_dtype=torch.bfloat16, gate="lower_bound"),
                      device, seed=32, tol=BF16_TOL)


def test_checkpoints_k_first_bf16_pool(device: str) -> None:
    check_checkpoints(Case((70, 1, 129), v_first=False, K=16, V=32, pool_dtype=torch.bfloat16, gate="lower_bound"),
                      device, seed=22, tol=BF16_TOL)


def test_checkpoints_across_pieces(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of one chunk: every sequence's state crosses carry rows between its checkpoints."""
    case = Case(LENGTHS, gate="lower_bound", intermediate=True)
    monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", case.HV)
    check_checkpoints(case, device, seed=23, tol=FP32_TOL)


def test_checkpoints_torch_backend() -> None:
    """The CPU backend takes the same checkpoints."""
    check_checkpoints(Case(LENGTHS, gate="lower_bound"), "cpu", seed=24, tol=FP32_TOL, backend="torch")
    check_checkpoints(Case((70, 1, 129), v_first=False, K=16, V=32), "cpu", seed=25, tol=FP32_TOL, backend="torch")
    check_checkpoints(Case(LENGTHS, gate="lower_bound"), "cpu", seed=28, tol=FP32_TOL, backend="torch", scattered=True)


STORE_VARIANTS = {"in the loop, addresses a chunk ahead": dict(state_ckpt_levels=0),
                  "in the loop, addresses at the store": dict(state_ckpt_levels=0, state_ckpt_prefetch=False),
                  "checkpoints end segments": dict(state_ckpt_levels=1 << 20)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("store", list(STORE_VARIANTS))
@pytest.mark.parametrize("scattered", [False, True], ids=["one buffer", "scattered"])
@pytest.mark.parametrize("pieces", [False, True], ids=["one piece", "pieces"])
@pytest.mark.parametrize("lengths", [(4096,), (2048, 1, 777, 300, 64)], ids=["narrow", "wide"])
def test_checkpoints_serving_shapes(lengths: tuple[int, ...], pieces: bool, scattered: bool, store: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """At serving shapes, each way the state pass can store its checkpoints: at every
    allowed position into one buffer, at one in five into scattered targets (as cache
    entries, a few per sequence)."""
    if pieces:
        monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", 7 * 32)
    override_config(monkeypatch, **STORE_VARIANTS[store])
    check_checkpoints(Case(lengths, H=32, HV=32, K=128, V=128, gate="lower_bound", dtype=torch.bfloat16),
                      "cuda", seed=26, tol=5e-3, ref_dtype=torch.float32, scattered=scattered,
                      every=5 if scattered else 1)

