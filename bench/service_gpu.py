"""End-to-end check of the service on a GPU: a real `kda-serve` process on CUDA with the
Triton backend, driven over loopback by `service.client.KDAClient` (binary transport).

Serving config of TARGETS.md (bf16, H = HV = 32, K = V = 128, lower_bound gate, q/k
l2norm, beta sigmoid). For each batch shape: the service's outputs and final states
against a direct in-process `chunk_kda` call on the same inputs (relative L2), and the
wall time per request next to the server's own kernel time (Server-Timing), so the share
of HTTP and transfer in a request shows.

    python bench/service_gpu.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.server_process import start_server  # noqa: E402
from kernels import chunk_kda  # noqa: E402
from kda_client.client import KDAClient  # noqa: E402

H, K = 32, 128
CASES = [(1, 4096), (8, 512), (64, 128), (4, 4096)]


def server_args(slots: int) -> list[str]:
    return ["--device", "cuda", "--backend", "triton", "--num-layers", "1", "--num-slots", str(slots),
            "--num-heads", str(H), "--head-dim", str(K), "--max-body-mb", "2048"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    server = start_server(server_args(max(n for n, _ in CASES) * (args.repeats + 1)), Path("kda-serve-gpu.log"))
    gen = torch.Generator().manual_seed(0)
    A_log, dt_bias = torch.rand(H, generator=gen), torch.randn(H, K, generator=gen)
    opts = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_qk_l2norm=True, use_beta_sigmoid=True)
    print(f"{'case':>10} {'MB in':>7} {'wall ms':>8} {'kernel ms':>9} {'MB/s':>7} {'rel o':>9} {'rel state':>9}")
    try:
        with KDAClient(server.url, timeout=300) as client:
            for n, length in CASES:
                seqs = []
                for _ in range(n):
                    q, k = (torch.randn(length, H, K, generator=gen).bfloat16() for _ in range(2))
                    v, g = (torch.randn(length, H, K, generator=gen).bfloat16() for _ in range(2))
                    beta = torch.randn(length, H, generator=gen).bfloat16()
                    seqs.append((None, q, k, v, g, beta))
                walls, kernel = [], []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = client.prefill(0, seqs, **opts)
                    walls.append(time.perf_counter() - t0)
                    kernel.append(out.server_timing.get("kernel", float("nan")))
                # the same inputs in process, from zero states
                packed = [torch.cat([s[i] for s in seqs]).cuda()[None] for i in range(1, 6)]
                pool = torch.zeros(n, H, K, K, device="cuda")
                cu = torch.tensor([i * length for i in range(n + 1)], device="cuda")
                o_ref = chunk_kda(*packed, initial_state=pool, initial_state_indices=torch.arange(n, device="cuda"),
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu, A_log=A_log.cuda(),
                                  dt_bias=dt_bias.cuda(), lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
                mb = sum(t.numel() * t.element_size() for s in seqs for t in s[1:]) / 1e6
                best = min(walls)
                print(f"{n:>4}x{length:<5} {mb:7.1f} {best * 1e3:8.2f} {min(kernel):9.3f} {mb / best:7.0f} "
                      f"{rel(out.o_packed.cuda(), o_ref[0]):9.2e} {rel(out.final_state.cuda(), pool):9.2e}")
    finally:
        print(f"kda-serve exit status on SIGTERM: {server.stop()}")


if __name__ == "__main__":
    main()
