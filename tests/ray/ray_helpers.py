"""Helpers for the Ray Serve tests: the geometry, random KDA inputs, the float64 reference
(`kernels.naive_recurrent_kda`) and `Cluster`, the handle on the running application.
(Not in conftest.py: test modules import these, and ``conftest`` names another folder's
module when several folders are collected together.)"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
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
