"""Guards for an in-place launch, at memory speed: `gather_rows` (a copy of the rows a
launch will write, to put back when it must be undone) and `any_nonfinite` (whether
some tensors hold a NaN or Inf, as a flag left on their device: read it once, after the
launch). The Triton kernels run on CUDA, or on CPU tensors under TRITON_INTERPRET=1
(``backend="triton"``); torch ops elsewhere."""
from __future__ import annotations

from typing import Optional

import torch

from .backends import default_backend, triton_available


def _use_triton(device: torch.device, backend: Optional[str]) -> bool:
    name = default_backend(device) if backend is None else backend
    if name not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch', 'triton' or None, got {name!r}")
    return name == "triton" and triton_available(device)


def gather_rows(src: torch.Tensor, indices: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """A copy of ``src[indices]``: src [S, ...] contiguous, indices [N] int64 on src's
    device (each in [0, S)); returns [N, ...] in src's dtype."""
    if not src.is_contiguous():
        raise ValueError("gather_rows needs a contiguous src")
    if _use_triton(src.device, backend):
        from .triton_kernels.guards import launch_gather_rows

        return launch_gather_rows(src, indices)
    return src.index_select(0, indices)


def any_nonfinite(*tensors: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
    """[1] int32 on the tensors' device: 1 when any of ``tensors`` (floating point, on one
    device) holds a NaN or +-Inf, else 0. Nothing is synchronized."""
    device = tensors[0].device
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    if _use_triton(device, backend):
        from .triton_kernels.guards import launch_flag_nonfinite

        launch_flag_nonfinite(tuple(t.contiguous() for t in tensors), flag)
        return flag
    for t in tensors:
        flag |= (~torch.isfinite(t)).any().to(torch.int32)
    return flag
