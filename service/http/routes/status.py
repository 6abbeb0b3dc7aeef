"""``GET /info``, ``GET /metrics``, ``GET /health/live``, ``GET /health/ready`` (the two
probes are served without the API key: `service.http.middleware.OPEN_PATHS`)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from ...core.api import CoreAPI
from ...core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ...wire.media import PROBLEM
from ...wire.schema import Info, Problem
from ..openapi import error_responses, ref


def add_status_routes(router: APIRouter, core: CoreAPI) -> None:
    """The figures and probes of ``core``."""

    @router.get("/info", response_model=Info, responses=error_responses(),
                summary="Pool geometry, device, backend and free slots")
    async def info() -> dict[str, Any]:
        return await core.info()

    @router.get("/metrics", response_class=Response, summary="Prometheus metrics",
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses()})
    async def metrics() -> Response:
        return Response(await core.render_metrics(), media_type=METRICS_CONTENT_TYPE)

    @router.get("/health/live", summary="The process is up")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @router.get("/health/ready", responses={503: {"description": "warming up, the kernel self-test failed, or no "
                                                                 "shard answers",
                                                  "content": {PROBLEM: {"schema": ref(Problem)}}}},
                summary="Ready once the core can serve (the kernels are warm and passed their self-test; on a sharded "
                        "deployment: a shard answers)")
    async def ready_probe() -> dict[str, str]:
        await core.check_ready()
        return {"status": "ready"}
