"""Edges of the public entry points (`chunk_kda`, `kda_prefill`; docs/KDA.md), on the torch
backend and on the Triton backend (compiled on a GPU, else under the Triton interpreter on
CPU tensors, as tests/triton does), each against the float64 per-token reference on fresh
random inputs, with every pool row no sequence names NaN-poisoned and checked bit for bit.

Accepted edges: lengths around the 64-token chunk boundaries and single tokens, int32 and
int64 offsets and indices, a given scale, bf16 inputs with an fp32 pool and the reverse,
mixed input dtypes, K != V with grouped heads, strided / transposed pool views and inputs,
non-contiguous indices, a batch of B sequences against the same sequences flattened.

Refused edges: each raises a ValueError (TypeError for an unknown keyword) naming the
argument, before anything is written: the pool is left bit-identical.

Interpreter cases are small (2 CPU cores in CI).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

from kernels import chunk_kda, kda_prefill, naive_recurrent_kda, run_problem
from kernels.api import build_problem

HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


def _import_triton_backend() -> bool:
    """Import the Triton backend with TRITON_INTERPRET=1 on a machine without CUDA (the
    kernels are decorated as interpreted at import), restoring the variable after; as
    tests/triton/conftest.py does. False when triton is missing."""
    saved = os.environ.get("TRITON_INTERPRET")
    if not HAS_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import kernels.triton_backend  # noqa: F401
    except ImportError:
        return False
    finally:
        if not HAS_CUDA:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return True


def _triton_runnable() -> Optional[str]:
    """None when the Triton backend can run here, else why not."""
    if not _import_triton_backend():
        return "triton is not installed"
    if HAS_CUDA:
        return None
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.triton_kernels.recurrent import recurrent_step_kernel

    if not isinstance(recurrent_step_kernel, InterpretedFunction):
        return "the Triton kernels were imported without TRITON_INTERPRET=1 in this process"
    return None


TRITON_SKIP = _triton_runnable()


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "triton":
        if TRITON_SKIP:
            pytest.skip(TRITON_SKIP)
        if not HAS_CUDA:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def device_of(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


H, HV, K, V = 1, 2, 16, 8  # grouped heads (HV = 2 H), K != V
FP32_TOL, BF16_TOL = 1e-4, 5e-3
OPTS = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    return float((x - ref).norm() / ref.norm())


def inputs(T: int, seed: int, B: int = 1, gate: bool = True) -> dict[str, torch.Tensor]:
    """Fresh random q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV, K] (raw gate with
    ``gate``, else the log decay), beta [B, T, HV] (logits), fp32 on the CPU: never zeros."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(B, T, HV, K, generator=gen)
    return dict(
        q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, HV, V, generator=gen), g=g if gate else -F.softplus(g),
        beta=torch.randn(B, T, HV, generator=gen),
    )


def gate_params(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(A_log=torch.rand(HV, generator=gen) * 2.0 - 1.0, dt_bias=2.0 * torch.randn(HV, K, generator=gen) - 3.0)


def poisoned_pool(slots: int, idx: list[int], seed: int) -> torch.Tensor:
    """[slots, HV, V, K] fp32: random states in the rows ``idx`` names, NaN elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((slots, HV, V, K), float("nan"))
    for i in idx:
        if i >= 0:
            pool[i] = 0.5 * torch.randn(HV, V, K, generator=gen)
    return pool


def reference(x: dict, pool: torch.Tensor, idx: list[int], cu: Optional[list[int]], scale: Optional[float] = None,
              gate: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (o [T, HV, V], final [N, HV, V, K]) of ``x`` (as stored: 16-bit inputs as
    rounded) from the pool rows ``idx`` names (zeros for -1), V-first pool ``pool``."""
    flat = {n: t.reshape(-1, *t.shape[2:]).cpu() for n, t in x.items()}
    init = torch.stack([pool[i].cpu().double() if i >= 0 else torch.zeros(HV, V, K, dtype=torch.float64)
                        for i in idx])
    gate = {n: t.cpu() for n, t in (gate or {}).items()}
    return naive_recurrent_kda(flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"], scale=scale,
                               initial_state=init, cu_seqlens=cu, use_qk_l2norm=True, use_beta_sigmoid=True, **gate)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.element_size() == 4 else torch.int16
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def check_pool(pool: torch.Tensor, before: torch.Tensor, idx: list[int], ref_final: torch.Tensor, tol: float) -> None:
    """Named rows hold the reference's final states; the others are bit-identical."""
    live = [(n, i) for n, i in enumerate(idx) if i >= 0]
    got = torch.stack([pool[i].float() for _, i in live])
    assert not torch.isnan(got).any(), "a named row was not written"
    err = rel_err(got, torch.stack([ref_final[n] for n, _ in live]))
    assert err <= tol, f"final states: rel L2 error {err:.3e} > {tol:.0e}"
    for i in sorted(set(range(pool.shape[0])) - {i for _, i in live}):
        assert same_bits(pool[i], before[i]), f"pool row {i}, named by no sequence, changed"


def on(x: dict, device: str, dtype: Optional[torch.dtype] = None) -> dict:
    return {n: t.to(device=device, dtype=dtype or t.dtype) for n, t in x.items()}


# ---- accepted edges, against the reference ----------------------------------------------


@pytest.mark.parametrize("offsets", [torch.int64, torch.int32])
def test_lengths_around_chunk_boundaries_into_a_poisoned_o(backend: str, offsets: torch.dtype) -> None:
    """Single tokens and 63/64/65/127/128/129 tokens in one launch, the -1 slot among them,
    int64 or int32 cu_seqlens and indices; o written into a NaN-filled buffer through the
    same argument checks as chunk_kda (`build_problem`), so an element no kernel writes shows."""
    device = device_of(backend)
    lengths = [63, 1, 129, 64, 1, 127, 65, 128] if offsets == torch.int64 else [65, 1, 64, 63]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    N = len(lengths)
    idx = torch.randperm(N + 3, generator=torch.Generator().manual_seed(1))[:N].tolist()
    idx[2] = -1
    x = inputs(cu[-1], seed=2)
    gate = gate_params(3)
    pool = poisoned_pool(N + 3, idx, seed=4)
    ref_o, ref_final = reference(x, pool, idx, cu, gate=gate)
    pool, before = pool.to(device), pool.clone().to(device)
    xd = on(x, device)
    p = build_problem(
        xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"], scale=None, pool=pool,
        indices=torch.tensor(idx, dtype=offsets, device=device), cu_seqlens=torch.tensor(cu, dtype=offsets, device=device),
        A_log=gate["A_log"].to(device), dt_bias=gate["dt_bias"].to(device), lower_bound=None,
        use_qk_l2norm=True, use_beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
        output_intermediate_states=False,
    )
    o_out = torch.full((cu[-1], HV, V), float("nan"), device=device)
    o, _ = run_problem(dataclasses.replace(p, o_out=o_out), backend)
    assert o.data_ptr() == o_out.data_ptr()
    assert not torch.isnan(o).any(), "o not fully written"
    assert rel_err(o, ref_o) <= FP32_TOL
    check_pool(pool, before, idx, ref_final, FP32_TOL)


def test_int32_offsets_and_a_given_scale_through_chunk_kda(backend: str) -> None:
    """chunk_kda itself with int32 cu_seqlens and indices, a given scale, the log decay given."""
    device = device_of(backend)
    cu, idx, scale = [0, 1, 64, 130], [4, 0, -1], 0.37
    x = inputs(cu[-1], seed=5, gate=False)
    pool = poisoned_pool(6, idx, seed=6)
    ref_o, ref_final = reference(x, pool, idx, cu, scale=scale)
    pool, before = pool.to(device), pool.clone().to(device)
    o = chunk_kda(**on(x, device), scale=scale, initial_state=pool,
                  initial_state_indices=torch.tensor(idx, dtype=torch.int32, device=device),
                  cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), backend=backend, **OPTS)
    assert o.shape == x["v"].shape and not torch.isnan(o).any()
    assert rel_err(o[0], ref_o) <= FP32_TOL
    check_pool(pool, before, idx, ref_final, FP32_TOL)


@pytest.mark.parametrize("mix", ["bf16 inputs, fp32 pool", "fp32 inputs, bf16 pool", "bf16 q k, fp32 v g beta",
                                 "fp16 v, bf16 g beta"])
def test_dtype_mixes(backend: str, mix: str) -> None:
    """Inputs of any float dtype each, with either pool dtype: o in v's dtype, final states
    in the pool's; bf16 tolerance wherever a 16-bit value is involved."""
    device = device_of(backend)
    cu, idx = [0, 1, 70], [2, 0]
    x = inputs(cu[-1], seed=7)
    pool_dtype = torch.bfloat16 if mix == "fp32 inputs, bf16 pool" else torch.float32
    cast = {"bf16 inputs, fp32 pool": dict.fromkeys(x, torch.bfloat16), "fp32 inputs, bf16 pool": {},
            "bf16 q k, fp32 v g beta": dict(q=torch.bfloat16, k=torch.bfloat16),
            "fp16 v, bf16 g beta": dict(v=torch.float16, g=torch.bfloat16, beta=torch.bfloat16)}[mix]
    x = {n: t.to(cast.get(n, t.dtype)) for n, t in x.items()}
    gate = gate_params(8)
    pool = poisoned_pool(4, idx, seed=9).to(pool_dtype)
    ref_o, ref_final = reference(x, pool, idx, cu, gate=gate)
    pool, before = pool.to(device), pool.clone().to(device)
    o = chunk_kda(**on(x, device), initial_state=pool, initial_state_indices=torch.tensor(idx, device=device),
                  cu_seqlens=torch.tensor(cu, device=device), backend=backend, **on(gate, device), **OPTS)
    assert o.dtype == x["v"].dtype and pool.dtype == pool_dtype
    assert not torch.isnan(o).any()
    assert rel_err(o[0], ref_o) <= BF16_TOL
    check_pool(pool, before, idx, ref_final, BF16_TOL)


def _slot_strided(pool: torch.Tensor) -> torch.Tensor:
    big = pool.new_full((2 * pool.shape[0], *pool.shape[1:]), float("nan"))
    big[::2] = pool
    return big[::2]


def _key_padded(pool: torch.Tensor) -> torch.Tensor:
    big = pool.new_full((*pool.shape[:3], K + 5), float("nan"))
    big[..., :K] = pool
    return big[..., :K]


def _transposed_storage(pool: torch.Tensor) -> torch.Tensor:
    return pool.transpose(-1, -2).contiguous().transpose(-1, -2)


POOL_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "slot-strided": _slot_strided, "key-padded": _key_padded, "transposed storage": _transposed_storage,
}


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a non-contiguous view: heads and tokens transposed in storage when it has
    several heads, else every other element of a tensor twice as long in its last dim."""
    if t.shape[2] > 1:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    big = t.new_full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"))
    big[..., ::2] = t
    return big[..., ::2]


@pytest.mark.parametrize("view", list(POOL_VIEWS))
def test_pool_views_and_transposed_inputs(backend: str, view: str) -> None:
    """A pool that is a strided view of a larger tensor (its gaps NaN) and inputs that are
    transposed views: updated in place through its strides, the gaps untouched."""
    device = device_of(backend)
    cu, idx = [0, 1, 66, 130], [3, -1, 1]
    x = inputs(cu[-1], seed=10)
    pool = poisoned_pool(5, idx, seed=11)
    ref_o, ref_final = reference(x, pool, idx, cu)
    pool = POOL_VIEWS[view](pool.to(device))
    base = pool._base
    base_before = base.clone()
    assert not pool.is_contiguous()
    before = pool.clone()
    xt = {n: strided(t.to(device)) for n, t in x.items()}
    assert not any(t.is_contiguous() for t in xt.values())
    o = chunk_kda(**xt, initial_state=pool, initial_state_indices=torch.tensor(idx, device=device),
                  cu_seqlens=torch.tensor(cu, device=device), backend=backend, **OPTS)
    assert not torch.isnan(o).any()
    assert rel_err(o[0], ref_o) <= FP32_TOL
    check_pool(pool, before, idx, ref_final, FP32_TOL)
    # the memory around the view (its NaN gaps) bit for bit as before
    mask = torch.ones_like(base, dtype=torch.bool)
    mask.as_strided(pool.shape, pool.stride(), pool.storage_offset() - base.storage_offset()).fill_(False)
    assert same_bits(base[mask], base_before[mask]), "memory outside the pool view changed"


def test_non_contiguous_indices(backend: str) -> None:
    """initial_state_indices as a strided view ([::2] of a longer tensor): the rows it names,
    not the ones its storage holds next to them."""
    device = device_of(backend)
    cu = [0, 5, 70, 71]
    storage = torch.tensor([3, 0, 6, 1, 2, 5], device=device)
    indices = storage[::2]  # [3, 6, 2]
    idx = indices.tolist()
    x = inputs(cu[-1], seed=12)
    pool = poisoned_pool(8, idx, seed=13)
    ref_o, ref_final = reference(x, pool, idx, cu)
    pool, before = pool.to(device), pool.clone().to(device)
    o = chunk_kda(**on(x, device), initial_state=pool, initial_state_indices=indices,
                  cu_seqlens=torch.tensor(cu, device=device), backend=backend, **OPTS)
    assert rel_err(o[0], ref_o) <= FP32_TOL
    check_pool(pool, before, idx, ref_final, FP32_TOL)


def test_batch_equals_flattened_with_cu_seqlens(backend: str) -> None:
    """[B, T, ...] without cu_seqlens is B sequences of T tokens: the same o and states as
    the flattened [1, B T, ...] with cu_seqlens, and both as the reference."""
    device = device_of(backend)
    B, T, idx = 2, 65, [1, 3]
    x = inputs(T, seed=14, B=B)
    cu = [0, T, 2 * T]
    pool = poisoned_pool(4, idx, seed=15)
    ref_o, ref_final = reference(x, pool, idx, cu)
    p_batch, p_flat, before = pool.to(device), pool.clone().to(device), pool.clone().to(device)
    o_b = chunk_kda(**on(x, device), initial_state=p_batch, initial_state_indices=torch.tensor(idx, device=device),
                    backend=backend, **OPTS)
    flat = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in x.items()}
    o_f = chunk_kda(**on(flat, device), initial_state=p_flat, initial_state_indices=torch.tensor(idx, device=device),
                    cu_seqlens=torch.tensor(cu, device=device), backend=backend, **OPTS)
    assert o_b.shape == (B, T, HV, V) and o_f.shape == (1, B * T, HV, V)
    assert rel_err(o_b.reshape(B * T, HV, V), ref_o) <= FP32_TOL
    assert rel_err(o_f[0], ref_o) <= FP32_TOL
    check_pool(p_batch, before, idx, ref_final, FP32_TOL)
    check_pool(p_flat, before, idx, ref_final, FP32_TOL)


# ---- refused calls: a clear error before anything is written --------------------------------

T_REF, CU_REF, IDX_REF, SLOTS = 8, [0, 3, 8], [0, 2], 3


def _call(backend: str, pool: torch.Tensor, **change) -> None:
    """chunk_kda over T_REF tokens, two sequences, with ``change`` applied to its arguments."""
    x = inputs(T_REF, seed=20)
    args = dict(**x, initial_state=pool, initial_state_indices=torch.tensor(IDX_REF), cu_seqlens=torch.tensor(CU_REF),
                backend=backend, **OPTS)
    args.update(change)
    chunk_kda(**args)


def _inputs_with(**shapes: tuple[int, ...]) -> dict:
    """Random tensors of the given shapes (q, k, v, g, beta replaced)."""
    gen = torch.Generator().manual_seed(21)
    return {n: (torch.rand(*s, generator=gen) if n == "beta" else torch.randn(*s, generator=gen))
            for n, s in shapes.items()}


REFUSED: dict[str, tuple[Callable[[], dict], type, str]] = {
    # sequences and indices
    "repeated slot": (lambda: dict(initial_state_indices=torch.tensor([1, 1])), ValueError,
                      r"initial_state_indices repeats a slot: \[1, 1\]"),
    "index past the pool": (lambda: dict(initial_state_indices=torch.tensor([0, 3])), ValueError,
                            r"initial_state_indices out of range for a pool of 3 slots: \[3\]"),
    "index below -1": (lambda: dict(initial_state_indices=torch.tensor([-2, 0])), ValueError,
                       r"initial_state_indices out of range for a pool of 3 slots: \[-2\]"),
    "float indices": (lambda: dict(initial_state_indices=torch.tensor([0.0, 2.0])), ValueError,
                      r"initial_state_indices must be int32 or int64, got torch.float32"),
    "indices on another device": (lambda: dict(initial_state_indices=torch.tensor([0, 2], device="meta")), ValueError,
                                  r"initial_state_indices is on meta"),
    "indices as a list, host offsets": (lambda: dict(initial_state_indices=[0, 2], cu_seqlens_cpu=torch.tensor(CU_REF)),
                                        ValueError, r"initial_state_indices must have shape \(2,\), one per sequence, "
                                                    r"got list"),
    "empty first sequence": (lambda: dict(cu_seqlens=torch.tensor([0, 0, 8])), ValueError,
                             r"cu_seqlens must .* got \[0, 0, 8\]"),
    "empty middle sequence": (lambda: dict(cu_seqlens=torch.tensor([0, 3, 3, 8]),
                                           initial_state_indices=torch.tensor([0, 1, 2])), ValueError,
                              r"cu_seqlens must .* got \[0, 3, 3, 8\]"),
    "empty last sequence": (lambda: dict(cu_seqlens=torch.tensor([0, 8, 8])), ValueError,
                            r"cu_seqlens must .* got \[0, 8, 8\]"),
    "cu_seqlens_cpu disagrees": (lambda: dict(cu_seqlens_cpu=torch.tensor([0, 5, 8])), ValueError,
                                 r"cu_seqlens_cpu .*\[0, 5, 8\].*cu_seqlens .*\[0, 3, 8\]"),
    # the pool
    "pool with no slot": (lambda: dict(initial_state=torch.zeros(0, HV, V, K),
                                       initial_state_indices=torch.tensor([-1, -1])), ValueError,
                          r"initial_state .*no slot.*\(0, 2, 8, 16\)"),
    "pool overlapping itself": (lambda: dict(initial_state=torch.zeros(1, HV, V, K).expand(SLOTS, HV, V, K)), ValueError,
                                r"initial_state .*overlap.*stride"),
    "fp16 pool": (lambda: dict(initial_state=torch.zeros(SLOTS, HV, V, K, dtype=torch.float16)), ValueError,
                  r"initial_state must be float32 or bfloat16, got torch.float16"),
    # heads
    "no q/k head": (lambda: _inputs_with(q=(1, 8, 0, K), k=(1, 8, 0, K)), ValueError,
                    r"at least one head.*H=0"),
    "no value head": (lambda: dict(**_inputs_with(v=(1, 8, 0, V), g=(1, 8, 0, K), beta=(1, 8, 0)),
                                   initial_state=torch.zeros(SLOTS, 0, V, K)), ValueError, r"at least one head.*HV=0"),
    # the gate and the scale
    "dt_bias transposed": (lambda: dict(A_log=torch.rand(HV), dt_bias=torch.randn(K, HV)), ValueError,
                           r"dt_bias must have shape \(2, 16\) or \(32,\), got \(16, 2\)"),
    "dt_bias without a gate": (lambda: dict(dt_bias=torch.randn(HV, K)), ValueError,
                               r"dt_bias needs A_log or lower_bound"),
    "A_log not a tensor": (lambda: dict(A_log=0.5), ValueError, r"A_log must be a float tensor of shape \(2,\), got float"),
    "A_log of ints": (lambda: dict(A_log=torch.zeros(HV, dtype=torch.int64)), ValueError,
                      r"A_log must be a float tensor .* torch.int64"),
    "dt_bias of ints": (lambda: dict(A_log=torch.rand(HV), dt_bias=torch.zeros(HV, K, dtype=torch.int32)), ValueError,
                        r"dt_bias must be a float tensor of shape \(2, 16\) or \(32,\), got \(2, 16\) torch.int32"),
    "A_log on another device": (lambda: dict(A_log=torch.zeros(HV, device="meta")), ValueError, r"A_log is on meta"),
    "NaN scale": (lambda: dict(scale=float("nan")), ValueError, r"scale must be a finite number, got nan"),
    "infinite scale": (lambda: dict(scale=float("inf")), ValueError, r"scale must be a finite number, got inf"),
    # fla's flags are not SGLang's contract: unknown keywords
    "output_final_state": (lambda: dict(output_final_state=True), TypeError, r"output_final_state"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_calls_leave_the_pool_bit_identical(backend: str, name: str) -> None:
    change, error, pattern = REFUSED[name]
    kw = change()
    pool = kw.pop("initial_state", poisoned_pool(SLOTS, IDX_REF, seed=22))
    before = pool.clone()
    with pytest.raises(error, match=pattern):
        _call(backend, pool, **kw)
    assert same_bits(pool, before), "a refused call wrote to the pool"


def test_kda_prefill_misuse_raises_value_error() -> None:
    """kda_prefill reads shapes itself (to size the zero states) before chunk_kda checks
    them: misuse must still be a ValueError naming the argument."""
    x = inputs(8, seed=23)
    with pytest.raises(ValueError, match=r"v must have 4 dimensions, got shape \(8, 2, 8\)"):
        kda_prefill(x["q"], x["k"], x["v"][0], x["g"], x["beta"], backend="torch")
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor"):
        kda_prefill(**x, cu_seqlens=[0, 3, 8], backend="torch")
    with pytest.raises(ValueError, match=r"initial_state must be a torch.Tensor, got list"):
        kda_prefill(**x, initial_state=[[0.0]], backend="torch")
