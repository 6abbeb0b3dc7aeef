"""The Triton backend against the shared reference vectors (tests/data/VECTORS.md): fixed
cases whose expected results come from an independent float64 implementation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kernels import chunk_kda
from triton_cases import rel_err, same_bits

VECTORS = Path(__file__).resolve().parents[1] / "data" / "kda_reference.safetensors"
FP32_TOL = 1e-4


def _cases() -> dict[str, dict]:
    with safe_open(str(VECTORS), "pt") as f:
        return json.loads(f.metadata()["cases"])


@pytest.mark.parametrize("name", sorted(_cases()))
def test_reference_vectors(device: str, name: str) -> None:
    opts = _cases()[name]
    with safe_open(str(VECTORS), "pt") as f:
        t = {key.split(".", 1)[1]: f.get_tensor(key).to(device) for key in f.keys() if key.startswith(name + ".")}
    N = t["cu_seqlens"].numel() - 1
    # pool: the N initial states in shuffled rows, plus two NaN rows no sequence names
    pool = torch.full((N + 2, *t["initial_state"].shape[1:]), float("nan"), device=device)
    rows = torch.randperm(N + 2)[:N].to(device)
    pool[rows] = t["initial_state"]
    before = pool.clone()
    gate = {}
    if opts["gate"] != "given":
        gate = dict(A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=opts["lower_bound"])
    o = chunk_kda(
        t["q"][None], t["k"][None], t["v"][None], t["g"][None], t["beta"][None], scale=opts["scale"],
        initial_state=pool, initial_state_indices=rows, use_qk_l2norm_in_kernel=opts["use_qk_l2norm"],
        cu_seqlens=t["cu_seqlens"], use_beta_sigmoid_in_kernel=opts["use_beta_sigmoid"],
        allow_neg_eigval=opts["allow_neg_eigval"], backend="triton", **gate,
    )
    assert not torch.isnan(o).any()
    assert rel_err(o[0], t["expected_o"]) <= FP32_TOL
    assert rel_err(pool[rows], t["expected_final_state"]) <= FP32_TOL
    for i in sorted(set(range(N + 2)) - set(rows.tolist())):
        assert same_bits(pool[i], before[i])
