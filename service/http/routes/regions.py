"""``POST``/``GET /shm/regions``, ``GET``/``DELETE /shm/regions/{name}``: the POSIX shared
memory regions ``POST /prefill`` reads tensors from by reference (one registry with the
KServe v2 shared memory extensions). A deployment without a registry (sharded: each
ingress replica would hold its own) answers each of them 404 `SharedMemoryUnavailable`."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Response

from ...errors import SharedMemoryUnavailable
from ...shm.prefill import RegionRegister, RegionStatus
from ...shm.registry import SYSTEM, ShmRegistry
from ..openapi import error_responses


def add_region_routes(router: APIRouter, regions: Optional[ShmRegistry]) -> None:
    """The region routes over ``regions`` (None: each refuses, and documents its 404)."""
    refused = (404,) if regions is None else ()

    def registry() -> ShmRegistry:
        if regions is None:
            raise SharedMemoryUnavailable("this deployment reads no shared memory (a sharded deployment has no "
                                          "region registry: regions registered with one ingress replica would be "
                                          "unknown to the others); send prefill tensors in the body")
        return regions

    @router.post("/shm/regions", status_code=201, response_model=RegionStatus,
                 responses=error_responses(400, 408, 413, 422, *refused),
                 summary="Register a POSIX shared memory region (for /prefill by reference)")
    async def shm_register(body: RegionRegister) -> dict[str, Any]:
        registry().register_system(body.name, body.key, body.offset, body.byte_size, body.ttl_s)
        return registry().status(SYSTEM, body.name)[0]

    @router.get("/shm/regions", response_model=list[RegionStatus], responses=error_responses(*refused),
                summary="Every registered system shared memory region")
    async def shm_regions() -> list[dict[str, Any]]:
        return registry().status(SYSTEM)

    @router.get("/shm/regions/{name}", response_model=RegionStatus, responses=error_responses(400, *refused),
                summary="One registered system shared memory region (400 when unknown)")
    async def shm_region(name: str) -> dict[str, Any]:
        return registry().status(SYSTEM, name)[0]

    @router.delete("/shm/regions/{name}", status_code=204, responses=error_responses(*refused),
                   summary="Unregister a region (idempotent); its mapping closes once no request uses it")
    async def shm_unregister(name: str) -> Response:
        registry().unregister(SYSTEM, name)
        return Response(status_code=204)
