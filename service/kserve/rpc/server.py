"""`GrpcFrontEnd`: the KServe v2 gRPC server (grpc.aio) in the serving process, on the event
loop HTTP runs on, over the same `KServeEndpoint` (core, sequence table, shared memory
registry).

It listens on ``--host``:``--grpc-port`` (SO_REUSEPORT off, so a port in use fails the
start instead of being shared). Received messages are limited to ``--max-body-mb`` (a
larger one is refused by gRPC with RESOURCE_EXHAUSTED before it is decoded); sent ones are
not. One that does not decode reaches its method as `decode.Malformed` (`TolerantDecoding`).

Stopping comes in two steps. From the moment ``stopping`` is set (the process got SIGTERM,
while uvicorn still drains HTTP; `service.http.app.begin_shutdown`): ServerReady and
ModelReady answer false, new calls and streams are refused (UNAVAILABLE), streams stop
reading and end (UNAVAILABLE) once their requests are answered; calls in flight go on.
`stop` (the app's shutdown, after HTTP's drain) sets it too if it was not, stops the server
giving the calls in flight `GRACE_S` to finish, and waits for every inference already
started to run to its end before the core closes.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

import grpc

from ...config import Settings
from ..endpoint import KServeEndpoint
from .calls import Calls
from .decode import TolerantDecoding
from .messages import pb_grpc
from .servicer import InferenceServicer

log = logging.getLogger("kda_serve.grpc")
GRACE_S = 30.0  # as HTTP's graceful shutdown


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcFrontEnd:
    """The gRPC server for ``settings`` (host, grpc_port, max_body_bytes, api_key) on
    ``endpoint``; ``stopping``: set once the server is asked to stop (see the module
    docstring). `start` in the serving loop, `stop` at shutdown."""

    def __init__(self, endpoint: KServeEndpoint, settings: Settings, stopping: asyncio.Event) -> None:
        self.endpoint = endpoint
        self.address = _address(settings.host, settings.grpc_port)
        self.max_receive_bytes = settings.max_body_bytes
        self.calls = Calls(endpoint.core.metrics, settings.api_key, stopping)
        self._server: Optional[grpc.aio.Server] = None

    async def start(self, version: str) -> None:
        """Listen and serve (``version``: the server's, for ServerMetadata). OSError when
        the address cannot be bound."""
        server = grpc.aio.server(interceptors=[TolerantDecoding()], options=[
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
        ])
        servicer = InferenceServicer(self.endpoint, self.calls, version)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        try:
            server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise OSError(f"cannot serve gRPC on {self.address}: {e}") from None
        await server.start()
        self._server = server
        log.info("serving the KServe v2 gRPC API on %s", self.address)

    async def stop(self) -> None:
        """Drain and stop (see the module docstring); a no-op when not started."""
        if self._server is None:
            return
        self.calls.stopping.set()
        await self._server.stop(GRACE_S)
        await self.calls.drain()
        self._server = None
        log.info("stopped the gRPC API on %s", self.address)
