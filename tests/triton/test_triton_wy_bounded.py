"""The bounded gate's WY kernel (`wy_bounded`, `LaunchConfig.bounded_wy`) against the
float64 reference, the current WY kernel, and its offline sm_90 compile.

Every case draws fresh random inputs; the WY stage's outputs are NaN-poisoned before each
launch (`WyOutputs.alloc`), so a row the kernel leaves unwritten fails.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.triton_kernels import config, wy, wy_bounded
from kernels.triton_kernels.wy import WyOutputs
from sm90_shared_memory import SM90_MAX_SHARED
from triton_cases import Case, check_case, make_inputs, reference, reference_errors, rel_err, run_triton

TOL = 5e-3  # relative L2 against the float64 reference, 16-bit inputs


@pytest.fixture(autouse=True)
def _poisoned_wy_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    alloc = WyOutputs.alloc.__func__

    def poisoned(cls: type, x: object, num_chunks: int) -> WyOutputs:
        out = alloc(cls, x, num_chunks)
        for t in (out.w, out.u, out.kg, out.qg, out.gexp):
            t.fill_(float("nan"))
        return out

    monkeypatch.setattr(WyOutputs, "alloc", classmethod(poisoned))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of each WY kernel's launches (so a test knows which path ran)."""
    counts = {"bounded": 0, "wy": 0}
    for name, module, fn in (("bounded", wy_bounded, "launch_wy_bounded"), ("wy", wy, "launch_wy")):
        orig = getattr(module, fn)

        def counted(*args: object, _orig=orig, _name=name) -> None:
            counts[_name] += 1
            _orig(*args)

        monkeypatch.setattr(f"kernels.triton_backend.{fn}", counted)
    return counts


def _bounded(monkeypatch: pytest.MonkeyPatch, wy_on: bool, intra_on: bool = False) -> None:
    monkeypatch.setattr(config, "BOUNDED_WY", wy_on)
    monkeypatch.setattr(config, "BOUNDED_INTRA", intra_on)


def _random_lengths(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(1, 200) for _ in range(n))


CASES = {
    # varlen with partial chunks, a single token, exact chunk multiples
    "varlen-bf16": Case((130, 1, 64, 200, 5, 128), gate="lower_bound", dtype=torch.bfloat16),
    # GVA (HV = 2H), non-power-of-two key dim (masked key slices, a masked value block), fp16
    "gva-fp16-k48": Case((97, 64, 3, 150), H=2, HV=4, K=48, V=32, gate="lower_bound", dtype=torch.float16),
    "random-lengths-gva-k128": Case(_random_lengths(7, 6), H=1, HV=2, K=128, V=64, gate="lower_bound",
                                   dtype=torch.bfloat16),
    "neg-eigval-bf16-pool": Case((70, 129), gate="lower_bound", neg_eigval=True, dtype=torch.bfloat16,
                                 pool_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("intra_on", [False, True], ids=["intra", "bounded-intra"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bounded_wy_meets_reference(device: str, monkeypatch: pytest.MonkeyPatch, launches: dict[str, int],
                                    name: str, intra_on: bool) -> None:
    """o and final states against the float64 reference, after either intra kernel."""
    _bounded(monkeypatch, True, intra_on)
    errs = check_case(CASES[name], device, seed=33, tol=TOL)
    assert launches["bounded"] > 0 and launches["wy"] == 0, (launches, errs)


@pytest.mark.parametrize("seed", [43, 44])
def test_bounded_wy_random_lengths_against_current_path(device: str, monkeypatch: pytest.MonkeyPatch,
                                                        launches: dict[str, int], seed: int) -> None:
    """Random lengths 1..200, GVA: o and final states against the float64 reference and
    against the current WY kernel on the same inputs (within 2e-3)."""
    case = Case(_random_lengths(seed, 5), H=2, HV=4, K=32, V=32, gate="lower_bound", dtype=torch.bfloat16)
    results = {}
    for on in (False, True):
        _bounded(monkeypatch, on)
        inp = make_inputs(case, device, seed)
        ref_o, ref_final, _ = reference(inp, case)
        o, _ = run_triton(case, inp)
        live = [(n, i) for n, i in enumerate(inp.indices.tolist()) if i >= 0]
        final = torch.stack([inp.pool[i].float() for _, i in live])
        errs = {"o": rel_err(o[0], ref_o), "final": rel_err(final, torch.stack([ref_final[n] for n, _ in live]))}
        results[on] = (errs, o, final)
    assert launches["bounded"] > 0 and launches["wy"] > 0
    (err_old, o_old, final_old), (err_new, o_new, final_new) = results[False], results[True]
    for name in err_new:
        assert err_new[name] <= TOL and err_new[name] <= 1.5 * err_old[name] + 2e-4, (err_new, err_old)
    assert rel_err(o_new, o_old) <= 2e-3
    assert rel_err(final_new, final_old) <= 2e-3


@pytest.mark.parametrize("K,V", [(48, 32), (128, 160)])
def test_bounded_wy_stage_outputs_match_current_kernel(device: str, K: int, V: int) -> None:
    """The stage itself: w, u, kg, qg of every token row of a chunk and gexp of every chunk
    row written (finite after NaN poisoning) and equal to the current kernel's up to rounding
    (the same intra outputs feed both). V = 160 takes two value blocks, the second masked."""
    from kernels.api import build_problem
    from kernels.triton_backend import stage_inputs
    from kernels.triton_kernels import select_config
    from kernels.triton_kernels.intra import IntraOutputs, launch_intra
    from kernels.triton_plan import launch_plan
    from kernels.triton_toolchain import configure_toolchain

    case = Case((150, 1, 64, 77), H=1, HV=2, K=K, V=V, gate="lower_bound", dtype=torch.bfloat16)
    inp = make_inputs(case, device, seed=53)
    p = build_problem(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=None, pool=inp.pool, indices=inp.indices,
                      cu_seqlens=inp.cu_seqlens, use_qk_l2norm=True, use_beta_sigmoid=True, allow_neg_eigval=False,
                      state_v_first=True, output_intermediate_states=False, **inp.gate_kwargs)
    cfg = select_config(case.K, case.V, interpret=inp.q.device.type != "cuda")
    x = stage_inputs(p, cfg)
    configure_toolchain(x.device)
    assert wy_bounded.bounded_wy_applies(x)
    plan = launch_plan(p.bounds, 0, x.device)
    intra_out = IntraOutputs.alloc(x)
    launch_intra(x, plan.chunks, intra_out, cfg)
    old, new = WyOutputs.alloc(x, plan.num_chunks), WyOutputs.alloc(x, plan.num_chunks)
    wy.launch_wy(x, plan.chunks, intra_out.tb, intra_out.rqk, old, cfg)
    wy_bounded.launch_wy_bounded(x, plan.chunks, intra_out.tb, intra_out.rqk, new, cfg)
    multi = torch.tensor([b - a > 1 for a, b in zip(p.bounds[:-1], p.bounds[1:])
                          for _ in range(b - a)], device=x.device)  # decode rows take no chunk
    rows = plan.chunks[:, 2]  # gexp: the chunk rows of the plan
    for name in ("w", "u", "kg", "qg", "gexp"):
        a, b = getattr(old, name), getattr(new, name)
        a, b = (a[rows], b[rows]) if name == "gexp" else (a[multi], b[multi])
        assert torch.isfinite(b).all(), f"{name}: rows left unwritten"
        assert rel_err(b.float(), a.float()) <= 2e-3, name


def test_bounded_wy_with_full_decays(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decay at the bound (g = L = -5 per token): 2^G spans [2^-462, 1], far past
    fp32's range, where the chunk's later rows' factors underflow to zero."""
    case = Case((200, 64), gate="lower_bound", dtype=torch.bfloat16)
    _bounded(monkeypatch, True)
    inp = make_inputs(case, device, seed=23)
    inp.gate_kwargs["dt_bias"] = inp.gate_kwargs["dt_bias"] + 40.0
    errs = reference_errors(case, inp)
    assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("drop", [("A_log", "dt_bias"), ("dt_bias",)], ids=["no-a_log-no-dt_bias", "no-dt_bias"])
def test_bounded_wy_without_gate_parameters(device: str, monkeypatch: pytest.MonkeyPatch, launches: dict[str, int],
                                            drop: tuple[str, ...]) -> None:
    """The lower-bound gate with A_log and/or dt_bias absent (their constexpr branches)."""
    case = Case((130, 9), H=1, HV=2, gate="lower_bound", dtype=torch.bfloat16)
    _bounded(monkeypatch, True)
    inp = make_inputs(case, device, seed=73)
    for name in drop:
        del inp.gate_kwargs[name]
    errs = reference_errors(case, inp)
    assert max(errs.values()) <= TOL and launches["bounded"] == 1, errs


def test_other_gates_keep_the_current_wy(device: str, monkeypatch: pytest.MonkeyPatch,
                                         launches: dict[str, int]) -> None:
    """The softplus gate and fp32 inputs are not the bounded kernel's: they run `wy`."""
    _bounded(monkeypatch, True)
    check_case(Case((70, 5), gate="softplus", dtype=torch.bfloat16), device, seed=63, tol=TOL)
    check_case(Case((70, 5), gate="lower_bound"), device, seed=64, tol=1e-4)
    assert launches["bounded"] == 0 and launches["wy"] == 2


def test_bounded_wy_fits_four_programs_an_sm90_sm() -> None:
    """Compiled for sm_90 (offline, `sm90_bounded_wy.py`, a process without the
    interpreter): at the config's register cap 4 programs of 4 warps fit an SM's 64K
    registers, and its shared memory up to K = V = 128 (at 256 the value tiles' pipeline
    stages leave room for 2), with at most a few values spilled outside the loops, and it
    issues at least 10% fewer instructions a program than `wy` (static loop bodies times
    trips)."""
    script = Path(__file__).with_name("sm90_bounded_wy.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), "64", "128", "256"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["K"] for row in rows] == [64, 128, 256]
    for row in rows:
        assert 4 * 128 * row["registers"] <= 65536, row
        assert row["stack"] <= 32 and row["spill_ops"] <= 16, row
        assert (4 if row["K"] <= 128 else 2) * row["shared"] <= SM90_MAX_SHARED, row
        assert row["per_warp"] <= 0.9 * row["wy_per_warp"], row
