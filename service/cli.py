"""``kda-serve``: start the server (uvicorn with httptools, through `KDAHttpConnection` or, where
this uvicorn lacks its hooks, uvicorn's stock protocol: `service.http.protocol_choice`) from flags
or KDA_* variables.

    kda-serve --num-slots 256 --head-dim 128 --port 8000
    kda-serve --version
    python -m service.cli --help

Start-up, in order: the pool is allocated and the gate file loaded (`create_app`), the
port is bound (the gRPC port and the framed socket's path checked), the snapshot restored;
then uvicorn starts, and once it listens, ``kda-serve: listening on http://HOST:PORT (...)``
is printed on stdout. The kernels warm up in the background after that (logged with their
duration; ``/health/ready`` answers 200 once they passed their self-test). A start refused
on the way (a pool larger than the device's memory, a CUDA device that is not there or a
backend that cannot run on the device, a bad gate file, a port in use, a framed socket that
cannot be made, a snapshot that cannot be used, a bad setting) prints one line,
``kda-serve: <why>``, on stderr and exits 2, with no traceback. Logs go to stderr in one
format (`service.logs`; ``--log-format json``).

Stopping (SIGTERM, or SIGINT): `Server`, uvicorn's, calls `begin_shutdown` the moment the
signal arrives, so gRPC stops taking new work at once; uvicorn stops listening and drains
HTTP (up to 30 s); then the app's shutdown stops gRPC, writes the last snapshot, exit 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType
from typing import NoReturn, Optional, Sequence

import uvicorn
from fastapi import FastAPI

from state_store import PoolError

from .config import Settings, parse_settings
from .framed import socket_path_problem
from .http.app import begin_shutdown, create_app
from .http.protocol_choice import choose_protocol, fallback_warning
from .http.request_id import RequestIdFilter
from .logs import configure_logging

log = logging.getLogger("kda_serve.cli")
REFUSED = 2
"""The exit status of a start refused (as argparse's for a bad flag)."""


class StartRefused(Exception):
    """The server cannot start; ``str(e)`` says why, on one line."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _exit_cleanly(signum: int, frame: object) -> NoReturn:
    """SIGTERM's handler outside uvicorn's serving loop: uvicorn drains, closes the app
    (snapshot) and then re-raises the signal it caught; this makes that an exit status of 0."""
    raise SystemExit(0)


class Server(uvicorn.Server):
    """uvicorn's server for ``app``, which also tells the app the moment a signal asks it
    to stop (`begin_shutdown`), before uvicorn's drain of HTTP. Made on the serving loop."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """uvicorn's handler (signal.signal, between two bytecodes): the app is told from
        the loop, as soon as the handler returns."""
        super().handle_exit(sig, frame)
        self._loop.call_soon_threadsafe(begin_shutdown, self._app)


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not block a restart
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartRefused(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _check_grpc_port(host: str, port: int) -> None:
    """Refuse now a gRPC port already in use (the gRPC server binds it itself, later)."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            raise StartRefused(f"cannot serve gRPC on {address}: {e.strerror or e}") from None


def _check_framed_socket(path: str) -> None:
    """Refuse now a framed socket the server could not make at start (`socket_path_problem`)."""
    if (why := socket_path_problem(path)) is not None:
        raise StartRefused(f"cannot serve the framed socket {path}: {why}")


def banner(settings: Settings, app: FastAPI, sock: socket.socket) -> str:
    """The line printed once the server listens."""
    core = app.state.core
    geometry = core.geometry
    port = sock.getsockname()[1]
    return (f"kda-serve: listening on http://{settings.host}:{port} (pool {list(geometry.shape)} "
            f"{geometry.dtype_name} on {geometry.device}, backend {core.backend}; /health/ready once the kernels "
            "are warm)")


async def _serve(settings: Settings, app: FastAPI, sock: socket.socket, config: uvicorn.Config) -> None:
    """Restore the snapshot, start uvicorn on ``sock`` and print the banner once it
    listens; return when it stops. StartRefused when the snapshot cannot be used or the
    application does not start."""
    try:
        await app.state.core.restore()
    except PoolError as e:  # SnapshotError, GeometryMismatch: the pool is as it was
        raise StartRefused(f"refused the snapshot: {_one_line(e)}") from None
    server = Server(config, app)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.wait({serving}, timeout=0.02)
    if server.started:
        print(banner(settings, app, sock), flush=True)
    await serving
    if not server.started:
        raise StartRefused("the application did not start (see the log above)")


def run(settings: Settings) -> None:
    """Start and serve until stopped (SIGTERM: drain, snapshot, exit 0). StartRefused
    when the start is refused (see the module docstring)."""
    if (why := settings.device_problem()) is not None:  # else: listening, its warm-up failing, never ready
        raise StartRefused(why)
    try:
        app = create_app(settings)
    except (PoolError, ValueError, OSError) as e:  # too large a pool, a bad geometry, device or gate file, ...
        raise StartRefused(_one_line(e)) from None
    sock = _bind(settings.host, settings.port)
    try:
        if settings.grpc_port:
            _check_grpc_port(settings.host, settings.grpc_port)
        if settings.framed_socket:
            _check_framed_socket(settings.framed_socket)
        protocol, fallback = choose_protocol()
        if fallback is not None:
            log.warning("%s", fallback_warning(fallback))
        # log_config=None: uvicorn's loggers keep going through ours (service.logs)
        config = uvicorn.Config(app, http=protocol, log_config=None, log_level=settings.log_level, lifespan="on",
                                timeout_graceful_shutdown=30)
        signal.signal(signal.SIGTERM, _exit_cleanly)
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:  # uvloop when installed
            runner.run(_serve(settings, app, sock, config))
    finally:
        sock.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = parse_settings(argv)  # a bad flag: argparse's usage message, exit 2
    configure_logging(settings.log_level, settings.log_format, filters=[RequestIdFilter()])
    try:
        run(settings)
    except StartRefused as e:
        print(f"kda-serve: {e}", file=sys.stderr, flush=True)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
