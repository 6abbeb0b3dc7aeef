"""What the stage launchers share: one launch's prepared inputs and where its states go.

`StageInputs` holds the contiguous input tensors, head counts and dims, the gate and
transform flags and the product settings; `StateTargets` the pool and the other state
outputs (per-chunk states h, checkpoints). `kernels.triton_backend` builds both once per
call and hands them to each stage's launcher (`intra.launch_intra`, `wy.launch_wy`, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch


@dataclass(frozen=True)
class StageInputs:
    """q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K]; beta: [T, HV] (contiguous, any float
    dtype). a_log [HV] / dt_bias [HV, K] fp32, or any tensor as a placeholder pointer when
    ``has_a_log`` / ``has_dt_bias`` is false. ``mat``: the dtype of the stored operand
    tiles (fp16 for 16-bit inputs, fp32 for fp32 inputs); ``dot_prec``: `tl.dot`'s
    input_precision for fp32 operands; ``fp16_solve``: the solve and T diag(beta) in fp16.
    ``checks``: [1] int32, the launch's input check
    (`kernels.problem.PrefillProblem.input_checks`; None: not checked)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    scale: float
    lower_bound: float
    gate: int
    has_a_log: bool
    has_dt_bias: bool
    l2norm: bool
    beta_sigmoid: bool
    neg_eigval: bool
    dot_prec: str
    mat: torch.dtype
    fp16_solve: bool
    checks: Optional[torch.Tensor] = None

    def check_pointer(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The input check for a kernel's arguments, ``placeholder`` where absent (CHECK keeps it unread)."""
        return placeholder if self.checks is None else self.checks

    @property
    def T(self) -> int:
        return self.q.shape[0]

    @property
    def H(self) -> int:
        return self.q.shape[1]

    @property
    def K(self) -> int:
        return self.q.shape[2]

    @property
    def HV(self) -> int:
        return self.v.shape[1]

    @property
    def V(self) -> int:
        return self.v.shape[2]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def gate_flags(self) -> dict[str, int | bool]:
        """The gate's constexprs (GATE, HAS_A_LOG, HAS_DT_BIAS)."""
        return dict(GATE=self.gate, HAS_A_LOG=self.has_a_log, HAS_DT_BIAS=self.has_dt_bias)

    @property
    def flags(self) -> dict[str, int | bool]:
        """The gate's and the per-token transforms' constexprs."""
        return dict(**self.gate_flags, USE_L2NORM=self.l2norm, BETA_SIGMOID=self.beta_sigmoid,
                    NEG_EIGVAL=self.neg_eigval)


@dataclass(frozen=True)
class StateTargets:
    """Where a launch reads and writes states.

    pool: [S, HV, ., .] fp32 or bf16, read at ``indices`` [N] int64 rows (-1: zeros) and
    written at ``write_indices`` [N] int64 rows (-1: no write; the same tensor as
    ``indices`` when the problem has no `PrefillProblem.write_indices`);
    ``pool_strides``: its (slot, head, key, value) element strides. h: [NT, HV, .., ..]
    fp32, the state before each chunk (None: not kept), with ``h_strides`` (key, value)
    inside one state. ckpt_addrs: [NT] int64, for each chunk (h
    index) the address of the [HV, ., .] state (the pool's dtype) that receives the state
    after it, 0 for none (None: no checkpoints); ``ckpt_strides``: the (head, key, value)
    element strides every such state shares. flags: [N + 1] int32, the launch's non-finite
    flags (`kernels.problem.PrefillProblem.nonfinite`; None: not checked). saved: [N, HV,
    ., .] in the pool's dtype and a row's strides, receiving each row as the decode kernel
    reads it (`PrefillProblem.saved_states`; None: not kept, or copied before the launch).
    """

    pool: torch.Tensor
    indices: torch.Tensor
    write_indices: torch.Tensor
    pool_strides: tuple[int, int, int, int]
    h: Optional[torch.Tensor]
    h_strides: tuple[int, int]
    ckpt_addrs: Optional[torch.Tensor]
    ckpt_strides: tuple[int, int, int]
    flags: Optional[torch.Tensor] = None
    saved: Optional[torch.Tensor] = None

    def with_h(self, h: torch.Tensor, h_strides: tuple[int, int]) -> "StateTargets":
        """The same targets with per-chunk states going to ``h`` (scratch of the split output path)."""
        return replace(self, h=h, h_strides=h_strides)

    def pointers(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, ckpt_addrs) for a kernel's arguments, ``placeholder`` where absent (the
        kernels' STORE_H / CHECKPOINT constexprs keep them unread)."""
        return (placeholder if self.h is None else self.h,
                self.indices if self.ckpt_addrs is None else self.ckpt_addrs)

    def flag_pointer(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The flags for a kernel's arguments, ``placeholder`` where absent (FLAG keeps it unread)."""
        return placeholder if self.flags is None else self.flags
