"""Each REST route is defined once (`service.http.routes`), and `ServerCore` implements the
core protocol those routes are written against (`service.core.api.CoreAPI`) with its
exact signatures. (The Ray ingress's side, which mounts the same routes over a
`ShardedCore`, is in tests/ray/test_ray_units.py.)"""
from __future__ import annotations

from route_helpers import (
    assert_core_attributes, assert_implements_core_api, core_api_methods, endpoints, registered_in_source,
)

from service.config import Settings
from service.core.server import ServerCore
from service.http.app import create_app

SETTINGS = Settings(num_layers=1, num_slots=2, num_heads=2, head_dim=8)
REST = {
    ("POST", "/slots"), ("GET", "/slots/{slot_id}"), ("DELETE", "/slots/{slot_id}"), ("POST", "/slots/{slot_id}/fork"),
    ("GET", "/slots/{slot_id}/state"), ("PUT", "/slots/{slot_id}/state"), ("POST", "/prefill"),
    ("POST", "/shm/regions"), ("GET", "/shm/regions"), ("GET", "/shm/regions/{name}"),
    ("DELETE", "/shm/regions/{name}"), ("GET", "/info"), ("GET", "/metrics"), ("GET", "/health/live"),
    ("GET", "/health/ready"), ("POST", "/slots/{slot_id}/publish"), ("GET", "/prefix/{key:prefix_key}"),
    ("DELETE", "/prefix/{key:prefix_key}"),
}


def test_each_rest_route_is_registered_by_exactly_one_module() -> None:
    registered = registered_in_source()
    twice = {key: modules for key, modules in registered.items() if len(modules) > 1}
    assert not twice, f"routes registered by more than one module: {twice}"
    for key in REST:
        (module,) = registered[key]
        assert module.startswith("service.http.routes."), (key, module)


DOCS_PAGES = {("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc")}  # not in the schema


def test_the_single_app_serves_the_rest_routes_from_their_one_module() -> None:
    served = endpoints(create_app(SETTINGS))
    assert {served[key][0] for key in DOCS_PAGES} == {"fastapi_offline.core"}  # the packaged Swagger UI, ReDoc
    rest = {key: where for key, where in served.items() if not key[1].startswith("/v2") and key not in DOCS_PAGES}
    assert set(rest) == REST
    registered = registered_in_source()
    for key, (module, _) in rest.items():
        assert registered[key] == [module], (key, module)


def test_server_core_implements_the_core_protocol() -> None:
    assert core_api_methods() == ["alloc", "alloc_prefix", "check_ready", "drop_prefix", "export_state", "fork",
                                  "free", "get_state", "info", "prefill", "prefix_info", "publish", "put_state",
                                  "render_metrics", "slot_info"]
    assert_implements_core_api(ServerCore)
    core = ServerCore(SETTINGS)
    try:
        assert_core_attributes(core)
    finally:
        core.worker.close()
