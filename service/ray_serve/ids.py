"""Slot ids of a sharded deployment: ``{shard}.{incarnation}.{token}``.

``shard`` names the shard deployment that issued the id, ``incarnation`` (base 36) the
life of that shard's process that issued it, ``token`` the id the shard's own pool gave
the slot (128 random bits, URL-safe base64, never a dot). The ingress routes by the shard
name; a shard answers 410 Gone rather than 404 for a token it no longer has when the
incarnation tells it the slot died with an earlier process (`Incarnation.lost`).

Tokens are unique across shards (128 random bits), so a moved slot is keyed by the token
of the id its client holds (`SlotDirectory`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

SEPARATOR = "."
_SHARD = re.compile(r"[A-Za-z0-9_-]{1,32}")
_INCARNATION = re.compile(r"[0-9a-z]{1,13}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def check_shard_name(name: str) -> str:
    """Return ``name`` if it can name a shard in an id: 1-32 characters of [A-Za-z0-9_-]."""
    if not isinstance(name, str) or not _SHARD.fullmatch(name):
        raise ValueError(f"a shard name is 1-32 characters of [A-Za-z0-9_-], got {name!r}")
    return name


def _base36(n: int) -> str:
    digits = []
    while True:
        n, r = divmod(n, 36)
        digits.append(_DIGITS[r])
        if n == 0:
            return "".join(reversed(digits))


@dataclass(frozen=True)
class SlotName:
    """A parsed slot id: the shard, the incarnation that issued it, the pool's token."""

    shard: str
    incarnation: int
    token: str

    def __str__(self) -> str:
        return SEPARATOR.join((self.shard, _base36(self.incarnation), self.token))


def parse_slot_id(slot_id: str) -> Optional[SlotName]:
    """The parts of ``slot_id``, or None when it is not an id of this format."""
    parts = slot_id.split(SEPARATOR) if isinstance(slot_id, str) else []
    if len(parts) != 3:
        return None
    shard, incarnation, token = parts
    if not (_SHARD.fullmatch(shard) and _INCARNATION.fullmatch(incarnation) and _TOKEN.fullmatch(token)):
        return None
    return SlotName(shard, int(incarnation, 36), token)
