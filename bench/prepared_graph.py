"""Where a prepared prefill's CUDA graph spends its device time, stage by stage, in one run.

A prepared prefill (`service.core.prepared`) replays one graph per run: the launch
transaction (its flags, and the copy of the rows it writes: taken before the kernels, or
saved by the decode kernel; or none, the new states written to spare rows instead), the
kernels (which check the inputs as they read them and write o into the client's region)
and, when asked, the final states' gather and copy. The value check as a pass of its own
(`value_extremes`, what the graph ran before) is timed beside the kernels' own checks. This
bench captures growing prefixes of that graph on the serving case (bench/serving_case.py: bf16, H = 32,
K = V = 128, fp32 pool) and replays each, so the differences between rows are each stage's
device time; the eager kernel call is timed beside them (back to back, and one call at a
time with CUDA events: the host's launch gaps included, as `latency.py`'s "kernel" row).

Usage (GPU): ``python bench/prepared_graph.py [--cases 8x4096,1x4096,256x1] [--reps 200]``.
Medians of interleaved replays, CUDA events around each. ``--extremes``: instead, the value
check alone on a case's five inputs for launch shapes of `value_extremes` (block, programs
per SM, warps), as read bandwidth against a device copy of the same bytes (its bytes read
and written over its time: the memory's speed in the same run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.serving_case import event_ms, make_case, problem_of  # noqa: E402
from kernels.triton_kernels.extremes import value_extremes  # noqa: E402
from service.core.transaction import LaunchTransaction, MovedRows  # noqa: E402

Step = Callable[[], object]

# the prepared step (finals declined) with its new states written to spare rows: timed against it in place
SPARE_ROWS_STEP = "the prepared step writing its new states to spare rows instead (nothing copied or saved)"
IN_PLACE_STEP = "+ o written into the client's region by the kernels (finals declined: the prepared step)"


def steps(c: dict) -> dict[str, Step]:
    """The graph's prefixes for case ``c``, by name, each a function queuing it (in place
    on the case's pool rows; the rows only drift, as a prepared prefill's do)."""
    pool, idx = c["pool"], c["idx"]
    requests = [(c["lengths"], [f"s{i}" for i in range(len(c["lengths"]))])]
    spare = sorted(set(range(pool.shape[0])) - set(idx.tolist()))[:len(c["lengths"])]
    moved = MovedRows(spare, torch.tensor(spare, device=pool.device), lambda positions: None, lambda positions: None)
    inputs = [c[n] for n in ("q", "k", "v", "g", "beta")]
    client_o = torch.empty_like(c["v"])  # the client's region, for o
    client_final = torch.empty((len(c["lengths"]), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)

    def kernel(saved: bool = False, check: str = "", o_out: bool = False, finals: bool = False,
               spare_rows: bool = False) -> Step:
        """``check``: "" none, "pass" a `value_extremes` pass first, "kernels" the kernels' own;
        ``spare_rows``: the new states written to spare rows (nothing copied or saved)."""
        def step() -> None:
            txn = LaunchTransaction(pool, idx, requests, saved_by_launch=saved, checks_inputs=check == "kernels",
                                    moved=moved if spare_rows else None)
            if check == "pass":
                value_extremes(inputs)
            problem = problem_of(c, txn.flags, saved_states=txn.saved if txn.saved_by_launch else None,
                                 input_checks=txn.input_checks, o_out=client_o if o_out else None,
                                 write_indices=txn.write_indices)
            kernels.run_problem(problem, "triton")
            if finals:
                client_final.copy_(pool.index_select(0, txn.written))
        return step

    def bare() -> None:
        kernels.run_problem(problem_of(c), "triton")

    return {
        "kernels alone": bare,
        "+ transaction (rows copied first, flags)": kernel(),
        "+ transaction (rows saved by the launch, flags)": kernel(saved=True),
        "+ the inputs' value check, a pass of its own (value_extremes; until 2026-12-04)": kernel(saved=True,
                                                                                                 check="pass"),
        "+ the inputs checked by the kernels instead (input_checks)": kernel(saved=True, check="kernels"),
        IN_PLACE_STEP: kernel(saved=True, check="kernels", o_out=True),
        "+ the final states gathered and copied": kernel(saved=True, check="kernels", o_out=True, finals=True),
        SPARE_ROWS_STEP: kernel(check="kernels", o_out=True, spare_rows=True),
    }


def captured(step: Step) -> torch.cuda.CUDAGraph:
    """``step`` warmed eagerly, then captured (its own memory pool)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph


def bench_case(name: str, reps: int, device: torch.device) -> None:
    n_seq, length = map(int, name.split("x"))
    c = make_case(n_seq, length, 32, device, spare_rows=n_seq)  # room for the spare-rows step
    graphs = {label: captured(step) for label, step in steps(c).items()}
    bare = steps(c)["kernels alone"]
    times: dict[str, list[float]] = {label: [] for label in graphs}
    eager: list[float] = []
    for _ in range(reps):  # interleaved
        for label, graph in graphs.items():
            times[label].append(event_ms(graph.replay, device))
        eager.append(event_ms(bare, device))
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        bare()
    end.record()
    end.synchronize()
    print(f"{name} H32 (medians of {reps} interleaved, ms):")
    print(f"  eager kernels, one call with its host gaps: {statistics.median(eager):.3f}; back to back: "
          f"{begin.elapsed_time(end) / reps:.3f} per call")
    previous = before_pass = None
    medians = {label: statistics.median(ts) for label, ts in times.items()}
    for label, ts in times.items():  # each row against the row above; the kernels' checks against the pass's base
        m = medians[label]
        base = before_pass if "checked by the kernels" in label else previous
        base = medians[IN_PLACE_STEP] if label == SPARE_ROWS_STEP else base
        step = "" if base is None else f" ({m - base:+.3f})"
        print(f"  graph, {label}: {m:.3f}{step}")
        before_pass = previous if "a pass of its own" in label else before_pass
        previous = m


EXTREMES_SHAPES = [(4096, 4, 8), (4096, 8, 8), (4096, 16, 4), (8192, 4, 8), (8192, 8, 16), (16384, 4, 16),
                   (2048, 16, 4), (2048, 32, 2)]  # (block, programs per SM, warps); the first is the default


def bench_extremes(name: str, reps: int, device: torch.device) -> None:
    """`value_extremes` over case ``name``'s five inputs for each of `EXTREMES_SHAPES`,
    medians of ``reps`` interleaved calls, as GB/s read, beside a copy of the same bytes."""
    n_seq, length = map(int, name.split("x"))
    c = make_case(n_seq, length, 32, device)
    inputs = [c[n] for n in ("q", "k", "v", "g", "beta")]
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in inputs])
    spare = torch.empty_like(flat)
    calls: dict[str, Step] = {"a copy of the same bytes (read + written)": lambda: spare.copy_(flat)}
    for block, per_sm, warps in EXTREMES_SHAPES:
        calls[f"value_extremes block {block}, {per_sm} programs/SM, {warps} warps"] = (
            lambda b=block, s=per_sm, w=warps: value_extremes(inputs, block=b, programs_per_sm=s, num_warps=w))
    for call in calls.values():  # compiles
        call()
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(reps):
        for label, call in calls.items():
            times[label].append(event_ms(call, device))
    print(f"{name} H32 inputs ({nbytes / 2**20:.0f} MiB), medians of {reps} interleaved:")
    for label, ts in times.items():
        m = statistics.median(ts)
        moved = 2 * nbytes if label.startswith("a copy") else nbytes
        print(f"  {label}: {m:.3f} ms, {moved / m / 1e6:.0f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="8x4096,1x4096,256x1")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--extremes", action="store_true", help="the value check's launch shapes instead")
    args = parser.parse_args()
    device = torch.device("cuda")
    for name in args.cases.split(","):
        (bench_extremes if args.extremes else bench_case)(name, args.reps, device)


if __name__ == "__main__":
    main()
