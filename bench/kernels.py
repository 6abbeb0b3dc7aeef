"""Kernel benchmark: kda-serve's Triton backend against fla-core 0.6.0 on one GPU.

Serving config (TARGETS.md): bf16 q/k/v/g/beta, H = HV = 32, K = V = 128, fused gate with
lower_bound = -5 (A_log, dt_bias), q/k L2 norm and beta sigmoid in kernel, varlen
cu_seqlens, initial states from an fp32 pool [S, HV, V, K] and final states written back.

- ours: `kernels.triton_backend.run_triton` on a prebuilt `PrefillProblem` (argument
  validation outside the timed region), in place on the pool rows;
- fla-core `chunk_kda` (safe_gate=True, use_gate_in_kernel=True, state_v_first=True): it
  has no indexed-pool form, so each timed call gathers the rows (index_select), runs, and
  scatters the final states back (index_copy_); decode: fla `fused_recurrent_kda_fwd` with
  its own in-place indexed form (ssm_state_indices, inplace_final_state=True).

Timing: `triton.testing.do_bench` median, always on scratch copies of the pool (the
timing runs advance those states, never a live one); ours is never autotuned. Each case
also checks our o and final states against fla's on the same inputs (relative L2).

Usage (GPU machine, fla-core on PYTHONPATH, FLA_FLASH_KDA=0):
    python bench/kernels.py [--sweep] [--no-fla] [--json PATH] [--cases NAMES]
    ncu -k regex:chunk_intra --launch-skip 2 --launch-count 1 python bench/kernels.py --profile 8x4096
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.api import build_problem  # noqa: E402
from kernels.problem import PrefillProblem  # noqa: E402
from kernels.reference import naive_recurrent_kda  # noqa: E402
from kernels.triton_backend import run_triton  # noqa: E402
from kernels.triton_kernels import LaunchConfig, select_config  # noqa: E402

H, K, V = 32, 128, 128
LOWER_BOUND = -5.0
CASES = [(1, 4096), (1, 16384), (1, 65536), (8, 4096), (64, 512), (256, 128)]
FP32_CASES = [(1, 4096), (8, 4096)]  # fp32 inputs: products as `LaunchConfig.fp32_products` says
DECODE = (256, 1)
# variants of our launch config timed with --sweep (overrides of the shape-chosen config);
# each must first match the default on a small case in its own process (`_warm_ours`)
VARIANTS: dict[str, dict] = {
    "full-width solve levels": dict(solve_diag16=False),
    "pairwise k decays": dict(factored_a=False),
    "decode BV 64": dict(rec_bv=64),
    "fp32 products ieee": dict(fp32_products="ieee"),  # changes the fp32 cases only
}


def make_case(n_seq: int, length: int, seed: int = 0, heads: int = H, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Random serving-config inputs for n_seq sequences of ``length`` tokens, on the GPU:
    q, k, v, g, beta in ``dtype``, A_log, dt_bias and the pool in fp32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = n_seq * length
    dev = dict(device="cuda")

    def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, **dev).to(dtype)

    pool_rows = n_seq + 8
    return dict(
        q=randn(1, T, heads, K), k=randn(1, T, heads, K), v=randn(1, T, heads, V),
        g=randn(1, T, heads, K), beta=randn(1, T, heads),
        A_log=torch.rand(heads, generator=gen, **dev), dt_bias=2.0 * randn(heads, K, dtype=torch.float32) - 3.0,
        cu=torch.arange(0, T + 1, length, dtype=torch.int64, **dev),
        pool=0.1 * randn(pool_rows, heads, V, K, dtype=torch.float32),
        idx=torch.randperm(pool_rows, generator=gen, **dev)[:n_seq],
    )


def our_problem(c: dict, pool: torch.Tensor) -> PrefillProblem:
    return build_problem(
        c["q"], c["k"], c["v"], c["g"], c["beta"], scale=None, pool=pool, indices=c["idx"],
        cu_seqlens=c["cu"], A_log=c["A_log"], dt_bias=c["dt_bias"], lower_bound=LOWER_BOUND,
        use_qk_l2norm=True, use_beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
        output_intermediate_states=False,
    )


def ours_fn(c: dict, pool: torch.Tensor, cfg: Optional[LaunchConfig] = None) -> Callable[[], torch.Tensor]:
    p = our_problem(c, pool)
    return lambda: run_triton(p, cfg)[0]


def fla_fn(c: dict, pool: torch.Tensor) -> Callable[[], torch.Tensor]:
    """fla-core chunk_kda (or, for 1-token sequences, fused_recurrent_kda_fwd) on ``pool``."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    gate = dict(A_log=c["A_log"], dt_bias=c["dt_bias"].reshape(-1), lower_bound=LOWER_BOUND)
    if int(c["cu"][1]) == 1:  # decode: fla's own in-place indexed form
        def decode() -> torch.Tensor:
            return fused_recurrent_kda_fwd(
                *args, initial_state=pool, inplace_final_state=True, state_v_first=True,
                cu_seqlens=c["cu"], ssm_state_indices=c["idx"], use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate)[0]
        return decode
    cu_cpu = c["cu"].cpu()

    def prefill() -> torch.Tensor:
        h0 = pool.index_select(0, c["idx"])
        o, ht = chunk_kda(
            *args, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
            state_v_first=True, cu_seqlens=c["cu"], cu_seqlens_cpu=cu_cpu, **gate)
        pool.index_copy_(0, c["idx"], ht)
        return o
    return prefill


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def kernel_breakdown(fn: Callable[[], object], iters: int = 5) -> dict[str, float]:
    """Mean GPU time per call of each kernel (ms), from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out[e.key[:48]] = t / iters / 1000.0
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def compiled_resources() -> list[str]:
    """Registers / spills / shared memory of every compiled variant of our kernels."""
    from kernels import triton_kernels as tk

    lines = []
    for name in ("chunk_intra_kernel", "chunk_wy_kernel", "chunk_state_kernel",
                 "chunk_output_kernel", "recurrent_step_kernel"):
        fn = getattr(tk, name)
        caches = getattr(fn, "device_caches", None) or {}
        for dev_cache in caches.values():
            kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for compiled in kernels.values():
                md = compiled.metadata
                lines.append(f"{name}: regs={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')} "
                             f"smem={getattr(md, 'shared', '?')} warps={getattr(md, 'num_warps', '?')} "
                             f"stages={getattr(md, 'num_stages', '?')}")
    return lines


GATE_TOL = 2e-2  # a variant's o and final states against the default's, 16-bit operands


def _warm_ours(overrides: dict) -> tuple[str, bool]:
    """Compile one config variant (in a worker process of its own) on small cases of the
    same shapes, and check it against the default config on them: (report, passed). A
    variant that faults (an illegal address kills the CUDA context) or differs is left
    out of the timed runs, which share one process."""
    torch.cuda.init()
    base = select_config(K, V, False)
    cfg = base.with_overrides(**overrides)
    t = time.time()
    worst = 0.0
    try:
        for n, length, dtype in ((2, 130, torch.bfloat16), (4, 1, torch.bfloat16), (2, 130, torch.float32)):
            c = make_case(n, length, seed=1, dtype=dtype)
            for fused in ((True, False) if length > 1 and cfg.fuse_output is None else (cfg.fuse_output,)):
                pool_v, pool_d = c["pool"].clone(), c["pool"].clone()
                o_v = ours_fn(c, pool_v, cfg.with_overrides(fuse_output=fused))()
                o_d = ours_fn(c, pool_d, base.with_overrides(fuse_output=fused))()
                worst = max(worst, rel(o_v, o_d), rel(pool_v[c["idx"]], pool_d[c["idx"]]))
        torch.cuda.synchronize()
    except Exception as e:
        return f"variant {overrides or 'default'} failed: {e!r}"[:300], False
    ok = worst < GATE_TOL  # NaN fails too
    return f"warm {overrides or 'default'}: {time.time() - t:.1f}s, vs default {worst:.1e}" + (
        "" if ok else " (differs: left out)"), ok


def _warm_fla() -> str:
    torch.cuda.init()
    t = time.time()
    with torch.inference_mode():
        for n, length in ((2, 130), (4, 1)):
            c = make_case(n, length, seed=1)
            fla_fn(c, c["pool"].clone())()
    torch.cuda.synchronize()
    return f"warm fla: {time.time() - t:.1f}s"


def warm_up(sweep: bool, with_fla: bool) -> list[str]:
    """Compile everything in parallel worker processes first (Triton's disk cache then
    serves the timed process); fla autotunes there too (its results are cached). Returns
    the names of the sweep's variants that passed their check."""
    names = list(VARIANTS) if sweep else []
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(len(names) + 2, 12), maxtasksperchild=1) as pool:
        fla_job = pool.apply_async(_warm_fla) if with_fla else None
        jobs = {name: pool.apply_async(_warm_ours, (VARIANTS[name],)) for name in names}
        default = pool.apply_async(_warm_ours, ({},))
        passed = []
        for name, job in [("default", default), *jobs.items()]:
            try:
                report, ok = job.get(timeout=300)
            except Exception as e:  # a worker that died
                report, ok = f"variant {name}: {e!r}", False
            print(report, flush=True)
            if ok and name != "default":
                passed.append(name)
        if fla_job is not None:
            try:
                print(fla_job.get(timeout=400), flush=True)
            except Exception as e:
                print(f"fla warm-up failed: {e!r}", flush=True)
    return passed


def accuracy(with_fla: bool) -> dict[str, float]:
    """Relative L2 error vs the float32 per-token reference, 2 x 2048 tokens, 4 heads."""
    c = make_case(2, 2048, seed=3, heads=4)
    init = c["pool"][c["idx"]].clone()
    ref_o, ref_s = naive_recurrent_kda(
        c["q"][0], c["k"][0], c["v"][0], c["g"][0], c["beta"][0], initial_state=init, cu_seqlens=c["cu"],
        A_log=c["A_log"], dt_bias=c["dt_bias"], lower_bound=LOWER_BOUND, use_qk_l2norm=True,
        use_beta_sigmoid=True, dtype=torch.float32)
    out = {}
    pool = c["pool"].clone()
    out["ours_o"] = rel(ours_fn(c, pool)(), ref_o)
    out["ours_state"] = rel(pool[c["idx"]], ref_s)
    if with_fla:
        pool = c["pool"].clone()
        with torch.inference_mode():
            out["fla_o"] = rel(fla_fn(c, pool)()[0], ref_o)
        out["fla_state"] = rel(pool[c["idx"]], ref_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time the config variants")
    ap.add_argument("--no-fla", action="store_true", help="skip fla-core")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--cases", help="only these cases, by name, comma-separated (e.g. '8x4096,1x4096 fp32')")
    ap.add_argument("--profile", metavar="NxL", help="only run ours on this case a few times (under ncu) and exit")
    args = ap.parse_args()
    if args.profile:
        n_seq, length = (int(x) for x in args.profile.split("x"))
        c = make_case(n_seq, length)
        fn = ours_fn(c, c["pool"].clone())
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return
    with_fla = not args.no_fla
    if with_fla:
        try:
            import fla  # noqa: F401
        except Exception as e:
            print(f"fla-core unavailable: {e!r}")
            with_fla = False

    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
               triton=triton.__version__, fla=getattr(sys.modules.get("fla"), "__version__", None),
               config=asdict(select_config(K, V, False)))
    print(json.dumps(env), flush=True)
    t0 = time.time()
    variants = warm_up(args.sweep, with_fla)
    print(f"warm-up {time.time() - t0:.0f}s", flush=True)

    rows = []
    cases = [(n, L, torch.bfloat16) for n, L in CASES + [DECODE]] + [(n, L, torch.float32) for n, L in FP32_CASES]
    wanted = None if args.cases is None else {name.strip() for name in args.cases.split(",")}
    for n_seq, length, dtype in cases:
        name = f"{n_seq}x{length}" + (" decode" if length == 1 else "") + (" fp32" if dtype == torch.float32 else "")
        if wanted is not None and name not in wanted:
            continue
        c = make_case(n_seq, length, dtype=dtype)
        row: dict = dict(case=name, tokens=n_seq * length)
        with torch.inference_mode():
            row["ours_ms"] = bench(ours_fn(c, c["pool"].clone()))
            if with_fla:
                row["fla_ms"] = bench(fla_fn(c, c["pool"].clone()))
                row["speedup"] = row["fla_ms"] / row["ours_ms"]
                pa, pb = c["pool"].clone(), c["pool"].clone()
                oa, ob = ours_fn(c, pa)(), fla_fn(c, pb)()
                row["vs_fla_o"] = rel(oa.reshape(ob.shape), ob)
                row["vs_fla_state"] = rel(pa[c["idx"]], pb[c["idx"]])
            if args.sweep:
                base = select_config(K, V, False)
                pool_d = c["pool"].clone()
                o_d = ours_fn(c, pool_d)()
                for vname in variants:
                    try:
                        cfg = base.with_overrides(**VARIANTS[vname])
                        row[vname] = bench(ours_fn(c, c["pool"].clone(), cfg), rep=100)
                        pool_v = c["pool"].clone()  # the variant's numbers against the default's, same inputs
                        row[f"{vname} vs default"] = max(rel(ours_fn(c, pool_v, cfg)(), o_d),
                                                         rel(pool_v[c["idx"]], pool_d[c["idx"]]))
                    except Exception as e:
                        row[vname] = f"error: {e!r}"[:120]
            row["kernels"] = kernel_breakdown(ours_fn(c, c["pool"].clone()))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del c
        torch.cuda.empty_cache()

    acc = accuracy(with_fla)
    print("accuracy vs float32 reference (2x2048, 4 heads):", json.dumps(acc), flush=True)
    res = compiled_resources()
    print("\n".join(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, accuracy=acc, resources=res), f, indent=1)

    print("\n| case | tokens | ours ms | fla-core ms | speed-up | o vs fla | state vs fla |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} | {r['ours_ms']:.3f} | {r.get('fla_ms', float('nan')):.3f} | "
              f"{r.get('speedup', float('nan')):.2f}x | {r.get('vs_fla_o', float('nan')):.1e} | "
              f"{r.get('vs_fla_state', float('nan')):.1e} |")
    if args.sweep:
        names = variants
        print("\nsweep, ms (rel L2 of o / final states against the default's): case | default | " + " | ".join(names))
        for r in rows:
            print(f"{r['case']} | {r['ours_ms']:.3f} | " + " | ".join(
                f"{r[n]:.3f} ({r[n + ' vs default']:.0e})" if isinstance(r[n], float) else "err" for n in names))


if __name__ == "__main__":
    main()
