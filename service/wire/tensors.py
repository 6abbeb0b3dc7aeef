"""Tensors on the wire: the dtypes it carries, and the JSON form ``{"dtype", "shape", "data"}``.

``data`` is the base64 of the tensor's little-endian, row-major bytes. Decoded tensors are
CPU tensors over a fresh buffer (`tensor_io.views`).
"""
from __future__ import annotations

import base64
import binascii
from typing import Any, Optional

import torch

from tensor_io.safetensors_format import CODES
from tensor_io.views import nbytes, tensor_bytes, view_tensor

from ..errors import MalformedBody

# The dtypes the wire carries, by JSON name; their safetensors codes are `tensor_io`'s.
JSON_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32,
}
JSON_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in JSON_DTYPES.items()}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {CODES[dt]: dt for dt in JSON_DTYPES.values()}


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
