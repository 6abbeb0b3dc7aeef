"""What the prefix cache costs (docs/PREFIX_CACHE.md), in one run.

1. Checkpoints: the server's launch (`packed_problem` + `kernels.run_problem`, serving config
   as bench/transaction.py: bf16 inputs, H = HV = 32, K = V = 128, lower-bound gate, fused
   l2norm and beta sigmoid, an fp32 pool) of 8 x 4096 tokens, plain against the same launch
   writing a checkpoint every 1024 tokens of every sequence (32 states) straight into
   `PrefixCache` entries placed for it and committed after, as `ServerCore._launch` does:
   placed when the launch first asks for its targets (`PrefillProblem.checkpoint_provider`,
   after the first piece's parallel stages are queued, so `PrefixCache.place` runs while the
   device works). Goal: at most 5% more over a prefill (medians of CUDA-event times,
   interleaved). A prefill's first layer stores every checkpoint into a new entry, its other
   layers into the entries present: both are timed, and the --layers prefill's mean is
   printed, with the host time of `place` alone. In the same run, for comparison: the
   entries placed before the launch (the server's path until issue 21's last change), the
   old path (a launch buffer copied into the entries), the checkpoints stored from inside
   the chunk loop instead of at segment ends (`LaunchConfig.state_ckpt_levels` 0), with
   their addresses loaded right before each store instead of a chunk ahead
   (`LaunchConfig.state_ckpt_prefetch` off), the state pass held to 2 pipeline stages (the
   rule before its stages were chosen by what fits), and the kernel alone. ``--every N``: a checkpoint every N tokens instead; ``--where``: per-kernel device
   times of the two ways to store them, on problems built once.
2. Restore: a 48-layer entry ([48, 32, 128, 128] fp32, 96 MiB) into a pool slot, as
   `ServerCore._alloc_prefix` does (`StatePool.alloc_copies` inside `PrefixCache.restoring`:
   the copy alone writes the row, no zero fill first), and the old way (a zeroed `alloc`,
   then `write_state`) for comparison, from the device tier (goal: <= 0.2 ms) and from the pinned host
   tier (goal: <= the PCIe time of its bytes + 0.2 ms, the PCIe time measured as a plain
   pinned-to-device copy of the same bytes). Wall time with a synchronization, medians.

Usage (GPU machine): ``python bench/prefix_cache.py`` [--reps 30] [--layers 48]
[--server-path-only: the goal's three launches alone, for many --reps]. On a CPU
(``--device cpu --case 2x256 --heads 4 --layers 4``) it runs the torch backend, a smoke test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.serving_case import K, V, launch, make_case, problem_of  # noqa: E402
from bench.serving_case import event_ms as timed_ms  # noqa: E402
from kernels.problem import CheckpointProvider  # noqa: E402
from kernels.triton_backend import run_triton  # noqa: E402
from kernels.triton_kernels import LaunchConfig, select_config  # noqa: E402
from state_store import CheckpointTarget, PrefixCache, StatePool  # noqa: E402

EVERY = 1024


def checkpoint_positions(c: dict, every: int) -> tuple[int, ...]:
    """Packed positions every ``every`` tokens of each sequence of case ``c`` (and its end)."""
    step = min(every, c["lengths"][0])
    return tuple(a + j for a, n in zip(c["bounds"][:-1], c["lengths"]) for j in range(step, n + 1, step))


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def host_ms(fn: Callable[[], object], device: torch.device) -> float:
    """The host time of one call (until it returns, its GPU work queued), after the device is idle."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    return elapsed


def launch_provided(c: dict, backend: str, positions: tuple[int, ...], provider: CheckpointProvider,
                    config: Optional[LaunchConfig]) -> torch.Tensor:
    """`serving_case.launch` with checkpoints at ``positions`` whose targets the launch asks
    ``provider`` for when it first needs them; o [T, HV, V]."""
    problem = replace(problem_of(c, checkpoint_tokens=positions), checkpoint_provider=provider)
    if config is not None:
        return run_triton(problem, config)[0]
    return kernels.run_problem(problem, backend)[0]


def place_us(cache: PrefixCache, layer: int, wanted: Sequence[tuple[str, int]], setup: Callable[[], object],
             reps: int) -> float:
    """Median host time of `PrefixCache.place` (the targets of ``wanted`` on ``layer``) alone, in us,
    each call after ``setup`` (untimed) and released after (untimed)."""
    times = []
    for _ in range(reps):
        setup()
        start = time.perf_counter()
        targets = cache.place(layer, wanted)
        times.append((time.perf_counter() - start) * 1e6)
        cache.release(targets)
    return statistics.median(times)


Variant = tuple[Callable[[], object], Callable[[], object]]  # (untimed setup, the timed call after it)


def bench_checkpoints(args: argparse.Namespace, device: torch.device, backend: str) -> None:
    """A prefill's launch with checkpoints as the server runs it, on its first layer (every
    checkpoint a new entry) and on a later one (every checkpoint into a present entry: the
    other L - 1 launches of an L-layer prefill), against the plain launch and the old path."""
    n_seq, length = map(int, args.case.split("x"))
    c = make_case(n_seq, length, args.heads, device)
    positions = checkpoint_positions(c, args.every)
    C = len(positions)
    marks = torch.empty((C, args.heads, V, K), dtype=torch.float32, device=device)
    geometry = StatePool(2, 1, args.heads, K, V, device=device).geometry  # entries of two layers
    cache = PrefixCache(geometry, (C + 1) * geometry.bytes_per_slot)
    wanted = [(f"ck.{row}", pos) for row, pos in enumerate(positions)]
    first_layer = marks.clone()
    base = select_config(K, V, interpret=device.type != "cuda")

    def config(**kw: object) -> Optional[LaunchConfig]:
        """The launch config with ``kw`` changed on a GPU: every variant, the default's too,
        calls `run_triton` with one (one call path, so variants differ only in ``kw``)."""
        return base.with_overrides(**kw) if device.type == "cuda" else None

    default = config()

    def into_entries(layer: int, config: Optional[LaunchConfig] = default) -> None:
        """The server's path (`ServerCore._launch`): targets placed when the launch asks for
        them (after its first stages are queued), written by it, committed."""
        targets: list[CheckpointTarget] = []

        def provide() -> list[torch.Tensor]:
            targets.extend(cache.place(layer, wanted))
            return [t.state for t in targets]
        launch_provided(c, backend, positions, provide, config)
        for target in targets:
            cache.commit(target)
        cache.release(targets)

    def placed_before(layer: int) -> None:
        """The server's path until issue 21's last change: targets placed before the launch."""
        targets = cache.place(layer, wanted)
        launch(c, backend, checkpoint_tokens=positions, checkpoint_states=[t.state for t in targets], config=default)
        for target in targets:
            cache.commit(target)
        cache.release(targets)

    def copied(layer: int) -> None:
        """The path before 2026-12-04: a launch buffer, each row copied into its entry after."""
        launch(c, backend, checkpoint_tokens=positions, checkpoint_states=marks, config=default)
        for row, (key, pos) in enumerate(wanted):
            cache.store_layer(key, pos, layer, marks[row])

    def no_entries() -> None:  # for a first-layer call: it stores new entries
        for key, _ in wanted:
            cache.drop(key)

    def first_layer_only() -> None:  # for a later-layer call: it finds its entries with layer 0 alone
        no_entries()
        for row, (key, pos) in enumerate(wanted):
            cache.store_layer(key, pos, 0, first_layer[row])

    def nothing() -> None:
        return None

    at_store, two = config(state_ckpt_prefetch=False, state_ckpt_levels=0), config(state_stages=2)
    in_loop = config(state_ckpt_levels=0)
    buffer_only = dict(checkpoint_tokens=positions, checkpoint_states=marks)
    variants: dict[str, Variant] = {
        "plain": (nothing, lambda: launch(c, backend, config=default)),
        "first layer: into new entries (the server's path)": (no_entries, lambda: into_entries(0)),
        "first layer: into new entries, placed before the launch": (no_entries, lambda: placed_before(0)),
        "first layer: a buffer copied into new entries (the old path)": (no_entries, lambda: copied(0)),
        "later layer: into the entries (the server's path)": (first_layer_only, lambda: into_entries(1)),
        "later layer: into the entries, placed before the launch": (first_layer_only, lambda: placed_before(1)),
        "later layer: a buffer copied into the entries (the old path)": (first_layer_only, lambda: copied(1)),
        "first layer: into new entries, addresses at the store": (no_entries, lambda: into_entries(0, at_store)),
        "later layer: into the entries, addresses at the store": (first_layer_only, lambda: into_entries(1, at_store)),
        "later layer: into the entries, 2 state stages (the old rule)": (first_layer_only,
                                                                         lambda: into_entries(1, two)),
        "first layer: into new entries, stored in the chunk loop": (no_entries, lambda: into_entries(0, in_loop)),
        "later layer: into the entries, stored in the chunk loop": (first_layer_only,
                                                                    lambda: into_entries(1, in_loop)),
        "kernel only: into a buffer, not stored": (nothing, lambda: launch(c, backend, **buffer_only, config=default)),
        "kernel only, addresses at the store": (nothing, lambda: launch(c, backend, **buffer_only, config=at_store)),
        "kernel only, stored in the chunk loop": (nothing, lambda: launch(c, backend, **buffer_only, config=in_loop)),
    }
    if args.server_path_only:
        variants = {name: v for name, v in variants.items() if name == "plain" or name.endswith("(the server's path)")}
    for setup, fn in variants.values():
        for _ in range(3):
            setup()
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):  # interleaved
        for name, (setup, fn) in variants.items():
            setup()
            times[name].append(timed_ms(fn, device))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    p = medians["plain"]
    print(f"checkpoints {args.case} H{args.heads}, one every {args.every} tokens ({C} states), medians of "
          f"{args.reps} interleaved:")
    for name, m in medians.items():
        print(f"  {name}: {m:.3f} ms ({100 * (m / p - 1):+.2f}% against plain)")
    paths = {"the server's path": ("into new entries (the server's path)", "into the entries (the server's path)"),
             "the server's path, placed before the launch": ("into new entries, placed before the launch",
                                                             "into the entries, placed before the launch"),
             "the old path": ("a buffer copied into new entries", "a buffer copied into the entries"),
             "the server's path, addresses at the store": ("into new entries, addresses at the store",
                                                           "into the entries, addresses at the store"),
             "the server's path, stored in the chunk loop": ("into new entries, stored in the chunk loop",
                                                             "into the entries, stored in the chunk loop")}
    for path, (first_name, later_name) in paths.items():
        first = next((m for n, m in medians.items() if n.startswith("first layer: " + first_name)), None)
        later = next((m for n, m in medians.items() if n.startswith("later layer: " + later_name)), None)
        if first is None or later is None:  # --server-path-only
            continue
        prefill = (first + (args.layers - 1) * later) / args.layers
        print(f"  a {args.layers}-layer prefill, {path}: {100 * (prefill / p - 1):+.2f}% against plain "
              f"(goal <= +5%)")
    reps = max(100, args.reps)
    first_us = place_us(cache, 0, wanted, no_entries, reps)
    later_us = place_us(cache, 1, wanted, first_layer_only, reps)
    print(f"  host time of PrefixCache.place alone ({C} targets, medians of {reps}): first layer (new entries) "
          f"{first_us:.1f} us, later layer (in place) {later_us:.1f} us: before the first launch when placed before "
          f"it, under the device's work on the server's path")


def bench_where(args: argparse.Namespace, device: torch.device) -> None:
    """Where a checkpointed launch's extra time sits: each Triton kernel's device time per
    call (torch profiler) and the launch's event time on a problem built once (no host
    building in the timed call), plain against checkpointed (into one buffer), for the
    state-pass launch variants (the default: each address loaded a chunk ahead; loaded at
    the store), each also
    without checkpoints, and the host time of a call (until it returns, the launches queued);
    then the registers and spills of every compiled state-pass variant."""
    from torch.profiler import ProfilerActivity, profile

    from kernels.triton_kernels import chunk_state_kernel

    n_seq, length = map(int, args.case.split("x"))
    c = make_case(n_seq, length, args.heads, device)
    positions = checkpoint_positions(c, args.every)
    marks = torch.empty((len(positions), args.heads, V, K), dtype=torch.float32, device=device)
    plain = problem_of(c)
    ckpt = problem_of(c, checkpoint_tokens=positions, checkpoint_states=marks)
    base = select_config(K, V, interpret=False)
    configs = {"segments end at the checkpoints": base.with_overrides(state_ckpt_levels=1 << 20),
               "in the chunk loop, addresses a chunk ahead": base.with_overrides(state_ckpt_levels=0)}
    print(f"where the checkpoints' cost sits, {args.case} H{args.heads} ({len(positions)} states), per call:")
    for cname, cfg in configs.items():
        for pname, prob in (("plain", plain), ("checkpoints", ckpt)):
            def call() -> None:
                run_triton(prob, cfg)
            for _ in range(3):
                call()
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize(device)
            per: dict[str, float] = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                if t > 0:
                    per[e.key] = per.get(e.key, 0.0) + t / 10 / 1000.0
            kern = ", ".join(f"{k.replace('chunk_', '').replace('_kernel', '')} {v:.3f}"
                             for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:4])
            if args.trace:
                print(f"  {cname}, {pname}: {device_timeline(prof, args.trace, cname + ' ' + pname, 10)}")
            event = statistics.median(timed_ms(call, device) for _ in range(args.reps))
            host = statistics.median(host_ms(call, device) for _ in range(args.reps))
            print(f"  {cname}, {pname}: event {event:.3f} ms, host {host:.3f} ms; device: {kern}", flush=True)
    from kernels.triton_plan import checkpoint_addresses, checkpoint_chunks

    targets = tuple(marks.unbind(0))
    bounds = tuple(c["bounds"])

    def table_call() -> None:
        rows = checkpoint_chunks(bounds, positions)
        checkpoint_addresses(rows[-1] + 1, rows, targets, device)
    table = statistics.median(host_ms(table_call, device) for _ in range(args.reps))
    print(f"  host time of the checkpoint address table alone: {table:.3f} ms")
    for dev_cache in (getattr(chunk_state_kernel, "device_caches", None) or {}).values():
        compiled_kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
        for compiled in compiled_kernels.values():
            md = compiled.metadata
            print(f"  compiled state pass: regs {getattr(compiled, 'n_regs', '?')}, spills "
                  f"{getattr(compiled, 'n_spills', '?')}, warps {getattr(md, 'num_warps', '?')}, stages "
                  f"{getattr(md, 'num_stages', '?')}, shared {getattr(md, 'shared', '?')}")


def device_timeline(prof: object, folder: str, name: str, calls: int) -> str:
    """The profiled calls' device timeline (``prof``: a finished torch profiler), its Chrome
    trace saved under ``folder``: per call, the device's busy time (kernels, copies and
    fills), its span from the first start to the last end, and the largest idle gaps with
    the kernels either side, so the event time's excess over the kernels shows as idle
    device time (launches the host had not queued yet) or as kernel time."""
    import json
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "".join(ch if ch.isalnum() else "_" for ch in name) + ".json")
    prof.export_chrome_trace(path)  # type: ignore[attr-defined]
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    if not device:
        return f"no device events in {path}"
    busy = sum(e["dur"] for e in device)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    gaps: dict[str, list[float]] = {}
    for before, after in zip(device, device[1:]):
        gap = after["ts"] - (before["ts"] + before["dur"])
        short = (before["name"][:28] + " -> " + after["name"][:28])
        gaps.setdefault(short, []).append(gap)
    top = sorted(((sum(g) / calls, k, len(g)) for k, g in gaps.items()), reverse=True)[:5]
    return (f"device busy {busy / calls / 1000:.3f} ms, span {span / calls / 1000:.3f} ms per call; idle per call by "
            "neighbours: " + "; ".join(f"{k} x{n / calls:g}: {t / 1000:.3f} ms" for t, k, n in top))


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
            (slot,) = pool.alloc_copies(held.state, 1, [1024] * args.layers)
        pool.free(slot)

    def zeroed_then_copied(key: str) -> None:
        with cache.restoring([key]) as held:
            (slot,) = pool.alloc(1)
            pool.write_state(slot, held.state)
        pool.free(slot)

    def move_rows() -> None:
        """Slot row 0 (the one each restore takes) onto spare rows on every other layer, as
        launches leave a serving pool's slots: its rows then form no progression."""
        for layer in range(0, args.layers, 2):
            read, spare = pool.layer_rows(layer, [0]), pool.take_spares(1)
            pool.commit_rows(layer, [0], read, spare)

    pinned = torch.empty(g.slot_shape, pin_memory=device.type == "cuda")
    target = torch.empty(g.slot_shape, device=device)
    results = {}
    for name, fn in (("device", lambda: restore("device")), ("host", lambda: restore("host")),
                     ("device, zeroed first", lambda: zeroed_then_copied("device")),
                     ("host, zeroed first", lambda: zeroed_then_copied("host")),
                     ("pcie", lambda: target.copy_(pinned, non_blocking=True)),
                     ("rows moved", move_rows),
                     ("device, rows moved", lambda: restore("device")), ("host, rows moved", lambda: restore("host"))):
        if name == "rows moved":
            fn()
            continue
        for _ in range(3):
            fn()
        results[name] = statistics.median(wall_ms(fn, device) for _ in range(args.reps))
    assert cache.info("host").tier == "host" and cache.info("device").tier == "device"
    print(f"restore of a {args.layers}-layer entry ({nbytes / 2**20:.0f} MiB): device tier "
          f"{results['device']:.3f} ms (goal <= 0.2 ms); host tier {results['host']:.3f} ms against PCIe "
          f"{results['pcie']:.3f} ms ({nbytes / results['pcie'] / 1e6:.1f} GB/s): "
          f"+{results['host'] - results['pcie']:.3f} ms (goal <= 0.2 ms); the old way (a zeroed slot, then the "
          f"copy): device {results['device, zeroed first']:.3f} ms, host {results['host, zeroed first']:.3f} ms; "
          f"into a slot whose rows launches moved: device {results['device, rows moved']:.3f} ms, host "
          f"+{results['host, rows moved'] - results['pcie']:.3f} ms over PCIe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--case", default="8x4096", help="N x T: sequences x tokens each")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--every", type=int, default=EVERY, help="tokens between checkpoints")
    parser.add_argument("--where", action="store_true",
                        help="only where the checkpoints' cost sits: per-kernel device times, prebuilt problems")
    parser.add_argument("--trace", default="", help="with --where: save the profiled calls' Chrome traces "
                        "in this folder and print their device timelines")
    parser.add_argument("--restores-only", action="store_true", help="only the restores of a cached entry")
    parser.add_argument("--server-path-only", action="store_true",
                        help="only the plain launch and the server's path (first and later layer), no restores: "
                        "many --reps in little time")
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = kernels.default_backend(device)
    torch.manual_seed(0)
    if args.where:
        bench_where(args, device)
        return
    if not args.restores_only:
        bench_checkpoints(args, device, backend)
    if not args.server_path_only:
        bench_restore(args, device)


if __name__ == "__main__":
    main()
