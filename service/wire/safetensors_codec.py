"""The safetensors container, parsed and written here (never by `torch.load` or pickle).

Layout: 8 bytes little-endian header length n, n bytes of JSON header, then the data.
The header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data) and may hold ``__metadata__``: string -> string.

`parse_safetensors` trusts nothing: the header length is capped and must fit the body, the
header must be a JSON object without duplicate keys, every dtype known, every shape a
short list of non-negative ints whose byte count equals its offsets' span, and the spans
must tile the data exactly (no overlap, no hole, no trailing bytes) as the format requires.
Only then are tensors made, as zero-copy views over the body.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Mapping, Sequence, Union

import torch

from ..errors import MalformedBody
from .tensors import MAX_RANK, SAFETENSORS_CODES, SAFETENSORS_DTYPES, nbytes, tensor_bytes, view_tensor

MAX_HEADER_BYTES = 8 << 20  # 8 MiB: the safetensors library allows 100 MB; requests need KBs
_SPEC_KEYS = {"dtype", "shape", "data_offsets"}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0  # not bool, not float


def _bad(detail: str, field: str | None = None) -> MalformedBody:
    return MalformedBody(f"bad safetensors body: {detail}", field=field)


def _read_header(view: memoryview, max_header_bytes: int) -> tuple[dict[str, Any], int]:
    """The JSON header as a dict, and where the data begins."""
    if len(view) < 8:
        raise _bad(f"{len(view)} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", view, 0)
    if n > max_header_bytes:
        raise _bad(f"header length {n} exceeds the {max_header_bytes}-byte limit")
    if 8 + n > len(view):
        raise _bad(f"header length {n} runs past the end of a {len(view)}-byte body")
    try:
        header = json.loads(bytes(view[8:8 + n]).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise _bad(f"header must be a JSON object, got {type(header).__name__}")
    return header, 8 + n


def _check_spec(name: str, spec: Any, data_size: int) -> tuple[int, int, torch.dtype, list[int]]:
    """(begin, end, dtype, shape) of one header entry, every field checked."""
    if not isinstance(spec, dict) or set(spec) != _SPEC_KEYS:
        raise _bad(f"tensor {name!r} must be an object with exactly {sorted(_SPEC_KEYS)}, got {spec!r:.200}", name)
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if code not in SAFETENSORS_DTYPES:
        raise _bad(f"tensor {name!r} has dtype {code!r:.40}; supported: {sorted(SAFETENSORS_DTYPES)}", name)
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_uint(d) for d in shape):
        raise _bad(f"tensor {name!r} shape must be a list of at most {MAX_RANK} non-negative ints, got {shape!r:.200}", name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise _bad(f"tensor {name!r} data_offsets must be [begin, end] non-negative ints, got {offsets!r:.200}", name)
    begin, end = offsets
    if not begin <= end <= data_size:
        raise _bad(f"tensor {name!r} data_offsets {offsets} out of range for {data_size} data bytes", name)
    dtype = SAFETENSORS_DTYPES[code]
    want = nbytes(shape, dtype)
    if want != end - begin:
        raise _bad(f"tensor {name!r}: shape {shape} of {code} needs {want} bytes, data_offsets span {end - begin}", name)
    return begin, end, dtype, shape


def parse_safetensors(
    body: Union[bytearray, memoryview], *, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Decode a safetensors body into (tensors, metadata).

    ``body`` must be writable (a bytearray) so the returned CPU tensors, views over it, are
    too; they keep it alive. Tensors come back in header order. Raises MalformedBody (400)
    with the reason, and the tensor's name as ``field``, on any inconsistency.
    """
    view = memoryview(body)
    header, data_start = _read_header(view, max_header_bytes)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("__metadata__ must be an object of strings", "__metadata__")
    data_size = len(view) - data_start
    specs = {name: _check_spec(name, spec, data_size) for name, spec in header.items()}
    position = 0
    for name, (begin, end, _, _) in sorted(specs.items(), key=lambda item: item[1][:2]):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else f"leaves a hole at {position}"
            raise _bad(f"tensor {name!r} at data_offsets [{begin}, {end}] {what}", name)
        position = end
    if position != data_size:
        raise _bad(f"tensors cover {position} of {data_size} data bytes")
    tensors = {name: view_tensor(body, data_start + begin, dtype, shape)
               for name, (begin, _, dtype, shape) in specs.items()}
    return tensors, metadata


TensorParts = Union[torch.Tensor, Sequence[torch.Tensor]]


def _parts(name: str, value: TensorParts) -> tuple[list[torch.Tensor], list[int]]:
    """The pieces of one entry and the shape of their concatenation along dim 0."""
    if isinstance(value, torch.Tensor):
        return [value], list(value.shape)
    parts = list(value)
    if not parts:
        raise ValueError(f"{name}: no tensors to concatenate")
    first = parts[0]
    for p in parts:
        if p.dim() == 0 or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{name}: parts must share dtype and trailing shape to be packed along tokens, "
                f"got {first.dtype}{list(first.shape)} and {p.dtype}{list(p.shape)}"
            )
    return parts, [sum(p.shape[0] for p in parts), *first.shape[1:]]


def _layout(tensors: Mapping[str, TensorParts], metadata: Mapping[str, str] | None
            ) -> tuple[bytes, list[tuple[int, list[torch.Tensor]]], int]:
    """(the 8-byte length and padded JSON header, each tensor's data offset and parts, data bytes)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    layout = []
    offset = 0
    for name, value in tensors.items():
        parts, shape = _parts(name, value)
        dtype = parts[0].dtype
        if dtype not in SAFETENSORS_CODES:
            raise TypeError(f"{name}: dtype {dtype} has no wire form")
        size = nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        layout.append((offset, parts))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as the safetensors writer does
    return struct.pack("<Q", len(head)) + head, layout, offset


def encode_safetensors(tensors: Mapping[str, TensorParts], metadata: Mapping[str, str] | None = None) -> bytearray:
    """One safetensors body holding ``tensors`` (in order) and ``metadata``.

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


def safetensors_pieces(tensors: Mapping[str, TensorParts], metadata: Mapping[str, str] | None = None
                       ) -> list[memoryview]:
    """The body `encode_safetensors` makes, as the pieces to send one after another,
    without joining them: the header, then each part's bytes, viewed in place when it is a
    contiguous CPU tensor (copied once otherwise). The tensors must not change until sent."""
    head, layout, _ = _layout(tensors, metadata)
    pieces = [memoryview(head)]
    for _, parts in layout:
        for p in parts:
            if p.numel():
                pieces.append(memoryview(tensor_bytes(p)))
    return pieces
