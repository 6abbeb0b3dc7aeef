"""What travels between the ingress and the shards through Ray.

Tensors travel as `Array`: the tensor's bytes as a flat numpy ``uint8`` array (a view,
no copy) plus dtype and shape. Ray serializes numpy arrays out of band: the bytes are
copied once into the object store and the receiver maps them without a copy (read-only).
Torch tensors would be pickled through their storage, and bfloat16 has no numpy dtype,
hence the byte view. Everything else in these records is small metadata.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from service.core.inputs import Checkpoint, PrefillInputs, PrefillParams
from service.wire.tensors import JSON_DTYPES, JSON_NAMES
from tensor_io.views import tensor_bytes

from .errors import ShardFault


@dataclass(frozen=True)
class Array:
    """A CPU tensor in transit: its bytes, dtype name (``float32``, ``bfloat16``, ...) and shape."""

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> "Array":
        """A view of ``t``'s bytes when it is a contiguous CPU tensor, else one copy."""
        return cls(tensor_bytes(t), JSON_NAMES[t.dtype], tuple(t.shape))

    def tensor(self) -> torch.Tensor:
        """The tensor, a view over the received bytes (read-only when they came from the
        object store: every reader here copies or only reads)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(self.data)
        return flat.view(JSON_DTYPES[self.dtype]).view(self.shape)


@dataclass(frozen=True)
class ShardPrefill:
    """One shard's part of a prefill (`service.core.inputs.PrefillInputs`): slot ids of this
    shard (or None: allocate), lengths, the request's params, and its tensors by name
    (`service.core.inputs.TENSORS`, those given) as `Array`s."""

    slots: list[Optional[str]]
    lengths: list[int]
    params: PrefillParams
    tensors: dict[str, Array]
    checkpoints: list[list[Checkpoint]] = field(default_factory=list)

    def inputs(self, slots: list[Optional[str]]) -> PrefillInputs:
        """The prefill on the shard's own slot tokens ``slots``, over the received bytes."""
        return PrefillInputs.of(self.params, slots, self.lengths, {n: a.tensor() for n, a in self.tensors.items()},
                                checkpoints=self.checkpoints or None)


@dataclass(frozen=True)
class ShardResult:
    """A shard's `service.core.inputs.PrefillResult`: ``slots`` and ``allocated`` are full
    ids; ``kernel_s``: seconds of the launch that ran it there."""

    slots: list[str]
    lengths: list[int]
    o: Array
    final_state: Optional[Array]
    allocated: list[str]
    kernel_s: float


@dataclass(frozen=True)
class SlotCargo:
    """A slot taken out of its shard for a move: its state [L, HV, V, K] bit for bit,
    its token counts and lost flag."""

    state: Array
    tokens_per_layer: list[int]
    state_lost: bool


@dataclass(frozen=True)
class TakeFailed:
    """What a shard's ``put`` returns when the ``take`` chained into it failed."""

    fault: ShardFault


@dataclass(frozen=True)
class ShardStatus:
    """A shard's figures, for placement, /info and /shards."""

    name: str
    incarnation: int
    capacity: int
    free: int
    used: int
    device: str
    backend: str
    pid: int
