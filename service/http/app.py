"""`create_app(settings)`: the single-process server, the REST API (`service.http.routes`)
and the Open Inference Protocol (KServe v2, ``/v2/...``) over one `ServerCore`.

Routes (all but /health/* need the API key when one is set):
POST /slots, GET/DELETE /slots/{id}, POST /slots/{id}/fork, GET/PUT /slots/{id}/state,
POST /prefill, GET /info, GET /metrics, GET /health/live, GET /health/ready,
POST/GET /shm/regions, GET/DELETE /shm/regions/{name}, and KServe v2 under /v2; with
--metrics-port, the Prometheus page on that port without the key.
/prefill and the state routes read the raw body themselves (JSON or safetensors, chosen
by Content-Type; the response by Accept), so their OpenAPI bodies are declared by hand.
/prefill also takes tensors by reference to registered shared memory
(``application/vnd.kda.shm+json``, see `service.shm.prefill`); the regions are the app's
`ShmRegistry`, shared with the KServe v2 shared memory extensions. Every /prefill response
carries ``Server-Timing: decode, validate, kernel, encode`` (milliseconds) so a client can
tell transport time from compute.

A client that leaves before its response (``POST /slots``, fork, a /prefill that created
slots) leaves no slot behind: the slots created for it are freed (status 499 in the
metrics), also when it leaves while a large response is still being sent.

Stopping: the server (`service.cli`) calls `begin_shutdown` the moment SIGTERM arrives;
gRPC stops taking new work then (readiness false, new calls UNAVAILABLE) while uvicorn
drains HTTP; then the lifespans' shutdown stops gRPC, the framed socket and the core.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator

from fastapi import FastAPI

from ..config import Settings
from ..core.server import ServerCore
from ..framed import FramedServer
from ..kserve import ProtocolErrors, kserve_router
from ..shm.registry import ShmRegistry
from .limits import LIMITS_STATE_KEY, REFUSED_STATE_KEY, ConnectionLimits
from .metrics_port import MetricsServer
from .problem_details import render_problem
from .rest_app import Lifespan, create_rest_app

log = logging.getLogger("kda_serve.app")
_REGION_EXPIRY_S = 1.0  # how often leased shared memory regions are checked for expiry


async def _warm(core: ServerCore) -> None:
    """Warm the kernels and run their self-test; the core is ready (/health/ready 200) once
    they are warm and the test passed."""
    log.info("warming the kernels (%s on %s) and running their self-test", core.backend, core.geometry.device)
    started = time.perf_counter()
    try:
        report = await core.warmup()
    except Exception:
        log.exception("kernel warmup failed after %.1f s: /health/ready stays 503", time.perf_counter() - started)
        return
    took = time.perf_counter() - started
    if not report.passed:
        log.error("%s (after %.1f s); /health/ready stays 503", report.describe(), took)
        return
    log.info("kernels warm in %.1f s (%s on %s), %s; ready", took, core.backend, core.geometry.device,
             report.describe())


async def _sweep_forever(core: ServerCore, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            await core.sweep()
        except Exception:
            log.exception("idle sweep failed; retrying in %.2f s", period)


async def _expire_regions(registry: ShmRegistry) -> None:
    while True:
        await asyncio.sleep(_REGION_EXPIRY_S)
        registry.expire()


def _lifespan(core: ServerCore, registry: ShmRegistry, settings: Settings) -> Lifespan:
    """Start the core, warm and self-test the kernels in the background, expire leased
    regions, sweep idle slots when a ttl is set, serve the framed socket when one is set
    (`service.framed`), and hand `KDAHttpProtocol` the connection limits and the count of
    the requests it refuses (uvicorn's lifespan state); at shutdown stop those and close the
    regions and the core (its last snapshot)."""
    limits = ConnectionLimits(header_timeout_s=settings.header_timeout_s, max_header_bytes=settings.max_header_bytes,
                              first_request_timeout_s=settings.first_request_timeout_s)

    framed = (FramedServer(core, registry, settings.framed_socket, render_problem, api_key=settings.api_key,
                           timeout_s=settings.body_timeout_s) if settings.framed_socket else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        await core.start()
        if framed is not None:
            await framed.start()
        tasks = [asyncio.create_task(_warm(core), name="kda-warmup"),
                 asyncio.create_task(_expire_regions(registry), name="kda-shm-leases")]
        if settings.slot_ttl_s is not None:
            period = min(max(settings.slot_ttl_s / 4, 0.05), 10.0)
            tasks.append(asyncio.create_task(_sweep_forever(core, period), name="kda-sweep"))
        try:
            # uvicorn's per-server state: KDAHttpProtocol reads it
            yield {LIMITS_STATE_KEY: limits, REFUSED_STATE_KEY: core.metrics.refused_request}
        finally:
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            if framed is not None:
                await framed.close()
            registry.close()
            if app.state.metrics_server is not None:
                app.state.metrics_server.close()
            await core.close()

    return lifespan


def begin_shutdown(app: FastAPI) -> None:
    """The process was asked to stop (SIGTERM): the front ends that uvicorn does not drain
    stop taking new work now (`service.kserve.rpc.server`). Idempotent; on the serving loop."""
    app.state.stopping.set()


def create_app(settings: Settings) -> FastAPI:
    """The app serving a new `ServerCore` (``app.state.core``; the pool is allocated and
    gate parameters loaded here, so bad settings fail before serving). Its lifespan starts
    the core, warms the kernels in the background (/health/ready answers 200 after), sweeps
    idle slots when a ttl is set, and closes the core (snapshot) at shutdown
    (``app.state.stopping``: set by `begin_shutdown`). With
    ``--metrics-port`` the Prometheus page is also served there, without the API key
    (`service.http.metrics_port`; a busy port raises OSError here)."""
    core = ServerCore(settings)
    registry = ShmRegistry(max_regions=settings.max_shm_regions, max_bytes=settings.max_shm_bytes,
                           cuda_in_place=settings.cuda_ipc_zero_copy)
    if settings.cuda_ipc_zero_copy:
        log.warning("--cuda-ipc-zero-copy: the kernels read CUDA IPC inputs in place; a client that writes its "
                    "region before the reply can corrupt its own slots' states")
    app = create_rest_app(core, settings, title="kda-serve",
                          summary="KDA (Kimi Delta Attention) chunked prefill over HTTP, on an in-place state pool",
                          regions=registry, lifespan=_lifespan(core, registry, settings))
    app.add_middleware(ProtocolErrors)  # outermost: {"error": ...} bodies under /v2, from every layer
    app.state.stopping = asyncio.Event()
    # Open Inference Protocol (KServe v2): /v2/... over HTTP, and gRPC on --grpc-port when set
    app.include_router(kserve_router(core, core.is_ready, registry, settings, app.state.stopping))
    # bound last, so nothing after it can fail and leave the port held; closed by the lifespan
    app.state.metrics_server = (MetricsServer(settings.host, settings.metrics_port, core.metrics.registry)
                                if settings.metrics_port else None)
    return app
