"""Which shapes become tensors: the one shape check of every decoder.

A shape read from a request or a file is a list of at most `MAX_RANK` non-negative ints
describing at most `MAX_EXTENT` elements, its zero dims counted as 1. `shape_problem` says
why one is not, before any tensor is made: the safetensors parser (`tensor_io.safetensors_format`:
request bodies, slot imports, snapshots, gate files) calls it for each header entry, and the
JSON, shared memory and KServe documents' shapes are one pydantic type that calls it
(`service.wire.schema.Shape`).
"""
from __future__ import annotations

from typing import Any, Optional

MAX_RANK = 8
MAX_EXTENT = 1 << 48
"""The most elements a shape may describe, its zero dims counted as 1 (256 TiB of bytes,
more than any host holds). Far beyond it torch and numpy cannot make the tensor, not even
an empty one: ``[2^63, 0]``, ``[2^40, 2^40, 0]``, and for numpy anything past 2^63 bytes."""


def shape_problem(shape: Any) -> Optional[str]:
    """Why ``shape`` can be no tensor's (not a list of at most `MAX_RANK` non-negative ints,
    or more than `MAX_EXTENT` elements with zero dims counted as 1), or None."""
    if isinstance(shape, list) and len(shape) <= MAX_RANK:
        extent = 1
        for d in shape:  # one pass: every request body's entries come through here
            if type(d) is not int or d < 0:
                break
            if d:
                extent *= d
        else:
            if extent <= MAX_EXTENT:
                return None
            return (f"shape {shape} describes more than 2^48 elements (zero dims counted as 1): no tensor "
                    "of this project has that shape")
    return f"shape must be a list of at most {MAX_RANK} non-negative ints, got {shape!r:.200}"
