"""The `chunk_kda` / `kda_prefill` contract of docs/KDA.md: argument handling, word-for-word
errors, batch layouts, pool semantics, on the torch backend against the float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.torch_backend as torch_backend
from kernels import chunk_kda, kda_prefill, naive_recurrent_kda
from kernels.api import G_BETA_SHORT, POOL_REQUIRED, TRAINING_KNOBS

H, HV, K, V = 2, 4, 16, 8


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def inputs(T: int, seed: int = 0, B: int = 1) -> dict[str, torch.Tensor]:
    """Random q, k, v, g (log decay), beta (logits) as [B, T, ...] fp32: never zeros."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
        v=torch.randn(B, T, HV, V, generator=gen), g=-F.softplus(torch.randn(B, T, HV, K, generator=gen)),
        beta=torch.randn(B, T, HV, generator=gen),
    )


OPTS = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, backend="torch")
REF_OPTS = dict(use_qk_l2norm=True, use_beta_sigmoid=True)


def pool_of(slots: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(slots, HV, V, K, generator=torch.Generator().manual_seed(seed)) * 0.3


def run(x: dict, pool: torch.Tensor, idx: list[int], cu: list[int] | None = None, **kw):
    cu_t = None if cu is None else torch.tensor(cu)
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                     initial_state_indices=torch.tensor(idx), cu_seqlens=cu_t, **OPTS, **kw)


# ---- errors, word for word ------------------------------------------------------------

def test_missing_pool_or_indices_raises_the_contract_message() -> None:
    x = inputs(8)
    with pytest.raises(ValueError) as e:
        chunk_kda(**x, initial_state=None, initial_state_indices=torch.tensor([0]))
    assert str(e.value) == POOL_REQUIRED == "KDA prefill requires an indexed initial-state pool"
    with pytest.raises(ValueError) as e:
        chunk_kda(**x, initial_state=pool_of(2), initial_state_indices=None)
    assert str(e.value) == POOL_REQUIRED


def test_short_g_or_beta_raises_the_contract_message() -> None:
    x = inputs(8)
    for name in ("g", "beta"):
        y = dict(x, **{name: x[name][:, :7]})
        with pytest.raises(ValueError) as e:
            run(y, pool_of(1), [0])
        assert str(e.value) == G_BETA_SHORT == "g and beta must cover every q token"


@pytest.mark.parametrize("knob", [{"cp_context": object()}, {"disable_recompute": True}])
def test_training_knobs_raise_not_implemented_in_both_entry_points(knob: dict) -> None:
    x = inputs(8)
    with pytest.raises(NotImplementedError) as e:
        run(x, pool_of(1), [0], **knob)
    assert str(e.value) == TRAINING_KNOBS
    assert str(e.value).startswith("kda_prefill is the inference forward path: cp_context, and disable_recompute")
    with pytest.raises(NotImplementedError) as e:
        kda_prefill(**x, **knob)
    assert str(e.value) == TRAINING_KNOBS


def test_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="head_first"):
        run(inputs(8), pool_of(1), [0], head_first=False)
    with pytest.raises(TypeError):
        kda_prefill(**inputs(8), head_first=False)


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda x, p, i, c: (dict(x, q=x["q"][0]), p, i, c), r"q must have 4 dimensions, got shape \(8, 2, 16\)"),
        (lambda x, p, i, c: (dict(x, k=x["k"][..., :8]), p, i, c), r"k must have q's shape"),
        (lambda x, p, i, c: (dict(x, v=torch.randn(1, 8, 3, V)), p, i, c), r"HV=3 must be a multiple of .* H=2"),
        (lambda x, p, i, c: (x, p, [0, 5], c), r"out of range for a pool of 3 slots: \[5\]"),
        (lambda x, p, i, c: (x, p, [1, 1], c), r"repeats a slot"),
        (lambda x, p, i, c: (x, p, [0], c), r"initial_state_indices must have shape \(2,\)"),
        (lambda x, p, i, c: (x, p, i, [0, 6, 5]), r"cu_seqlens must .* end at T=8, got \[0, 6, 5\]"),
        (lambda x, p, i, c: (x, p, i, [0, 4, 7]), r"end at T=8"),
        (lambda x, p, i, c: (x, p[:, :, :4], i, c), r"initial_state must be \[num_slots, HV, V, K\]"),
        (lambda x, p, i, c: (dict(x, g=x["g"][..., :5]), p, i, c), r"g must be \[B, T', HV, K\]"),
    ],
)
def test_misuse_raises_value_error_naming_argument_and_shapes(mutate, pattern: str) -> None:
    x, p, i, c = mutate(inputs(8), pool_of(3), [0, 2], [0, 3, 8])
    with pytest.raises(ValueError, match=pattern):
        run(x, p, i, c)


def test_head_dims_over_256_are_refused() -> None:
    q = torch.randn(1, 4, 1, 257)
    with pytest.raises(ValueError, match="head dims must be in 1..256, got K=257"):
        chunk_kda(q, q, torch.randn(1, 4, 1, 4), -torch.rand(1, 4, 1, 257), torch.rand(1, 4, 1),
                  initial_state=torch.zeros(1, 1, 4, 257), initial_state_indices=torch.tensor([0]))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_kda(**inputs(8), initial_state=pool_of(1), initial_state_indices=torch.tensor([0]),
                  backend="cuda-magic")


# ---- semantics --------------------------------------------------------------------------

def reference(x: dict, init: torch.Tensor | None, cu: list[int] | None):
    flat = {n: t.reshape(-1, *t.shape[2:]) for n, t in x.items()}
    return naive_recurrent_kda(flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"], initial_state=init,
                               cu_seqlens=cu, **REF_OPTS)


def test_pool_in_place_with_minus_one_and_untouched_rows() -> None:
    lengths = [1, 37, 64, 130, 5]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = inputs(cu[-1], seed=3)
    pool = torch.full((9, HV, V, K), float("nan"))
    idx = [7, 2, -1, 0, 4]
    init = pool_of(5, seed=4)
    for n, i in enumerate(idx):
        if i >= 0:
            pool[i] = init[n]
    init[2] = 0.0  # -1: zero initial state
    before = pool.clone()
    o = run(x, pool, idx, cu)
    ref_o, ref_final = reference(x, init, cu)
    assert rel_err(o[0], ref_o) <= 1e-4
    for n, i in enumerate(idx):
        if i >= 0:
            assert rel_err(pool[i], ref_final[n]) <= 1e-4
    for i in (1, 3, 5, 6, 8):  # rows no sequence named: still NaN, bit for bit
        assert torch.equal(pool[i].view(torch.int32), before[i].view(torch.int32))


def test_continuation_equals_one_call() -> None:
    x = inputs(200, seed=5)
    one, two = pool_of(1, seed=6), pool_of(1, seed=6)
    o_full = run(x, one, [0])
    first = {n: t[:, :77] for n, t in x.items()}
    second = {n: t[:, 77:] for n, t in x.items()}
    o_a, o_b = run(first, two, [0]), run(second, two, [0])
    assert rel_err(torch.cat([o_a, o_b], 1), o_full) <= 1e-5
    assert rel_err(two, one) <= 1e-5


def test_g_and_beta_longer_than_q_are_trimmed() -> None:
    x = inputs(70, seed=7)
    long = dict(x, g=torch.cat([x["g"], -torch.rand(1, 9, HV, K)], 1), beta=torch.cat([x["beta"], torch.randn(1, 9, HV)], 1))
    p1, p2 = pool_of(1), pool_of(1)
    assert torch.equal(run(x, p1, [0]), run(long, p2, [0]))
    assert torch.equal(p1, p2)


def test_batch_of_equal_lengths_equals_varlen() -> None:
    x = inputs(40, seed=8, B=3)
    p1, p2 = pool_of(3), pool_of(3)
    o_b = run(x, p1, [0, 1, 2])
    flat = {n: t.reshape(1, -1, *t.shape[2:]) for n, t in x.items()}
    o_v = run(flat, p2, [0, 1, 2], [0, 40, 80, 120])
    assert o_b.shape == (3, 40, HV, V)
    assert torch.allclose(o_b.reshape(1, 120, HV, V), o_v, rtol=1e-5, atol=1e-6)
    assert torch.allclose(p1, p2, rtol=1e-5, atol=1e-6)


def test_state_k_first_layout_equals_v_first() -> None:
    x = inputs(90, seed=9)
    pv = pool_of(2)
    pk = pv.transpose(-1, -2).contiguous()
    o_v = run(x, pv, [1])
    o_k = run(x, pk, [1], state_v_first=False)
    assert torch.allclose(o_v, o_k, rtol=1e-5, atol=1e-6)
    assert torch.allclose(pk.transpose(-1, -2), pv, rtol=1e-5, atol=1e-6)


def test_intermediate_states_are_the_states_before_each_chunk() -> None:
    cu = [0, 1, 131, 195]
    x = inputs(195, seed=10)
    pool = pool_of(3, seed=11)
    init = pool.clone()
    o, h = run(x, pool, [2, 0, 1], cu, output_intermediate_states=True)
    assert h.shape == (1, 1 + 3 + 1, HV, V, K) and h.dtype == torch.float32
    starts = [(0, 2), (1, 0), (65, 0), (129, 0), (131, 1)]  # (chunk start token, slot)
    for j, (t0, slot) in enumerate(starts):
        seq = max(n for n in range(3) if cu[n] <= t0)
        pre = {n: t[:, cu[seq]:t0] for n, t in x.items()}
        if t0 == cu[seq]:
            assert torch.equal(h[0, j], init[slot]), f"chunk {j}: h is not the slot's initial state"
        else:
            assert rel_err(h[0, j], reference(pre, init[slot][None], None)[1][0]) <= 1e-4
    assert rel_err(o[0], reference(x, init[[2, 0, 1]], cu)[0]) <= 1e-4


def test_bf16_inputs_and_bf16_pool() -> None:
    x = inputs(150, seed=12)
    init = pool_of(1, seed=13)
    ref_o, ref_final = reference(x, init, None)
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    pool = init.to(torch.bfloat16)
    o = run(xb, pool, [0])
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    assert rel_err(o[0], ref_o) <= 1e-2
    assert rel_err(pool[0], ref_final[0]) <= 1e-2


def test_single_token_sequences_take_the_recurrent_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("single-token sequences must not take the chunked path")

    monkeypatch.setattr(torch_backend, "chunked_pass", forbidden)
    x = inputs(3, seed=14)
    pool = pool_of(3, seed=15)
    init = pool.clone()
    o = run(x, pool, [2, 0, 1], [0, 1, 2, 3])
    ref_o, ref_final = reference(x, init[[2, 0, 1]], [0, 1, 2, 3])
    assert rel_err(o[0], ref_o) <= 1e-5
    assert rel_err(pool[[2, 0, 1]], ref_final) <= 1e-5


def test_kda_prefill_returns_final_states_and_leaves_its_input_alone() -> None:
    x = inputs(100, seed=16, B=2)
    init = pool_of(2, seed=17)
    keep = init.clone()
    o, final = kda_prefill(**x, initial_state=init, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert torch.equal(init, keep)
    ref_o, ref_final = reference(x, init, [0, 100, 200])
    assert rel_err(o.reshape(1, 200, HV, V)[0], ref_o) <= 1e-4
    assert rel_err(final, ref_final) <= 1e-4
    o0, final0 = kda_prefill(**x, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert rel_err(final0, reference(x, None, [0, 100, 200])[1]) <= 1e-4


def test_real_gates_with_one_huge_decay_among_small_ones_stay_accurate() -> None:
    """exp(A_log) up to 200: one token decays by ~-2600 amid tokens of ~-0.01, the regime
    where factoring exp(G_t - G_s) as exp(G_t) * exp(-G_s) overflows float32."""
    T = 160
    x = inputs(T, seed=18)
    raw = torch.full((1, T, HV, K), -9.0)  # softplus(-9) * 200 ~ 0.025
    raw[0, 20] = 13.0  # softplus(13) * 200 = 2600
    raw[0, 100, :, :3] = 10.0
    A_log = torch.log(torch.tensor([200.0, 50.0, 1.0, 120.0]))
    x["g"] = raw
    pool = pool_of(1, seed=19)
    init = pool.clone()
    o = run(x, pool, [0], A_log=A_log)
    flat = {n: t[0] for n, t in x.items()}
    ref_o, ref_final = naive_recurrent_kda(flat["q"], flat["k"], flat["v"], flat["g"], flat["beta"],
                                           initial_state=init, A_log=A_log, **REF_OPTS)
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()
    assert rel_err(o[0], ref_o) <= 1e-4
    assert rel_err(pool, ref_final) <= 1e-4


def test_default_backend_on_cpu_is_torch() -> None:
    from kernels import default_backend

    assert default_backend(torch.device("cpu")) == "torch"


# ---- host-side sequence bounds (cu_seqlens_cpu) -------------------------------------------

@pytest.mark.parametrize("lengths", [(1, 1, 1, 1), (5, 1, 70, 3)], ids=["decode", "mixed"])
def test_cu_seqlens_cpu_gives_results_identical_to_cu_seqlens(lengths: tuple[int, ...]) -> None:
    """The host bounds replace reading cu_seqlens back: o and every pool row bit for bit
    the same, with cu_seqlens given too or alone from cu_seqlens_cpu (int32 or int64)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x, idx = inputs(cu[-1], seed=7), [3, -1, 0, 5][:len(lengths)]
    want_pool = pool_of(6)
    want = run(x, want_pool, idx, cu)
    for dtype in (torch.int64, torch.int32):
        for device_bounds in (torch.tensor(cu), None):
            pool = pool_of(6)
            got = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                            initial_state_indices=torch.tensor(idx), cu_seqlens=device_bounds,
                            cu_seqlens_cpu=torch.tensor(cu, dtype=dtype), **OPTS)
            assert torch.equal(got, want) and torch.equal(pool, want_pool)


def test_cu_seqlens_cpu_is_checked() -> None:
    x = inputs(8)
    cases = [
        (dict(cu_seqlens=torch.tensor([0, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 8])),
         r"cu_seqlens_cpu must hold cu_seqlens' 3 offsets, got 2"),
        (dict(cu_seqlens_cpu=torch.tensor([0, 3, 7])), r"cu_seqlens must .* end at T=8, got \[0, 3, 7\]"),
        (dict(cu_seqlens_cpu=torch.tensor([0.0, 8.0])), r"cu_seqlens_cpu must be int32 or int64"),
        (dict(cu_seqlens_cpu=torch.tensor([0, 3, 8], device="meta")), r"cu_seqlens_cpu must be on the host"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool_of(3),
                      initial_state_indices=torch.tensor([0, 2]), **OPTS, **kw)


@pytest.mark.parametrize("cu", [[0, 64], [0, 100], [0, 1], [0, 64, 65, 130]])
def test_run_problem_returns_o_contiguous_and_right(cu: list[int]) -> None:
    """`run_problem`'s o [T, HV, V] is contiguous, as the Triton backend's (a lone chunked
    sequence's comes from its chunk layout; the encoders hand o's bytes out as they lie),
    and matches the float64 reference."""
    from kernels import run_problem
    from kernels.api import build_problem

    T = cu[-1]
    x = inputs(T, seed=11)
    pool = pool_of(len(cu) - 1)
    idx = torch.arange(len(cu) - 1)
    problem = build_problem(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, pool=pool.clone(), indices=idx,
        cu_seqlens=torch.tensor(cu), A_log=None, dt_bias=None, lower_bound=None, use_qk_l2norm=True,
        use_beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True, output_intermediate_states=False)
    o, _ = run_problem(problem, "torch")
    o_ref, _ = naive_recurrent_kda(x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], initial_state=pool,
                                   cu_seqlens=cu, **REF_OPTS)
    assert o.shape == (T, HV, V) and o.is_contiguous()
    assert rel_err(o, o_ref) < 1e-4
