"""What the transactional launch costs: `service.core.transaction.LaunchTransaction` (copies of
the pool rows a launch writes; the kernels' non-finite flags, set as they store o and the
final states; one read of the flags) against the kernel it guards, in one run.

Serving config (as bench/kernels.py): bf16 q/k/v/g/beta, H = HV = 32, K = V = 128, gate
``lower_bound = -5`` with A_log/dt_bias, q/k L2 norm and beta sigmoid in kernel, varlen
cu_seqlens, an fp32 pool [S, HV, V, K] written in place; 8 sequences of 4096 tokens by
default. The pool is a scratch one: the timed launches advance its rows.

Two figures, both medians over ``--reps`` launches after warm-up, interleaved:
- time (CUDA events, so host launch gaps included) of the kernel without and with the
  flags, of the row copies, and of reading the flags;
- wall time of the launch as the server runs it (kernel, the final states gathered, a
  synchronization) with and without the transaction (copies, kernel with flags, the
  flags read): the added time. ``--profile`` adds each kernel's device time.
The goal is a ratio under 3% at 8x4096.

Usage (GPU machine): ``python bench/transaction.py`` [--case 8x4096] [--reps 50]. On a CPU
(``--device cpu --case 2x256 --heads 4``) it runs the torch backend, as a smoke test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.serving_case import K, V, launch, make_case  # noqa: E402
from bench.serving_case import event_ms as gpu_ms  # noqa: E402
from service.core.transaction import LaunchTransaction  # noqa: E402

GOAL = 0.03


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_guarded(c: dict, backend: str, requests: list) -> None:
    """Each kernel's device time (and count) in 10 transactional launches, as the server
    runs them: the events of `gpu_ms` include the host's launch gaps, these do not."""
    from torch.profiler import ProfilerActivity, profile

    layer = c["pool"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            txn = LaunchTransaction(layer, c["idx"], requests)
            o = launch(c, backend, nonfinite=txn.flags)
            layer.index_select(0, c["idx"])
            txn.settle(o)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="8x4096", help="NxT: N sequences of T tokens")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true",
                        help="also print each kernel's device time in 10 transactional launches (torch.profiler)")
    args = parser.parse_args()
    device = torch.device(args.device)
    n_seq, length = (int(x) for x in args.case.split("x"))
    backend = kernels.default_backend(device)
    c = make_case(n_seq, length, args.heads, device)
    layer = c["pool"]
    requests = [([n], [None]) for n in c["lengths"]]
    for _ in range(3):  # compile, autotune, warm caches
        o = launch(c, backend)
    sync(device)

    kernel, flagged, copies, checks, plain, guarded, opened, settled = [], [], [], [], [], [], [], []
    for _ in range(args.reps):
        kernel.append(gpu_ms(lambda: launch(c, backend), device))
        txn = LaunchTransaction(layer, c["idx"], requests)
        flagged.append(gpu_ms(lambda: launch(c, backend, nonfinite=txn.flags), device))
        copies.append(gpu_ms(lambda: layer.index_select(0, c["idx"]), device))
        checks.append(gpu_ms(lambda: txn.diverged(o), device))  # the flags' one host read
        sync(device)
        start = time.perf_counter()
        launch(c, backend)
        layer.index_select(0, c["idx"])  # the final states a response returns
        sync(device)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        txn = LaunchTransaction(layer, c["idx"], requests)
        o = launch(c, backend, nonfinite=txn.flags)
        layer.index_select(0, c["idx"])  # the final states, gathered before the flags are read (as the server does)
        refused = txn.settle(o)
        sync(device)
        guarded.append(time.perf_counter() - start)
        assert not refused, refused
        start = time.perf_counter()  # the transaction's two host parts alone, the device idle
        txn = LaunchTransaction(layer, c["idx"], requests)
        sync(device)
        opened.append(time.perf_counter() - start)
        o = launch(c, backend, nonfinite=txn.flags)
        sync(device)
        start = time.perf_counter()
        txn.settle(o)
        settled.append(time.perf_counter() - start)

    if args.profile and device.type == "cuda":
        profile_guarded(c, backend, requests)
    med = statistics.median
    k_ms, f_ms, c_ms, x_ms = med(kernel), med(flagged), med(copies), med(checks)
    p_ms, g_ms = med(plain) * 1e3, med(guarded) * 1e3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, backend {backend}, {n_seq}x{length} H{args.heads} K{K} V{V} bf16 inputs, fp32 pool, "
          f"{args.reps} reps (medians)")
    print(f"event time: kernel {k_ms:.3f} ms, with flags {f_ms:.3f} ms ({(f_ms - k_ms) / k_ms:+.2%}), "
          f"row copies {c_ms:.3f} ms ({c_ms / k_ms:.2%}), flags read {x_ms:.3f} ms ({x_ms / k_ms:.2%})")
    ratio = (g_ms - p_ms) / p_ms
    print(f"wall time of a launch: {p_ms:.3f} ms plain, {g_ms:.3f} ms transactional: {ratio:+.2%} "
          f"(goal < {GOAL:.0%}: {'met' if ratio < GOAL else 'NOT met'})")
    print(f"  its parts, wall, the device idle: opening (row copies, flags zeroed, synchronized) "
          f"{med(opened) * 1e3:.3f} ms, settling (flags read) {med(settled) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
