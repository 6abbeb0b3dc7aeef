"""The slot pool: KDA recurrent states of many sequences in one device tensor, behind opaque
slot ids, with fork, export/import, snapshot/restore and idle expiry. Knows nothing of HTTP.

`StatePool` owns the tensor [L, S, HV, V, K]; `SlotOrdering` orders asyncio work per
(slot, layer). Every error is a `PoolError`.
"""
from .errors import GeometryMismatch, PoolError, PoolFull, SnapshotError, UnknownSlot
from .geometry import PoolGeometry
from .ordering import SlotOrdering
from .pool import StatePool
from .records import PoolStats, SlotInfo

__all__ = [
    "StatePool",
    "PoolGeometry",
    "SlotInfo",
    "PoolStats",
    "SlotOrdering",
    "PoolError",
    "PoolFull",
    "UnknownSlot",
    "GeometryMismatch",
    "SnapshotError",
]
