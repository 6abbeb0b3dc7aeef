"""Where `chunk_kda`'s host time goes, next to the prebuilt problem's (issue 19's last reading).

A call waited for alone costs its host work before the first launch plus the launches; the
prebuilt problem (`kernels.run_problem`) skips the validation and problem building. This
prints, per case (H32, K = V = 128, bf16, the serving gate, ``cu_seqlens_cpu`` given, indices
on the device: the path that reads nothing back):

- p50 host microseconds of `build_problem` alone, and, taking turns, of `run_problem` on the
  prebuilt problem, of `build_problem` then `run_problem`, and of `chunk_kda`, each until
  it returns (the launches enqueued, no synchronization);
- p50 wall milliseconds of each path waited for alone (as `bench/latency.py` times them);
- the prebuilt problem's mean time per call back to back: when it is no more than the host
  time above, the host, not the device, bounds the calls (small problems);
- with ``--profile``, a cProfile of the prebuilt path's and of `chunk_kda`'s calls, by
  cumulative time.

    python3 bench/host_path.py [--cases 1x4096,256x1] [--calls 300] [--profile] [--json FILE]

On a machine without CUDA it times `build_problem` alone on host tensors (the indices are
then read and checked: not the GPU path's figure).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from kernels.api import build_problem  # noqa: E402

HEADS, DIM, LOWER_BOUND = 32, 128, -5.0


def case_inputs(sequences: int, length: int, device: torch.device) -> dict[str, Any]:
    """Random serving-shaped arguments of `chunk_kda` for ``sequences`` x ``length`` tokens:
    q, k, v, g [1, T, H, 128] bf16, beta [1, T, H] bf16, a pool of ``sequences`` fp32 rows,
    device indices, cu_seqlens on the device and on the host, A_log [H], dt_bias [H, 128]."""
    gen = torch.Generator().manual_seed(sequences * 7919 + length)
    T = sequences * length

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    bounds = torch.arange(0, T + 1, length, dtype=torch.int64)
    return dict(
        five=(rand(1, T, HEADS, DIM), rand(1, T, HEADS, DIM), rand(1, T, HEADS, DIM), rand(1, T, HEADS, DIM),
              rand(1, T, HEADS)),
        pool=torch.randn(sequences, HEADS, DIM, DIM, generator=gen).to(device) * 0.1,
        indices=torch.arange(sequences, dtype=torch.int64, device=device),
        cu=bounds.to(device), cpu_bounds=bounds,
        A_log=torch.randn(HEADS, generator=gen).to(device), dt_bias=torch.randn(HEADS, DIM, generator=gen).to(device),
    )


def build(a: dict[str, Any]) -> kernels.PrefillProblem:
    return build_problem(*a["five"], scale=None, pool=a["pool"], indices=a["indices"], cu_seqlens=a["cu"],
                         A_log=a["A_log"], dt_bias=a["dt_bias"], lower_bound=LOWER_BOUND, use_qk_l2norm=True,
                         use_beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
                         output_intermediate_states=False, cu_seqlens_cpu=a["cpu_bounds"])


def public_call(a: dict[str, Any]) -> torch.Tensor:
    return kernels.chunk_kda(*a["five"], initial_state=a["pool"], initial_state_indices=a["indices"],
                             use_qk_l2norm_in_kernel=True, cu_seqlens=a["cu"], A_log=a["A_log"],
                             dt_bias=a["dt_bias"], lower_bound=LOWER_BOUND, use_beta_sigmoid_in_kernel=True,
                             backend="triton", cu_seqlens_cpu=a["cpu_bounds"])


def host_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """p50 microseconds until ``fn`` returns, synchronized between calls (not inside)."""
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e6


def waited_ms(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """p50 milliseconds of ``fn`` plus a synchronization, one call at a time."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def interleaved_host_us(paths: dict[str, Callable[[], object]], calls: int, sync: Callable[[], None],
                        rounds: int = 5) -> dict[str, float]:
    """`host_us` of each path, the paths taking turns over ``rounds`` rounds (a drift of the
    machine's speed falls on all alike); the p50 of all its calls, by path."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            for _ in range(max(calls // rounds, 1)):
                sync()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    sync()
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def back_to_back_ms(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Mean milliseconds per call of ``calls`` calls with one synchronization at the end:
    the device's time when it is the slower side, else the host's (host-bound)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e3


def profile(fn: Callable[[], object], calls: int, sync: Callable[[], None], rows: int = 30) -> str:
    """A cProfile of ``calls`` calls of ``fn``, each waited for: the functions by cumulative
    time (where a call's time goes, stage by stage)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
        sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x4096,256x1")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each path")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "cases": {}}
    for name in args.cases.split(","):
        sequences, length = map(int, name.split("x"))
        a = case_inputs(sequences, length, device)
        record: dict[str, Any] = {"build_problem_us": host_us(lambda: build(a), args.calls, sync)}
        if cuda:
            problem = build(a)
            prebuilt = lambda: kernels.run_problem(problem, "triton")  # noqa: E731
            for fn in (prebuilt, lambda: public_call(a)):  # compile and cache the launch tables
                fn()
            hosts = interleaved_host_us({"run_problem": prebuilt, "build_then_run": lambda: kernels.run_problem(
                build(a), "triton"), "chunk_kda": lambda: public_call(a)}, args.calls, sync)
            record.update({f"{name}_host_us": us for name, us in hosts.items()})
            record["prebuilt_waited_ms"] = waited_ms(prebuilt, args.calls, sync)
            record["chunk_kda_waited_ms"] = waited_ms(lambda: public_call(a), args.calls, sync)
            record["gap_waited_us"] = (record["chunk_kda_waited_ms"] - record["prebuilt_waited_ms"]) * 1e3
            record["prebuilt_back_to_back_ms"] = back_to_back_ms(prebuilt, args.calls, sync)
            profiled = {"run_problem on the prebuilt problem": prebuilt, "chunk_kda": lambda: public_call(a)}
            for label, fn in profiled.items() if args.profile else ():
                print(f"== {name}: cProfile of {args.calls} calls of {label}, each waited for")
                print(profile(fn, args.calls, sync))
        results["cases"][name] = record
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in record.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
