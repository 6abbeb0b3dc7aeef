"""Helpers for the Ray Serve tests: the geometry, random KDA inputs and the float64
reference (`kernels.naive_recurrent_kda`)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from kernels import naive_recurrent_kda

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
