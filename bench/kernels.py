"""Kernel benchmark: kda-serve's Triton backend against fla-core 0.6.0 and FlashKDA, one GPU, one run.

Serving config: bf16 q/k/v/g/beta, K = V = 128, fused gate with lower_bound = -5 (A_log,
dt_bias), q/k L2 norm and beta sigmoid in kernel, varlen cu_seqlens, initial states from
an fp32 pool [S, HV, V, K] and final states written back. Cases: the issue tables' H = 32
and H = 96 batches, and decode (256 one-token sequences on a 2048-slot pool).

- ours: `kernels.triton_backend.run_triton` on a prebuilt `PrefillProblem` (argument
  validation outside the timed region), in place on the pool rows;
- the peers (`bench/kernel_peers.py`): fla-core `chunk_kda` and FlashKDA, each
  "pre-gathered" (states gathered before the timed region: the issue tables' figure) and
  with the gather/scatter of pool rows a serving engine adds; decode: fla's in-place
  indexed `fused_recurrent_kda_fwd`.

Timing: `triton.testing.do_bench` median, always on scratch copies of the pool (timing
runs advance those states, never a live one); ours is never autotuned. Each case also
checks our o and final states against each peer's on the same inputs (relative L2), and
gives our per-stage GPU times (torch profiler) with the bytes each stage moves
(`bench/stage_bytes.py`) and the bandwidth that makes. ``--sweep`` times the config
variants of `VARIANTS` beside the default (total and per stage), each first checked against
the default in a worker process of its own (a faulting variant cannot take the timed
process down).

Usage (GPU machine; fla-core and .peers on PYTHONPATH, FLA_FLASH_KDA=0 so fla runs its own path):
    python bench/kernels.py [--sweep] [--no-peers] [--fp32] [--json PATH] [--cases NAMES]
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

from bench import kernel_peers  # noqa: E402
from bench.stage_bytes import stage_bytes  # noqa: E402
from kernels.api import build_problem  # noqa: E402
from kernels.problem import PrefillProblem  # noqa: E402
from kernels.reference import naive_recurrent_kda  # noqa: E402
from kernels.triton_backend import run_triton  # noqa: E402
from kernels.triton_kernels import LaunchConfig, select_config  # noqa: E402
from kernels.triton_toolchain import toolchain_report  # noqa: E402

K, V = 128, 128
LOWER_BOUND = kernel_peers.LOWER_BOUND
# (name, sequence lengths, heads): the issue tables' cases
CASES: list[tuple[str, tuple[int, ...], int]] = [
    ("1x4096 H32", (4096,), 32), ("1x16384 H32", (16384,), 32), ("1x65536 H32", (65536,), 32),
    ("8x4096 H32", (4096,) * 8, 32), ("64x512 H32", (512,) * 64, 32), ("256x128 H32", (128,) * 256, 32),
    ("1x8192 H96", (8192,), 96), ("6 varlen H96", (3000, 2048, 1500, 1000, 600, 44), 96),
    ("8x1024 H96", (1024,) * 8, 96),
]
DECODE = ("256x1 decode H32", (1,) * 256, 32)
PEERS = ("fla", "FlashKDA")
DECODE_POOL = 2048
FP32_CASES = [("1x4096 H32 fp32", (4096,), 32), ("8x4096 H32 fp32", (4096,) * 8, 32)]
# config variants timed with --sweep (overrides of the shape-chosen config)
VARIANTS: dict[str, dict] = {
    "decode BV 64": dict(rec_bv=64),
    # the bounded gate's intra kernel (`intra_bounded`) is the default: the kernel before it, and its caps
    "previous intra": dict(bounded_intra=False),
    "bounded intra, no register cap": dict(bounded_intra=True, bounded_intra_maxnreg=0),
    "bounded intra, 128 registers": dict(bounded_intra=True, bounded_intra_maxnreg=128),  # 4 programs an SM, spills
}
STAGE_OF = {"chunk_intra_kernel": "intra", "chunk_intra_bounded_kernel": "intra", "chunk_wy_kernel": "wy",
            "chunk_state_kernel": "state", "chunk_output_kernel": "output", "recurrent_step_kernel": "decode"}


def make_case(lengths: tuple[int, ...], heads: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
              pool_rows: Optional[int] = None) -> dict:
    """Random serving-config inputs on the GPU: q, k, v, g, beta in ``dtype`` [1, T, heads, .],
    A_log, dt_bias and the pool (``pool_rows``, default N + 8) in fp32, N random distinct slots."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(lengths), len(lengths)

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dt)

    rows = pool_rows or N + 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    return dict(
        lengths=list(lengths), heads=heads,
        q=randn(1, T, heads, K), k=randn(1, T, heads, K), v=randn(1, T, heads, V),
        g=randn(1, T, heads, K), beta=randn(1, T, heads),
        A_log=torch.rand(heads, generator=gen, device="cuda"),
        dt_bias=2.0 * randn(heads, K, dt=torch.float32) - 3.0, cu=cu,
        pool=0.1 * randn(rows, heads, V, K, dt=torch.float32),
        idx=torch.randperm(rows, generator=gen, device="cuda")[:N],
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


def peer_fns(c: dict, pool: torch.Tensor, gather: bool, names: tuple[str, ...] = PEERS
             ) -> dict[str, Optional[Callable[[], torch.Tensor]]]:
    """{"fla": ..., "FlashKDA": ...} on ``pool``, those of ``names`` (decode: fla's in-place
    form, no FlashKDA)."""
    decode = max(c["lengths"]) == 1
    make = {"fla": lambda: kernel_peers.fla_decode(c, pool) if decode else kernel_peers.fla_prefill(c, pool, gather),
            "FlashKDA": lambda: None if decode else kernel_peers.flash_kda_prefill(c, pool, gather)}
    return {name: make[name]() for name in names}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def stage_times(fn: Callable[[], object], iters: int = 5) -> dict[str, float]:
    """Mean GPU time per call of each of our stages (ms), from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        stage = STAGE_OF.get(e.key)
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if stage and t > 0:
            out[stage] = out.get(stage, 0.0) + t / iters / 1000.0
    return out


def compiled_resources() -> list[str]:
    """Registers / spills / shared memory of every compiled variant of our kernels."""
    from kernels import triton_kernels as tk

    lines = []
    for name in STAGE_OF:
        fn = getattr(tk, name)
        for dev_cache in (getattr(fn, "device_caches", None) or {}).values():
            kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for compiled in kernels.values():
                md = compiled.metadata
                lines.append(f"{name}: regs={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')} "
                             f"smem={getattr(md, 'shared', '?')} warps={getattr(md, 'num_warps', '?')} "
                             f"stages={getattr(md, 'num_stages', '?')}")
    return lines


GATE_TOL = 2e-2  # a variant's o and final states against the default's, 16-bit operands (reported)


def _warm_ours(overrides: dict, fp32: bool) -> tuple[str, bool]:
    """Compile one config variant (in a worker process of its own) on small cases of the
    benchmark's shapes and compare it with the default config on them: (report, ran without
    an error). Each variant's accuracy against the reference is in `accuracy`."""
    torch.cuda.init()
    base = select_config(K, V, False)
    cfg = base.with_overrides(**overrides)
    t = time.time()
    worst = 0.0
    shapes = [((130, 130), 32, torch.bfloat16), ((1,) * 4, 32, torch.bfloat16), ((130, 130), 96, torch.bfloat16),
              ((130,), 32, torch.bfloat16), ((130,), 96, torch.bfloat16)]
    if fp32:
        shapes.append(((130, 130), 32, torch.float32))
    try:
        for lengths, heads, dtype in shapes:
            c = make_case(lengths, heads, seed=1, dtype=dtype)
            pool_v, pool_d = c["pool"].clone(), c["pool"].clone()
            o_v = ours_fn(c, pool_v, cfg)()
            o_d = ours_fn(c, pool_d, base)()
            worst = max(worst, rel(o_v, o_d), rel(pool_v[c["idx"]], pool_d[c["idx"]]))
        torch.cuda.synchronize()
    except Exception as e:
        return f"variant {overrides or 'default'} failed: {e!r}"[:300], False
    differs = not worst < GATE_TOL  # NaN differs too; still timed (the default may be the wrong one)
    return f"warm {overrides or 'default'}: {time.time() - t:.1f}s, vs default {worst:.1e}" + (
        " (DIFFERS)" if differs else ""), True


def _warm_peers(names: tuple[str, ...]) -> str:
    torch.cuda.init()
    t = time.time()
    with torch.inference_mode():
        for lengths, heads in (((130, 130), 32), ((1,) * 4, 32), ((130, 130), 96)):
            c = make_case(lengths, heads, seed=1)
            for fn in peer_fns(c, c["pool"].clone(), True, names).values():
                if fn is not None:
                    fn()
    torch.cuda.synchronize()
    return f"warm peers: {time.time() - t:.1f}s"


def warm_up(names: list[str], peers: tuple[str, ...], fp32: bool) -> list[str]:
    """Compile everything in parallel worker processes first (Triton's disk cache then
    serves the timed process; fla autotunes there too, its results cached). Returns the
    names of the sweep's variants ``names`` that passed their check."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(len(names) + 2, 12), maxtasksperchild=1) as pool:
        peer_job = pool.apply_async(_warm_peers, (peers,)) if peers else None
        jobs = {name: pool.apply_async(_warm_ours, (VARIANTS[name], fp32)) for name in names}
        default = pool.apply_async(_warm_ours, ({}, fp32))
        passed = []
        for name, job in [("default", default), *jobs.items()]:
            try:
                report, ok = job.get(timeout=300)
            except Exception as e:  # a worker that died
                report, ok = f"variant {name}: {e!r}", False
            print(report, flush=True)
            if ok and name != "default":
                passed.append(name)
        if peer_job is not None:
            try:
                print(peer_job.get(timeout=400), flush=True)
            except Exception as e:
                print(f"peer warm-up failed: {e!r}", flush=True)
    return passed


def accuracy(peers: tuple[str, ...], variants: list[str]) -> dict[str, float]:
    """Relative L2 error of o and final states vs the float32 per-token reference,
    2 x 2048 tokens, 4 heads: ours (default and each variant) and the peers'."""
    c = make_case((2048, 2048), 4, seed=3)
    init = c["pool"][c["idx"]].clone()
    ref_o, ref_s = naive_recurrent_kda(
        c["q"][0], c["k"][0], c["v"][0], c["g"][0], c["beta"][0], initial_state=init, cu_seqlens=c["cu"],
        A_log=c["A_log"], dt_bias=c["dt_bias"], lower_bound=LOWER_BOUND, use_qk_l2norm=True,
        use_beta_sigmoid=True, dtype=torch.float32)
    out = {}
    runs = {"ours": lambda pool: ours_fn(c, pool)}
    for vname in variants:
        cfg = select_config(K, V, False).with_overrides(**VARIANTS[vname])
        runs[vname] = lambda pool, cfg=cfg: ours_fn(c, pool, cfg)
    runs.update({name: (lambda pool, name=name: peer_fns(c, pool, True, peers)[name]) for name in peers})
    for name, make in runs.items():
        pool = c["pool"].clone()
        fn = make(pool)
        if fn is None:
            continue
        with torch.inference_mode():
            o = fn()
        out[f"{name}_o"] = rel(o.reshape(ref_o.shape), ref_o)
        out[f"{name}_state"] = rel(pool[c["idx"]], ref_s)
    return out


def time_case(name: str, c: dict, peers: tuple[str, ...], variants: list[str]) -> dict:
    """One case's row: our time, the variants', the peers' (both forms), the agreement of
    o and final states with each peer, and our per-stage times, bytes and bandwidths."""
    row: dict = dict(case=name, tokens=sum(c["lengths"]))
    with torch.inference_mode():
        row["ours_ms"] = bench(ours_fn(c, c["pool"].clone()))
        pool_d = c["pool"].clone()
        o_d = ours_fn(c, pool_d)()
        for vname in variants:
            try:
                cfg = select_config(K, V, False).with_overrides(**VARIANTS[vname])
                row[vname] = bench(ours_fn(c, c["pool"].clone(), cfg), rep=100)
                pool_v = c["pool"].clone()
                row[f"{vname} vs default"] = max(rel(ours_fn(c, pool_v, cfg)(), o_d),
                                                 rel(pool_v[c["idx"]], pool_d[c["idx"]]))
                row[f"{vname} stages"] = stage_times(ours_fn(c, c["pool"].clone(), cfg))
            except Exception as e:
                row[vname] = f"error: {e!r}"[:120]
        if peers:
            for gather in (False, True):
                for peer, fn in peer_fns(c, c["pool"].clone(), gather, peers).items():
                    if fn is not None:
                        row[f"{peer}{' gather/scatter' if gather else ''}_ms"] = bench(fn)
            for peer in peers:
                pool_p = c["pool"].clone()
                fn = peer_fns(c, pool_p, True, peers)[peer]
                if fn is None:
                    continue
                o_p = fn()
                row[f"o vs {peer}"] = rel(o_d.reshape(o_p.shape), o_p)
                row[f"state vs {peer}"] = rel(pool_d[c["idx"]], pool_p[c["idx"]])
        times = stage_times(ours_fn(c, c["pool"].clone()))
    moved = stage_bytes(c["lengths"], c["heads"], c["heads"], K, V, c["q"].element_size(), 4)
    token_heads = row["tokens"] * c["heads"]
    row["stages"] = {s: dict(ms=t, bytes_per_token_head=moved.get(s, 0) / token_heads,
                             tb_per_s=moved.get(s, 0) / (t * 1e-3) / 1e12) for s, t in times.items()}
    return row


def case_list(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...], int, torch.dtype]]:
    cases = [(n, lengths, heads, torch.bfloat16) for n, lengths, heads in CASES + [DECODE]]
    if args.fp32:
        cases += [(n, lengths, heads, torch.float32) for n, lengths, heads in FP32_CASES]
    wanted = None if args.cases is None else {name.strip() for name in args.cases.split(",")}
    return [case for case in cases if wanted is None or case[0] in wanted]


def print_tables(rows: list[dict], variants: list[str]) -> None:
    print("\n| case | tokens | fla-core | FlashKDA | kda-serve | vs FlashKDA | vs fla | fla g/s | FlashKDA g/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    nan = float("nan")
    for r in rows:
        fla, fk, ours = r.get("fla_ms", nan), r.get("FlashKDA_ms", nan), r["ours_ms"]
        print(f"| {r['case']} | {r['tokens']} | {fla:.3f} | {fk:.3f} | {ours:.3f} | {fk / ours:.2f}x | "
              f"{fla / ours:.2f}x | {r.get('fla gather/scatter_ms', nan):.3f} | "
              f"{r.get('FlashKDA gather/scatter_ms', nan):.3f} |")
    print("\nour stages: ms (bytes per token-head, TB/s)")
    for r in rows:
        print(f"{r['case']}: " + ", ".join(f"{s} {v['ms']:.3f} ({v['bytes_per_token_head']:.0f} B, "
                                           f"{v['tb_per_s']:.2f})" for s, v in r["stages"].items()))
    if variants:
        print("\nsweep, ms (rel L2 of o / final states against the default's): case | default | " + " | ".join(variants))
        for r in rows:
            print(f"{r['case']} | {r['ours_ms']:.3f} | " + " | ".join(
                f"{r[n]:.3f} ({r[n + ' vs default']:.0e})" if isinstance(r.get(n), float) else "err"
                for n in variants))
        print("stages, ms: case | default | " + " | ".join(variants))
        for r in rows:
            print(f"{r['case']} | " + " | ".join(
                ", ".join(f"{st} {ms:.3f}" for st, ms in stages.items())
                for stages in [{s: v["ms"] for s, v in r["stages"].items()},
                               *(r.get(f"{n} stages", {}) for n in variants)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time the config variants")
    ap.add_argument("--variants", help="with --sweep: only these variants, by name, comma-separated")
    ap.add_argument("--no-peers", action="store_true", help="skip fla-core and FlashKDA")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="which peers to time, comma-separated (fla's autotuning warm-up alone takes ~190 s)")
    ap.add_argument("--fp32", action="store_true", help="add the fp32-input cases (ours and fla)")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--cases", help="only these cases, by name, comma-separated (e.g. '8x4096 H32,1x8192 H96')")
    args = ap.parse_args()
    peers = () if args.no_peers else tuple(p.strip() for p in args.peers.split(",") if p.strip())
    if unknown := set(peers) - set(PEERS):
        ap.error(f"unknown peer(s) {sorted(unknown)}; the peers are {', '.join(PEERS)}")
    if "fla" in peers:
        try:
            import fla  # noqa: F401
        except Exception as e:
            print(f"fla-core unavailable: {e!r}")
            peers = tuple(p for p in peers if p != "fla")
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
               fla=getattr(sys.modules.get("fla"), "__version__", None), flash_kda=kernel_peers.flash_kda_available() or "ok",
               toolchain=toolchain_report(torch.device("cuda")), config=asdict(select_config(K, V, False)))
    print(json.dumps(env, default=str), flush=True)
    t0 = time.time()
    swept = [] if not args.sweep else list(VARIANTS) if args.variants is None else [
        v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(swept) - set(VARIANTS):
        ap.error(f"unknown variant(s) {sorted(unknown)}; the variants are {', '.join(VARIANTS)}")
    variants = warm_up(swept, peers, args.fp32)
    print(f"warm-up {time.time() - t0:.0f}s", flush=True)
    rows = []
    for name, lengths, heads, dtype in case_list(args):
        c = make_case(lengths, heads, dtype=dtype, pool_rows=DECODE_POOL if max(lengths) == 1 else None)
        row = time_case(name, c, peers, variants)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del c
        torch.cuda.empty_cache()
    acc = accuracy(peers, variants)
    print("accuracy vs float32 reference (2x2048, 4 heads):", json.dumps(acc), flush=True)
    res = compiled_resources()
    print("\n".join(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, accuracy=acc, resources=res), f, indent=1, default=str)
    print_tables(rows, variants)


if __name__ == "__main__":
    main()
