"""A single-tensor safetensors container, written and read in a streaming, validating way.

Layout (the safetensors format): an 8-byte little-endian header length N, N bytes of JSON
``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``
padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.

The ``safetensors`` package cannot read ``__metadata__`` from in-memory bytes, nor write a
tensor in pieces; this module does both, so that a whole GPU pool is written one layer at a
time (no full host copy) and a file is checked for truncation and read into one preallocated
buffer while it is hashed. Files it writes load with ``safetensors`` and vice versa.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Optional

import torch

DTYPE_CODES: dict[torch.dtype, str] = {torch.float32: "F32", torch.bfloat16: "BF16"}
MAX_HEADER_BYTES = 100 * 1024 * 1024
_READ_CHUNK_BYTES = 64 * 1024 * 1024


class ContainerError(ValueError):
    """The bytes are not a well-formed safetensors container of the expected content."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; ``begin``/``end`` are offsets into the data section."""

    dtype_code: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed header: the metadata, the one tensor's entry and the data section's offset."""

    metadata: dict[str, str]
    name: str
    entry: TensorEntry
    data_start: int


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (any device) as a host buffer; no copy for a contiguous
    CPU tensor."""
    host = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(host.view(torch.uint8).numpy())


def write(
    stream: BinaryIO,
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    pieces: Iterable[torch.Tensor],
    metadata: dict[str, str],
) -> None:
    """Write one tensor ``name`` of ``shape``/``dtype`` whose row-major bytes are the
    concatenation of ``pieces`` (tensors on any device)."""
    nbytes = math.prod(shape) * dtype.itemsize
    entry = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [0, nbytes]}
    header = json.dumps({"__metadata__": metadata, name: entry}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    stream.write(len(header).to_bytes(8, "little"))
    stream.write(header)
    written = 0
    for piece in pieces:
        written += stream.write(as_bytes(piece))
    if written != nbytes:
        raise ValueError(f"pieces hold {written} bytes, the tensor needs {nbytes}")


def read_header(stream: BinaryIO, size: int, name: str) -> Header:
    """Parse and check the header of a ``size``-byte container holding one tensor ``name``.

    Checks that the data section ends exactly at ``size`` (catches truncation and trailing
    bytes). Raises ContainerError.
    """
    stream.seek(0)
    if size < 8:
        raise ContainerError(f"{size} bytes is too short for a safetensors header")
    length = int.from_bytes(stream.read(8), "little")
    if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
        raise ContainerError(
            f"not a safetensors container (header length {length} in {size} bytes), or truncated"
        )
    try:
        text = stream.read(length).decode("utf-8")
    except UnicodeDecodeError:
        raise ContainerError("not a safetensors container: header is not UTF-8") from None
    header = parse_json(text, "the safetensors header")
    if not isinstance(header, dict):
        raise ContainerError("not a safetensors container: header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ContainerError("__metadata__ must map strings to strings")
    if list(header) != [name]:
        raise ContainerError(f"expected exactly one tensor {name!r}, found {sorted(header)}")
    entry = _entry(name, header[name])
    data_start = 8 + length
    if entry.begin != 0 or data_start + entry.end != size:
        raise ContainerError(
            f"the header puts tensor data at bytes {data_start + entry.begin}..{data_start + entry.end}"
            f" but the container has {size} bytes (truncated, or trailing bytes)"
        )
    return Header(metadata=metadata, name=name, entry=entry, data_start=data_start)


def parse_json(text: str, what: str) -> Any:
    """``json.loads`` that raises ContainerError for any malformed (or absurdly nested) text."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ContainerError(f"{what} is not valid JSON ({type(exc).__name__}: {exc})") from None


def _entry(name: str, raw: Any) -> TensorEntry:
    try:
        dtype_code, shape, (begin, end) = raw["dtype"], raw["shape"], raw["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise ContainerError(f"tensor {name!r}: malformed header entry {raw!r}") from None
    ints = [*shape, begin, end] if isinstance(shape, list) else None
    if (
        not isinstance(dtype_code, str)
        or ints is None
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ints)
        or begin > end
    ):
        raise ContainerError(f"tensor {name!r}: malformed header entry {raw!r}")
    return TensorEntry(dtype_code=dtype_code, shape=tuple(shape), begin=begin, end=end)


def read_tensor(
    stream: BinaryIO, header: Header, dtype: torch.dtype, hasher: Optional[Any] = None
) -> torch.Tensor:
    """Read the container's tensor into a new CPU tensor, feeding its bytes to ``hasher``
    (a hashlib object) if given. The caller checks the shape; this checks dtype and size."""
    entry, name = header.entry, header.name
    if entry.dtype_code != DTYPE_CODES[dtype]:
        raise ContainerError(
            f"tensor {name!r} has dtype {entry.dtype_code}, expected {DTYPE_CODES[dtype]}"
        )
    nbytes = math.prod(entry.shape) * dtype.itemsize
    if entry.end - entry.begin != nbytes:
        raise ContainerError(
            f"tensor {name!r} of shape {list(entry.shape)} needs {nbytes} bytes, its offsets "
            f"span {entry.end - entry.begin}"
        )
    tensor = torch.empty(entry.shape, dtype=dtype)
    buffer = as_bytes(tensor)
    stream.seek(header.data_start + entry.begin)
    for start in range(0, nbytes, _READ_CHUNK_BYTES):
        chunk = buffer[start : start + _READ_CHUNK_BYTES]
        if stream.readinto(chunk) != len(chunk):
            raise ContainerError(f"tensor {name!r} is truncated")
        if hasher is not None:
            hasher.update(chunk)
    return tensor
