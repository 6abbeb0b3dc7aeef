"""`CoreAPI`: what the REST routes (`service.http.routes`) need of a core, and nothing more.

Two classes implement it with the same signatures and return types: `ServerCore` (one
pool on one device) and the Ray ingress's `ShardedCore` (`service.ray_serve.router`: the
same operations routed to the shards holding the slots). Every operation is a coroutine,
because a sharded core answers each of them over the network; a single core's metadata
reads (`slot_info`, `info`) simply never wait.

Errors are the service's (`service.errors`, `state_store`'s pool errors, and for a
sharded core `service.ray_serve.errors`); the problem+json handlers render each one.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from state_store import PoolGeometry, PrefixInfo, PrefixMatch, SlotInfo

from .inputs import PrefillInputs, PrefillResult
from .metrics import Metrics


class CoreAPI(Protocol):
    """The operations behind every REST route.

    ``geometry``: the pool's layers, heads, head sizes and state dtype (what a request is
    checked against); ``metrics``: the registry the HTTP middleware counts requests in and
    the abandoned-response counter lives in; ``slot_missing``: the errors `free` raises for
    a slot that is already gone (skipped when freeing the slots of a client that left).
    """

    geometry: PoolGeometry
    metrics: Metrics
    slot_missing: tuple[type[Exception], ...]

    async def alloc(self, count: int = 1) -> list[str]:
        """``count`` new slots with zero state, all or none (PoolFull when short)."""
        ...

    async def free(self, slot_id: str) -> None:
        """Free the slot once the work queued on it before this call is done."""
        ...

    async def fork(self, slot_id: str) -> str:
        """A new slot holding a copy of ``slot_id``'s state (and token counts)."""
        ...

    async def slot_info(self, slot_id: str) -> SlotInfo:
        """The slot's metadata, ``slot_id`` as the caller named it."""
        ...

    async def get_state(self, slot_id: str) -> torch.Tensor:
        """The slot's state, [L, HV, V, K] in the pool dtype, on the host."""
        ...

    async def export_state(self, slot_id: str) -> bytes:
        """The slot's state as safetensors (tensor ``state`` plus geometry metadata)."""
        ...

    async def put_state(self, slot_id: str, state: torch.Tensor) -> None:
        """Replace the slot's state with ``state`` [L, HV, V, K] (pool dtype, finite)."""
        ...

    async def alloc_prefix(self, prefix: Sequence[str], count: int = 1) -> tuple[list[str], PrefixMatch]:
        """``count`` new slots holding the longest complete prefix cache entry among the keys
        ``prefix`` (zero state when none matches), and the match."""
        ...

    async def publish(self, slot_id: str, key: str) -> PrefixInfo:
        """The slot's state (all layers, equal token counts) as the complete entry ``key``."""
        ...

    async def prefix_info(self, key: str) -> PrefixInfo:
        """The prefix cache entry ``key`` (UnknownPrefix when there is none)."""
        ...

    async def drop_prefix(self, key: str) -> bool:
        """Remove the prefix cache entry ``key``; whether there was one (no entry is no error)."""
        ...

    async def prefill(self, inputs: PrefillInputs) -> PrefillResult:
        """Validate and run one prefill; outputs on the host unless ``device_outputs``."""
        ...

    async def info(self) -> dict[str, Any]:
        """The ``GET /info`` document: geometry, device, backend, slot counts, gate layers."""
        ...

    async def render_metrics(self) -> bytes:
        """The ``GET /metrics`` page (Prometheus text exposition)."""
        ...

    async def check_ready(self) -> None:
        """Return when the core can serve; raise NotReady (503) saying why not."""
        ...
