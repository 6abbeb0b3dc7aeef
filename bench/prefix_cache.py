"""What the prefix cache costs (docs/PREFIX_CACHE.md), in one run.

1. Checkpoints: the server's launch (`packed_problem` + `kernels.run_problem`, serving config
   as bench/transaction.py: bf16 inputs, H = HV = 32, K = V = 128, lower-bound gate, fused
   l2norm and beta sigmoid, an fp32 pool) of 8 x 4096 tokens, plain against the same launch
   writing a checkpoint every 1024 tokens of every sequence (32 states) into its buffer and
   storing each into a `PrefixCache` entry, as `ServerCore._store_checkpoints` does. Goal:
   at most 5% more (medians of CUDA-event times, interleaved).
2. Restore: a 48-layer entry ([48, 32, 128, 128] fp32, 96 MiB) into a pool slot, as
   `ServerCore._alloc_prefix` does (`StatePool.alloc` + `write_state` inside
   `PrefixCache.restoring`), from the device tier (goal: <= 0.2 ms) and from the pinned host
   tier (goal: <= the PCIe time of its bytes + 0.2 ms, the PCIe time measured as a plain
   pinned-to-device copy of the same bytes). Wall time with a synchronization, medians.

Usage (GPU machine): ``python bench/prefix_cache.py`` [--reps 30] [--layers 48]. On a CPU
(``--device cpu --case 2x256 --heads 4 --layers 4``) it runs the torch backend, a smoke test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.serving_case import K, V, launch, make_case  # noqa: E402
from bench.serving_case import event_ms as timed_ms  # noqa: E402
from kernels.triton_kernels import LaunchConfig, select_config  # noqa: E402
from state_store import PrefixCache, StatePool  # noqa: E402

EVERY = 1024


def checkpoint_positions(c: dict) -> tuple[int, ...]:
    """Packed positions every `EVERY` tokens of each sequence of case ``c`` (and its end)."""
    step = min(EVERY, c["lengths"][0])
    return tuple(a + j for a, n in zip(c["bounds"][:-1], c["lengths"]) for j in range(step, n + 1, step))


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def bench_checkpoints(args: argparse.Namespace, device: torch.device, backend: str) -> None:
    n_seq, length = map(int, args.case.split("x"))
    c = make_case(n_seq, length, args.heads, device)
    positions = checkpoint_positions(c)
    C = len(positions)
    marks = torch.empty((C, args.heads, V, K), dtype=torch.float32, device=device)
    geometry = StatePool(1, 1, args.heads, K, V, device=device).geometry
    cache = PrefixCache(geometry, (C + 1) * geometry.bytes_per_slot)

    def with_checkpoints(config: Optional[LaunchConfig] = None, store: bool = True) -> None:
        launch(c, backend, checkpoint_tokens=positions, checkpoint_states=marks, config=config)
        for row in range(C if store else 0):
            cache.store_layer(f"ck.{row}", positions[row], 0, marks[row])

    variants: dict[str, Callable[[], object]] = {
        "plain": lambda: launch(c, backend), "with checkpoints stored": with_checkpoints}
    if args.state_stages:  # the same with the state pass's pipeline depth forced, and the parts
        s = args.state_stages
        forced = select_config(K, V, interpret=False).with_overrides(state_stages=s)
        variants[f"plain, {s} state stages"] = lambda: launch(c, backend, config=forced)
        variants[f"with checkpoints, {s} state stages"] = lambda: with_checkpoints(forced)
        variants[f"checkpoints written, not stored, {s} state stages"] = lambda: with_checkpoints(forced, store=False)
    for fn in variants.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):  # interleaved
        for name, fn in variants.items():
            times[name].append(timed_ms(fn, device))
    p = statistics.median(times["plain"])
    print(f"checkpoints {args.case} H{args.heads}, one every {EVERY} tokens ({C} states), medians of "
          f"{args.reps} interleaved:")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name}: {m:.3f} ms ({100 * (m / p - 1):+.2f}% against plain; goal for checkpoints <= +5%)")


def bench_restore(args: argparse.Namespace, device: torch.device) -> None:
    pool = StatePool(args.layers, 4, args.heads, K, V, device=device)
    g = pool.geometry
    nbytes = g.bytes_per_slot
    cache = PrefixCache(g, nbytes, nbytes)
    state = torch.randn(g.slot_shape, device=device)
    cache.publish("host", 1024, state)
    cache.publish("device", 1024, state)  # "host" moves to the host tier

    def restore(key: str) -> None:
        with cache.restoring([key]) as held:
            (slot,) = pool.alloc(1)
            pool.write_state(slot, held.state)
        pool.free(slot)

    pinned = torch.empty(g.slot_shape, pin_memory=device.type == "cuda")
    target = torch.empty(g.slot_shape, device=device)
    results = {}
    for name, fn in (("device", lambda: restore("device")), ("host", lambda: restore("host")),
                     ("pcie", lambda: target.copy_(pinned, non_blocking=True))):
        for _ in range(3):
            fn()
        results[name] = statistics.median(wall_ms(fn, device) for _ in range(args.reps))
    assert cache.info("host").tier == "host" and cache.info("device").tier == "device"
    print(f"restore of a {args.layers}-layer entry ({nbytes / 2**20:.0f} MiB): device tier "
          f"{results['device']:.3f} ms (goal <= 0.2 ms); host tier {results['host']:.3f} ms against PCIe "
          f"{results['pcie']:.3f} ms ({nbytes / results['pcie'] / 1e6:.1f} GB/s): "
          f"+{results['host'] - results['pcie']:.3f} ms (goal <= 0.2 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--case", default="8x4096", help="N x T: sequences x tokens each")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--state-stages", type=int, default=0,
                        help="GPU: also time plain, checkpointed and checkpoints-not-stored launches with the "
                             "state pass's pipeline stages forced to this")
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = kernels.default_backend(device)
    torch.manual_seed(0)
    bench_checkpoints(args, device, backend)
    bench_restore(args, device)


if __name__ == "__main__":
    main()
