"""Checkpoints (`chunk_kda(checkpoint_tokens=..., checkpoint_states=...)`): the state after
every allowed position, written by the prefill's own launch, against the float64
reference, into a NaN-poisoned buffer whose rows outside the checkpoints must stay
bit-identical (`triton_cases.check_checkpoints`).

Targets given by a provider (`PrefillProblem.checkpoint_provider`, as the server gives
them: placed in the prefix cache when the launch asks) on both backends: asked once, after
the first piece's parallel stages are queued, never without checkpoints, checked as given
targets are, and written bit for bit as given targets are.

Interpreted on the CPU without CUDA (CI), compiled on a GPU; the last tests run only
there, at serving shapes.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import pytest
import torch

import kernels.triton_backend as triton_backend
from kernels import run_problem
from kernels.api import build_problem
from kernels.problem import PrefillProblem
from kernels.triton_kernels import config
from triton_cases import Case, Inputs, check_checkpoints, chunk_ends, make_inputs, same_bits

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


class Provider:
    """A launch's provider of checkpoint targets: hands out ``targets`` and counts the calls."""

    def __init__(self, targets: Sequence[torch.Tensor], on_call: Callable[[], None] = lambda: None) -> None:
        self.targets, self.on_call, self.calls = list(targets), on_call, 0

    def __call__(self) -> list[torch.Tensor]:
        self.calls += 1
        self.on_call()
        return self.targets


def poisoned_targets(inp: Inputs, count: int) -> list[torch.Tensor]:
    """``count`` NaN-filled targets of one pool row each, scattered (a tensor of their own each)."""
    return [torch.full(inp.pool.shape[1:], float("nan"), dtype=inp.pool.dtype, device=inp.pool.device)
            for _ in range(count)]


def problem_of(case: Case, inp: Inputs, pool: torch.Tensor, positions: Sequence[int],
               targets: Sequence[torch.Tensor]) -> PrefillProblem:
    """``case``'s problem on ``pool`` with checkpoints at ``positions`` into ``targets``
    (checked as `chunk_kda` checks them; none when ``positions`` is empty)."""
    gate = dict(A_log=None, dt_bias=None, lower_bound=None) | inp.gate_kwargs
    tokens = torch.tensor(list(positions), dtype=torch.int64) if positions else None
    return build_problem(
        inp.q, inp.k, inp.v, inp.g, inp.beta, scale=None, pool=pool, indices=inp.indices, cu_seqlens=inp.cu_seqlens,
        use_qk_l2norm=case.l2norm, use_beta_sigmoid=case.sigmoid, allow_neg_eigval=case.neg_eigval,
        state_v_first=case.v_first, output_intermediate_states=case.intermediate,
        checkpoint_tokens=tokens, checkpoint_states=list(targets) if positions else None, **gate,
    )


def provided(problem: PrefillProblem, provider: Provider) -> PrefillProblem:
    """``problem`` with its checkpoint targets left to ``provider``."""
    return replace(problem, checkpoint_states=(), checkpoint_provider=provider)


@pytest.mark.parametrize("backend,pieces", [("triton", False), ("triton", True), ("torch", False)],
                         ids=["triton, one piece", "triton, pieces", "torch"])
def test_provided_targets_are_asked_once_and_written_bit_for_bit_as_given_ones(
        device: str, backend: str, pieces: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same problem twice, on equal pools: its checkpoint targets given, and left to a
    provider. o, h, the pool and every target are equal bit for bit; the provider was
    asked exactly once."""
    case = Case(LENGTHS, gate="lower_bound", intermediate=True)
    if pieces:
        monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", 2 * case.HV)
    inp = make_inputs(case, device, seed=33)
    positions = chunk_ends(inp.cu_seqlens.tolist(), seed=33)
    pools, targets = [inp.pool.clone(), inp.pool.clone()], [poisoned_targets(inp, len(positions)) for _ in range(2)]
    given = problem_of(case, inp, pools[0], positions, targets[0])
    provider = Provider(targets[1])
    lazy = provided(problem_of(case, inp, pools[1], positions, targets[1]), provider)
    (o_given, h_given), (o_lazy, h_lazy) = run_problem(given, backend), run_problem(lazy, backend)
    assert provider.calls == 1
    assert same_bits(o_given, o_lazy) and same_bits(h_given, h_lazy) and same_bits(pools[0], pools[1])
    assert all(same_bits(a, b) for a, b in zip(*targets))
    assert not any(torch.isnan(t).any() for t in targets[1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_provider_is_never_asked_without_checkpoints(device: str, backend: str) -> None:
    case = Case(LENGTHS, gate="lower_bound")
    inp = make_inputs(case, device, seed=34)
    provider = Provider([])
    run_problem(provided(problem_of(case, inp, inp.pool, (), ()), provider), backend)
    assert provider.calls == 0


def test_the_provider_is_asked_after_the_first_pieces_parallel_stages_are_queued(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of two chunks, no single-token sequence: the targets are asked for once the
    first piece's WY stage is launched, before any state pass, so a provider's host work
    (the server's placement in the prefix cache) runs while the device works."""
    case = Case((130, 64, 200), gate="lower_bound")
    monkeypatch.setattr(config, "PIECE_CHUNK_HEADS", 2 * case.HV)
    events: list[str] = []

    def recorded(name: str, launch: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return launch(*args, **kwargs)
        return run

    for name in ("launch_wy", "launch_state"):
        monkeypatch.setattr(triton_backend, name, recorded(name, getattr(triton_backend, name)))
    inp = make_inputs(case, device, seed=35)
    positions = chunk_ends(inp.cu_seqlens.tolist(), seed=35)
    provider = Provider(poisoned_targets(inp, len(positions)), on_call=lambda: events.append("provider"))
    run_problem(provided(problem_of(case, inp, inp.pool, positions, provider.targets), provider), "triton")
    assert events.count("launch_wy") > 1, "one piece: the test asks for several"
    assert events[:3] == ["launch_wy", "provider", "launch_state"] and events.count("provider") == 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_providers_targets_are_checked_as_given_ones(device: str, backend: str) -> None:
    """Targets of another dtype, or too few, from a provider: a ValueError, as for given ones."""
    case = Case(LENGTHS, gate="lower_bound")
    inp = make_inputs(case, device, seed=36)
    positions = chunk_ends(inp.cu_seqlens.tolist(), seed=36)
    problem = problem_of(case, inp, inp.pool, positions, poisoned_targets(inp, len(positions)))
    for bad, message in (([t.double() for t in poisoned_targets(inp, len(positions))], "float32"),
                         (poisoned_targets(inp, len(positions) - 1), f"{len(positions)} tensors")):
        with pytest.raises(ValueError, match=message):
            run_problem(provided(problem, Provider(bad)), backend)


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

