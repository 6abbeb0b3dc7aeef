"""The slot pool: KDA recurrent states of many sequences in one device tensor, behind opaque
slot ids, with fork, export/import, snapshot/restore and idle expiry. Knows nothing of HTTP.

`StatePool` owns the logical pool [L, S, HV, V, K], kept in storage rows with spares
(`row_map.RowMap`: launches write new states to spare rows and commit by moving rows);
`SlotOrdering` orders asyncio work per (slot, layer); `Persistence` adds periodic
snapshots and a journal of the slots changed since the latest one, for restarts after a
crash; `PrefixCache` keeps slot states under callers' keys (device and pinned host tiers,
LRU within byte budgets) to start new slots from. Every error is a `PoolError`.
"""
from .errors import GeometryMismatch, PoolError, PoolFull, SnapshotError, UnknownSlot
from .geometry import PoolGeometry
from .ordering import SlotOrdering
from .persistence import Persistence, RestoreReport
from .prefix_cache import HOST, CheckpointTarget, PrefixCache, PrefixInfo, PrefixMatch, TierStats, key_problem
from .pool import SlotGroup, StatePool
from .records import PoolStats, SlotInfo
from .row_map import Rows

__all__ = [
    "StatePool",
    "SlotGroup",
    "Rows",
    "PoolGeometry",
    "SlotInfo",
    "PoolStats",
    "SlotOrdering",
    "Persistence",
    "RestoreReport",
    "PrefixCache",
    "CheckpointTarget",
    "HOST",
    "PrefixInfo",
    "PrefixMatch",
    "TierStats",
    "key_problem",
    "PoolError",
    "PoolFull",
    "UnknownSlot",
    "GeometryMismatch",
    "SnapshotError",
]
