"""Backend dispatch: which implementation runs a `PrefillProblem` on which device."""
from __future__ import annotations

import os
from typing import Optional

import torch

from .problem import Backend
from .torch_backend import run_torch

BACKENDS = ("torch", "triton")


def triton_available(device: torch.device) -> bool:
    """True when the Triton backend can run on tensors of ``device``: CUDA with triton
    installed, or CPU tensors under the Triton interpreter (TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def default_backend(device: torch.device) -> str:
    """The best backend for ``device``: Triton on CUDA, the torch chunked form elsewhere."""
    return "triton" if device.type == "cuda" and triton_available(device) else "torch"


def resolve_backend(name: Optional[str], device: torch.device) -> Backend:
    """The backend callable for ``name`` (None = the default for ``device``)."""
    name = default_backend(device) if name is None else name
    if name == "torch":
        return run_torch
    if name == "triton":
        if not triton_available(device):
            raise ValueError(
                f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1; got {device}"
            )
        from .triton_backend import run_triton

        return run_triton
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
