"""Errors of the sharded deployment, and how a shard hands an expected error to the ingress.

`SlotGone` (410), `SlotMoving` (503) and `UnknownShard` (404) are `ServiceError`s, so the
ingress renders them with the single server's problem handlers. A shard never raises an
expected error through Ray (Serve would log a traceback for every 404); it returns a
`ShardFault`, and the ingress raises the rebuilt exception as if it had happened in its
own process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.errors import ServiceError


class SlotGone(ServiceError):
    """410: the slot's state is lost for good (its shard died, or stopped without a
    snapshot). Never served as a zeroed state."""

    status = 410
    slug = "slot-gone"
    title = "Slot state lost"

    def __init__(self, slot_id: str, detail: str) -> None:
        super().__init__(detail)
        self.slot_id = slot_id

    def extra(self) -> dict[str, Any]:
        return {"slot": self.slot_id}


class SlotMoving(ServiceError):
    """503: the slot is between shards; the ingress waits for the move to land and retries,
    so a client sees this only when a move stalls."""

    status = 503
    slug = "slot-moving"
    title = "Slot is being moved"

    def __init__(self, slot_id: str) -> None:
        super().__init__(f"slot {slot_id!r} is being moved to another shard; retry shortly")
        self.slot_id = slot_id

    def extra(self) -> dict[str, Any]:
        return {"slot": self.slot_id}


class UnknownShard(ServiceError):
    """404: a shard name that is not part of this deployment."""

    status = 404
    slug = "unknown-shard"
    title = "Unknown shard"

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"no shard named {name!r}; the shards are {known}", field="shard")


@dataclass(frozen=True)
class ShardFault:
    """An expected exception (a `ServiceError` or `state_store.PoolError`) as plain data.

    Exception classes of this project take constructor arguments that differ from their
    ``args`` (``PoolFull(requested, free)``), so pickling them does not round-trip; this
    carries the class, ``args`` and attributes and `error` rebuilds the same exception
    without calling its constructor.
    """

    kind: type[Exception]
    args: tuple[Any, ...]
    state: dict[str, Any]

    @classmethod
    def of(cls, error: Exception) -> "ShardFault":
        return cls(type(error), tuple(error.args), dict(vars(error)))

    def error(self) -> Exception:
        error = self.kind.__new__(self.kind)
        Exception.__init__(error, *self.args)
        vars(error).update(self.state)
        return error
