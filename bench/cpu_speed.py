"""CPU speed of the torch chunked backend against the float32 per-token reference.

One 4096-token sequence, H=4, K=V=128, the serving options (lower-bound gate, q/k l2norm,
beta sigmoid), initial state from a pool and written back. Both are timed in the same
process, interleaved, so machine noise hits both alike; the ratio of the best times is
the figure (goal: >= 5x).

    python bench/cpu_speed.py [--tokens 4096] [--heads 4] [--dim 128] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

# The repository before bench/ on the path: bench/kernels.py would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import chunk_kda, naive_recurrent_kda  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    T, H, D = args.tokens, args.heads, args.dim

    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, T, H, D, generator=gen) for _ in range(4))
    beta = torch.randn(1, T, H, generator=gen)
    A_log, dt_bias = torch.rand(H, generator=gen), torch.randn(H, D, generator=gen)
    init = torch.randn(1, H, D, D, generator=gen) * 0.1
    opts = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        pool = init.clone()
        o = chunk_kda(q, k, v, g, beta, initial_state=pool, initial_state_indices=torch.tensor([0]),
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, backend="torch", **opts)
        return o[0], pool

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return naive_recurrent_kda(q[0], k[0], v[0], g[0], beta[0], initial_state=init, use_qk_l2norm=True,
                                   use_beta_sigmoid=True, dtype=torch.float32, **opts)

    chunked()  # warm-up
    times: dict[str, list[float]] = {"chunked": [], "reference": []}
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name, fn in (("chunked", chunked), ("reference", reference)):
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)

    (o_c, s_c), (o_r, s_r) = outputs["chunked"], outputs["reference"]
    err_o = float((o_c - o_r).norm() / o_r.norm())
    err_s = float((s_c - s_r).norm() / s_r.norm())
    best = {n: min(t) for n, t in times.items()}
    print(f"T={T} H={H} K=V={D} torch threads={torch.get_num_threads()} repeats={args.repeats}")
    for name, ts in times.items():
        print(f"  {name:9s} best {best[name] * 1e3:8.1f} ms   median {statistics.median(ts) * 1e3:8.1f} ms")
    print(f"  speed-up (best/best): {best['reference'] / best['chunked']:.2f}x")
    print(f"  rel L2 chunked vs reference: o {err_o:.2e}, final state {err_s:.2e}")


if __name__ == "__main__":
    main()
