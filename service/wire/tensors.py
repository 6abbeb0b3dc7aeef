"""Tensors on the wire: the dtype tables, and the JSON form ``{"dtype", "shape", "data"}``.

``data`` is the base64 of the tensor's little-endian, row-major bytes. Decoded tensors are
CPU tensors over a fresh buffer; `tensor_bytes` gives a tensor's bytes without a copy when
it already is a contiguous CPU tensor.
"""
from __future__ import annotations

import base64
import binascii
import math
import sys
from typing import Any, Optional

import numpy as np
import torch

from ..errors import MalformedBody

if sys.byteorder != "little":  # the wire is little-endian and tensors are viewed in place
    raise ImportError("service.wire needs a little-endian host")

# JSON dtype name <-> torch dtype <-> safetensors dtype code. One table, read both ways.
_DTYPES: tuple[tuple[str, torch.dtype, str], ...] = (
    ("float32", torch.float32, "F32"),
    ("bfloat16", torch.bfloat16, "BF16"),
    ("float16", torch.float16, "F16"),
    ("int64", torch.int64, "I64"),
    ("int32", torch.int32, "I32"),
)
JSON_DTYPES: dict[str, torch.dtype] = {name: dt for name, dt, _ in _DTYPES}
JSON_NAMES: dict[torch.dtype, str] = {dt: name for name, dt, _ in _DTYPES}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {code: dt for _, dt, code in _DTYPES}
SAFETENSORS_CODES: dict[torch.dtype, str] = {dt: code for _, dt, code in _DTYPES}
MAX_RANK = 8


def nbytes(shape: list[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` occupies (exact Python int, no overflow)."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a flat uint8 array: a view when ``t`` is a contiguous CPU tensor,
    else one copy (to the host, to contiguous). The array keeps the memory alive."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def view_tensor(buf: bytearray | memoryview, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A CPU tensor of ``shape``/``dtype`` over ``buf[offset:]``, without a copy when
    ``offset`` is aligned to the dtype's size (a misaligned one is copied out).

    ``buf`` must be writable (a bytearray, or a memoryview of one) so the tensor is too.
    The caller has checked that the bytes are in range.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    if offset % size:
        chunk = bytearray(memoryview(buf)[offset:offset + count * size])
        return torch.frombuffer(chunk, dtype=dtype).view(shape)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)


def tensor_to_json(t: torch.Tensor) -> dict[str, Any]:
    """``{"dtype", "shape", "data": base64}`` for a tensor of a wire dtype."""
    if t.dtype not in JSON_NAMES:
        raise TypeError(f"dtype {t.dtype} has no wire form (have {sorted(JSON_DTYPES)})")
    return {
        "dtype": JSON_NAMES[t.dtype],
        "shape": list(t.shape),
        "data": base64.b64encode(tensor_bytes(t)).decode("ascii"),
    }


def tensor_from_json(dtype: str, shape: list[int], data: str, *, field: str) -> torch.Tensor:
    """Decode a JSON tensor (already schema-checked: a known ``dtype``, ``shape`` of ints >= 0).

    Raises MalformedBody naming ``field`` when ``data`` is not strict base64 or its byte
    count disagrees with dtype x shape.
    """
    torch_dtype = JSON_DTYPES[dtype]
    want = nbytes(shape, torch_dtype)
    # base64 of n bytes has 4 * ceil(n / 3) characters: refuse a mismatch before decoding.
    if len(data) != 4 * ((want + 2) // 3):
        raise MalformedBody(
            f"{field}: shape {shape} of {dtype} needs {want} bytes ({4 * ((want + 2) // 3)} base64 "
            f"characters), got {len(data)} characters", field=field,
        )
    try:
        raw = base64.b64decode(data, validate=True)  # alphabet and trailing padding only
    except (binascii.Error, ValueError) as e:
        raise MalformedBody(f"{field}.data is not valid base64: {e}", field=field) from None
    if len(raw) != want:
        raise MalformedBody(
            f"{field}: shape {shape} of {dtype} needs {want} bytes, data decodes to {len(raw)}", field=field
        )
    return view_tensor(bytearray(raw), 0, torch_dtype, shape)


def describe(t: Optional[torch.Tensor]) -> str:
    """``float32[12, 4, 64]`` (or ``absent``): how error messages show a tensor."""
    if t is None:
        return "absent"
    return f"{JSON_NAMES.get(t.dtype, str(t.dtype))}{list(t.shape)}"
