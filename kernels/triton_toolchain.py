"""Which ptxas compiles the Triton kernels: chosen in code before the first compile, logged.

On Hopper (sm_90) Triton 3.6's bundled ptxas (12.8) has miscompiled a correct kernel of
this backend (a fused intra + WY kernel: 0.26-0.53 relative error on an H200), while the
machine's CUDA 13.0 ptxas compiled it and the GPU suite correctly; the ptxas of a CUDA
newer than the driver (the nvidia-cuda-nvcc 13.5 wheel on driver 580, CUDA 13.0) left
outputs unwritten without an error. So on Hopper the backend takes the first ptxas of
`PTXAS_CANDIDATES` whose CUDA release is at least `MIN_PTXAS` and at most the driver's,
through Triton's ``TRITON_PTXAS_PATH``; else it leaves Triton's bundled one, and says so.
A ``TRITON_PTXAS_PATH`` the caller set is kept (and reported). Other GPUs keep Triton's
default. `toolchain_report` says which ptxas compiles (for logs, the bench, a self-test).
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional

import torch

log = logging.getLogger(__name__)

PTXAS_ENV = "TRITON_PTXAS_PATH"
MIN_PTXAS = (13, 0)


def ptxas_candidates(env: Mapping[str, str]) -> list[str]:
    """System ptxas binaries to try, in order: $CUDA_HOME's, $CUDA_PATH's, /usr/local/cuda's."""
    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"]
    out: list[str] = []
    for root in roots:
        if root and os.path.join(root, "bin", "ptxas") not in out:
            out.append(os.path.join(root, "bin", "ptxas"))
    return out


@dataclass(frozen=True)
class Toolchain:
    """The ptxas that compiles: its path (None: Triton's bundled one), CUDA release, why."""

    ptxas: Optional[str]
    release: Optional[tuple[int, int]]
    reason: str


def ptxas_release(path: str) -> Optional[tuple[int, int]]:
    """The CUDA release (major, minor) ``path --version`` prints, None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def driver_cuda_release() -> Optional[tuple[int, int]]:
    """The CUDA release the installed driver supports (cuDriverGetVersion), None if unknown."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return (v.value // 1000, v.value % 1000 // 10)


def choose_ptxas(capability: tuple[int, int], env: Mapping[str, str],
                 driver: Optional[tuple[int, int]]) -> Toolchain:
    """The ptxas for a GPU of compute ``capability`` (pure: no environment change)."""
    if env.get(PTXAS_ENV):
        path = env[PTXAS_ENV]
        return Toolchain(path, ptxas_release(path), f"{PTXAS_ENV} set by the caller")
    if capability[0] != 9:
        return Toolchain(None, None, f"sm_{capability[0]}{capability[1]}: Triton's bundled ptxas")
    for path in ptxas_candidates(env):
        release = ptxas_release(path) if os.path.exists(path) else None
        if release is None or release < MIN_PTXAS:
            continue
        if driver is not None and release > driver:
            continue
        return Toolchain(path, release, f"Hopper: CUDA {release[0]}.{release[1]} ptxas, driver CUDA {driver}")
    return Toolchain(None, None, f"Hopper, but no ptxas of CUDA >= {MIN_PTXAS[0]}.{MIN_PTXAS[1]} and <= the "
                                 f"driver's ({driver}) among {ptxas_candidates(env)}: Triton's bundled ptxas")


@lru_cache(maxsize=None)
def configure_toolchain(device: torch.device) -> Toolchain:
    """Choose the ptxas for ``device`` once per process, before the first compile, and log it.
    Sets ``TRITON_PTXAS_PATH`` when it picks a system ptxas."""
    if device.type != "cuda":
        return Toolchain(None, None, "not CUDA (interpreter)")
    capability = torch.cuda.get_device_capability(device)
    chosen = choose_ptxas(capability, os.environ, driver_cuda_release())
    if chosen.ptxas is not None and not os.environ.get(PTXAS_ENV):
        os.environ[PTXAS_ENV] = chosen.ptxas
    hopper_bundled = capability[0] == 9 and chosen.ptxas is None
    (log.warning if hopper_bundled else log.info)(
        "Triton kernels on %s compile with ptxas %s (CUDA %s): %s", torch.cuda.get_device_name(device),
        chosen.ptxas or "bundled with Triton", chosen.release, chosen.reason)
    return chosen


def toolchain_report(device: torch.device) -> dict[str, object]:
    """What compiles the kernels on ``device``: the choice, and the ptxas Triton resolves."""
    chosen = configure_toolchain(device)
    out: dict[str, object] = dict(ptxas=chosen.ptxas, release=chosen.release, reason=chosen.reason)
    try:
        import triton

        tool = triton.knobs.nvidia.ptxas  # Triton >= 3.4: the binary it will run, and its version
        out["triton_ptxas"] = dict(path=tool.path, version=tool.version)
    except (ImportError, AttributeError, RuntimeError):
        out["triton_ptxas"] = None
    return out
