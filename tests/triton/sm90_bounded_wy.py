"""Registers, spills, shared memory and instructions a warp of the bounded gate's WY kernel
(`wy_bounded`) and of `wy`, compiled for an H100/H200 (sm_90) on this machine: no GPU
needed, Triton's own ptxas and cuobjdump.

Run as a script (``python tests/triton/sm90_bounded_wy.py [K ...]``) in a process where
TRITON_INTERPRET is unset; prints one JSON object per head dim K = V: for the launch
`wy_bounded.launch_wy_bounded` makes in the serving setup (bf16, H = HV = 32, the config's
slices and register cap) ``registers`` (a thread), ``stack`` (bytes of stack frame and
local memory, where ptxas puts spilled registers), ``spill_ops`` (LDL/STL instructions),
``shared`` (bytes), ``sass`` (static instructions), ``loops`` (the static length of each
loop body, in code order: key slices, then value blocks when there are two or more) and
``per_warp`` (instructions a warp issues per program: static plus each loop body once
more per extra trip); ``wy_per_warp`` and ``wy_registers``: the same of `wy.launch_wy`'s.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_kernels.config import select_config  # noqa: E402
from kernels.triton_kernels.wy import chunk_wy_kernel  # noqa: E402
from kernels.triton_kernels.wy_bounded import chunk_wy_bounded_kernel  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
POINTERS = dict(q="bf16", k="bf16", v="bf16", g="bf16", tb="fp16", w="fp16", kg="fp16", qg="fp16", chunks="i64")


def compile_stats(fn: triton.JITFunction, constants: dict, trips: list[int], num_stages: int,
                  maxnreg: int) -> dict[str, object]:
    """Figures of ``fn`` compiled with ``constants`` for sm_90 (4 warps); ``trips``: the
    trip count of each loop, in code order."""
    params = fn.arg_names
    signature = {p: "constexpr" if p in constants else "fp32" if p == "lower_bound"
                 else "*" + POINTERS.get(p, "fp32") for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature[p].startswith("*")}
    source = ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in constants.items()}, attrs=aligned)
    options = dict(num_warps=4, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(source, target=SM90, options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":", 1) for line in usage.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":", 1)[1].isdigit())
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    loops = []
    for addr, op in ins:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:  # a backward branch closes a loop body
            loops.append(sum(1 for a, _ in ins if int(target.group(1), 16) <= a <= addr))
    assert len(loops) == len(trips), (loops, trips)
    return dict(registers=int(fields["REG"]), stack=int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)),
                spill_ops=sum(op.split()[0].split(".")[0] in ("LDL", "STL") for _, op in ins),
                shared=int(compiled.metadata.shared), sass=len(ins), loops=loops,
                per_warp=len(ins) + sum((n - 1) * body for n, body in zip(trips, loops)))


def resources(K: int) -> dict[str, object]:
    """The sm_90 figures for head dim K = V (see the module docstring)."""
    cfg = select_config(K, K, interpret=False)
    gate = dict(H=32, HV=32, K=K, V=K, HAS_A_LOG=True, HAS_DT_BIAS=True)
    bk, bv = cfg.bounded_wy_bk, min(cfg.bounded_wy_bv, K)
    new = compile_stats(chunk_wy_bounded_kernel, dict(gate, BK=bk, BV=bv), [K // bk] + ([K // bv] if K > bv else []),
                        cfg.wy_stages, cfg.bounded_wy_maxnreg)
    old = compile_stats(chunk_wy_kernel, dict(gate, BK=cfg.wy_bk, BV=cfg.wy_bv, GATE=2, DOT_PREC="tf32", FLOOR=30.0,
                                              BLOCK_SCAN=cfg.wy_block_scan),
                        [K // cfg.wy_bk] + ([K // cfg.wy_bv] if K > cfg.wy_bv else []), cfg.wy_stages, 0)
    return dict(K=K, **new, wy_registers=old["registers"], wy_shared=old["shared"], wy_loops=old["loops"],
                wy_per_warp=old["per_warp"])


if __name__ == "__main__":
    for K in [int(a) for a in sys.argv[1:]] or [64, 128, 256]:
        print(json.dumps(resources(K)), flush=True)
