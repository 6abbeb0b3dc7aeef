"""Shared memory of every kernel launch the Triton backend makes in the serving setup,
compiled for an H100/H200 (sm_90) on this machine: no GPU needed, Triton's own ptxas.

Run as a script (``python tests/triton/sm90_shared_memory.py [K ...]``) in a process where
TRITON_INTERPRET is unset (the Triton tests' conftest interprets the kernels in its own
process); prints one JSON object per launch: kernel, operand dtype, head dim, the launch
config (``stages`` as the config gives it, ``launched_stages`` after the state pass's step
down when that many do not fit), and ``shared`` (bytes, as launched). A launch asking for more than the 227 KB a Hopper block
may take fails on the GPU with OutOfResources, before it runs (H200, 2026-12-01: fp32
inputs at K = 128 asked the state pass for 256 KB with 3 pipeline stages).

The launches are those of `kernels.triton_backend.run_triton` for one lower_bound-gated
batch (A_log, dt_bias, q/k l2norm, beta sigmoid), narrow (one sequence) and wide (many
sequence-heads), with o from the state pass and from the output kernel.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_kernels import (  # noqa: E402
    chunk_intra_kernel, chunk_output_kernel, chunk_state_kernel, chunk_wy_kernel, recurrent_step_kernel,
)
from kernels.triton_kernels.config import WIDE_STATE_MIN_SEQ_HEADS, select_config, state_launch  # noqa: E402
from kernels.triton_kernels.gate import GATE_LOWER_BOUND, LOG_DECAY_FLOOR  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED = 232448  # bytes of shared memory one block may take on sm_90 (227 KB)
HEADS = 32
INT_ARGS = {"scale": "fp32", "lower_bound": "fp32", "s_slot": "i64", "s_head": "i64", "s_pv": "i64", "s_hv": "i64",
            "c_head": "i64", "c_v": "i64", "s_saved": "i64"}
# Strides that are 1 in the serving layout (a V-first pool, K contiguous, as are h and the
# checkpoint targets): Triton specializes an integer argument equal to 1 as a constant, so
# the launches compile with these as constants.
ONE_ARGS = ("s_pk", "s_hk", "c_k")


def shared_bytes(fn: triton.JITFunction, pointers: dict[str, str], constants: dict, num_warps: int,
                 num_stages: int) -> int:
    """Compile ``fn`` for sm_90 with ``constants`` (its constexprs) and pointer element types
    ``pointers`` (others fp32, 16-byte aligned); the shared memory it asks for."""
    params = fn.arg_names
    constants = {**{p: 1 for p in ONE_ARGS if p in params}, **constants}
    signature = {p: "constexpr" if p in constants else INT_ARGS.get(p) or "*" + pointers.get(p, "fp32")
                 for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature[p].startswith("*")}
    source = ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in constants.items()}, attrs=aligned)
    compiled = triton.compile(source, target=SM90, options=dict(num_warps=num_warps, num_stages=num_stages))
    return int(compiled.metadata.shared)


def launches(K: int, fp32_inputs: bool) -> Iterator[tuple[str, dict, triton.JITFunction, dict, dict, int, int]]:
    """(kernel name, launch description, kernel, pointer dtypes, constexprs, warps, stages) of
    each launch `run_triton` makes for head dims K = V in the serving setup."""
    V = K
    cfg = select_config(K, V, interpret=False)
    inp = "fp32" if fp32_inputs else "bf16"
    mat = "fp32" if fp32_inputs else "fp16"
    dot_prec = cfg.fp32_products if fp32_inputs else "tf32"
    fp16_solve = not fp32_inputs and cfg.fp16_solve
    flags = dict(GATE=GATE_LOWER_BOUND, HAS_A_LOG=True, HAS_DT_BIAS=True, USE_L2NORM=True, BETA_SIGMOID=True,
                 NEG_EIGVAL=False)
    io = dict(q=inp, k=inp, v=inp, g=inp, beta=inp, o=inp)
    bk = max(16, triton.next_power_of_2(K))
    yield ("intra", {}, chunk_intra_kernel,
           {**io, "tb": "fp16" if fp16_solve else "fp32", "aqk": mat, "chunks": "i64"},
           dict(H=HEADS, HV=HEADS, K=K, BK=cfg.intra_bk, BKD=cfg.intra_bkd, **flags, SAFE=True, DOT_PREC=dot_prec,
                FLOOR=LOG_DECAY_FLOOR, FP16_SOLVE=fp16_solve, DIAG16=cfg.solve_diag16, FACTORED=cfg.factored_a),
           cfg.intra_warps, cfg.intra_stages)
    yield ("wy", {}, chunk_wy_kernel,
           {**io, "tb": "fp16" if fp16_solve else "fp32", "w": mat, "kg": mat, "qg": mat, "chunks": "i64"},
           dict(H=HEADS, HV=HEADS, K=K, V=V, BK=cfg.wy_bk, BV=cfg.wy_bv, GATE=GATE_LOWER_BOUND, HAS_A_LOG=True,
                HAS_DT_BIAS=True, DOT_PREC=dot_prec, FLOOR=LOG_DECAY_FLOOR, BLOCK_SCAN=cfg.wy_block_scan),
           cfg.wy_warps, cfg.wy_stages)
    state_ptrs = {**io, "w": mat, "kg": mat, "qg": mat, "aqk": mat, "indices": "i64", "write_indices": "i64",
                  "segs": "i64", "ckpt_addrs": "i64"}
    for seq_heads in (HEADS, WIDE_STATE_MIN_SEQ_HEADS):
        for fuse, ckpt, at_end in ((True, False, False), (True, True, False), (True, True, True), (False, True, False),
                                   (False, True, True)):
            bv, warps, stages = state_launch(cfg, seq_heads, K, V, 4 if fp32_inputs else 2)
            yield ("state", {"seq_heads": seq_heads, "fused_output": fuse, "checkpoints": ckpt, "at_end": at_end},
                   chunk_state_kernel,
                   state_ptrs, dict(HV=HEADS, K=K, V=V, BK=bk, BV=bv, FUSE_OUT=fuse, STORE_H=not fuse,
                                    CHECKPOINT=ckpt, FLAG=True, DOT_PREC=dot_prec,
                                    CKPT_PREFETCH=ckpt and cfg.state_ckpt_prefetch and not at_end,
                                    CKPT_AT_END=at_end),
                   warps, stages)
    yield ("output", {}, chunk_output_kernel, {"qg": mat, "aqk": mat, "o": inp, "chunks": "i64"},
           dict(HV=HEADS, K=K, V=V, BK=cfg.out_bk, BV=cfg.out_bv, DOT_PREC=dot_prec), cfg.out_warps, cfg.out_stages)
    yield ("recurrent", {}, recurrent_step_kernel,
           {**io, "indices": "i64", "write_indices": "i64", "decs": "i64", "ckpt_addrs": "i64"},
           dict(H=HEADS, HV=HEADS, K=K, V=V, BK=bk, BV=cfg.rec_bv, **flags, STORE_H=False, CHECKPOINT=True, FLAG=True,
                SAVE=True),
           cfg.rec_warps, 3)


def fitted(fn: triton.JITFunction, pointers: dict[str, str], constants: dict, num_warps: int, num_stages: int,
           falls_back: bool) -> tuple[int, int]:
    """(stages, shared bytes) the launch runs with: ``num_stages``, or, for a launcher that
    steps down when a variant does not fit (the state pass, `state.launch_fitting`), the
    most stages up to that which fit."""
    shared = shared_bytes(fn, pointers, constants, num_warps, num_stages)
    while falls_back and shared > SM90_MAX_SHARED and num_stages > 1:
        num_stages -= 1
        shared = shared_bytes(fn, pointers, constants, num_warps, num_stages)
    return num_stages, shared


def main(head_dims: list[int]) -> None:
    for K in head_dims:
        for fp32_inputs in (False, True):
            for name, launch, fn, pointers, constants, warps, stages in launches(K, fp32_inputs):
                ran, shared = fitted(fn, pointers, constants, warps, stages, falls_back=name == "state")
                print(json.dumps(dict(kernel=name, inputs="fp32" if fp32_inputs else "bf16", K=K, **launch,
                                      warps=warps, stages=stages, launched_stages=ran, shared=shared)), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 128, 256])
