"""The peers `bench/kernels.py` times kda-serve against, as callables over one case.

- fla-core 0.6.0 `chunk_kda` (safe_gate, gate, l2norm and beta sigmoid in kernel,
  state_v_first; run with FLA_FLASH_KDA=0 so that it is fla's own Triton path). It has no
  indexed pool: "pre-gathered" times the call alone on states gathered before the timed
  region (as the issue tables quote it); "gather/scatter" adds what a serving engine adds
  around it (index_select of the pool rows, index_copy_ of the final states). Decode:
  `fused_recurrent_kda_fwd` in its own in-place indexed form (ssm_state_indices).
- FlashKDA (MoonshotAI/FlashKDA, prebuilt for the H200 machine, carried in `.peers/`):
  `flash_kda.fwd`, bf16 inputs, K = V = 128, lower-bound gate only; no indexed pool either,
  so the same two forms.

A case is the dict of `bench.kernels.make_case`. Each function returns a zero-argument
callable (or None where the peer cannot run the case) that returns o.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

LOWER_BOUND = -5.0
Fn = Callable[[], torch.Tensor]


def _fla_gate(c: dict) -> dict:
    return dict(A_log=c["A_log"], dt_bias=c["dt_bias"].reshape(-1), lower_bound=LOWER_BOUND)


def fla_decode(c: dict, pool: torch.Tensor) -> Fn:
    """fla's fused_recurrent in place on ``pool`` rows (1-token sequences only)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def run() -> torch.Tensor:
        return fused_recurrent_kda_fwd(
            c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=pool, inplace_final_state=True,
            state_v_first=True, cu_seqlens=c["cu"], ssm_state_indices=c["idx"], use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **_fla_gate(c))[0]
    return run


def fla_prefill(c: dict, pool: torch.Tensor, gather: bool) -> Fn:
    """fla-core chunk_kda on ``pool``'s rows ``c['idx']``: with ``gather``, the gather and
    scatter inside the call; else on rows gathered once, outside (final states discarded)."""
    from fla.ops.kda import chunk_kda

    cu_cpu = c["cu"].cpu()
    h0_fixed = pool.index_select(0, c["idx"])

    def run() -> torch.Tensor:
        h0 = pool.index_select(0, c["idx"]) if gather else h0_fixed
        o, ht = chunk_kda(
            c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, state_v_first=True, cu_seqlens=c["cu"], cu_seqlens_cpu=cu_cpu, **_fla_gate(c))
        if gather:
            pool.index_copy_(0, c["idx"], ht)
        return o
    return run


def flash_kda_available() -> Optional[str]:
    """None when flash_kda imports, else why not."""
    try:
        import flash_kda  # noqa: F401
    except Exception as e:  # a missing or mismatched build: any import failure
        return repr(e)
    return None


def flash_kda_prefill(c: dict, pool: torch.Tensor, gather: bool) -> Optional[Fn]:
    """FlashKDA on ``pool``'s rows, as `fla_prefill`; None where it cannot run the case
    (not bf16, K or V not 128)."""
    if c["q"].dtype != torch.bfloat16 or c["q"].shape[-1] != 128 or c["v"].shape[-1] != 128:
        return None
    import flash_kda

    h0_fixed = pool.index_select(0, c["idx"])
    out = torch.empty_like(c["v"])
    final = torch.empty_like(h0_fixed)
    scale = c["q"].shape[-1] ** -0.5

    def run() -> torch.Tensor:
        h0 = pool.index_select(0, c["idx"]) if gather else h0_fixed
        flash_kda.fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], scale, out, c["A_log"], c["dt_bias"], LOWER_BOUND,
                      initial_state=h0, final_state=final, cu_seqlens=c["cu"])
        if gather:
            pool.index_copy_(0, c["idx"], final)
        return out
    return run
