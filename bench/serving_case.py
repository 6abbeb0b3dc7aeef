"""The serving configuration the benches time (as bench/kernels.py): bf16 q/k/v/g/beta,
K = V = 128, gate ``lower_bound = -5`` with A_log/dt_bias, q/k L2 norm and beta sigmoid in
kernel, varlen bounds, an fp32 pool [S, HV, V, K] written in place; and the server's kernel
call on it (`ServerCore._launch`: a `packed_problem` run by `kernels.run_problem`)."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

import kernels
from kernels.problem import packed_problem
from kernels.triton_backend import run_triton
from kernels.triton_kernels import LaunchConfig

K = V = 128
LOWER_BOUND = -5.0


def make_case(n_seq: int, length: int, heads: int, device: torch.device, spare_rows: int = 8) -> dict:
    """``n_seq`` sequences of ``length`` tokens and ``heads`` heads (fixed seed): inputs
    [T, H, .] packed, host ``bounds``, a scratch pool of n_seq + ``spare_rows`` rows and the
    [n_seq] rows ``idx`` the sequences use, their ``lengths``."""
    gen = torch.Generator(device=device).manual_seed(0)
    T = n_seq * length

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    rows = n_seq + spare_rows
    return dict(
        q=randn(T, heads, K), k=randn(T, heads, K), v=randn(T, heads, V), g=randn(T, heads, K),
        beta=randn(T, heads), A_log=torch.rand(heads, generator=gen, device=device),
        dt_bias=2.0 * randn(heads, K, dtype=torch.float32) - 3.0,
        bounds=list(range(0, T + 1, length)),
        pool=0.1 * randn(rows, heads, V, K, dtype=torch.float32),
        idx=torch.randperm(rows, generator=gen, device=device)[:n_seq],
        lengths=[length] * n_seq,
    )


def problem_of(c: dict, nonfinite: Optional[torch.Tensor] = None, checkpoint_tokens: tuple[int, ...] = (),
               checkpoint_states: Sequence[torch.Tensor] = (), saved_states: Optional[torch.Tensor] = None,
               input_checks: Optional[torch.Tensor] = None, o_out: Optional[torch.Tensor] = None,
               write_indices: Optional[torch.Tensor] = None) -> kernels.PrefillProblem:
    """The server's problem for case ``c`` (in place on its scratch pool, or writing to the
    rows ``write_indices``), with the non-finite flags, checkpoints (their targets: a
    [C, HV, V, K] tensor or C states [HV, V, K]), the rows' copy (``saved_states``), the
    input check and o's destination given (none by default)."""
    return packed_problem(
        c["q"], c["k"], c["v"], c["g"], c["beta"], bounds=c["bounds"], pool=c["pool"], indices=c["idx"],
        scale=None, A_log=c["A_log"], dt_bias=c["dt_bias"], lower_bound=LOWER_BOUND, use_qk_l2norm=True,
        use_beta_sigmoid=True, allow_neg_eigval=False, nonfinite=nonfinite,
        checkpoint_tokens=checkpoint_tokens, checkpoint_states=checkpoint_states, saved_states=saved_states,
        input_checks=input_checks, o_out=o_out, write_indices=write_indices,
    )


def launch(c: dict, backend: str, nonfinite: Optional[torch.Tensor] = None, checkpoint_tokens: tuple[int, ...] = (),
           checkpoint_states: Sequence[torch.Tensor] = (), config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """The server's kernel call on case ``c`` (`problem_of`, built in the call); o [T, HV, V].
    ``config``: a Triton launch config in place of the shape-chosen one (variants of a bench)."""
    problem = problem_of(c, nonfinite, checkpoint_tokens, checkpoint_states)
    if config is not None:
        return run_triton(problem, config)[0]
    return kernels.run_problem(problem, backend)[0]


def event_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call's time: CUDA events around it on a GPU (the host's launch gaps included),
    wall time on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)
