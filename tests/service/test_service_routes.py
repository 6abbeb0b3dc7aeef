"""`ServerCore` implements the core protocol (`service.core.api.CoreAPI`) with its exact
signatures. (`ShardedCore`'s side is in tests/ray/test_ray_units.py.)"""
from __future__ import annotations

from route_helpers import assert_core_attributes, assert_implements_core_api, core_api_methods

from service.config import Settings
from service.core.server import ServerCore

SETTINGS = Settings(num_layers=1, num_slots=2, num_heads=2, head_dim=8)


def test_server_core_implements_the_core_protocol() -> None:
    assert core_api_methods() == ["alloc", "check_ready", "export_state", "fork", "free", "get_state", "info",
                                  "prefill", "put_state", "render_metrics", "slot_info"]
    assert_implements_core_api(ServerCore)
    core = ServerCore(SETTINGS)
    try:
        assert_core_attributes(core)
    finally:
        core.worker.close()
