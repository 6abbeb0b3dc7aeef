"""Plain-data views the pool hands out: one slot's metadata and the pool's figures."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SlotInfo:
    """One live slot. ``created`` and ``last_used`` are unix wall-clock seconds;
    ``tokens_per_layer[l]`` counts the tokens recorded on layer l; ``state_lost`` is set
    by `StatePool.mark_lost` (an in-place update failed midway) and cleared when the
    state is replaced by `write_state` or `import_`."""

    slot_id: str
    row: int
    created: float
    last_used: float
    tokens_per_layer: list[int]
    state_lost: bool


@dataclass
class PoolStats:
    """Capacity figures. ``allocations`` counts slots created (alloc, fork, import into a
    new slot); ``frees`` explicit frees; ``expiries`` slots freed for idling past the ttl.
    The three counters are process totals: `StatePool.restore` leaves them alone.
    ``state_lost``: live slots flagged state_lost (their state was not recovered)."""

    capacity: int
    free: int
    used: int
    allocations: int
    frees: int
    expiries: int
    bytes_per_slot: int
    state_lost: int
