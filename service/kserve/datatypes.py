"""Tensor datatypes of the Open Inference Protocol and the torch dtypes they map to.

KDA takes FP32, BF16 and FP16 inputs (the same three as ``/prefill``); the protocol's other
datatypes are recognised by name only, so a refusal can say what was sent.
"""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"FP32": torch.float32, "BF16": torch.bfloat16, "FP16": torch.float16}
DATATYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH_DTYPES.items()}
PROTOCOL_DATATYPES = frozenset({
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
})
ACCEPTED = "FP32, BF16 or FP16"
BINARY_ONLY = frozenset({torch.bfloat16})  # JSON numbers have no bfloat16 form (the protocol's rule)


def torch_dtype(datatype: str) -> torch.dtype | None:
    """The torch dtype of a protocol ``datatype`` KDA accepts, or None."""
    return TORCH_DTYPES.get(datatype)


def datatype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"FP32"`` (only the three KDA dtypes have a name here)."""
    return DATATYPE_NAMES[dtype]
