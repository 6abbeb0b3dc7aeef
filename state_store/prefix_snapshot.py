"""The prefix cache's file beside a pool snapshot: written atomically, verified in full
before anything changes.

A safetensors file with one tensor ``"entries"`` [E, L, HV, V, K] (the pool dtype; E may be
0) and this metadata: ``format`` = "kda-serve/prefix-cache", ``version`` = "1"; ``index``:
JSON ``{"geometry": {num_layers, num_heads, head_k_dim, head_v_dim, dtype}, "entries":
[{key, tokens, have: [bool per layer], idle: seconds since last use}, ...]}`` least recently
used first; ``index_sha256`` and ``entries_sha256`` of the index (UTF-8) and the tensor.

Both tiers are saved alike; a restore places entries as the budgets allow, the most
recently used first. Entries are copies independent of every slot, so this file need not
be of the same generation as the pool snapshot beside it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch

from tensor_io import safetensors_format
from tensor_io.views import tensor_bytes

from .errors import GeometryMismatch, SnapshotError
from .geometry import PoolGeometry
from .prefix_cache import PrefixCache, key_problem
from .snapshot import PathLike, write_atomically

FORMAT = "kda-serve/prefix-cache"
VERSION = "1"
TENSOR_NAME = "entries"
SUFFIX = ".prefix"

Loaded = tuple[str, int, list[bool], float, torch.Tensor]
"""One entry read back: key, tokens, layers stored, idle seconds, state [L, HV, V, K] (CPU)."""


def write(path: PathLike, cache: PrefixCache) -> None:
    """Write every entry of ``cache`` to ``path`` atomically (temporary file, fsync, rename,
    directory fsync). Raises SnapshotError when it cannot be written."""
    g = cache.geometry
    entries = cache.entries()
    now = cache.now()
    index = json.dumps({
        "geometry": g.state_fields(),
        "entries": [{"key": e.key, "tokens": e.tokens, "have": list(e.have),
                     "idle": max(0.0, now - e.last_used)} for e in entries],
    })
    states = [e.state for e in entries]
    digest = hashlib.sha256()
    for state in states:
        digest.update(tensor_bytes(state))
    metadata = {"format": FORMAT, "version": VERSION, "index": index,
                "index_sha256": hashlib.sha256(index.encode()).hexdigest(), "entries_sha256": digest.hexdigest()}
    write_atomically(path, TENSOR_NAME, g.dtype, (len(states), *g.slot_shape), states, metadata)


def read(path: PathLike, geometry: PoolGeometry) -> list[Loaded]:
    """The entries of the file at ``path``, verified, for a pool of ``geometry``.

    Raises GeometryMismatch for another geometry or dtype, SnapshotError when the file is
    unreadable, truncated, corrupted or not a prefix cache file."""
    try:
        with open(path, "rb") as stream:
            header = safetensors_format.read_header(stream, os.fstat(stream.fileno()).st_size)
            entry = header.only(TENSOR_NAME)
            meta = header.metadata
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise safetensors_format.ContainerError(
                    f"not a kda-serve prefix cache file (format {meta.get('format')!r}, version {meta.get('version')!r})")
            raw = meta.get("index", "")
            if hashlib.sha256(raw.encode()).hexdigest() != meta.get("index_sha256"):
                raise safetensors_format.ContainerError("index checksum mismatch: the index is corrupted")
            index = safetensors_format.parse_json(raw, "index")
            expected = geometry.state_fields()
            if not isinstance(index, dict) or index.get("geometry") != expected:
                raise GeometryMismatch(expected, index.get("geometry") if isinstance(index, dict) else None)
            items = [_item(x, geometry.num_layers) for x in _list(index.get("entries"))]
            want = (len(items), *geometry.slot_shape)
            if entry.shape != want or entry.dtype != geometry.dtype:
                raise safetensors_format.ContainerError(
                    f"tensor {TENSOR_NAME!r} is {entry.dtype}{list(entry.shape)}, the index declares "
                    f"{geometry.dtype}{list(want)}")
            digest = hashlib.sha256()
            states = safetensors_format.read_tensor(stream, header, TENSOR_NAME, digest)
    except OSError as exc:
        raise SnapshotError(path, f"cannot read: {exc}") from exc
    except safetensors_format.ContainerError as exc:
        raise SnapshotError(path, str(exc)) from None
    if digest.hexdigest() != meta.get("entries_sha256"):
        raise SnapshotError(path, "entries checksum mismatch: the data is corrupted")
    return [(key, tokens, have, idle, states[i]) for i, (key, tokens, have, idle) in enumerate(items)]


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise safetensors_format.ContainerError(f"index entries must be a list, got {type(value).__name__}")
    return value


def _item(x: Any, num_layers: int) -> tuple[str, int, list[bool], float]:
    bad = safetensors_format.ContainerError(f"not a prefix cache entry: {str(x)[:200]}")
    if not isinstance(x, dict) or set(x) != {"key", "tokens", "have", "idle"}:
        raise bad
    key, tokens, have, idle = x["key"], x["tokens"], x["have"], x["idle"]
    if key_problem(key) is not None or not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise bad
    if not isinstance(have, list) or len(have) != num_layers or not all(isinstance(h, bool) for h in have):
        raise bad
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not math.isfinite(idle) or idle < 0:
        raise bad
    return key, tokens, have, float(idle)
