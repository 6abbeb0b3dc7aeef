"""`SlotDirectory`: where moved slots live now, and which shards are draining.

A slot's id names the shard that issued it, so only moved slots need a record: the token
of the id its client holds -> the id it has now on another shard. One directory serves
every ingress replica (`service.ray_serve.deploy` runs it as a detached named Ray actor,
so it outlives ingress restarts) and, given a path, persists every change to a JSON file
(temp file, fsync, rename) that a restarted directory reads back. No Ray in here.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from .ids import parse_slot_id


class SlotDirectory:
    """Moved slots (public token -> current id) and draining shards, kept in ``path``
    when one is given (None: in memory, for the life of this object)."""

    def __init__(self, path: Optional[str]) -> None:
        self._path = path
        self._moved: dict[str, str] = {}
        self._draining: set[str] = set()
        if path is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            self._moved = {str(k): str(v) for k, v in doc["moved"].items()}
            self._draining = {str(name) for name in doc["draining"]}
        self._origin = {self._current_token(current): token for token, current in self._moved.items()}

    @staticmethod
    def _current_token(slot_id: str) -> str:
        parsed = parse_slot_id(slot_id)
        if parsed is None:
            raise ValueError(f"not a sharded slot id: {slot_id!r}")
        return parsed.token

    def lookup(self, tokens: list[str]) -> dict[str, str]:
        """The current ids of those of ``tokens`` that were moved."""
        return {token: self._moved[token] for token in tokens if token in self._moved}

    def origins(self, tokens: list[str]) -> dict[str, str]:
        """For tokens of slots as they live now, the public token of those that were moved
        there (a slot's public token is its own token until it moves)."""
        return {token: self._origin[token] for token in tokens if token in self._origin}

    def record(self, token: str, current: str) -> None:
        """The slot publicly known by ``token`` now lives at ``current``."""
        previous = self._moved.get(token)
        if previous is not None:
            self._origin.pop(self._current_token(previous), None)
        self._moved[token] = current
        self._origin[self._current_token(current)] = token
        self._save()

    def forget(self, token: str) -> None:
        """The slot publicly known by ``token`` was freed."""
        current = self._moved.pop(token, None)
        if current is not None:
            self._origin.pop(self._current_token(current), None)
            self._save()

    def draining(self) -> list[str]:
        """Shards that take no new slots."""
        return sorted(self._draining)

    def set_draining(self, shard: str, draining: bool) -> None:
        if draining:
            self._draining.add(shard)
        else:
            self._draining.discard(shard)
        self._save()

    def _save(self) -> None:
        if self._path is None:
            return
        directory = os.path.dirname(os.path.abspath(self._path))
        os.makedirs(directory, exist_ok=True)
        tmp = self._path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"moved": self._moved, "draining": sorted(self._draining)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
