"""`ConnectionLimits`: what one connection may take before it is refused, handed from the
app (its settings) to the HTTP protocol (`service.http.protocol`) through uvicorn's
per-server lifespan state, under `LIMITS_STATE_KEY`, with the `CountRefused` that counts
each request the protocol refuses (under `REFUSED_STATE_KEY`). Importable without uvicorn,
so the app does not depend on the protocol module (which a stock uvicorn protocol may
replace)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

LIMITS_STATE_KEY = "kda_serve.connection_limits"
"""Where the app's lifespan puts its `ConnectionLimits` in uvicorn's per-server state."""

REFUSED_STATE_KEY = "kda_serve.count_refused"
"""Where the app's lifespan puts its `CountRefused` in uvicorn's per-server state."""

CountRefused = Callable[[int, str], None]
"""Counts a request the HTTP protocol refused before the app saw it: its status and its
method (``unknown`` when its request line was not read that far)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Seconds and bytes a connection may take (``Settings``: --header-timeout-s,
    --max-header-kb, --first-request-timeout-s); the defaults are the settings'."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10
    first_request_timeout_s: float = 10.0
