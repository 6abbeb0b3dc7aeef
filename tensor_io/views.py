"""A tensor's bytes and tensors over bytes, without copies where the layout allows.

Every byte format of the project (safetensors, base64 JSON, KServe binary data, shared
memory, Ray payloads) is little-endian and row-major, and tensors are viewed in place.
"""
from __future__ import annotations

import math
import sys
from typing import Sequence, Union

import numpy as np
import torch

if sys.byteorder != "little":  # the formats are little-endian and tensors are viewed in place
    raise ImportError("tensor_io needs a little-endian host")


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` occupies (exact Python int, no overflow)."""
    return math.prod(shape) * dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a flat uint8 array: a view when ``t`` is a contiguous CPU tensor,
    else one copy (to the host, to contiguous). The array keeps the memory alive."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def view_tensor(buf: Union[bytearray, memoryview], offset: int, dtype: torch.dtype,
                shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor of ``shape``/``dtype`` over ``buf[offset:]``, without a copy when
    ``offset`` is aligned to the dtype's size (a misaligned one is copied out).

    ``buf`` must be writable (a bytearray, or a memoryview of one) so the tensor is too.
    The caller has checked that the bytes are in range.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    size = dtype.itemsize
    if offset % size:
        chunk = bytearray(memoryview(buf)[offset:offset + count * size])
        return torch.frombuffer(chunk, dtype=dtype).view(shape)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
