"""`PrefillOutput`: what a prefill gives back (`KDAClient.prefill`, `PreparedPrefill.run`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class PrefillOutput:
    """The result of `prefill`: ``slots`` (each sequence's slot id, new ones included),
    ``lengths``, ``o_packed`` [T, HV, V] in v's dtype and ``final_state`` [N, HV, V, K]
    (None when declined). ``o`` splits o_packed per sequence (views, no copy).
    ``server_timing``: the server's phases in milliseconds (decode, validate, kernel, encode;
    a prepared run's refill, rows, queue, wait, settle, deliver, total), from its ``Server-Timing``."""

    slots: list[str]
    lengths: list[int]
    o_packed: torch.Tensor
    final_state: Optional[torch.Tensor]
    server_timing: dict[str, float] = field(default_factory=dict)

    @property
    def o(self) -> list[torch.Tensor]:
        return list(self.o_packed.split(self.lengths))
