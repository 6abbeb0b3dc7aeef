"""Registers, spills and shared memory of the bounded gate's intra kernel
(`intra_bounded`) compiled for an H100/H200 (sm_90) on this machine: no GPU needed,
Triton's own ptxas and cuobjdump.

Run as a script (``python tests/triton/sm90_bounded_intra.py [K ...]``) in a process where
TRITON_INTERPRET is unset; prints one JSON object per head dim K = V: ``registers`` (a
thread), ``stack`` (bytes of stack frame, where ptxas puts spilled registers),
``spill_ops`` (LDL/STL instructions) and ``shared`` (bytes), for the launches
`intra_bounded.launch_intra_bounded` makes in the serving setup (bf16, H = HV = 32, the
config's register cap): ``check`` false (a prefill) and true (the inputs checked, as a
prepared prefill's launch asks).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_kernels.config import select_config  # noqa: E402
from kernels.triton_kernels.intra_bounded import BK, chunk_intra_bounded_kernel  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
POINTERS = dict(q="bf16", k="bf16", g="bf16", beta="bf16", tb="fp16", aqk="fp16", chunks="i64", checks="i32")


def resources(K: int, check: bool) -> dict[str, int]:
    """The sm_90 compile's figures for head dim K, with or without the input check (see
    the module docstring)."""
    cfg = select_config(K, K, interpret=False)
    fn = chunk_intra_bounded_kernel
    constants = dict(H=32, HV=32, K=K, BK=BK, HAS_A_LOG=True, HAS_DT_BIAS=True, NEG_EIGVAL=False, CHECK=check)
    params = fn.arg_names
    signature = {p: "constexpr" if p in constants else "fp32" if p in ("scale", "lower_bound")
                 else "*" + POINTERS.get(p, "fp32") for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature[p].startswith("*")}
    source = ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in constants.items()}, attrs=aligned)
    options = dict(num_warps=4, num_stages=cfg.intra_stages, maxnreg=cfg.bounded_intra_maxnreg)
    compiled = triton.compile(source, target=SM90, options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":", 1) for line in usage.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":", 1)[1].isdigit())
    ops = [line.split("*/", 1)[1].split()[0] for line in sass.splitlines()
           if line.strip().startswith("/*") and ";" in line]
    return dict(K=K, check=check, registers=int(fields["REG"]), stack=int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)),
                spill_ops=sum(op.split(".")[0] in ("LDL", "STL") for op in ops), shared=int(compiled.metadata.shared))


if __name__ == "__main__":
    for K in [int(a) for a in sys.argv[1:]] or [64, 128, 256]:
        for check in (False, True):
            print(json.dumps(resources(K, check)), flush=True)
