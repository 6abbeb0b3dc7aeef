"""Export and import of one slot's state: safetensors bytes holding tensor ``"state"``
[L, HV, V, K] (the pool dtype) and, in metadata, the geometry it belongs to (num_layers,
num_heads, head_k_dim, head_v_dim, dtype) and ``tokens_per_layer`` (JSON list)."""
from __future__ import annotations

import io
import json
from typing import Optional, Union

import torch

from tensor_io import safetensors_format

from .errors import GeometryMismatch, SnapshotError
from .geometry import PoolGeometry

TENSOR_NAME = "state"
_GEOMETRY_KEYS = ("num_layers", "num_heads", "head_k_dim", "head_v_dim", "dtype")


def encode(geometry: PoolGeometry, layers: list[torch.Tensor], tokens_per_layer: list[int]) -> bytes:
    """Serialize a slot whose state on layer l is ``layers[l]`` [HV, V, K] (any device)."""
    metadata = {key: str(value) for key, value in geometry.state_fields().items()}
    metadata["tokens_per_layer"] = json.dumps(tokens_per_layer)
    out = io.BytesIO()
    safetensors_format.write(out, TENSOR_NAME, geometry.dtype, geometry.slot_shape, layers, metadata)
    return out.getvalue()


def decode(
    data: Union[bytes, bytearray, memoryview], geometry: PoolGeometry
) -> tuple[torch.Tensor, Optional[list[int]]]:
    """Parse and check an export against ``geometry``.

    Returns the state as a CPU tensor [L, HV, V, K] of the pool dtype, and the token counts
    per layer when the export carries them. Raises GeometryMismatch when it belongs to
    another geometry or dtype, SnapshotError (path None) when the bytes are not a valid export.
    """
    raw = memoryview(data).cast("B")
    stream = io.BytesIO(raw)
    try:
        header = safetensors_format.read_header(stream, len(raw))
        entry = header.only(TENSOR_NAME)
        got = _declared_geometry(header.metadata)
        expected = geometry.state_fields()
        if got != expected:
            raise GeometryMismatch(expected, got)
        if entry.shape != geometry.slot_shape or entry.dtype != geometry.dtype:
            raise safetensors_format.ContainerError(
                f"tensor {TENSOR_NAME!r} is {entry.dtype}{list(entry.shape)}, its metadata "
                f"declares {geometry.dtype}{list(geometry.slot_shape)}"
            )
        tokens = _tokens(header.metadata, geometry.num_layers)
        state = safetensors_format.read_tensor(stream, header, TENSOR_NAME)
    except safetensors_format.ContainerError as exc:
        raise SnapshotError(None, str(exc)) from None
    return state, tokens


def _declared_geometry(metadata: dict[str, str]) -> dict[str, Union[int, str]]:
    """The geometry an export declares, in the form of `PoolGeometry.state_fields`."""
    missing = [key for key in _GEOMETRY_KEYS if key not in metadata]
    if missing:
        raise safetensors_format.ContainerError(f"metadata lacks the geometry fields {missing}")
    declared: dict[str, Union[int, str]] = {}
    for key in _GEOMETRY_KEYS:
        value = metadata[key]
        if key == "dtype":
            declared[key] = value
        elif value.isascii() and value.isdigit():
            declared[key] = int(value)
        else:
            raise safetensors_format.ContainerError(f"metadata {key}={value!r} is not an integer")
    return declared


def _tokens(metadata: dict[str, str], num_layers: int) -> Optional[list[int]]:
    if "tokens_per_layer" not in metadata:
        return None
    tokens = safetensors_format.parse_json(metadata["tokens_per_layer"], "metadata tokens_per_layer")
    if not (
        isinstance(tokens, list)
        and len(tokens) == num_layers
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
    ):
        raise safetensors_format.ContainerError(
            f"metadata tokens_per_layer must be a list of {num_layers} non-negative integers"
        )
    return tokens
