"""`PoolGeometry`: the shape, dtype and device of a state pool, validated once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
"""The pool dtypes the kernels accept, with their names in metadata and messages."""


@dataclass(frozen=True)
class PoolGeometry:
    """Geometry of a logical pool ``[num_layers, num_slots, num_heads, head_v_dim, head_k_dim]``
    (`StatePool` keeps it in storage rows, with spares beside them).

    num_heads is HV, the value heads (the state's heads). The state of one head is stored
    V-first, ``[head_v_dim, head_k_dim]`` with K contiguous. dtype is float32 or bfloat16.
    """

    num_layers: int
    num_slots: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_slots", "num_heads", "head_k_dim", "head_v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"pool dtype must be torch.float32 or torch.bfloat16, got {self.dtype}")
        if not isinstance(self.device, torch.device):
            raise ValueError(f"device must be a torch.device, got {self.device!r}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The logical pool's shape [L, S, HV, V, K] (a snapshot's tensor)."""
        return (self.num_layers, self.num_slots, self.num_heads, self.head_v_dim, self.head_k_dim)

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        """One slot's state across all layers, [L, HV, V, K]."""
        return (self.num_layers, self.num_heads, self.head_v_dim, self.head_k_dim)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's state over all layers."""
        L, HV, V, K = self.slot_shape
        return L * HV * V * K * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of the logical pool (its spare rows not counted)."""
        return self.bytes_per_slot * self.num_slots

    def state_fields(self) -> dict[str, Any]:
        """What a slot's state must agree on (num_slots and device excluded), JSON-ready."""
        return {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_k_dim": self.head_k_dim,
            "head_v_dim": self.head_v_dim,
            "dtype": self.dtype_name,
        }

    def pool_fields(self) -> dict[str, Any]:
        """What a whole-pool snapshot must agree on (device excluded), JSON-ready."""
        return {"num_slots": self.num_slots, **self.state_fields()}
