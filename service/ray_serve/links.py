"""The ingress's lines to the shards and to the slot directory, over Ray.

`ShardLink.call` turns a shard's `ShardFault` back into the exception it stands for, and
a shard process that died under the call into `ShardUnavailable` (which the router turns
into 410 for that shard's slots). `ShardLink.send` starts a call without awaiting it, so
one call's result can be handed to another shard through the object store (a move's
state never passes through the ingress).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from service.errors import ServiceError

from .errors import ShardFault


class ShardUnavailable(ServiceError):
    """503: a shard process died under a call, or does not answer."""

    status = 503
    slug = "shard-unavailable"
    title = "Shard unavailable"

    def __init__(self, shard: str, why: str) -> None:
        super().__init__(f"shard {shard!r} is unavailable: {why}")
        self.shard = shard


def _died(error: BaseException) -> bool:
    """Whether ``error`` says a Ray actor (a shard replica) died or cannot be reached."""
    if isinstance(error, (RayActorError, DeploymentUnavailableError)):
        return True
    return isinstance(error, RayTaskError) and isinstance(error.cause, RayActorError)


class ShardLink:
    """Calls to the shard deployment ``name`` through ``handle``."""

    def __init__(self, name: str, handle: DeploymentHandle) -> None:
        self.name = name
        self._handle = handle

    def send(self, method: str, *args: Any) -> DeploymentResponse:
        """Start ``method(*args)`` on the shard; arguments may be other calls' responses."""
        return getattr(self._handle, method).remote(*args)

    async def result(self, response: DeploymentResponse, timeout_s: Optional[float] = None) -> Any:
        """A started call's value; the exception a returned `ShardFault` stands for;
        `ShardUnavailable` when the replica died, is gone, or ``timeout_s`` passed."""
        try:
            reply = await asyncio.wait_for(response, timeout_s) if timeout_s is not None else await response
        except asyncio.TimeoutError:
            response.cancel()
            raise ShardUnavailable(self.name, f"no answer within {timeout_s:g} s") from None
        except Exception as e:
            if _died(e):
                raise ShardUnavailable(self.name, f"its process failed ({type(e).__name__})") from None
            raise
        if isinstance(reply, ShardFault):
            raise reply.error()
        return reply

    async def call(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        """``method(*args)`` on the shard, awaited (see `result`)."""
        return await self.result(self.send(method, *args), timeout_s)


class DirectoryLink:
    """Calls to the `SlotDirectory` actor."""

    def __init__(self, actor: ActorHandle) -> None:
        self._actor = actor

    async def lookup(self, tokens: list[str]) -> dict[str, str]:
        return await self._actor.lookup.remote(tokens)

    async def origins(self, tokens: list[str]) -> dict[str, str]:
        return await self._actor.origins.remote(tokens)

    async def record(self, token: str, current: str) -> None:
        await self._actor.record.remote(token, current)

    async def forget(self, token: str) -> None:
        await self._actor.forget.remote(token)

    async def draining(self) -> list[str]:
        return await self._actor.draining.remote()

    async def set_draining(self, shard: str, draining: bool) -> None:
        await self._actor.set_draining.remote(shard, draining)
