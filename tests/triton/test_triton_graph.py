"""A decode step through the public `chunk_kda` captured in a CUDA graph (as engines run
decode) and replayed equals the eager step bit for bit, pool included (skipped without CUDA).

With ``cu_seqlens`` and ``cu_seqlens_cpu`` both given nothing inside `chunk_kda` reads the
device back, so the capture succeeds; its launch tables are cached by one eager call first.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import chunk_kda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
N, SLOTS, HV, K, V = 256, 300, 32, 128, 128  # the decode step: 256 sequences of one token


def decode_inputs(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """q, k, v, raw g, beta logits of one token per sequence, [1, N, ...] bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    return dict(q=randn(1, N, HV, K), k=randn(1, N, HV, K), v=randn(1, N, HV, V), g=randn(1, N, HV, K),
                beta=randn(1, N, HV))


def test_a_decode_step_captured_in_a_cuda_graph_replays_as_the_eager_step() -> None:
    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(0)
    pool0 = torch.randn(SLOTS, HV, V, K, generator=gen, device=device) * 0.1
    indices = torch.randperm(SLOTS, generator=gen, device=device)[:N]
    cu_cpu = torch.arange(N + 1, dtype=torch.int64)
    options = dict(initial_state_indices=indices, cu_seqlens=cu_cpu.to(device), cu_seqlens_cpu=cu_cpu,
                   use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
                   A_log=torch.rand(HV, generator=gen, device=device),
                   dt_bias=F.normalize(torch.randn(HV * K, generator=gen, device=device), dim=0),
                   backend="triton")
    static = decode_inputs(1, device)

    def step(pool: torch.Tensor) -> torch.Tensor:
        return chunk_kda(static["q"], static["k"], static["v"], static["g"], static["beta"], initial_state=pool,
                         **options)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile, autotune and cache the launch tables before capturing
        for _ in range(2):
            step(pool0.clone())
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    captured_pool = pool0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step(captured_pool)
    eager_pool = pool0.clone()
    for seed in (1, 2, 3):  # three steps: each replay continues from the states the last one wrote
        fresh = decode_inputs(seed, device)
        for name, t in fresh.items():
            static[name].copy_(t)
        graph.replay()
        o_eager = step(eager_pool)
        torch.cuda.synchronize(device)
        assert torch.equal(o_static, o_eager), f"step {seed}: o differs"
        assert torch.equal(captured_pool, eager_pool), f"step {seed}: the pool differs"
    assert not torch.equal(eager_pool, pool0)  # the steps wrote the named rows
    rest = torch.ones(SLOTS, dtype=torch.bool, device=device)
    rest[indices] = False
    assert torch.equal(captured_pool[rest], pool0[rest])  # and no other row
