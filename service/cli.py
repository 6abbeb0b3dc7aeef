"""``kda-serve``: start the server (uvicorn with httptools, through `KDAHttpConnection`) from flags or
KDA_* variables.

    kda-serve --num-slots 256 --head-dim 128 --port 8000
    python -m service.cli --help
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import NoReturn, Optional, Sequence

import uvicorn

from .http.app import create_app
from .config import parse_settings
from .http.protocol_choice import choose_protocol, fallback_warning

log = logging.getLogger("kda_serve.cli")


def _exit_cleanly(signum: int, frame: object) -> NoReturn:
    """SIGTERM's handler outside uvicorn's serving loop: uvicorn drains, closes the app
    (snapshot) and then re-raises the signal it caught; this makes that an exit status of 0."""
    raise SystemExit(0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
    except (ValueError, OSError) as e:  # a bad geometry, device, gate file, ...
        print(f"kda-serve: {e}", file=sys.stderr)
        return 2
    geometry = app.state.core.geometry
    print(
        f"kda-serve: listening on http://{settings.host}:{settings.port} "
        f"(pool {list(geometry.shape)} {geometry.dtype_name} on {geometry.device}, backend {app.state.core.backend})",
        flush=True,
    )
    protocol, fallback = choose_protocol()
    if fallback is not None:
        log.warning("%s", fallback_warning(fallback))
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(app, host=settings.host, port=settings.port, http=protocol, log_level=settings.log_level,
                timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
