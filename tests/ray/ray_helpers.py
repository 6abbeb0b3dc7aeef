"""Helpers for the Ray Serve tests: the geometry, random KDA inputs, the float64 reference
(`kernels.naive_recurrent_kda`) and `Cluster`, the handle on the running application.
(Not in conftest.py: test modules import these, and ``conftest`` names another folder's
module when several folders are collected together.)"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

import httpx
import torch
import torch.nn.functional as F

from kernels import naive_recurrent_kda
from service.config import Settings
from service.ray_serve.config import ScaleOut

# K != V and H < HV catch transposes and GVA slips.
LAYERS, HV, H, K, V = 2, 4, 2, 16, 32
TOL = 1e-4  # relative L2 against float64, fp32 inputs


def make_sequence(T: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random fp32 (q, k, v, g, beta) for T tokens: g a log decay < 0, beta in (0, 1)."""
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen) / K ** 0.5
    v = torch.randn(T, HV, V, generator=gen)
    g = -F.softplus(torch.randn(T, HV, K, generator=gen) - 2.0)
    beta = torch.rand(T, HV, generator=gen) * 0.9 + 0.05
    return q, k, v, g, beta


def reference(seqs: Sequence[tuple[torch.Tensor, ...]],
              initial: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-token reference over packed ``seqs``: (o [T, HV, V], final [N, HV, V, K])."""
    packed = [torch.cat([s[i] for s in seqs]) for i in range(5)]
    bounds = [0]
    for s in seqs:
        bounds.append(bounds[-1] + s[0].shape[0])
    return naive_recurrent_kda(*packed, initial_state=initial, cu_seqlens=bounds)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against the reference ``b``."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def shard_of(slot_id: str) -> str:
    return slot_id.split(".")[0]


ROOT = Path(__file__).resolve().parents[2]
SHARD_SLOTS = 16
MAX_BODY_MB = 1
APP = "kda-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """The running application: its URL, settings and the two shard names."""

    url: str
    settings: Settings
    scale_out: ScaleOut

    @property
    def shards(self) -> list[str]:
        return self.scale_out.shard_names

    def kill(self, deployment: str) -> None:
        """Kill every replica of ``deployment`` the hard way (no graceful stop); Serve
        starts new ones."""
        import ray

        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "serve" and f"#{deployment}#" in a["name"]]
        assert names, f"no replica of {deployment!r}"
        for name in names:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until the ingress answers and every shard is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/shards", timeout=10)
                if r.status_code == 200 and all(row["up"] for row in r.json()["shards"]):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the application did not become ready")


RAY_START_ATTEMPTS = 3
RAY_LOGS = Path("/tmp/ray/session_latest/logs")  # where ray.init's default temp dir keeps them
_RAY_LOG_FILES = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")


def start_local_ray(ray: ModuleType, num_cpus: int, env_vars: dict[str, str]) -> None:
    """``ray.init`` a one-node cluster on 127.0.0.1 (no dashboard, a 256 MiB object store),
    trying up to RAY_START_ATTEMPTS times.

    Ray 2.60 gives its raylet a fixed 30 s to register with the GCS and raises otherwise,
    leaving the processes it started running (it never records the node, so
    ``ray.shutdown`` cannot stop them); on a loaded 2-core CI machine that wait ran out
    once. Each failed attempt's processes are killed before the next; when every attempt
    fails, the error carries the top CPU users and the tails of the raylet's and GCS's logs."""
    failures = []
    for _ in range(RAY_START_ATTEMPTS):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False, object_store_memory=256 * 2**20, runtime_env={"env_vars": env_vars})
            return
        except Exception as e:  # Ray raises a bare Exception for the timeout
            failures.append(f"{type(e).__name__}: {e}\n{_ray_start_diagnostics()}")
            ray.shutdown()
            _kill_ray_children()
    raise RuntimeError(f"Ray did not start in {RAY_START_ATTEMPTS} attempts:\n" + "\n".join(failures))


def _kill_ray_children() -> None:
    """SIGKILL this process's descendants that run Ray's own binaries or modules (a failed
    ``ray.init`` leaves its GCS, raylet and agents running), read from /proc (Linux; a
    no-op elsewhere), and wait up to 10 s for them to go."""
    proc = Path("/proc")
    parents: dict[int, int] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    ours, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - ours
        ours |= frontier
    doomed = []
    for pid in ours:
        try:
            if b"/ray/" in (proc / str(pid) / "cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                doomed.append(pid)
        except OSError:
            pass  # gone meanwhile
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(_running, doomed)):
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: a killed child of ours is reaped here, and a zombie
    (state Z) counts as gone."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child: its own parent reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _ray_start_diagnostics() -> str:
    """The machine's top CPU users (``ps``, where it exists) and the last lines of the
    raylet's and GCS's logs."""
    try:
        lines = subprocess.run(["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True,
                               text=True, timeout=10).stdout.splitlines()[:9]
    except (OSError, subprocess.SubprocessError) as e:
        lines = [f"ps: {e}"]
    lines = [f"  {line[:200]}" for line in lines]
    for name in _RAY_LOG_FILES:
        path = RAY_LOGS / name
        if path.is_file():
            tail = path.read_text(errors="replace").splitlines()[-15:]
            lines += [f"--- {path}"] + [f"  {line[:200]}" for line in tail]
    return "\n".join(lines)
