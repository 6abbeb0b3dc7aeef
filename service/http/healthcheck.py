"""Container health probe: exit 0 when this host's kda-serve answers /health/ready with 200.

The Docker image's HEALTHCHECK runs ``python -m service.http.healthcheck``. It reads the same
``KDA_*`` variables (and flags) as the server, so it probes the port the server listens
on; a wildcard listen address is probed on loopback.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import httpx

from ..config import parse_settings

READY_PATH = "/health/ready"
_WILDCARDS = {"0.0.0.0", "::", ""}


def probe_url(host: str, port: int) -> str:
    """The readiness URL for a server listening on ``host``:``port``."""
    if host in _WILDCARDS:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{READY_PATH}"


def main(argv: Optional[Sequence[str]] = None, timeout: float = 3.0) -> int:
    settings = parse_settings(argv)
    url = probe_url(settings.host, settings.port)
    try:
        status = httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError as e:
        print(f"kda-serve health: {url}: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"kda-serve health: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
