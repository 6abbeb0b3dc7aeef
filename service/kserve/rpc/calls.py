"""What every gRPC call goes through: the API key, the server stopping, the status code of
its outcome, the metrics, and work that must finish whole once started.

- The key: ``authorization: Bearer <key>`` metadata (compared in constant time) on every
  call but ServerLive and ServerReady, as the HTTP health probes; UNAUTHENTICATED otherwise.
- Stopping: once ``stopping`` is set (the process got SIGTERM, or the app shuts down), a
  new call is refused UNAVAILABLE (`ShuttingDown`), but for the health calls (ServerLive,
  ServerReady, ModelReady: readiness then answers false, `ready`); calls already admitted
  go on. Then a request that is not a valid message (`decode.Malformed`) is refused.
- Outcome: a service error becomes its status code and message (`rpc_status`); the call
  ends with it. A call the client cancelled counts as CANCELLED.
- Metrics: ``kda_grpc_requests{method, status}`` and ``kda_grpc_request_seconds{method}``.
- `whole`: an inference started for a call runs to its end even if the client goes (a
  cancelled call, a dropped stream), so no request is ever half applied (a START bound
  without its slot, an END that freed the slot but kept the id). Shutdown waits for them.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from typing import Awaitable, Callable, Optional, TypeVar

import grpc

from ...core.metrics import Metrics
from .decode import Malformed
from .status import ShuttingDown, Unauthenticated, rpc_status

_T = TypeVar("_T")
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
HEALTH_METHODS = frozenset({"ServerLive", "ServerReady", "ModelReady"})


class Calls:
    """The call bookkeeping of one gRPC front end; ``api_key`` None: no key needed;
    ``stopping``: set once the server is asked to stop (see the module docstring)."""

    def __init__(self, metrics: Metrics, api_key: Optional[str], stopping: asyncio.Event) -> None:
        self.metrics = metrics
        self.stopping = stopping
        self._key = None if api_key is None else api_key.encode("utf-8")
        self._running: set[asyncio.Task] = set()

    def admit(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """`check_key`, then ShuttingDown for a new call of ``method`` while the server stops
        (health calls excepted)."""
        self.check_key(method, context)
        if self.stopping.is_set() and method not in HEALTH_METHODS:
            raise ShuttingDown()

    def ready(self, ready: bool) -> bool:
        """What readiness answers, ``ready`` being the endpoint's: false while stopping."""
        return ready and not self.stopping.is_set()

    def check_key(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """Unauthenticated unless ``method`` is open or the call carries the key."""
        if self._key is None or method in OPEN_METHODS:
            return
        values = [v for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
        scheme, _, token = (values[0] if len(values) == 1 and isinstance(values[0], str) else "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self._key)):
            raise Unauthenticated()

    def count(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.metrics.grpc_requests.labels(method, code.name).inc()
        self.metrics.grpc_latency.labels(method).observe(seconds)

    async def unary(self, method: str, request: object, context: grpc.aio.ServicerContext,
                    body: Callable[[], Awaitable[_T]]) -> _T:
        """``body()`` as the call ``method`` of ``request``: `admit` first, then whether
        ``request`` parsed; an error ends the call with its status code and message."""
        start, code = time.monotonic(), grpc.StatusCode.OK
        try:
            self.admit(method, context)
            if isinstance(request, Malformed):
                raise request.error()
            return await body()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:
            code, message = rpc_status(e)
            await context.abort(code, message)
            raise  # unreachable: abort raises
        finally:
            self.count(method, code, time.monotonic() - start)

    async def whole(self, work: Awaitable[_T]) -> _T:
        """``work``'s result; it runs to its end even if this caller is cancelled."""
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that left has nobody else to see it

    async def drain(self) -> None:
        """Wait for every `whole` still running (their callers may be gone)."""
        while self._running:
            await asyncio.wait(list(self._running))
