"""Shared harness for the Triton backend tests: random KDA problems on a poisoned pool,
the per-token reference chained chunk by chunk, and the checks every test applies.

A case draws fresh random inputs (never zeros), builds a pool whose rows not named by any
sequence are NaN-filled, names one sequence -1 (zero state, no write-back) when there are
several, runs `kernels.chunk_kda(..., backend="triton")`, and checks against
`kernels.naive_recurrent_kda`: o (fully written, no NaN), final states of the named rows,
unnamed rows bit-identical, and optionally the per-chunk intermediate states.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F

from kernels import chunk_kda, naive_recurrent_kda
from kernels.problem import CHUNK_SIZE, PrefillProblem, packed_problem


@dataclass(frozen=True)
class Case:
    """One test configuration. gate: "given" | "softplus" | "lower_bound" | "real_scale"
    (softplus with exp(A_log) up to 200 and raw gates x3)."""

    lengths: tuple[int, ...]
    H: int = 2
    HV: int = 2
    K: int = 16
    V: int = 16
    gate: str = "softplus"
    l2norm: bool = True
    sigmoid: bool = True
    neg_eigval: bool = False
    dtype: torch.dtype = torch.float32
    pool_dtype: torch.dtype = torch.float32
    v_first: bool = True
    intermediate: bool = False
    zero_slot: bool = True  # name one sequence -1 when there are several
    extra_slots: int = 2  # NaN-poisoned rows no sequence names


@dataclass
class Inputs:
    """Packed inputs [1, T, ...] on the target device, plus the pool and its indices."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor
    pool: torch.Tensor
    indices: torch.Tensor
    gate_kwargs: dict = field(default_factory=dict)


def make_inputs(case: Case, device: torch.device | str, seed: int) -> Inputs:
    """Fresh random inputs for ``case`` (drawn on the CPU from ``seed``, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(case.lengths), len(case.lengths)
    H, HV, K, V = case.H, case.HV, case.K, case.V

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(1, T, H, K), randn(1, T, H, K), randn(1, T, HV, V)
    if not case.l2norm:  # keep the recurrence stable: |k| <= 1 keeps I - beta k k^T contractive
        q = q / q.norm(dim=-1, keepdim=True)
        k = 0.9 * k / k.norm(dim=-1, keepdim=True)
    beta = randn(1, T, HV) if case.sigmoid else torch.rand(1, T, HV, generator=gen)
    g = randn(1, T, HV, K)
    gate_kwargs: dict = {}
    if case.gate == "given":
        g = -F.softplus(2.0 * g - 1.0)
    elif case.gate == "softplus":
        # decays from ~-1e-3 (long memory) to ~-5 per token, as in trained models
        gate_kwargs = dict(A_log=torch.rand(HV, generator=gen) * 2.0 - 1.0, dt_bias=2.0 * randn(HV, K) - 3.0)
    elif case.gate == "lower_bound":
        gate_kwargs = dict(A_log=torch.rand(HV, generator=gen), dt_bias=2.0 * randn(HV, K) - 3.0, lower_bound=-5.0)
    elif case.gate == "real_scale":
        a = torch.exp(torch.rand(HV, generator=gen) * math.log(200.0))
        gate_kwargs = dict(A_log=torch.log(a), dt_bias=randn(HV, K))
        g = 3.0 * g
    else:
        raise ValueError(case.gate)

    S = N + case.extra_slots
    shape = (S, HV, V, K) if case.v_first else (S, HV, K, V)
    pool = torch.full(shape, float("nan"))
    slots = torch.randperm(S, generator=gen)[:N]
    pool[slots] = 0.5 * randn(N, *shape[1:])
    indices = slots.clone()
    if case.zero_slot and N > 1:
        indices[N // 2] = -1
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int64)

    def dev(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return x.to(device=device, dtype=dtype or x.dtype)

    return Inputs(
        q=dev(q, case.dtype), k=dev(k, case.dtype), v=dev(v, case.dtype), g=dev(g, case.dtype),
        beta=dev(beta, case.dtype), cu_seqlens=dev(cu), pool=dev(pool, case.pool_dtype),
        indices=dev(indices), gate_kwargs={n: dev(x) if isinstance(x, torch.Tensor) else x
                                           for n, x in gate_kwargs.items()},
    )


def initial_states(inp: Inputs, v_first: bool) -> torch.Tensor:
    """[N, HV, V, K] (V-first, as the reference takes it) initial state of each sequence."""
    rows = []
    for i in inp.indices.tolist():
        s = inp.pool[i].float() if i >= 0 else torch.zeros_like(inp.pool[0], dtype=torch.float32)
        rows.append(s if v_first else s.transpose(-1, -2))
    return torch.stack(rows)


def reference(inp: Inputs, case: Case, dtype: torch.dtype = torch.float64):
    """Per-token reference chained chunk by chunk: (o [T, HV, V], final [N, HV, V, K],
    h [NT, HV, V, K] or None: the state before every chunk, in order, when
    ``case.intermediate``), all in ``dtype``."""
    init = initial_states(inp, case.v_first)
    bounds = inp.cu_seqlens.tolist()
    opts = dict(use_qk_l2norm=case.l2norm, use_beta_sigmoid=case.sigmoid,
                allow_neg_eigval=case.neg_eigval, dtype=dtype, **inp.gate_kwargs)
    outs, finals, hs = [], [], []
    for n in range(len(bounds) - 1):
        state = init[n].to(dtype)
        for a in range(bounds[n], bounds[n + 1], CHUNK_SIZE):
            b = min(a + CHUNK_SIZE, bounds[n + 1])
            if case.intermediate:
                hs.append(state)
            o, fin = naive_recurrent_kda(
                inp.q[0, a:b], inp.k[0, a:b], inp.v[0, a:b], inp.g[0, a:b], inp.beta[0, a:b],
                initial_state=state[None], **opts,
            )
            outs.append(o)
            state = fin[0]
        finals.append(state)
    return torch.cat(outs), torch.stack(finals), torch.stack(hs) if hs else None


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    view = torch.int32 if a.element_size() == 4 else torch.int16
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def problem_of(case: Case, inp: Inputs, nonfinite: Optional[torch.Tensor] = None,
               saved_states: Optional[torch.Tensor] = None, input_checks: Optional[torch.Tensor] = None,
               o_out: Optional[torch.Tensor] = None) -> PrefillProblem:
    """The backends' problem of ``inp`` (in place on its pool) under ``case``'s settings,
    with the launch's optional outputs given (`kernels.problem.PrefillProblem`)."""
    return packed_problem(
        inp.q[0], inp.k[0], inp.v[0], inp.g[0], inp.beta[0], bounds=inp.cu_seqlens.tolist(), pool=inp.pool,
        indices=inp.indices, scale=None, A_log=inp.gate_kwargs.get("A_log"), dt_bias=inp.gate_kwargs.get("dt_bias"),
        lower_bound=inp.gate_kwargs.get("lower_bound"), use_qk_l2norm=case.l2norm, use_beta_sigmoid=case.sigmoid,
        allow_neg_eigval=case.neg_eigval, state_v_first=case.v_first, nonfinite=nonfinite,
        saved_states=saved_states, input_checks=input_checks, o_out=o_out,
    )


def run_triton(case: Case, inp: Inputs, backend: str = "triton", **checkpoints: Optional[torch.Tensor]):
    """chunk_kda on the Triton backend (or ``backend``): returns (o [1, T, HV, V], h or
    None). ``checkpoints``: checkpoint_tokens and checkpoint_states, passed through."""
    res = chunk_kda(
        inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.pool, initial_state_indices=inp.indices,
        use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=inp.cu_seqlens,
        output_intermediate_states=case.intermediate, use_beta_sigmoid_in_kernel=case.sigmoid,
        allow_neg_eigval=case.neg_eigval, state_v_first=case.v_first, backend=backend,
        **inp.gate_kwargs, **checkpoints,
    )
    return res if case.intermediate else (res, None)


def chunk_ends(bounds: list[int], seed: int, every: int = 1) -> list[int]:
    """Every checkpoint position the contract allows (each sequence's 64-token multiples
    and its end), in a seeded random order; with ``every`` > 1, a seeded random one in
    ``every`` of them (at least one), so runs of several chunks lie between checkpoints."""
    ends = sorted({t for a, b in zip(bounds[:-1], bounds[1:]) for t in [*range(a + CHUNK_SIZE, b, CHUNK_SIZE), b]})
    order = torch.randperm(len(ends), generator=torch.Generator().manual_seed(seed)).tolist()
    return [ends[i] for i in order[:max(1, len(ends) // every)]]


def reference_checkpoints(inp: Inputs, case: Case, positions: list[int],
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference`'s o and final states, and [C, HV, V, K] (V-first): the state after each
    position, from its per-chunk states (a position is a chunk end: the state before the
    next chunk, or the final state)."""
    ref_o, finals, before = reference(inp, replace(case, intermediate=True), dtype)
    bounds = inp.cu_seqlens.tolist()
    first = [0]
    for a, b in zip(bounds[:-1], bounds[1:]):
        first.append(first[-1] + -(-(b - a) // CHUNK_SIZE))
    rows = []
    for pos in positions:
        n = max(i for i in range(len(bounds) - 1) if bounds[i] < pos)
        j = (pos - bounds[n] - 1) // CHUNK_SIZE + 1  # chunks done
        rows.append(finals[n] if first[n] + j == first[n + 1] else before[first[n] + j])
    return ref_o, finals, torch.stack(rows)


def check_checkpoints(case: Case, device: torch.device | str, seed: int, tol: float, backend: str = "triton",
                      ref_dtype: torch.dtype = torch.float64, scattered: bool = False, every: int = 1) -> float:
    """Run ``case`` with a checkpoint at every allowed position (random order; one in
    ``every`` of them, `chunk_ends`) into rows
    1..C of a NaN-poisoned [C + 2, ...] buffer (``scattered``: into the middle layer of a
    NaN-poisoned [3, ...] tensor of its own each, as a cache's entries are, passed as C
    separate targets); assert every target written and within ``tol`` of the reference,
    the memory around them (rows 0 and C + 1, or the outer layers) bit-identical, and o
    and the final states as good as without checkpoints. Returns the checkpoints' error."""
    inp = make_inputs(case, device, seed)
    positions = chunk_ends(inp.cu_seqlens.tolist(), seed, every)
    ref_o, ref_final, ref_ckpt = reference_checkpoints(inp, case, positions, ref_dtype)
    C = len(positions)
    row = inp.pool.shape[1:]
    if scattered:
        bufs = [torch.full((3, *row), float("nan"), dtype=inp.pool.dtype, device=inp.pool.device) for _ in range(C)]
        targets, around = [b[1] for b in bufs], [b[j] for b in bufs for j in (0, 2)]
    else:
        buf = torch.full((C + 2, *row), float("nan"), dtype=inp.pool.dtype, device=inp.pool.device)
        targets, around = buf[1:C + 1], [buf[0], buf[C + 1]]
    before = [t.clone() for t in around]
    o, _ = run_triton(case, inp, backend, checkpoint_tokens=torch.tensor(positions, dtype=torch.int64, device=device),
                      checkpoint_states=targets)
    assert all(same_bits(a, b) for a, b in zip(around, before)), "memory outside the checkpoints changed"
    got = torch.stack(list(targets)).float()
    assert not torch.isnan(got).any(), "checkpoint rows not fully written"
    if not case.v_first:
        got = got.transpose(-1, -2)
    err = rel_err(got, ref_ckpt)
    assert err <= tol, f"checkpoints: rel L2 error {err:.3e} > {tol:.0e} ({case})"
    assert rel_err(o[0], ref_o) <= tol
    live = [(n, i) for n, i in enumerate(inp.indices.tolist()) if i >= 0]
    final = torch.stack([inp.pool[i].float() for _, i in live])
    if not case.v_first:
        final = final.transpose(-1, -2)
    assert rel_err(final, torch.stack([ref_final[n] for n, _ in live])) <= tol
    return err


def reference_errors(case: Case, inp: Inputs) -> dict[str, float]:
    """Run ``case`` on ``inp`` and return the relative L2 errors of o and of the named rows'
    final states against the float64 reference (both asserted finite first)."""
    ref_o, ref_final, _ = reference(inp, case)
    o, _ = run_triton(case, inp)
    live = [(n, i) for n, i in enumerate(inp.indices.tolist()) if i >= 0]
    final = torch.stack([inp.pool[i].float() for _, i in live])
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    return {"o": rel_err(o[0], ref_o), "final": rel_err(final, torch.stack([ref_final[n] for n, _ in live]))}


def check_case(case: Case, device: torch.device | str, seed: int, tol: float,
               ref_dtype: torch.dtype = torch.float64) -> dict[str, float]:
    """Run ``case`` and assert every check; returns the errors measured."""
    inp = make_inputs(case, device, seed)
    before = inp.pool.clone()
    ref_o, ref_final, ref_h = reference(inp, case, ref_dtype)
    o, h = run_triton(case, inp)

    assert o.shape == inp.v.shape and o.dtype == inp.v.dtype
    assert not torch.isnan(o).any(), "o not fully written"
    errs = {"o": rel_err(o[0], ref_o)}
    named = [i for i in inp.indices.tolist() if i >= 0]
    untouched = [i for i in range(inp.pool.shape[0]) if i not in named]
    for i in untouched:
        assert same_bits(inp.pool[i], before[i]), f"pool row {i} (not named) was modified"
    live = [(n, i) for n, i in enumerate(inp.indices.tolist()) if i >= 0]
    got = torch.stack([inp.pool[i].float() for _, i in live])
    if not case.v_first:
        got = got.transpose(-1, -2)
    errs["final"] = rel_err(got, torch.stack([ref_final[n] for n, _ in live]))
    if case.intermediate:
        assert h is not None and h.dtype == torch.float32
        assert h.shape[:2] == (1, ref_h.shape[0])
        hh = h[0] if case.v_first else h[0].transpose(-1, -2)
        assert not torch.isnan(hh).any()
        errs["h"] = rel_err(hh, ref_h)
    for name, err in errs.items():
        assert err <= tol, f"{name}: rel L2 error {err:.3e} > {tol:.0e} ({case})"
    return errs
