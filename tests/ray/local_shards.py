"""A `ShardedCore` over two real `ShardServer`s in this process (`LocalLink` stands in for
Ray: same faults, same chaining of one call's result into another), for races and states a
cluster cannot be steered into; shared by the in-process Ray Serve tests."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Optional

import torch
from ray_helpers import HV, K, LAYERS, V, make_sequence

from service.config import Settings
from service.core.inputs import REQUIRED_TENSORS, Checkpoint, PrefillInputs, PrefillParams
from service.ray_serve.directory import SlotDirectory
from service.ray_serve.links import ShardLink
from service.ray_serve.router import ShardedCore
from service.ray_serve.shard import ShardServer

SETTINGS = Settings(device="cpu", num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                    batch_window_ms=0.0, prefix_cache_mb=1.0)
Hook = Callable[[str, tuple[Any, ...]], Any]


class LocalLink(ShardLink):
    """`ShardLink` over a `ShardServer` in this process: a call is a task, an argument that
    is another call's task is awaited first (as Ray resolves a response passed on), and
    ``before`` (when set) runs ahead of every call with its method and arguments."""

    def __init__(self, name: str, shard: ShardServer) -> None:
        self.name = name
        self.shard = shard
        self.before: Optional[Hook] = None

    def send(self, method: str, *args: Any) -> Any:
        async def run() -> Any:
            resolved = [await a if isinstance(a, asyncio.Future) else a for a in args]
            if self.before is not None:
                await self.before(method, tuple(resolved))
            return await getattr(self.shard, method)(*resolved)
        return asyncio.ensure_future(run())


class LocalDirectory:
    """`DirectoryLink`'s methods over a `SlotDirectory` in this process."""

    def __init__(self) -> None:
        self._table = SlotDirectory(None)

    async def lookup(self, tokens: list[str]) -> dict[str, str]:
        return self._table.lookup(tokens)

    async def origins(self, tokens: list[str]) -> dict[str, str]:
        return self._table.origins(tokens)

    async def record(self, token: str, current: str) -> None:
        self._table.record(token, current)

    async def forget(self, token: str) -> None:
        self._table.forget(token)

    async def draining(self) -> list[str]:
        return self._table.draining()

    async def set_draining(self, shard: str, draining: bool) -> None:
        self._table.set_draining(shard, draining)


@dataclasses.dataclass
class Local:
    """A `ShardedCore` over shards ``a`` and ``b`` (links by name, for hooks and direct calls)."""

    core: ShardedCore
    links: dict[str, LocalLink]

    def pool_token(self, slot_id: str) -> str:
        return slot_id.split(".")[2]


async def _local(status_max_age_s: float = 0.0) -> Local:
    links = {}
    for name in ("a", "b"):
        shard = ShardServer(name, SETTINGS, None)
        await shard.start()
        links[name] = LocalLink(name, shard)
    core = ShardedCore(SETTINGS, links, LocalDirectory(), move_wait_s=1.0,  # type: ignore[arg-type]
                       status_max_age_s=status_max_age_s)
    return Local(core, links)


async def _close(local: Local) -> None:
    for link in local.links.values():
        await link.shard.close()


def run_local(scenario: Callable[[Local], Any], status_max_age_s: float = 0.0) -> None:
    """Run ``scenario(local)`` over a fresh `Local`, closed after."""
    async def main() -> None:
        local = await _local(status_max_age_s)
        try:
            await asyncio.wait_for(scenario(local), 120)
        finally:
            await _close(local)
    asyncio.run(main())


def prefill_inputs(slots: list[Optional[str]], seqs: list[tuple[torch.Tensor, ...]], layer: int = 0,
            checkpoints: Optional[list[list[Checkpoint]]] = None) -> PrefillInputs:
    packed = [torch.cat([s[i] for s in seqs]) for i in range(5)]
    return PrefillInputs.of(PrefillParams(layer=layer), slots, [s[0].shape[0] for s in seqs],
                            dict(zip(REQUIRED_TENSORS, packed)), checkpoints=checkpoints)


async def slots_on(local: Local, shard: str, count: int = 1) -> list[str]:
    """``count`` new slots on ``shard`` (through the router's own shard link)."""
    return await local.core.shards[shard].call("alloc", count)


async def fill_layers(local: Local, slot: str, tokens: int, gen: torch.Generator, key: Optional[str] = None) -> None:
    """Prefill ``tokens`` on every layer of ``slot``, checkpointing ``key`` at the end of each."""
    for layer in range(LAYERS):
        marks = [[Checkpoint(tokens, key)]] if key is not None else None
        await local.core.prefill(prefill_inputs([slot], [make_sequence(tokens, gen)], layer, marks))
