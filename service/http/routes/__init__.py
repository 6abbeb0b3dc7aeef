"""`rest_router(core, regions)`: the REST API over any `service.core.api.CoreAPI`, mounted
by the single-process app (`service.http.app`, a `ServerCore`) and by the Ray Serve
ingress (`service.ray_serve.ingress`, a `ShardedCore`). Each REST route is defined here
once, in the module of its concern:

- `slots`: POST /slots, GET/DELETE /slots/{id}, POST /slots/{id}/fork;
- `state`: GET/PUT /slots/{id}/state;
- `prefill`: POST /prefill (JSON, safetensors, shared memory by reference);
- `regions`: POST/GET /shm/regions, GET/DELETE /shm/regions/{name};
- `prefix`: POST /slots/{id}/publish, GET/DELETE /prefix/{key} (POST /slots with a prefix is
  the slot route's);
- `status`: GET /info, GET /metrics, GET /health/live, GET /health/ready.

What a deployment cannot do is refused by the shared route itself, never by a second
definition: without a shared memory registry (``regions`` None, the sharded deployment,
whose ingress replicas would each hold their own) /prefill answers a shared memory body
415 and the region routes 404 (`service.errors.SharedMemoryUnavailable`).
"""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter

from ...core.api import CoreAPI
from ...shm.registry import ShmRegistry
from ..abandon import Abandonment
from .prefill import add_prefill_route
from .prefix import add_prefix_routes
from .regions import add_region_routes
from .slots import add_slot_routes
from .state import add_state_routes
from .status import add_status_routes

def rest_router(core: CoreAPI, regions: Optional[ShmRegistry] = None, server_cancels: bool = False) -> APIRouter:
    """Every REST route on ``core``; shared memory through ``regions`` (None: refused).
    Slots made for a client that left before learning their ids are freed again and
    counted in ``core.metrics.abandoned``; with ``server_cancels`` (the server cancels the
    request of a client that left: Ray Serve) also when the request was cancelled while
    they were being made."""
    router = APIRouter()
    left = Abandonment(core.free, core.metrics.abandoned, missing=core.slot_missing, shield=server_cancels)
    add_slot_routes(router, core, left)
    add_state_routes(router, core)
    add_prefix_routes(router, core)
    add_prefill_route(router, core, left, regions)
    add_region_routes(router, regions)
    add_status_routes(router, core)
    return router
