"""CUDA IPC prefill end to end against the kernel alone, on one GPU (issue 9).

How much of a ``POST /prefill`` whose tensors live in the client's GPU memory is the KDA
kernel, and how much is the rest.

One run starts a real ``kda-serve`` on 127.0.0.1 (``--device cuda:0 --backend triton``,
one layer, H = HV = 32, K = V = 128, fp32 pool) and, in this (client) process, for each
case (``--cases`` x ``--dtypes``):

1. allocates one fresh CUDA buffer holding the prefill's inputs (q, k, v, raw g, beta,
   A_log, dt_bias) and room for its outputs (o, final_state), fills the inputs with random
   values and registers the buffer with the server as a CUDA shared memory region (KServe
   v2 extension: ``/v2/cudasharedmemory/region/{name}/register``, torch's IPC handle);
2. e2e: times ``POST /prefill`` (``application/vnd.kda.shm+json``: a small JSON document
   naming each tensor by region and offset; every sequence on a new slot, freed after the
   request, outside the timing) from the request to the parsed response, wall clock on the
   client, over one keep-alive connection: median of ``--repeats`` after ``--warmup``
   (the first warm-up request also compiles the gate's Triton kernels on the server);
3. kernel: times ``kernels.chunk_kda`` in this process on the very same input tensors
   (views of the buffer) with a scratch state pool (``triton.testing.do_bench``, median);
4. checks that the o and final states the server wrote into the region equal what that
   in-process ``chunk_kda`` gives from zero states (relative L2 < 1e-2).

5. client e2e: the product path, ``KDAClient(url, transport="cuda")`` on the same device
   tensors (the client copies them into its own CUDA region; results come back as device
   tensors), median of ``--repeats``.

Serving config of TARGETS.md: lower_bound gate (-5) with A_log and dt_bias, q/k l2norm,
beta sigmoid. Columns: ``e2e ms`` (2), ``client e2e ms`` (5), ``kernel ms`` (3),
``kernel/e2e``, ``overhead ms`` (e2e - kernel), then the server's own phases from its
``Server-Timing`` header (medians, ms): ``decode`` (bounds checks, and the copy of q, k, v,
g, beta out of the region into the server's GPU memory, device to device), ``validate``
(the NaN/Inf scan, on the GPU), ``kernel`` (the launch; o and final states stay on the
device), ``encode`` (o and final states written into the region, device synchronized);
``rest`` = e2e - the four (HTTP, the JSON documents, the batcher's queue). The server's
batch window is 0 unless ``--batch-window-ms`` says otherwise (its default, 1 ms, would add
up to that much waiting to a lone request).

On the GPU machine, from the repository root (the script puts the repository first on
its own and the server's path, keeping PYTHONPATH; exit status 1 when a check fails, 2
when there is no CUDA device or no cuda-python):

    python3 bench/cuda_ipc.py --cases 1x4096,8x4096,1x16384 --dtypes bfloat16,float32 \\
        --repeats 20 --json cuda_ipc.json
"""
from __future__ import annotations

import argparse
import base64
import faulthandler
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.server_process import start_server  # noqa: E402
from kernels import chunk_kda  # noqa: E402
from kda_client.client import KDAClient, _server_timing  # noqa: E402
from service.shm.cuda_ipc import unavailable_reason  # noqa: E402
from kda_client.shm import cuda_ipc_handle  # noqa: E402
from service.shm.prefill import SHM_JSON  # noqa: E402
from service.wire.tensors import JSON_NAMES  # noqa: E402

HEADS, DIM = 32, 128  # H = HV, K = V: the serving config
LOWER_BOUND = -5.0
ALIGN = 256  # bytes; every tensor of the buffer starts on a multiple
TOL = 1e-2
INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
PHASES = ("decode", "validate", "kernel", "encode")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# -- the buffer and the request document (pure: runs anywhere) --------------------------------

@dataclass(frozen=True)
class Case:
    """``sequences`` sequences of ``length`` tokens each, inputs in ``dtype``."""

    sequences: int
    length: int
    dtype: torch.dtype

    @property
    def tokens(self) -> int:
        return self.sequences * self.length

    @property
    def name(self) -> str:
        return f"{self.sequences}x{self.length} {JSON_NAMES[self.dtype]}"


@dataclass(frozen=True)
class Slot:
    """A tensor's place in the buffer: ``offset`` bytes from its start."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def byte_size(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Where each input and output lies in one buffer of ``total`` bytes."""

    inputs: dict[str, Slot]
    o: Slot
    final_state: Slot
    total: int


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"1x4096,8x4096"`` -> [(1, 4096), (8, 4096)] (sequences x tokens each)."""
    cases = []
    for item in text.split(","):
        n, sep, length = item.strip().partition("x")
        if not sep or not n.isdigit() or not length.isdigit() or int(n) < 1 or int(length) < 1:
            raise ValueError(f"a case is SEQUENCESxTOKENS like 8x4096, got {item!r}")
        cases.append((int(n), int(length)))
    return cases


def parse_dtypes(text: str) -> list[torch.dtype]:
    """``"bfloat16,float32"`` -> the torch dtypes."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        raise ValueError(f"dtypes are among {sorted(DTYPES)}, got {unknown}")
    return [DTYPES[name] for name in names]


def make_layout(case: Case, heads: int = HEADS, k_dim: int = DIM, v_dim: int = DIM,
                state_dtype: torch.dtype = torch.float32) -> Layout:
    """The buffer of ``case`` (H = HV = ``heads``): inputs packed along tokens, then o
    [T, HV, V] in the inputs' dtype and final_state [N, HV, V, K] in ``state_dtype``, each
    ``ALIGN``-aligned. A_log and dt_bias are float32."""
    T, dt = case.tokens, case.dtype
    shapes = {"q": (dt, (T, heads, k_dim)), "k": (dt, (T, heads, k_dim)), "v": (dt, (T, heads, v_dim)),
              "g": (dt, (T, heads, k_dim)), "beta": (dt, (T, heads)), "A_log": (torch.float32, (heads,)),
              "dt_bias": (torch.float32, (heads, k_dim)),
              "o": (dt, (T, heads, v_dim)), "final_state": (state_dtype, (case.sequences, heads, v_dim, k_dim))}
    slots, at = {}, 0
    for name, (dtype, shape) in shapes.items():
        slots[name] = Slot(at, dtype, shape)
        at += -(-slots[name].byte_size // ALIGN) * ALIGN
    return Layout({name: slots[name] for name in INPUTS}, slots["o"], slots["final_state"], at)


def _ref(region: str, base: int, slot: Slot) -> dict[str, Any]:
    return {"region": region, "offset": base + slot.offset, "byte_size": slot.byte_size}


def prefill_doc(case: Case, layout: Layout, region: str, base: int = 0) -> dict[str, Any]:
    """The ``/prefill`` shared memory document of ``case``: every sequence on a new slot,
    tensors at ``base`` + their layout offset in ``region``, the serving options."""
    doc: dict[str, Any] = {"layer": 0, "sequences": [{"slot": None, "length": case.length}] * case.sequences,
                           "lower_bound": LOWER_BOUND, "use_qk_l2norm": True, "use_beta_sigmoid": True}
    for name, slot in layout.inputs.items():
        doc[name] = {"dtype": JSON_NAMES[slot.dtype], "shape": list(slot.shape), "shm": _ref(region, base, slot)}
    doc["outputs"] = {"o": _ref(region, base, layout.o), "final_state": _ref(region, base, layout.final_state)}
    return doc


def view(memory: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor at ``slot`` of uint8 buffer ``memory`` (a view: no copy)."""
    return memory[slot.offset:slot.offset + slot.byte_size].view(slot.dtype).view(slot.shape)


def fill_inputs(memory: torch.Tensor, layout: Layout, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random inputs written into ``memory`` (gen on its device); their views, by name.
    g and beta are raw (the gate and the sigmoid act on them); A_log in [0, 1)."""
    inputs = {name: view(memory, slot) for name, slot in layout.inputs.items()}
    for name, t in inputs.items():
        if name == "A_log":
            t.uniform_(generator=gen)
        else:
            t.normal_(generator=gen)
    return inputs


def kernel_call(inputs: dict[str, torch.Tensor], case: Case, pool: torch.Tensor,
                backend: Optional[str] = None) -> Callable[[], torch.Tensor]:
    """``chunk_kda`` on ``inputs`` with the request's options, sequence i on row i of
    ``pool`` (in place): a closure returning o [1, T, HV, V]."""
    device = pool.device
    cu_seqlens = torch.arange(0, case.tokens + 1, case.length, dtype=torch.int64, device=device)
    indices = torch.arange(case.sequences, dtype=torch.int64, device=device)
    q, k, v, g, beta = (inputs[name][None] for name in INPUTS[:5])

    def call() -> torch.Tensor:
        return chunk_kda(q, k, v, g, beta, initial_state=pool, initial_state_indices=indices,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, A_log=inputs["A_log"],
                         dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND, use_beta_sigmoid_in_kernel=True,
                         backend=backend)
    return call


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b``."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def median_phases(timings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median over the responses that carry it (ms)."""
    names = {name for t in timings for name in t}
    return {name: statistics.median(t[name] for t in timings if name in t) for name in sorted(names)}


# -- one case on the GPU ----------------------------------------------------------------------------

@dataclass
class Result:
    """The figures of one case (milliseconds)."""

    case: str
    sequences: int
    length: int
    dtype: str
    tokens: int
    e2e_ms: float
    kernel_ms: float
    server_ms: dict[str, float]
    rel_o: float
    rel_final_state: float
    client_ms: float = float("nan")  # KDAClient(transport="cuda") on the same device tensors, median
    e2e_all_ms: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """kernel / e2e: the share of the request that is the kernel."""
        return self.kernel_ms / self.e2e_ms

    @property
    def overhead_ms(self) -> float:
        """e2e - kernel: what the request costs beyond the kernel."""
        return self.e2e_ms - self.kernel_ms

    @property
    def ok(self) -> bool:
        return self.rel_o < TOL and self.rel_final_state < TOL

    def figures(self) -> dict[str, Any]:
        """Every figure, the derived ones included (for --json)."""
        return {**asdict(self), "ratio": self.ratio, "overhead_ms": self.overhead_ms, "ok": self.ok}


def register(http: httpx.Client, name: str, memory: torch.Tensor) -> int:
    """Register the caching-allocator block under ``memory`` as CUDA region ``name``; the
    offset of ``memory`` in it (torch's IPC handle opens the whole block)."""
    handle, base = cuda_ipc_handle(memory)
    body = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": memory.device.index,
            "byte_size": base + memory.numel()}
    r = http.post(f"/v2/cudasharedmemory/region/{name}/register", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"registering CUDA region {name!r}: {r.status_code} {r.text}")
    return base


def prefill(http: httpx.Client, body: bytes) -> tuple[float, dict[str, float], list[str]]:
    """One shared memory ``POST /prefill``: wall seconds, Server-Timing phases (ms), new slots."""
    t0 = time.perf_counter()
    r = http.post("/prefill", content=body, headers={"content-type": SHM_JSON})
    slots = r.json()["slots"] if r.status_code == 200 else None
    seconds = time.perf_counter() - t0
    if slots is None:
        raise RuntimeError(f"/prefill answered {r.status_code}: {r.text}")
    return seconds, _server_timing(r.headers), slots


def free(http: httpx.Client, slots: Sequence[str]) -> None:
    """``DELETE /slots/{id}`` of each slot (RuntimeError unless 204)."""
    for slot in slots:
        r = http.delete(f"/slots/{urllib.parse.quote(slot, safe='')}")
        if r.status_code != 204:
            raise RuntimeError(f"DELETE /slots/{slot}: {r.status_code} {r.text}")


def kernel_ms(call: Callable[[], torch.Tensor], rep_ms: int) -> float:
    """Median ms of ``call`` by ``triton.testing.do_bench`` (its own warm-up first)."""
    from triton.testing import do_bench

    return float(do_bench(call, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


def client_seconds(client: KDAClient, inputs: dict[str, torch.Tensor], case: Case, repeats: int) -> float:
    """Median wall seconds of ``client.prefill`` (the product path: the client copies the
    device tensors into its own CUDA region, the results come back as device tensors) on
    the case's sequences, each on a new slot, freed outside the timing."""
    seqs = [(None, *(inputs[name][i * case.length:(i + 1) * case.length] for name in INPUTS[:5]))
            for i in range(case.sequences)]
    options = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND,
                   use_qk_l2norm=True, use_beta_sigmoid=True)
    walls = []
    for i in range(repeats + 1):  # the first sizes the client's region
        t0 = time.perf_counter()
        out = client.prefill(0, seqs, **options)
        if i:
            walls.append(time.perf_counter() - t0)
        for slot in out.slots:
            client.free(slot)
    return statistics.median(walls)


def run_case(http: httpx.Client, client: KDAClient, case: Case, index: int, args: argparse.Namespace) -> Result:
    """Buffer, registration, e2e timing, correctness, kernel timing of one case."""
    device = torch.device("cuda", 0)
    layout = make_layout(case)
    memory = torch.zeros(layout.total, dtype=torch.uint8, device=device)
    inputs = fill_inputs(memory, layout, torch.Generator(device=device).manual_seed(index))
    torch.cuda.synchronize(device)  # the inputs are in place before the server reads them
    name = f"kda-bench-{os.getpid()}-{index}"
    base = register(http, name, memory)
    try:
        body = json.dumps(prefill_doc(case, layout, name, base)).encode()
        walls: list[float] = []
        timings: list[dict[str, float]] = []
        started = time.monotonic()
        for _ in range(args.warmup):
            free(http, prefill(http, body)[2])
        print(f"{case.name}: registered, {args.warmup} warm-up requests in {time.monotonic() - started:.1f} s",
              flush=True)
        deadline = time.monotonic() + args.budget_s
        while len(walls) < args.repeats and (not walls or time.monotonic() < deadline):
            seconds, timing, slots = prefill(http, body)
            free(http, slots)
            walls.append(seconds)
            timings.append(timing)
        o_got, final_got = view(memory, layout.o).clone(), view(memory, layout.final_state).clone()
    finally:
        http.post(f"/v2/cudasharedmemory/region/{name}/unregister")
    pool = torch.zeros(layout.final_state.shape, dtype=torch.float32, device=device)
    call = kernel_call(inputs, case, pool, backend="triton")
    o_want = call()[0]
    rel_o, rel_final = rel(o_got, o_want), rel(final_got, pool)
    return Result(case.name, case.sequences, case.length, JSON_NAMES[case.dtype], case.tokens,
                  statistics.median(walls) * 1e3, kernel_ms(call, args.kernel_rep_ms), median_phases(timings),
                  rel_o, rel_final, client_seconds(client, inputs, case, args.repeats) * 1e3,
                  [w * 1e3 for w in walls])


# -- report -------------------------------------------------------------------------------------------

def table(results: Sequence[Result]) -> str:
    """The figures as a Markdown table."""
    head = ["case", "tokens", "e2e ms", "client e2e ms", "kernel ms", "kernel/e2e", "overhead ms",
            *(f"server {p} ms" for p in PHASES), "rest ms", "rel o", "rel state", "check"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 2) + " --- |"]
    for r in results:
        phases = [r.server_ms.get(p, float("nan")) for p in PHASES]
        rest = r.e2e_ms - sum(phases)
        cells = [r.case, str(r.tokens), f"{r.e2e_ms:.2f}", f"{r.client_ms:.2f}", f"{r.kernel_ms:.2f}", f"{r.ratio:.2f}",
                 f"{r.overhead_ms:.2f}", *(f"{p:.2f}" for p in phases), f"{rest:.2f}",
                 f"{r.rel_o:.1e}", f"{r.rel_final_state:.1e}", "ok" if r.ok else "FAIL"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0), "python": platform.python_version()}


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where it waits
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x4096,8x4096,1x16384", help="SEQUENCESxTOKENS, comma separated")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="input dtypes, comma separated")
    ap.add_argument("--repeats", type=int, default=20, help="timed requests per case (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed requests per case first (at least 1)")
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop a case's timed requests after this long")
    ap.add_argument("--kernel-rep-ms", type=int, default=300, help="do_bench's measuring time per case")
    ap.add_argument("--batch-window-ms", type=float, default=0.0, help="the server's batch window")
    ap.add_argument("--start-timeout-s", type=float, default=600.0, help="wait this long for the server's warm-up")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--server-log", type=Path, help="keep the server's output here (default: a temporary file)")
    args = ap.parse_args()
    try:
        cases = [Case(n, length, dtype) for dtype in parse_dtypes(args.dtypes) for n, length in parse_cases(args.cases)]
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1 or args.warmup < 1:
        ap.error("--repeats and --warmup must be at least 1")
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench/cuda_ipc.py needs a CUDA device and cuda-python: {reason}", file=sys.stderr)
        return 2
    env = environment()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; H = HV = {HEADS}, "
          f"K = V = {DIM}, fp32 pool")
    most = max(c.sequences for c in cases)
    server_args = ["--device", "cuda:0", "--backend", "triton", "--num-layers", "1", "--num-slots", str(2 * most),
                   "--num-heads", str(HEADS), "--head-dim", str(DIM), "--batch-window-ms", str(args.batch_window_ms),
                   "--max-batch-tokens", str(max(65536, max(c.tokens for c in cases)))]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        server = start_server(server_args, args.server_log or Path(tmp) / "kda-serve.log", args.start_timeout_s)
        print(f"kda-serve ready after {time.monotonic() - started:.0f} s (its kernels warm)", flush=True)
        results: list[Result] = []
        try:
            with httpx.Client(base_url=server.url, timeout=600, trust_env=False) as http, \
                    KDAClient(server.url, timeout=600, transport="cuda") as client:  # no proxy: loopback
                for i, case in enumerate(cases):
                    results.append(run_case(http, client, case, i, args))
                    r = results[-1]
                    print(f"{r.case}: e2e {r.e2e_ms:.2f} ms (n={len(r.e2e_all_ms)}), client {r.client_ms:.2f} ms, "
                          f"kernel {r.kernel_ms:.2f} ms, "
                          f"rel o {r.rel_o:.1e}, rel state {r.rel_final_state:.1e}", flush=True)
        except Exception:
            print(f"kda-serve log (tail):\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            status = server.stop()
            print(f"kda-serve exit status on SIGTERM: {status}")
    print()
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({**env, "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": [r.figures() for r in results]}, indent=2))
        print(f"\nwrote {args.json}")
    failed = [r.case for r in results if not r.ok]
    if failed:
        print(f"\ncheck FAILED (rel L2 >= {TOL}): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
