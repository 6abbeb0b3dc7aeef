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


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    dtype: np.dtype(name) for dtype, name in (
        (torch.float64, "<f8"), (torch.float32, "<f4"), (torch.float16, "<f2"), (torch.int64, "<i8"),
        (torch.int32, "<i4"), (torch.int16, "<i2"), (torch.int8, "i1"), (torch.uint8, "u1"), (torch.bool, "?"),
    )
}
"""The dtypes numpy has too (not bfloat16): `view_tensor` and `tensor_bytes` go through numpy
for those, faster than torch's own calls."""


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` occupies (exact Python int, no overflow)."""
    return math.prod(shape) * dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a flat uint8 array: a view when ``t`` is a contiguous CPU tensor,
    else one copy (to the host, to contiguous). The array keeps the memory alive."""
    if t.is_cpu and t.is_contiguous() and not t.requires_grad and t.dtype in _NUMPY_DTYPES:
        return t.numpy().reshape(-1).view(np.uint8)  # 1.0 us where the conversions below take 2.6
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
    if (array_dtype := _NUMPY_DTYPES.get(dtype)) is not None:  # 0.8 us where torch.frombuffer + view take 1.9
        return torch.from_numpy(np.frombuffer(buf, array_dtype, count, offset).reshape(shape))
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
