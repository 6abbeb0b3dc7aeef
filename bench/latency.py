"""Per-call latency of the co-located hot path (issue 19): every figure in one run.

Each mode starts a real ``kda-serve`` on 127.0.0.1 and times calls one after another over one
keep-alive connection (p50 and p90 over ``--calls`` calls, after ``--warmup`` untimed ones),
printing the server's ``Server-Timing`` phases (medians, ms: decode, validate, kernel,
encode) beside each figure and each goal with ``ok`` or ``MISSED``.

``cpu`` (any machine): a CPU server, one layer, HV = 2 heads, K = V = 16, its default batch
window. Interleaved per round, so load from other processes hits them alike:
``GET /health/live``, a 1-token and a 64-token prefill through `KDAClient` (safetensors, on
one named slot each), the ratios to ``/health/live`` (goals <= 1.6x and <= 2.0x); the same
prefills through POSIX shared memory over HTTP and over the server's framed socket
(``--framed-socket``, `kda_client.framed`), and the framed socket's PING. Then a decode
step of 256 one-token sequences, prepared and RUN over the framed socket, on a server of
256 slots (the host work around the GPU's decode step; its kernels the torch backend's). Then 32
concurrent 64-token requests (`AsyncKDAClient`) on a second server of ``bench/transport.py``
(d)'s geometry (4 heads, K = V = 64, its 2 ms window): p50/p90 of a burst and tokens/s.

``gpu`` (the H200): a GPU server (``--device cuda:0 --backend triton``, H = HV = 32, K = V =
128, fp32 pool, bf16 inputs, the serving options: lower-bound gate with A_log and dt_bias,
q/k l2norm, beta sigmoid). Cases 1x4096, 8x4096 and a decode step 256x1, each on named
slots, and ``GET /health/live`` on the same client (the HTTP round trip every call includes):

- CUDA IPC: the inputs already lie in a registered CUDA region of this process, the request
  names them in place (the engine's call, sent as `KDAClient` sends small requests:
  `kda_client.small.SmallExchange`, one kept-alive connection); goals 1x4096 <= kernel + 0.3 ms and <= 1.0 ms,
  8x4096 <= kernel + 0.5 ms, decode <= 0.5 ms; the same document over the framed socket
  (`kda_client.framed.FramedExchange`), and its PING beside ``/health/live``; and over the
  socket once more on the server's second layer, whose gate parameters the server holds
  (``--gate-params``), so the request sends no A_log, dt_bias or lower_bound (an engine's
  call once configured);
- POSIX shared memory from a CPU client: the inputs lie in a registered /dev/shm region;
  goal 1x4096 <= kernel + DMA + 0.3 ms, DMA being a pinned host -> device copy of the input
  bytes and device -> host of the output bytes, timed here;
- the kernel in this process on the same inputs, three ways: the prebuilt problem
  (`kernels.problem.packed_problem` once, `kernels.run_problem` per call: the service's
  path), `chunk_kda` with a device ``cu_seqlens``, and `chunk_kda` with ``cu_seqlens_cpu``
  as well; goal: chunk_kda within 5% (or 20 us) of the prebuilt path. Each call is timed
  wall clock with one synchronization after it (the latency a caller sees), and a run of
  ``--calls`` back to back with one synchronization at the end gives the mean when host
  work overlaps the GPU.

    python bench/latency.py cpu [--calls 200] [--json cpu.json]
    python bench/latency.py gpu [--calls 200] [--json gpu.json]     # on the GPU machine
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.server_process import Server, start_server  # noqa: E402
from kda_client.client import AsyncKDAClient, KDAClient, _server_timing  # noqa: E402
from kda_client.framed import FramedExchange  # noqa: E402
from kda_client.small import Response, SmallExchange  # noqa: E402
from service.core.prepared import RUN_PHASES  # noqa: E402
from service.wire.frames import PREPARED_ID, Op, request_frame, split_reply  # noqa: E402
from kda_client.transport import StdlibTransport  # noqa: E402

PHASES = ("decode", "validate", "kernel", "encode",  # a prefill's
          *RUN_PHASES)  # a prepared prefill's RUN (`service.core.prepared.PreparedRun`)


@dataclass
class Figure:
    """p50 and p90 (ms) of one timed call over ``n`` calls, and its server phases (medians, ms)."""

    name: str
    n: int
    p50: float
    p90: float
    phases: dict[str, float] = field(default_factory=dict)

    def row(self) -> str:
        phases = ", ".join(f"{p} {self.phases[p]:.3f}" for p in PHASES if p in self.phases)
        inner = sum(self.phases[p] for p in PHASES if p in self.phases)
        rest = f"; rest {self.p50 - inner:.3f}" if self.phases else ""
        if "total" in self.phases:  # the framed socket's: the server's whole time on the request
            total = self.phases["total"]
            rest += f" (in the server {total - inner:.3f}, outside it {self.p50 - total:.3f})"
        return f"| {self.name} | {self.n} | {self.p50:.3f} | {self.p90:.3f} | {phases}{rest} |"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def figure(name: str, seconds: Sequence[float], timings: Sequence[dict[str, float]] = ()) -> Figure:
    """The figure of per-call wall ``seconds`` and their Server-Timing ``timings`` (ms)."""
    ms = [s * 1e3 for s in seconds]
    phases = {p: statistics.median(t[p] for t in timings if p in t) for p in (*PHASES, "total")
              if any(p in t for t in timings)}
    return Figure(name, len(ms), statistics.median(ms), quantile(ms, 0.9), phases)


def print_table(figures: Sequence[Figure]) -> None:
    print("\n| call | n | p50 ms | p90 ms | server phases, p50 ms |")
    print("| --- | ---: | ---: | ---: | --- |")
    for f in figures:
        print(f.row())


def goal(text: str, value: float, limit: float) -> dict[str, Any]:
    """Print one goal's line; its record for --json."""
    met = value <= limit
    print(f"goal {text}: {value:.3f} <= {limit:.3f}: {'ok' if met else 'MISSED'}")
    return {"goal": text, "value": value, "limit": limit, "met": met}


def http_client(url: str) -> httpx.Client:
    """An httpx client on `KDAClient`'s transport (one keep-alive connection, no proxy)."""
    return httpx.Client(base_url=url, timeout=600, trust_env=False, mounts={"http://": StdlibTransport()})


# -- cpu -----------------------------------------------------------------------------------------

def small_sequence(tokens: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, g (log decay), beta of one sequence: [T, heads, dim] fp32 ([T, heads] for beta)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, heads, dim, generator=gen) / dim ** 0.5
    v = torch.randn(tokens, heads, dim, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(tokens, heads, dim, generator=gen))
    return q, k, v, g, torch.rand(tokens, heads, generator=gen)


def framed_path() -> str:
    """A fresh path for the server's framed socket."""
    return f"/tmp/kda-latency-{os.getpid()}.sock"


def cpu_loopback(server: Server, framed: str, calls: int, warmup: int) -> tuple[list[Figure], list[dict[str, Any]]]:
    """/health/live, a 1-token and a 64-token prefill, interleaved, on one server; the same
    prefills through POSIX shared memory over HTTP and over the framed socket ``framed``,
    and the framed socket's PING."""
    lengths = (1, 64)
    seqs = {n: small_sequence(n, 2, 16, n) for n in lengths}
    rows = ["live", "ping", *(f"{way} {n}" for way in ("body", "shm", "framed", "prepared") for n in lengths)]
    walls: dict[str, list[float]] = {row: [] for row in rows}
    timings: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    ping = FramedExchange(framed, None, 60)
    with KDAClient(server.url) as body, KDAClient(server.url, transport="shm") as shm, \
            KDAClient(server.url, transport="shm", framed_socket=framed) as over_frames, \
            http_client(server.url) as http:
        clients = {"body": body, "shm": shm, "framed": over_frames}
        slots = {(way, n): slot for way in (*clients, "prepared") for n, slot in zip(lengths, body.alloc(len(lengths)))}
        prepared = {n: over_frames.prepare(0, [(slots["prepared", n], *seqs[n])]) for n in lengths}

        def live() -> None:
            if http.get("/health/live").status_code != 200:
                raise RuntimeError("/health/live did not answer 200")

        def framed_ping() -> None:
            if ping.request(Op.PING, b"").status != 200:
                raise RuntimeError("the framed PING did not answer 200")
        for i in range(warmup + calls):
            for row, fn in (("live", live), ("ping", framed_ping)):
                t0 = time.perf_counter()
                fn()
                if i >= warmup:
                    walls[row].append(time.perf_counter() - t0)
            for way, client in clients.items():
                for n in lengths:
                    t0 = time.perf_counter()
                    out = client.prefill(0, [(slots[way, n], *seqs[n])])
                    wall = time.perf_counter() - t0
                    if i >= warmup:
                        walls[f"{way} {n}"].append(wall)
                        timings[f"{way} {n}"].append(dict(out.server_timing))
            for n in lengths:
                t0 = time.perf_counter()
                out = prepared[n].run(*seqs[n])
                if i >= warmup:
                    walls[f"prepared {n}"].append(time.perf_counter() - t0)
                    timings[f"prepared {n}"].append(dict(out.server_timing))
        for n in lengths:
            prepared[n].release()
    ping.close()
    names = {"live": "GET /health/live", "ping": "framed socket PING",
             **{f"{way} {n}": f"KDAClient prefill, {n} token(s), HV=2 K=V=16, {what}" for n in lengths
                for way, what in (("body", "in the HTTP body"), ("shm", "POSIX shm over HTTP"),
                                  ("framed", "POSIX shm over the framed socket"),
                                  ("prepared", "prepared, RUN over the framed socket"))}}
    figures = [figure(names[row], walls[row], timings[row]) for row in rows]
    by = {row: f.p50 for row, f in zip(rows, figures)}
    records = [goal("CPU 1-token prefill / GET /health/live (p50)", by["body 1"] / by["live"], 1.6),
               goal("CPU 64-token prefill / GET /health/live (p50)", by["body 64"] / by["live"], 2.0)]
    for n in lengths:
        print(f"{n}-token shm prefill, framed socket / HTTP (p50): {by[f'framed {n}'] / by[f'shm {n}']:.2f}x")
        print(f"{n}-token prepared RUN / framed PREFILL (p50): {by[f'prepared {n}'] / by[f'framed {n}']:.2f}x, "
              f"/ PING: {by[f'prepared {n}'] / by['ping']:.1f}x")
    return figures, records


async def _bursts(url: str, n: int, tokens: int, rounds: int) -> list[float]:
    """Wall seconds of each of ``rounds`` bursts of ``n`` concurrent one-sequence prefills
    (4 heads, K = V = 64), on ``n`` named slots."""
    seq = small_sequence(tokens, 4, 64, 1)
    async with AsyncKDAClient(url) as client:
        slots = await client.alloc(n)
        await asyncio.gather(*(client.prefill(0, [(s, *seq)]) for s in slots))  # connections up
        walls = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await asyncio.gather(*(client.prefill(0, [(s, *seq)]) for s in slots))
            walls.append(time.perf_counter() - t0)
        return walls


def cpu_concurrent(n: int, tokens: int, rounds: int) -> tuple[Figure, float]:
    """32 concurrent small requests on a server of bench/transport.py (d)'s geometry: the
    burst's figure and tokens/s over all bursts."""
    server = start_server(["--num-layers", "1", "--num-slots", str(n), "--num-heads", "4", "--head-dim", "64",
                           "--batch-window-ms", "2", "--max-batch-tokens", "65536"])
    try:
        walls = asyncio.run(_bursts(server.url, n, tokens, rounds))
    finally:
        server.stop()
    return figure(f"{n} concurrent x {tokens} tokens (one burst)", walls), n * tokens * len(walls) / sum(walls)


def cpu_decode_step(framed: str, sequences: int, calls: int, warmup: int) -> Figure:
    """A decode step on a CPU server of the loopback case's heads and dims: ``sequences``
    one-token sequences on named slots, prepared once and RUN ``calls`` times over the
    framed socket (finals declined), with its phases: the CPU's view of the host work
    around the GPU's 256-sequence step (issue 19), whose kernels here are the torch
    backend's."""
    server = start_server(["--num-layers", "1", "--num-slots", str(sequences), "--num-heads", "2",
                           "--head-dim", "16", "--framed-socket", framed])
    try:
        with KDAClient(server.url, transport="shm", framed_socket=framed) as client:
            step = small_sequence(sequences, 2, 16, 3)  # row i: sequence i's one token
            slots = client.alloc(sequences)
            prepared = client.prepare(0, [(slot, *(t[i:i + 1] for t in step)) for i, slot in enumerate(slots)],
                                      return_final_state=False)
            walls, timings = [], []
            for i in range(warmup + calls):
                t0 = time.perf_counter()
                out = prepared.run(*step)
                if i >= warmup:
                    walls.append(time.perf_counter() - t0)
                    timings.append(dict(out.server_timing))
            prepared.release()
    finally:
        server.stop()
    return figure(f"decode step, {sequences} x 1 token, HV=2 K=V=16, prepared RUN (finals declined)", walls, timings)


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    framed = framed_path()
    server = start_server(["--num-layers", "1", "--num-slots", "8", "--num-heads", "2", "--head-dim", "16",
                           "--framed-socket", framed, *args.server_arg])
    try:
        figures, records = cpu_loopback(server, framed, args.calls, args.warmup)
    finally:
        server.stop()
    figures.append(cpu_decode_step(framed, 256, args.calls, args.warmup))
    burst, rate = cpu_concurrent(32, 64, args.burst_rounds)
    figures.append(burst)
    print_table(figures)
    for r in records:
        print(f"{r['goal']}: {r['value']:.2f}x (goal <= {r['limit']}x): {'ok' if r['met'] else 'MISSED'}")
    print(f"32 concurrent x 64 tokens: {rate:.0f} tokens/s (compare bench/transport.py (d), window on)")
    return {"figures": [asdict(f) for f in figures], "goals": records, "concurrent_tokens_s": rate}


# -- gpu -----------------------------------------------------------------------------------------

def _cuda_timed(fn: Callable[[], object], calls: int, warmup: int) -> tuple[list[float], float]:
    """Wall seconds of each call of ``fn`` with a synchronization after it, and the mean of
    ``calls`` calls back to back with one synchronization at the end."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return walls, (time.perf_counter() - t0) / calls


@dataclass(frozen=True)
class GpuCase:
    sequences: int
    length: int

    @property
    def name(self) -> str:
        return f"{self.sequences}x{self.length}"


def kernel_paths(inputs: dict[str, torch.Tensor], case: GpuCase, calls: int, warmup: int
                 ) -> tuple[list[Figure], dict[str, float]]:
    """The kernel on ``inputs`` (views of the region's memory) three ways; figures and the
    back-to-back means (ms), by path."""
    import kernels
    from kernels.problem import packed_problem

    from bench.cuda_ipc import LOWER_BOUND

    device = inputs["q"].device
    pool = torch.zeros(case.sequences, *inputs["v"].shape[1:], inputs["q"].shape[2], device=device)
    bounds = list(range(0, case.sequences * case.length + 1, case.length))
    cu = torch.tensor(bounds, dtype=torch.int64, device=device)
    indices = torch.arange(case.sequences, dtype=torch.int64, device=device)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    options = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND)
    problem = packed_problem(q, k, v, g, beta, bounds=bounds, pool=pool, indices=indices, scale=None,
                             use_qk_l2norm=True, use_beta_sigmoid=True, allow_neg_eigval=False, **options)
    public = dict(initial_state=pool, initial_state_indices=indices, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                  use_beta_sigmoid_in_kernel=True, backend="triton", **options)
    cpu_bounds = torch.tensor(bounds)
    five = (q[None], k[None], v[None], g[None], beta[None])
    paths: dict[str, Callable[[], object]] = {
        "prebuilt problem (run_problem)": lambda: kernels.run_problem(problem, "triton"),
        "chunk_kda, cu_seqlens on device": lambda: kernels.chunk_kda(*five, **public),
        "chunk_kda, cu_seqlens_cpu given": lambda: kernels.chunk_kda(*five, cu_seqlens_cpu=cpu_bounds, **public),
    }
    figures, means = [], {}
    for name, fn in paths.items():
        walls, mean = _cuda_timed(fn, calls, warmup)
        figures.append(figure(f"{case.name} kernel: {name}", walls))
        means[name] = mean * 1e3
    return figures, means


SERVER_GATES_LAYER = 1
"""The GPU server's layer whose gate parameters it holds itself (``--gate-params``): its
requests send no A_log, dt_bias or lower_bound, as an engine's would once configured."""


def _doc(case: GpuCase, layout: Any, region: str, base: int, slots: Sequence[str], finals: bool = True,
         server_gates: bool = False) -> bytes:
    """The request document on named ``slots``; ``finals``: the final states asked for
    (an engine's decode step, whose states stay in the pool, declines them);
    ``server_gates``: on `SERVER_GATES_LAYER`, without the gate parameters."""
    from bench.cuda_ipc import prefill_doc

    doc = prefill_doc(_as_ipc_case(case), layout, region, base)
    doc["sequences"] = [{"slot": s, "length": case.length} for s in slots]
    if not finals:
        doc["return_final_state"] = False
        del doc["outputs"]["final_state"]
    if server_gates:
        doc["layer"] = SERVER_GATES_LAYER
        for name in ("A_log", "dt_bias", "lower_bound"):
            doc.pop(name, None)
    return json.dumps(doc).encode()


def write_server_gates(path: Path, heads: int, dim: int) -> None:
    """A ``--gate-params`` file for `SERVER_GATES_LAYER` (the serving gate: A_log, dt_bias,
    lower bound -5)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(7)
    prefix = f"layers.{SERVER_GATES_LAYER}."
    save_file({prefix + "A_log": torch.rand(heads, generator=gen),
               prefix + "dt_bias": torch.randn(heads, dim, generator=gen),
               prefix + "lower_bound": torch.tensor([-5.0])}, str(path))


def _as_ipc_case(case: GpuCase) -> Any:
    from bench.cuda_ipc import Case

    return Case(case.sequences, case.length, torch.bfloat16)


@contextmanager
def _py_spy(pid: Optional[int], out: Optional[Path]) -> Iterator[None]:
    """Sample process ``pid`` with py-spy (every thread, idle ones too; collapsed stacks to
    ``out``) while the block runs; nothing when either is None."""
    if pid is None or out is None:
        yield
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spy = subprocess.Popen([exe, "record", "-p", str(pid), "-r", "500", "--idle", "--threads", "--format", "raw",
                            "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        _, err = spy.communicate(timeout=60)
        print(f"py-spy -> {out}: {err.decode(errors='replace').strip().splitlines()[-1:]}", flush=True)


Timings = tuple[list[float], list[dict[str, float]]]


class PollingExchange:
    """Frames on a framed socket connection of its own, each reply awaited by polling the
    socket without sleeping (non-blocking receives in a loop) instead of a blocking
    receive: what a client that keeps its core busy while it waits would save in wake-up
    latency (a CPU idle state entered during a long wait costs its exit latency when the
    reply arrives). An experiment of this bench, not a client path: `request` as
    `FramedExchange.request` for what `_timed_prepared` sends (no key, no reconnect)."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._sock.setblocking(False)

    def request(self, op: Op, payload: bytes) -> Response:
        self._sock.setblocking(True)
        self._sock.sendall(request_frame(op, payload))
        self._sock.setblocking(False)
        got = bytearray()
        while len(got) < 4 or len(got) < 4 + int.from_bytes(got[:4], "big"):
            try:
                chunk = self._sock.recv(1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise ConnectionError("the server closed the framed socket")
            got += chunk
        status, timing, body = split_reply(bytes(got[4:]))
        return Response(status, {"server-timing": timing} if timing else {}, bytearray(body))

    def close(self) -> None:
        self._sock.close()


def _timed_calls(call: Callable[[], Any], what: str, calls: int, warmup: int, profile: Optional[Path],
                 server_pid: Optional[int]) -> Timings:
    """Wall seconds and ``Server-Timing`` phases of ``calls`` calls of ``call`` (a response
    with ``status`` and ``headers``; ``what`` names it when it is not 200), after ``warmup``
    untimed ones. ``profile``: py-spy's samples of the server (``server_pid``) meanwhile."""
    def timed() -> tuple[float, Any]:
        t0 = time.perf_counter()
        r = call()
        wall = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"{what} answered {r.status}: {bytes(r.body)!r}")
        return wall, r

    for _ in range(warmup):
        timed()
    walls, timings = [], []
    with _py_spy(server_pid, profile):
        for _ in range(calls):
            wall, r = timed()
            walls.append(wall)
            timings.append(_server_timing(r.headers))
    return walls, timings


def _timed_posts(small: SmallExchange, body: bytes, calls: int, warmup: int, profile: Optional[Path] = None,
                 server_pid: Optional[int] = None) -> Timings:
    """POST /prefill of the shared memory document ``body`` through `KDAClient`'s path for
    small requests (`SmallExchange`, one kept-alive connection), as an engine's call goes."""
    from service.shm.prefill import SHM_JSON

    headers = {"content-type": SHM_JSON, "content-length": str(len(body))}
    return _timed_calls(lambda: small.request("POST", "/prefill", headers, [body]), "/prefill", calls, warmup,
                        profile, server_pid)


def _timed_frames(framed: FramedExchange, body: bytes, calls: int, warmup: int, profile: Optional[Path] = None,
                  server_pid: Optional[int] = None) -> Timings:
    """The same shared memory document over the server's framed socket."""
    return _timed_calls(lambda: framed.request(Op.PREFILL, body), "framed PREFILL", calls, warmup, profile,
                        server_pid)


def _timed_prepared(framed: Union[FramedExchange, PollingExchange], body: bytes, calls: int, warmup: int, profile: Optional[Path] = None,
                    server_pid: Optional[int] = None) -> Timings:
    """The same document prepared once (PREPARE), then run (RUN frames of its id): an
    engine's fixed-shape call; released after."""
    answer = framed.request(Op.PREPARE, body)
    if answer.status != 201:
        raise RuntimeError(f"PREPARE answered {answer.status}: {bytes(answer.body)!r}")
    reply = json.loads(answer.body)
    print(f"PREPARE answered {reply['prepared']}, graphed: {reply['graphed']}")
    prepared = PREPARED_ID.pack(reply["prepared"])
    try:
        return _timed_calls(lambda: framed.request(Op.RUN, prepared), "RUN", calls, warmup, profile, server_pid)
    finally:
        framed.request(Op.RELEASE, prepared)


def _dma_ms(in_bytes: int, out_bytes: int, calls: int) -> float:
    """p50 ms of a pinned host -> device copy of ``in_bytes`` plus device -> host of ``out_bytes``."""
    host_in = torch.empty(in_bytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(out_bytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(in_bytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(out_bytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        dev_in.copy_(host_in, non_blocking=True)
        host_out.copy_(dev_out, non_blocking=True)

    walls, _ = _cuda_timed(copy, calls, 5)
    return statistics.median(walls) * 1e3


def gpu_case(http: httpx.Client, small: SmallExchange, framed: FramedExchange, case: GpuCase, index: int,
             args: argparse.Namespace) -> tuple[list[Figure], list[dict[str, Any]]]:
    """One case: CUDA IPC (over HTTP and over the framed socket), POSIX shared memory, and
    the kernel paths, on the same inputs."""
    from bench.cuda_ipc import fill_inputs, make_layout, register

    device = torch.device("cuda", 0)
    layout = make_layout(_as_ipc_case(case))
    r = http.post("/slots", json={"count": case.sequences})
    if r.status_code != 201 and r.status_code != 200:
        raise RuntimeError(f"POST /slots: {r.status_code} {r.text}")
    slots = r.json()["slots"]
    memory = torch.zeros(layout.total, dtype=torch.uint8, device=device)
    inputs = fill_inputs(memory, layout, torch.Generator(device=device).manual_seed(index))
    torch.cuda.synchronize()
    figures, records = [], []
    name = f"kda-latency-{os.getpid()}-{index}"
    base = register(http, name, memory)
    try:
        doc = _doc(case, layout, name, base, slots)
        walls, timings = _timed_posts(small, doc, args.calls, args.warmup,
                                      args.profile and args.profile / f"{case.name}_cuda_ipc.txt", args.server_pid)
        framed_walls, framed_timings = _timed_frames(framed, doc, args.calls, args.warmup, args.profile and
                                                     args.profile / f"{case.name}_framed.txt", args.server_pid)
        gated = _timed_frames(framed, _doc(case, layout, name, base, slots, server_gates=True), args.calls,
                              args.warmup)
        ran = _timed_prepared(framed, doc, args.calls, args.warmup, args.profile and
                              args.profile / f"{case.name}_prepared.txt", args.server_pid)
        ran_gated = _timed_prepared(framed, _doc(case, layout, name, base, slots, server_gates=True), args.calls,
                                    args.warmup)
    finally:
        http.post(f"/v2/cudasharedmemory/region/{name}/unregister")
    ipc = figure(f"{case.name} CUDA IPC end to end", walls, timings)
    ipc_framed = figure(f"{case.name} CUDA IPC over the framed socket", framed_walls, framed_timings)
    ipc_gated = figure(f"{case.name} CUDA IPC over the framed socket, the server's gate parameters", *gated)
    prepared = figure(f"{case.name} CUDA IPC prepared, RUN over the framed socket", *ran)
    prepared_gated = figure(f"{case.name} CUDA IPC prepared, RUN over the framed socket, the server's gate "
                            "parameters", *ran_gated)
    figures += [ipc, ipc_framed, ipc_gated, prepared, prepared_gated]
    if case.length == 1:  # the decode step as an engine sends it: the states stay in the pool
        base = register(http, name, memory)
        try:
            doc = _doc(case, layout, name, base, slots, finals=False)
            walls, timings = _timed_posts(small, doc, args.calls, args.warmup,
                                          args.profile and args.profile / f"{case.name}_lean.txt", args.server_pid)
            framed_walls, framed_timings = _timed_frames(framed, doc, args.calls, args.warmup, args.profile and
                                                         args.profile / f"{case.name}_framed_lean.txt",
                                                         args.server_pid)
            gated = _timed_frames(framed, _doc(case, layout, name, base, slots, finals=False, server_gates=True),
                                  args.calls, args.warmup)
            ran_lean = _timed_prepared(framed, _doc(case, layout, name, base, slots, finals=False, server_gates=True),
                                       args.calls, args.warmup, args.profile and
                                       args.profile / f"{case.name}_prepared_lean.txt", args.server_pid)
            polling = PollingExchange(framed.path)
            try:
                ran_lean_polled = _timed_prepared(
                    polling, _doc(case, layout, name, base, slots, finals=False, server_gates=True), args.calls,
                    args.warmup)
            finally:
                polling.close()
        finally:
            http.post(f"/v2/cudasharedmemory/region/{name}/unregister")
        lean = figure(f"{case.name} CUDA IPC end to end, final states declined", walls, timings)
        lean_framed = figure(f"{case.name} CUDA IPC over the framed socket, final states declined", framed_walls,
                             framed_timings)
        lean_gated = figure(f"{case.name} CUDA IPC over the framed socket, final states declined, the server's "
                            "gate parameters", *gated)
        lean_prepared = figure(f"{case.name} CUDA IPC prepared, RUN over the framed socket, final states declined, "
                               "the server's gate parameters", *ran_lean)
        lean_polled = figure(f"{case.name} the same RUN, the client polling for its reply (PollingExchange)",
                             *ran_lean_polled)
        figures += [lean, lean_framed, lean_gated, lean_prepared, lean_polled]

    shm_name = f"kda-latency-{os.getpid()}-{index}-host"
    path = f"/dev/shm/{shm_name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, layout.total)
        os.close(fd)
        host = torch.from_file(path, shared=True, size=layout.total, dtype=torch.uint8)
        host.copy_(memory.cpu())
        r = http.post("/shm/regions", json={"name": shm_name, "key": "/" + shm_name, "byte_size": layout.total})
        if r.status_code not in (200, 201):
            raise RuntimeError(f"POST /shm/regions: {r.status_code} {r.text}")
        try:
            walls, timings = _timed_posts(small, _doc(case, layout, shm_name, 0, slots), args.calls, args.warmup)
            ran_shm = _timed_prepared(framed, _doc(case, layout, shm_name, 0, slots, server_gates=True), args.calls,
                                      args.warmup)
        finally:
            http.delete(f"/shm/regions/{shm_name}")
    finally:
        os.unlink(path)
    shm = figure(f"{case.name} POSIX shm end to end (CPU client)", walls, timings)
    shm_prepared = figure(f"{case.name} POSIX shm prepared, RUN over the framed socket, the server's gate parameters "
                          "(CPU client)", *ran_shm)
    figures += [shm, shm_prepared]

    kernel_figures, means = kernel_paths(inputs, case, args.calls, args.warmup)
    figures += kernel_figures
    kernel = kernel_figures[0].p50
    for f in kernel_figures[1:]:
        records.append(goal(f"{f.name} within 5% or 20 us of the prebuilt problem", f.p50,
                            max(kernel * 1.05, kernel + 0.020)))
    for name, mean in means.items():
        print(f"{case.name} {name}: {mean:.3f} ms per call back to back")
    prebuilt = means["prebuilt problem (run_problem)"]
    records.append(goal(f"{case.name} chunk_kda with cu_seqlens_cpu, back to back, within 5% or 20 us of the "
                        f"prebuilt problem", means["chunk_kda, cu_seqlens_cpu given"],
                        max(prebuilt * 1.05, prebuilt + 0.020)))
    if case.length == 1:
        records.append(goal(f"{case.name} decode step over CUDA IPC (ms)", ipc.p50, 0.5))
        records.append(goal(f"{case.name} decode step over CUDA IPC, final states declined (ms)", lean.p50, 0.5))
        records.append(goal(f"{case.name} decode step over the framed socket, final states declined (ms)",
                            lean_framed.p50, 0.5))
        records.append(goal(f"{case.name} decode step over the framed socket, final states declined, the server's "
                            "gate parameters (ms)", lean_gated.p50, 0.5))
        records.append(goal(f"{case.name} decode step prepared, final states declined, the server's gate "
                            "parameters (ms)", lean_prepared.p50, 0.5))
    elif case.sequences == 1:
        records.append(goal(f"{case.name} CUDA IPC <= kernel + 0.3 ms", ipc.p50, kernel + 0.3))
        records.append(goal(f"{case.name} CUDA IPC <= 1.0 ms", ipc.p50, 1.0))
        records.append(goal(f"{case.name} CUDA IPC over the framed socket <= 1.0 ms", ipc_framed.p50, 1.0))
        records.append(goal(f"{case.name} CUDA IPC over the framed socket, the server's gate parameters <= 1.0 ms",
                            ipc_gated.p50, 1.0))
        records.append(goal(f"{case.name} CUDA IPC prepared <= 1.0 ms", prepared.p50, 1.0))
        records.append(goal(f"{case.name} CUDA IPC prepared, the server's gate parameters <= 1.0 ms",
                            prepared_gated.p50, 1.0))
        in_bytes = sum(layout.inputs[n].byte_size for n in layout.inputs)
        dma = _dma_ms(in_bytes, layout.o.byte_size + layout.final_state.byte_size, args.calls)
        print(f"{case.name} DMA of the request's bytes (pinned, in + out): {dma:.3f} ms")
        records.append(goal(f"{case.name} POSIX shm <= kernel + DMA + 0.3 ms", shm.p50, kernel + dma + 0.3))
        records.append(goal(f"{case.name} POSIX shm prepared <= kernel + DMA + 0.3 ms", shm_prepared.p50,
                            kernel + dma + 0.3))
    else:
        records.append(goal(f"{case.name} CUDA IPC <= kernel + 0.5 ms", ipc.p50, kernel + 0.5))
        records.append(goal(f"{case.name} CUDA IPC prepared <= kernel + 0.5 ms", prepared.p50, kernel + 0.5))
    for slot in slots:
        http.delete(f"/slots/{slot}")
    return figures, records


def trivial_request(small: SmallExchange, calls: int, warmup: int) -> Figure:
    """``GET /health/live`` on the same client path and server: the HTTP round trip alone,
    which every prefill's end-to-end figure includes."""
    walls = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        if small.request("GET", "/health/live", {}).status != 200:
            raise RuntimeError("/health/live did not answer 200")
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
    return figure("GET /health/live (the same client path)", walls)


def trivial_frame(framed: FramedExchange, calls: int, warmup: int) -> Figure:
    """The framed socket's PING: its round trip alone."""
    walls = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        if framed.request(Op.PING, b"").status != 200:
            raise RuntimeError("the framed PING did not answer 200")
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
    return figure("framed socket PING", walls)


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    from bench.cuda_ipc import DIM, HEADS

    if not torch.cuda.is_available():
        print("bench/latency.py gpu needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    cases = [c for c in (GpuCase(1, 4096), GpuCase(8, 4096), GpuCase(256, 1))
             if args.cases is None or c.name in args.cases.split(",")]
    framed_socket = framed_path()
    gates = Path(f"/tmp/kda-latency-gates-{os.getpid()}.safetensors")
    write_server_gates(gates, HEADS, DIM)
    server = start_server(["--device", "cuda:0", "--backend", "triton", "--num-layers", str(SERVER_GATES_LAYER + 1),
                           "--num-slots", "512", "--num-heads", str(HEADS), "--head-dim", str(DIM),
                           "--gate-params", str(gates), "--framed-socket", framed_socket, *args.server_arg],
                          timeout_s=600)
    figures, records = [], []
    args.server_pid = server.process.pid
    try:
        with http_client(server.url) as http:
            url = http.base_url
            small = SmallExchange(url.host, url.port, url.netloc.decode("ascii"), "", {}, 600)
            framed = FramedExchange(framed_socket, None, 600)
            figures.append(trivial_request(small, args.calls, args.warmup))
            figures.append(trivial_frame(framed, args.calls, args.warmup))
            for i, case in enumerate(cases):
                f, r = gpu_case(http, small, framed, case, i, args)
                figures += f
                records += r
                print(f"{case.name}: done", flush=True)
    except Exception:
        print(f"kda-serve log (tail):\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()
    print_table(figures)
    return {"gpu": torch.cuda.get_device_name(0), "figures": [asdict(f) for f in figures], "goals": records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("cpu", "gpu"))
    ap.add_argument("--calls", type=int, default=200, help="timed calls per figure (p50, p90)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    ap.add_argument("--burst-rounds", type=int, default=20, help="cpu: bursts of 32 concurrent requests")
    ap.add_argument("--server-arg", action="append", default=[], help="one more kda-serve flag (repeatable)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--cases", help="gpu: only these cases, comma-separated (of 1x4096, 8x4096, 256x1)")
    ap.add_argument("--profile", type=Path, help="gpu: py-spy samples of the server during the CUDA IPC calls, "
                                                 "into this folder (CASE_cuda_ipc.txt, CASE_lean.txt)")
    args = ap.parse_args()
    if args.calls < 200:
        print(f"note: {args.calls} calls per figure; the issue's figures are over >= 200")
    out = run_cpu(args) if args.mode == "cpu" else run_gpu(args)
    out["git"] = os.popen(f"git -C {ROOT} log --oneline -1").read().strip()
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
