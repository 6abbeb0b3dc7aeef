"""Whole-pool snapshot files: write atomically, read and verify before anything changes.

A snapshot is a safetensors file with one tensor ``"pool"`` [L, S, HV, V, K] (the pool
dtype) and this metadata:
- ``format`` = "kda-serve/pool-snapshot", ``version`` = "1";
- ``index``: JSON ``{"geometry": {num_slots, num_layers, num_heads, head_k_dim, head_v_dim,
  dtype}, "saved_at": unix seconds, "generation": n, "slots": [{slot_id, row, created,
  last_used, tokens_per_layer, state_lost}, ...]}``; ``generation`` numbers the snapshots
  of one pool file (`state_store.persistence` keys its journal by it; 0 when absent);
- ``index_sha256`` and ``pool_sha256``: hex sha256 of the index string (UTF-8) and of the
  tensor's bytes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
from typing import Any, Iterable, Sequence, Union

import torch

from tensor_io import safetensors_format
from tensor_io.views import tensor_bytes

from .errors import GeometryMismatch, SnapshotError, SnapshotNotDurable
from .geometry import PoolGeometry
from .records import SlotInfo

FORMAT = "kda-serve/pool-snapshot"
VERSION = "1"
TENSOR_NAME = "pool"
PathLike = Union[str, os.PathLike]
_SLOT_KEYS = {field.name for field in dataclasses.fields(SlotInfo)}


@dataclasses.dataclass(frozen=True)
class Stamp:
    """Which snapshot: the unix time it was taken and its generation."""

    saved_at: float
    generation: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A verified snapshot: the pool as a CPU tensor [L, S, HV, V, K], its slots, its stamp."""

    pool: torch.Tensor
    slots: list[SlotInfo]
    stamp: Stamp


def write(
    path: PathLike,
    geometry: PoolGeometry,
    parts: Sequence[torch.Tensor],
    slots: list[SlotInfo],
    saved_at: float,
    generation: int = 0,
) -> None:
    """Write the pool [L, S, HV, V, K] given as ``parts``, each [n, HV, V, K]: its L * S rows
    in order (layer by layer, slot rows in order), n at a time (any device; views of the
    pool's storage), and its id map to ``path`` atomically.

    The file is written to a temporary name in the same directory, flushed and fsynced,
    renamed over ``path``, and the directory fsynced: a crash leaves the old snapshot or
    the new one, never a mix. The pool is copied to the host one part at a time.
    Raises SnapshotError when the file cannot be written.
    """
    index = json.dumps(
        {
            "geometry": geometry.pool_fields(),
            "saved_at": saved_at,
            "generation": generation,
            "slots": [dataclasses.asdict(slot) for slot in slots],
        }
    )
    count = sum(part.shape[0] for part in parts)
    if count != geometry.num_layers * geometry.num_slots:
        raise ValueError(f"a pool of {geometry.num_layers} x {geometry.num_slots} rows, got {count}")
    pool_hash = hashlib.sha256()
    for part in parts:
        pool_hash.update(tensor_bytes(part))
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "index": index,
        "index_sha256": hashlib.sha256(index.encode()).hexdigest(),
        "pool_sha256": pool_hash.hexdigest(),
    }
    write_atomically(path, TENSOR_NAME, geometry.dtype, geometry.shape, parts, metadata)


def write_atomically(path: PathLike, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                     parts: Iterable[torch.Tensor], metadata: dict[str, str]) -> None:
    """One safetensors file at ``path`` holding the tensor ``name`` of ``dtype`` and
    ``shape`` (the bytes of ``parts`` concatenated) and ``metadata``, written atomically: a
    temporary file beside it, fsynced, renamed over ``path``, the directory fsynced.
    SnapshotError when it cannot be written (the old file, if any, is left as it was);
    SnapshotNotDurable when it was renamed in but the directory's fsync failed."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                safetensors_format.write(out, name, dtype, shape, parts, metadata)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
    except OSError as exc:
        raise SnapshotError(path, f"cannot write: {exc}") from exc
    try:
        fsync_directory(directory)
    except OSError as exc:
        raise SnapshotNotDurable(path, f"renamed into place, but the rename may not survive a crash: {exc}") from exc


def remove_temporaries(path: PathLike) -> None:
    """Remove the temporary files of `write_atomically` for ``path`` that a crash left
    beside it (each as large as the file). Only while nothing writes ``path`` (at start).
    SnapshotError when its directory cannot be listed."""
    directory, base = os.path.split(os.path.abspath(path))
    temporary = re.compile(rf"\.{re.escape(base)}\.[^./]+\.tmp")  # mkstemp's prefix, random part, suffix
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise SnapshotError(path, f"cannot list its directory: {exc}") from exc
    for name in names:
        if temporary.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def fsync_directory(directory: str) -> None:
    """Make a rename or a new file in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: PathLike, geometry: PoolGeometry) -> Snapshot:
    """Read and verify a snapshot taken of a pool of ``geometry``.

    Raises GeometryMismatch when it is of another geometry or dtype,
    SnapshotError when it is unreadable, truncated, corrupted or not a pool snapshot.
    """
    try:
        with open(path, "rb") as stream:
            header = safetensors_format.read_header(stream, os.fstat(stream.fileno()).st_size)
            entry = header.only(TENSOR_NAME)
            index = _verified_index(header.metadata)
            expected = geometry.pool_fields()
            if index.get("geometry") != expected:
                raise GeometryMismatch(expected, index.get("geometry"))
            if entry.shape != geometry.shape or entry.dtype != geometry.dtype:
                raise safetensors_format.ContainerError(
                    f"tensor {TENSOR_NAME!r} is {entry.dtype}{list(entry.shape)}, the index "
                    f"declares {geometry.dtype}{list(geometry.shape)}"
                )
            slots = _slots(index.get("slots"), geometry)
            saved_at = _finite(index.get("saved_at"), "saved_at")
            generation = index.get("generation", 0)
            if not _count(generation):
                raise safetensors_format.ContainerError(f"index generation is not a count: {generation!r}")
            pool_hash = hashlib.sha256()
            pool = safetensors_format.read_tensor(stream, header, TENSOR_NAME, pool_hash)
    except OSError as exc:
        raise SnapshotError(path, f"cannot read: {exc}") from exc
    except safetensors_format.ContainerError as exc:
        raise SnapshotError(path, str(exc)) from None
    if pool_hash.hexdigest() != header.metadata["pool_sha256"]:
        raise SnapshotError(path, "pool tensor checksum mismatch: the data is corrupted")
    return Snapshot(pool, slots, Stamp(saved_at, generation))


def _verified_index(metadata: dict[str, str]) -> dict[str, Any]:
    if metadata.get("format") != FORMAT:
        raise safetensors_format.ContainerError(f"not a kda-serve pool snapshot (format {metadata.get('format')!r})")
    if metadata.get("version") != VERSION:
        raise safetensors_format.ContainerError(f"unsupported snapshot version {metadata.get('version')!r}")
    missing = [key for key in ("index", "index_sha256", "pool_sha256") if key not in metadata]
    if missing:
        raise safetensors_format.ContainerError(f"metadata lacks {missing}")
    if hashlib.sha256(metadata["index"].encode()).hexdigest() != metadata["index_sha256"]:
        raise safetensors_format.ContainerError("index checksum mismatch: the id map is corrupted")
    index = safetensors_format.parse_json(metadata["index"], "the index")
    if not isinstance(index, dict):
        raise safetensors_format.ContainerError("index is not a JSON object")
    return index


def _slots(raw: Any, geometry: PoolGeometry) -> list[SlotInfo]:
    if not isinstance(raw, list):
        raise safetensors_format.ContainerError("index slots is not a list")
    slots = [_slot(item, geometry) for item in raw]
    if len({slot.slot_id for slot in slots}) != len(slots):
        raise safetensors_format.ContainerError("index maps one slot id twice")
    if len({slot.row for slot in slots}) != len(slots):
        raise safetensors_format.ContainerError("index maps one row to two slot ids")
    return slots


def _slot(item: Any, geometry: PoolGeometry) -> SlotInfo:
    if not isinstance(item, dict) or set(item) != _SLOT_KEYS:
        raise safetensors_format.ContainerError(f"malformed slot entry {item!r}")
    slot = SlotInfo(**item)
    tokens = slot.tokens_per_layer
    if not (
        isinstance(slot.slot_id, str)
        and slot.slot_id
        and _count(slot.row)
        and slot.row < geometry.num_slots
        and isinstance(tokens, list)
        and len(tokens) == geometry.num_layers
        and all(_count(t) for t in tokens)
        and isinstance(slot.state_lost, bool)
    ):
        raise safetensors_format.ContainerError(f"malformed slot entry {item!r}")
    _finite(slot.created, "created")
    _finite(slot.last_used, "last_used")
    return slot


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise safetensors_format.ContainerError(f"index {name} is not a finite number: {value!r}")
    return float(value)
