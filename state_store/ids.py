"""Public slot ids: opaque random strings, safe in a URL path segment."""
from __future__ import annotations

import re
import secrets
from typing import Container

_PREFIX = re.compile(r"[A-Za-z0-9._~-]{0,64}")
ID_RANDOM_BYTES = 16
"""128 random bits per id: a repeat is not expected in the life of the universe; the
membership check in `new_slot_id` makes a live collision impossible all the same."""


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` (e.g. a shard name) if it is at most 64 URL-unreserved characters."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"id_prefix must be at most 64 characters from [A-Za-z0-9._~-], got {prefix!r}"
        )
    return prefix


def new_slot_id(prefix: str, taken: Container[str]) -> str:
    """A fresh id ``prefix + token_urlsafe(16)`` that is not in ``taken`` (the live ids)."""
    while True:
        slot_id = prefix + secrets.token_urlsafe(ID_RANDOM_BYTES)
        if slot_id not in taken:
            return slot_id
