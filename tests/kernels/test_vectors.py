"""Every CPU-runnable backend against the shared float64 vectors (tests/data/VECTORS.md):
results of an independent implementation, so a misunderstanding shared by our kernel and
our reference (a gate sign, a state transpose) still shows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kernels import chunk_kda, kda_prefill, naive_recurrent_kda

VECTORS = Path(__file__).resolve().parents[1] / "data" / "kda_reference.safetensors"
TENSORS = load_file(VECTORS)
with safe_open(VECTORS, "pt") as _f:
    CASES: dict[str, dict] = json.loads(_f.metadata()["cases"])


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def case_inputs(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {k.split(".", 1)[1]: v for k, v in TENSORS.items() if k.startswith(name + ".")}
    opts = CASES[name]
    gate = {}
    if opts["gate"] != "given":
        gate = dict(A_log=tensors["A_log"], dt_bias=tensors["dt_bias"], lower_bound=opts["lower_bound"])
    return tensors, gate


def test_vector_file_holds_the_five_cases() -> None:
    assert set(CASES) == {"given_basic", "softplus_varlen", "lower_bound_gva", "neg_eigval", "real_scale_gates"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_vectors(name: str) -> None:
    t, gate = case_inputs(name)
    opts = CASES[name]
    o, final = naive_recurrent_kda(
        t["q"], t["k"], t["v"], t["g"], t["beta"], scale=opts["scale"], initial_state=t["initial_state"],
        cu_seqlens=t["cu_seqlens"], use_qk_l2norm=opts["use_qk_l2norm"], use_beta_sigmoid=opts["use_beta_sigmoid"],
        allow_neg_eigval=opts["allow_neg_eigval"], **gate,
    )
    assert rel_err(o, t["expected_o"]) < 1e-12
    assert rel_err(final, t["expected_final_state"]) < 1e-12


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_chunk_kda_matches_vectors_in_place(name: str) -> None:
    t, gate = case_inputs(name)
    opts = CASES[name]
    N = t["initial_state"].shape[0]
    # Pool with spare NaN rows; sequences live in shuffled rows.
    pool = torch.full((N + 3, *t["initial_state"].shape[1:]), float("nan"))
    rows = torch.randperm(N + 3)[:N]
    pool[rows] = t["initial_state"]
    spare = [i for i in range(N + 3) if i not in rows.tolist()]
    o = chunk_kda(
        t["q"][None], t["k"][None], t["v"][None], t["g"][None], t["beta"][None], opts["scale"],
        pool, rows, opts["use_qk_l2norm"], t["cu_seqlens"],
        use_beta_sigmoid_in_kernel=opts["use_beta_sigmoid"], allow_neg_eigval=opts["allow_neg_eigval"],
        backend="torch", **gate,
    )
    assert o.dtype == torch.float32 and not torch.isnan(o).any()
    assert rel_err(o[0], t["expected_o"]) <= 1e-4
    assert rel_err(pool[rows], t["expected_final_state"]) <= 1e-4
    assert torch.isnan(pool[spare]).all(), "a row no sequence named was written"


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_kda_prefill_matches_vectors_bf16(name: str) -> None:
    t, gate = case_inputs(name)
    opts = CASES[name]
    bf = {n: t[n].to(torch.bfloat16)[None] for n in ("q", "k", "v", "g", "beta")}
    o, final = kda_prefill(
        bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], opts["scale"], t["initial_state"], opts["use_qk_l2norm"],
        t["cu_seqlens"], use_beta_sigmoid_in_kernel=opts["use_beta_sigmoid"],
        allow_neg_eigval=opts["allow_neg_eigval"], backend="torch", **gate,
    )
    assert o.dtype == torch.bfloat16
    assert rel_err(o[0].float(), t["expected_o"]) <= 1e-2
    assert rel_err(final, t["expected_final_state"]) <= 1e-2
