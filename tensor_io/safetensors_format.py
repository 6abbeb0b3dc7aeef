"""The safetensors container, parsed and written here (never by `torch.load` or pickle):
request and response bodies, slot exports, pool snapshots and gate parameter files.

Layout: 8 bytes little-endian header length n, n bytes of JSON header (padded with spaces
to a multiple of 8 when written here), then the data. The header maps tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data) and
may hold ``__metadata__``: string -> string.

Nothing is trusted: the header length is capped (`MAX_HEADER_BYTES` for files, whose
metadata may hold a pool's slot index; `MAX_REQUEST_HEADER_BYTES` for request bodies,
whose headers are a few KB) and must fit the container; the header must be a JSON object
without duplicate keys, every dtype a string the caller takes, every shape one a tensor can
have (`tensor_io.shapes.shape_problem`) whose byte count equals its offsets' span, and the spans must tile the
data exactly (no overlap, no hole, no trailing bytes) as the format requires. Only then are
tensors made: zero-copy views over an in-memory container (`parse`), or read from a stream
into one new buffer (`read_tensor`, for files too large to hold twice). Containers written
here load with the ``safetensors`` package and vice versa.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, Optional, Sequence, Union

import torch

from .shapes import shape_problem
from .views import nbytes, tensor_bytes, view_tensor

MAX_HEADER_BYTES = 100 << 20  # files: the safetensors package's own limit
MAX_REQUEST_HEADER_BYTES = 8 << 20  # request bodies: their headers need KBs
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
_SPEC_KEYS = {"dtype", "shape", "data_offsets"}
_READ_CHUNK_BYTES = 64 << 20


class ContainerError(ValueError):
    """The bytes are not a well-formed safetensors container, or not of the content the
    reader expects; ``field`` names the tensor (or ``__metadata__``) at fault, if one is."""

    def __init__(self, detail: str, field: Optional[str] = None) -> None:
        super().__init__(detail)
        self.field = field


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; ``begin``/``end`` are offsets into the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: the metadata, each tensor's entry in header order, and where the
    data section starts in the container."""

    metadata: dict[str, str]
    entries: dict[str, TensorEntry]
    data_start: int

    def only(self, name: str) -> TensorEntry:
        """The entry of ``name`` when it is the container's one tensor (else ContainerError)."""
        if list(self.entries) != [name]:
            raise ContainerError(f"expected exactly one tensor {name!r}, found {sorted(self.entries)}")
        return self.entries[name]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates)  # made once: `json.loads` with a hook makes one per call


def parse_json(text: Union[str, bytes], what: str) -> Any:
    """The JSON value of ``text`` (bytes must be UTF-8); raises ContainerError for
    malformed (or absurdly nested) text or duplicate keys."""
    try:
        return _DECODER.decode(text.decode("utf-8") if isinstance(text, bytes) else text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ContainerError(f"{what} is not valid JSON: {e}") from None


def header_length(prefix: Union[bytes, memoryview], size: int, max_header_bytes: int) -> int:
    """The header length n from the first 8 bytes of a ``size``-byte container, checked
    against the cap and the container's size."""
    if size < 8:
        raise ContainerError(f"{size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n > max_header_bytes:
        raise ContainerError(f"header length {n} exceeds the {max_header_bytes}-byte limit")
    if 8 + n > size:
        raise ContainerError(f"header length {n} runs past the end of a {size}-byte body")
    return n


def _entry(name: str, spec: Any, data_size: int, dtypes: Mapping[str, torch.dtype]) -> TensorEntry:
    """One header entry, every field checked."""
    if not isinstance(spec, dict) or spec.keys() != _SPEC_KEYS:
        raise ContainerError(f"tensor {name!r} must be an object with exactly {sorted(_SPEC_KEYS)}, "
                             f"got {spec!r:.200}", name)
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or (dtype := dtypes.get(code)) is None:
        raise ContainerError(f"tensor {name!r} has dtype {code!r:.40}; supported: {sorted(dtypes)}", name)
    if (problem := shape_problem(shape)) is not None:
        raise ContainerError(f"tensor {name!r}: {problem}", name)
    begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 else (None, None)
    if type(begin) is not int or type(end) is not int or begin < 0 or end < 0:  # not bool, not float
        raise ContainerError(f"tensor {name!r} data_offsets must be [begin, end] non-negative ints, "
                             f"got {offsets!r:.200}", name)
    if not begin <= end <= data_size:
        raise ContainerError(f"tensor {name!r} data_offsets {offsets} out of range for {data_size} data bytes", name)
    want = nbytes(shape, dtype)
    if want != end - begin:
        raise ContainerError(f"tensor {name!r}: shape {shape} of {code} needs {want} bytes, data_offsets span "
                             f"{end - begin}", name)
    return TensorEntry(dtype, tuple(shape), begin, end)


def parse_header(text: Union[bytes, memoryview], data_start: int, size: int,
                 dtypes: Mapping[str, torch.dtype] = DTYPES) -> Header:
    """Check the JSON header ``text`` of a ``size``-byte container whose data starts at
    ``data_start``: a `Header`, or ContainerError naming what is wrong."""
    header = parse_json(bytes(text), "header")
    if not isinstance(header, dict):
        raise ContainerError(f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ContainerError("__metadata__ must be an object of strings", "__metadata__")
    data_size = size - data_start
    entries = {name: _entry(name, spec, data_size, dtypes) for name, spec in header.items()}
    position = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != position:
            what = "overlaps the previous tensor" if e.begin < position else f"leaves a hole at {position}"
            raise ContainerError(f"tensor {name!r} at data_offsets [{e.begin}, {e.end}] {what}", name)
        position = e.end
    if position != data_size:
        raise ContainerError(f"tensors cover {position} of {data_size} data bytes")
    return Header(metadata, entries, data_start)


# -- in memory -------------------------------------------------------------------------

def parse(body: Union[bytearray, memoryview], *, max_header_bytes: int = MAX_HEADER_BYTES,
          dtypes: Mapping[str, torch.dtype] = DTYPES) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of an in-memory container, the tensors zero-copy views over it in
    header order (they keep it alive). ``body`` must be writable (a bytearray) so the
    tensors are too. ContainerError on any inconsistency."""
    view = memoryview(body)
    n = header_length(view, len(view), max_header_bytes)
    header = parse_header(view[8:8 + n], 8 + n, len(view), dtypes)
    tensors = {name: view_tensor(body, header.data_start + e.begin, e.dtype, e.shape)
               for name, e in header.entries.items()}
    return tensors, header.metadata


def load(path: Union[str, Path], dtypes: Mapping[str, torch.dtype] = DTYPES
         ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`parse` of a small file read whole (gate parameters): CPU tensors over its bytes."""
    return parse(bytearray(Path(path).read_bytes()), dtypes=dtypes)


TensorParts = Union[torch.Tensor, Sequence[torch.Tensor]]


def _parts(name: str, value: TensorParts) -> tuple[list[torch.Tensor], list[int]]:
    """The pieces of one entry and the shape of their concatenation along dim 0."""
    if isinstance(value, torch.Tensor):
        return [value], list(value.shape)
    parts = list(value)
    if not parts:
        raise ValueError(f"{name}: no tensors to concatenate")
    first = parts[0]
    if len(parts) == 1 and first.dim():  # one sequence: nothing to match
        return parts, list(first.shape)
    for p in parts:
        if p.dim() == 0 or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{name}: parts must share dtype and trailing shape to be packed along tokens, "
                f"got {first.dtype}{list(first.shape)} and {p.dtype}{list(p.shape)}"
            )
    return parts, [sum(p.shape[0] for p in parts), *first.shape[1:]]


def header_bytes(specs: Mapping[str, tuple[torch.dtype, Sequence[int]]], metadata: Optional[Mapping[str, str]]
                 ) -> tuple[bytes, list[int], int]:
    """The 8-byte length and the JSON header (padded so the data starts 8-byte aligned, as
    the safetensors writer does) of tensors ``specs`` (name: dtype, shape) laid out back to
    back in order; each one's offset in the data; the data's size."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets, offset = [], 0
    for name, (dtype, shape) in specs.items():
        if dtype not in CODES:
            raise TypeError(f"{name}: dtype {dtype} has no safetensors code")
        size = nbytes(shape, dtype)
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offsets.append(offset)
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, offsets, offset


def _layout(tensors: Mapping[str, TensorParts], metadata: Optional[Mapping[str, str]]
            ) -> tuple[bytes, list[tuple[int, list[torch.Tensor]]], int]:
    """(header bytes, each tensor's data offset and parts, data bytes)."""
    parted = {name: _parts(name, value) for name, value in tensors.items()}
    head, offsets, size = header_bytes({name: (parts[0].dtype, shape) for name, (parts, shape) in parted.items()},
                                       metadata)
    return head, [(start, parts) for start, (parts, _) in zip(offsets, parted.values())], size


def encode(tensors: Mapping[str, TensorParts], metadata: Optional[Mapping[str, str]] = None) -> bytearray:
    """One container holding ``tensors`` (in order) and ``metadata``.

    A value may be a tensor or a sequence of tensors, written back to back as their
    concatenation along dim 0 (so packing sequences costs no extra copy). Tensors may live
    on any device; each byte is copied once, straight into the returned buffer.
    """
    head, layout, size = _layout(tensors, metadata)
    base = len(head)
    buf = bytearray(base + size)
    buf[:base] = head
    for start, parts in layout:
        position = base + start
        for p in parts:
            size = p.numel() * p.element_size()
            if size:
                dst = torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=position)
                dst.copy_(p.detach().contiguous().reshape(-1).view(torch.uint8))
            position += size
    return buf


def pieces(tensors: Mapping[str, TensorParts], metadata: Optional[Mapping[str, str]] = None) -> list[memoryview]:
    """The container `encode` makes, as the pieces to send one after another, without
    joining them: the header, then each part's bytes, viewed in place when it is a
    contiguous CPU tensor (copied once otherwise). The tensors must not change until sent."""
    head, layout, _ = _layout(tensors, metadata)
    out = [memoryview(head)]
    for _, parts in layout:
        for p in parts:
            if p.numel():
                out.append(memoryview(tensor_bytes(p)))
    return out


# -- streams (files too large to hold twice) --------------------------------------------

def write(stream: BinaryIO, name: str, dtype: torch.dtype, shape: Sequence[int],
          tensor_pieces: Iterable[torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write a container of one tensor ``name`` of ``shape``/``dtype`` whose row-major bytes
    are the concatenation of ``tensor_pieces`` (tensors on any device, each brought to the
    host alone: a GPU pool is written one piece at a time)."""
    head, _, size = header_bytes({name: (dtype, shape)}, metadata)
    stream.write(head)
    written = 0
    for piece in tensor_pieces:
        written += stream.write(memoryview(tensor_bytes(piece)))
    if written != size:
        raise ValueError(f"pieces hold {written} bytes, the tensor needs {size}")


def read_header(stream: BinaryIO, size: int, *, max_header_bytes: int = MAX_HEADER_BYTES,
                dtypes: Mapping[str, torch.dtype] = DTYPES) -> Header:
    """The checked header of the ``size``-byte container in ``stream`` (read from its start)."""
    stream.seek(0)
    n = header_length(stream.read(8), size, max_header_bytes)
    return parse_header(stream.read(n), 8 + n, size, dtypes)


def read_tensor(stream: BinaryIO, header: Header, name: str, hasher: Optional[Any] = None) -> torch.Tensor:
    """Tensor ``name`` of the container in ``stream`` read into a new CPU tensor, its bytes
    fed to ``hasher`` (a hashlib object) if given, in chunks as they arrive."""
    entry = header.entries[name]
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    buffer = memoryview(tensor_bytes(tensor))
    stream.seek(header.data_start + entry.begin)
    for start in range(0, len(buffer), _READ_CHUNK_BYTES):
        chunk = buffer[start:start + _READ_CHUNK_BYTES]
        if stream.readinto(chunk) != len(chunk):
            raise ContainerError(f"tensor {name!r} is truncated", name)
        if hasher is not None:
            hasher.update(chunk)
    return tensor
