"""The harness every HTTP test folder shares (service, kserve, transport, reliability): a real `kda-serve` process, random KDA inputs, the
float64 reference, and an image of the pool to prove a rejected request changed nothing."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import httpx
import pytest
import torch
import torch.nn.functional as F
import uvicorn

from kernels import naive_recurrent_kda

ROOT = Path(__file__).resolve().parents[1]

# The geometry every test server uses: K != V and H < HV catch transposes and GVA slips.
LAYERS, SLOTS, HV, H, K, V = 2, 256, 4, 2, 16, 32
GEOMETRY_ARGS = ["--num-layers", str(LAYERS), "--num-slots", str(SLOTS), "--num-heads", str(HV),
                 "--head-dim", str(K), "--head-v-dim", str(V)]
TOL = 1e-4  # relative L2 against float64, fp32 inputs
MAX_BODY_MB = 1  # the shared server's body limit: small, so the 413 tests send little


def server_python_path() -> str:
    """A server process's PYTHONPATH: the repository first, then whatever the caller's path
    holds (e.g. wheels carried to the GPU machine, installed beside the image's packages)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


@contextmanager
def uvicorn_in_thread(app: Callable, http: type, *, lifespan: str = "auto", timeout_keep_alive: int = 5
                      ) -> Iterator[str]:
    """``app`` served by uvicorn with the HTTP protocol class ``http`` on a free loopback
    port, in a thread of this process: its URL while the block runs, stopped after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, loop="auto",
                                           lifespan=lifespan, log_level="warning",
                                           timeout_keep_alive=timeout_keep_alive))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running ``python -m service.cli`` process and its log; ``grpc``: the address of its
    KServe v2 gRPC endpoint (``127.0.0.1:port``), when started with one."""

    url: str
    process: subprocess.Popen
    log: Path
    grpc: Optional[str] = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful: drain, snapshot) and the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(args: Sequence[str], log: Path, env: Optional[dict[str, str]] = None,
                 timeout: float = 90.0, grpc: bool = False,
                 entry: Sequence[str] = ("-m", "service.cli")) -> Server:
    """Start kda-serve on a free loopback port (and, with ``grpc``, its gRPC endpoint on
    another: ``--grpc-port``) and wait until /health/ready says 200 (gRPC listens by then).
    ``entry``: what the interpreter runs (a script that sets up the process, then calls
    `service.cli.main`)."""
    port = free_port()
    grpc_args = ["--grpc-port", str(free_port())] if grpc else []
    full_env = {**os.environ, "PYTHONPATH": server_python_path(), **(env or {})}
    out = open(log, "wb")
    process = subprocess.Popen(
        [sys.executable, *entry, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
         *grpc_args, *args],
        cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
    )
    out.close()
    server = Server(f"http://127.0.0.1:{port}", process, log, f"127.0.0.1:{grpc_args[1]}" if grpc else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kda-serve exited with {process.returncode}:\n{server.log_text()}")
        try:
            if httpx.get(f"{server.url}/health/ready", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"kda-serve not ready after {timeout}s:\n{server.log_text()}")


def kill_9(server: Server) -> None:
    """SIGKILL the server process (no shutdown, no snapshot) and reap it."""
    server.process.send_signal(signal.SIGKILL)
    assert server.process.wait(30) == -signal.SIGKILL


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, period: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def make_sequence(T: int, gen: torch.Generator, *, heads: int = H, raw_gate: bool = False,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Random (q, k, v, g, beta) for T tokens: never zero; g a log decay in (-inf, 0)
    (softplus-shaped) unless ``raw_gate``; beta in (0, 1)."""
    q = torch.randn(T, heads, K, generator=gen)
    k = torch.randn(T, heads, K, generator=gen) / K ** 0.5
    v = torch.randn(T, HV, V, generator=gen)
    g_raw = torch.randn(T, HV, K, generator=gen)
    g = g_raw if raw_gate else -F.softplus(g_raw - 2.0)
    beta = torch.rand(T, HV, generator=gen) * 0.9 + 0.05
    return tuple(t.to(dtype) for t in (q, k, v, g, beta))


def random_state(gen: torch.Generator, n: int = 1) -> torch.Tensor:
    """n random slot states [n, L, HV, V, K] of moderate size (fp32)."""
    return torch.randn(n, LAYERS, HV, V, K, generator=gen) * 0.3


def make_victims(url: str, gen: torch.Generator, layer: int) -> list[str]:
    """Four new slots: three live with random states (the first advanced 5 tokens on
    ``layer``, so token counts are recorded too), the fourth freed again (a freed id must be
    refused like an unknown one)."""
    from kda_client.client import KDAClient

    with KDAClient(url) as c:
        slots = c.alloc(4)
        for slot, state in zip(slots, random_state(gen, 4)):
            c.put_state(slot, state)
        c.prefill(layer, [(slots[0], *make_sequence(5, gen))])
        c.free(slots[3])
    return slots


def reference(seqs: Sequence[tuple[torch.Tensor, ...]], initial: Optional[torch.Tensor] = None,
              **options) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-token reference over packed ``seqs``: (o [T, HV, V], final [N, HV, V, K])."""
    packed = [torch.cat([s[i] for s in seqs]) for i in range(5)]
    bounds = [0]
    for s in seqs:
        bounds.append(bounds[-1] + s[0].shape[0])
    return naive_recurrent_kda(*packed, initial_state=initial, cu_seqlens=bounds, **options)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against the reference ``b``."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def pool_image(url: str, slots: Sequence[str], headers: Optional[dict[str, str]] = None) -> dict[str, object]:
    """What a rejected request must not change: each slot's exported bytes (state and token
    counts), and the free-slot count (no slot allocated or freed)."""
    with httpx.Client(base_url=url, headers=headers or {}) as http:
        image: dict[str, object] = {s: http.get(f"/slots/{s}/state").content for s in slots}
        image["free_slots"] = http.get("/info").json()["free_slots"]
    return image


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        sample_name, _, rest = sample.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample_name == name and got == want:
            return float(value)
    return 0.0


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The float64 reference runs thousands of tiny ops: one thread, not a pool spinning
    against the server process on a 2-core machine. Restored afterwards, so tests in other
    folders keep their threads. Conftests that import this get it for their folder."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
