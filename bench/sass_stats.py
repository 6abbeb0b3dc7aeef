"""Static figures of the Triton kernels for an H200 (sm_90), compiled here without a GPU.

For each stage-1 variant of the sweep in `bench/kernels.py` (serving config: bf16 inputs,
H = HV = 32, K = V = 128, lower_bound gate, l2norm, beta sigmoid), Triton compiles the
kernel for sm_90 and cuobjdump (bundled with Triton) reads the cubin: registers, spills
(local memory and the stack frame, LDL/STL instructions), shared memory, SASS
instructions, tensor-core instructions (HMMA: mma.sync; HGMMA: wgmma), barriers and MUFU
(exp, rsqrt, ...) instructions. These are counts of the
code, not of its execution (a loop body counts once): they compare variants and tell a
spill or a register-bound occupancy before device time is spent, never a speed.

Pointer arguments are declared 16-byte aligned, as the launches' tensors are; integer
arguments are not specialized as the GPU's launch would, so absolute register counts can
differ a little from the GPU's. The GPU machine runs Triton 3.6: for its figures run this
with triton==3.6.0 (pip install into a virtual environment; no CUDA needed).

    python bench/sass_stats.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the GPU runs set it

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_kernels import chunk_intra_kernel, chunk_wy_kernel  # noqa: E402
from kernels.triton_kernels.config import LaunchConfig  # noqa: E402
from kernels.triton_kernels.intra_bounded import BK as BOUNDED_BK, chunk_intra_bounded_kernel  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SM90 = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"
POINTERS = dict(q=BF16, k=BF16, v=BF16, g=BF16, beta=BF16, a_log="*fp32", dt_bias="*fp32", tb="*fp16",
                aqk="*fp16", rqk="*fp32", w="*fp16", u="*fp32", kg="*fp16", qg="*fp16", gexp="*fp32",
                chunks="*i64", scale="fp32", lower_bound="fp32")
GATE = dict(GATE=2, HAS_A_LOG=True, HAS_DT_BIAS=True, USE_L2NORM=True, BETA_SIGMOID=True, NEG_EIGVAL=False)
STAGE1 = dict(H=32, HV=32, K=128, BK=16, BKD=8, SAFE=True, DOT_PREC="tf32", FLOOR=30.0, FP16_SOLVE=True, **GATE)
BOUNDED_INTRA_MAXNREG = LaunchConfig.bounded_intra_maxnreg
BOUNDED = dict(H=32, HV=32, K=128, BK=BOUNDED_BK, HAS_A_LOG=True, HAS_DT_BIAS=True, NEG_EIGVAL=False)
WY = dict(H=32, HV=32, K=128, V=128, BK=32, BV=64, GATE=2, HAS_A_LOG=True, HAS_DT_BIAS=True, DOT_PREC="tf32",
          FLOOR=30.0, BLOCK_SCAN=True)


@dataclass(frozen=True)
class Figures:
    registers: int
    spill_bytes: int  # local memory plus the stack frame (where ptxas puts spilled registers)
    spill_ops: int  # LDL / STL instructions
    shared_bytes: int
    instructions: int
    hmma: int
    hgmma: int
    barriers: int
    mufu: int


def compile_sm90(fn: triton.JITFunction, constants: dict, num_warps: int = 4, num_stages: int = 3,
                 maxnreg: Optional[int] = None) -> Figures:
    """Compile ``fn`` with ``constants`` (its constexprs) for sm_90, at most ``maxnreg``
    registers a thread (None: ptxas's choice); its static figures."""
    params = fn.arg_names
    signature = {p: ("constexpr" if p in constants else POINTERS.get(p, "*fp32")) for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature[p].startswith("*")}
    source = ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in constants.items()},
                       attrs=aligned)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    compiled = triton.compile(source, target=SM90, options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":", 1) for line in usage.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":", 1)[1].isdigit())
    ops = [line.split("*/", 1)[1] for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    return Figures(int(fields["REG"]), int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
                   sum(op.split()[0].split(".")[0] in ("LDL", "STL") for op in ops), int(compiled.metadata.shared),
                   len(ops),
                   sum("HMMA" in op for op in ops), sum("HGMMA" in op for op in ops),
                   sum("BAR" in op for op in ops), sum("MUFU" in op for op in ops))


def variants() -> dict[str, tuple[triton.JITFunction, dict, Optional[int]]]:
    """The intra kernel with each combination of its two solve/decay options, the bounded
    gate's intra kernel (at its register cap and uncapped) and WY: (kernel, constexprs,
    maxnreg)."""
    out: dict[str, tuple[triton.JITFunction, dict, Optional[int]]] = {}
    for diag16 in (False, True):
        for factored in (False, True):
            flags = dict(DIAG16=diag16, FACTORED=factored)
            tag = ", ".join(name for name, on in (("diag16", diag16), ("factored A", factored)) if on)
            out[f"intra{' (' + tag + ')' if tag else ''}"] = (chunk_intra_kernel, {**STAGE1, **flags}, None)
    out[f"intra bounded (maxnreg {BOUNDED_INTRA_MAXNREG})"] = (chunk_intra_bounded_kernel, BOUNDED,
                                                               BOUNDED_INTRA_MAXNREG)
    out["intra bounded (uncapped)"] = (chunk_intra_bounded_kernel, BOUNDED, None)
    out["wy"] = (chunk_wy_kernel, WY, None)
    return out


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, 4 warps, 3 stages")
    print("| kernel | registers | spill bytes | LDL/STL | shared bytes | SASS | HMMA | HGMMA | barriers | MUFU"
          " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (fn, constants, maxnreg) in variants().items():
        f = compile_sm90(fn, constants, maxnreg=maxnreg)
        print(f"| {name} | {f.registers} | {f.spill_bytes} | {f.spill_ops} | {f.shared_bytes} | {f.instructions} | "
              f"{f.hmma} | {f.hgmma} | {f.barriers} | {f.mufu} |", flush=True)


if __name__ == "__main__":
    main()
