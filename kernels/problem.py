"""The validated, backend-neutral description of one prefill launch.

`kernels.api` turns the public arguments into a `PrefillProblem`; every backend takes one
and returns outputs, writing final states into the pool in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

CHUNK_SIZE = 64
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class PrefillProblem:
    """One varlen launch over packed sequences.

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (raw when a gate is fused, else the log
    decay); beta: [T, HV]. Inputs may be fp32, bf16 or fp16; arithmetic is fp32.
    cu_seqlens: [N + 1] int64 on the inputs' device; ``bounds`` holds the same on the host.
    pool: [S, HV, V, K] (``state_v_first``) or [S, HV, K, V], fp32 or bf16, updated in place.
    indices: [N] int64 on the device: sequence n reads and writes ``pool[indices[n]]``;
    -1 means a zero initial state and no write-back.
    A_log: [HV] or None; dt_bias: [HV, K] or None; lower_bound: float or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor
    bounds: tuple[int, ...]
    pool: torch.Tensor
    indices: torch.Tensor
    state_v_first: bool
    scale: float
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    lower_bound: Optional[float]
    use_qk_l2norm: bool
    use_beta_sigmoid: bool
    allow_neg_eigval: bool
    output_intermediate_states: bool

    @property
    def num_sequences(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    @property
    def num_chunks(self) -> int:
        """NT: chunks over all sequences, ceil(length / 64) each (a 1-token sequence is one)."""
        return sum((n + CHUNK_SIZE - 1) // CHUNK_SIZE for n in self.lengths)

    @property
    def gate_fused(self) -> bool:
        return self.A_log is not None or self.lower_bound is not None


# A backend runs a problem: returns o [T, HV, V] in v's dtype and, when
# output_intermediate_states, h [NT, HV, V, K] (or [NT, HV, K, V]) in fp32: the state
# before each chunk; final states are written into pool rows in place.
Backend = Callable[[PrefillProblem], tuple[torch.Tensor, Optional[torch.Tensor]]]
