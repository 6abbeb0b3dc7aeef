"""`service.http.encoded_slash`: an encoded slash outside a prefix key is an unknown path
(404 not-found, after the API key check, counted as ``unmatched``); inside a prefix key,
under a root path either kept in ``raw_path`` or not, and in a query it passes. The live
server's side (the pool untouched) is in tests/reliability/test_http_protocol_edges.py."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from service.config import Settings
from service.http.app import create_app
from service.http.encoded_slash import has_stray_encoded_slash

SETTINGS = Settings(num_layers=1, num_slots=2, num_heads=2, head_dim=8)
PROBLEM = "application/problem+json"


def scope(raw_path: bytes | None, root_path: str = "") -> dict[str, Any]:
    return {"type": "http", "raw_path": raw_path, "root_path": root_path}


@pytest.mark.parametrize("raw, root", [
    (b"/slots%2Fabc", ""), (b"/slots/abc%2Fstate", ""), (b"/slots%2fabc%2fstate", ""),
    (b"/prefix%2Fkey", ""), (b"/x/prefix%2Fkey", "/x"), (b"/v2/models/kda%2Fready", ""),
    (b"/slots/..%2F..%2Fhealth%2Flive", ""), (b"/api/prefix/a%2Fb", "/ap"),
])
def test_an_encoded_slash_outside_a_prefix_key_is_stray(raw: bytes, root: str) -> None:
    assert has_stray_encoded_slash(scope(raw, root))


@pytest.mark.parametrize("raw, root", [
    (b"/prefix/a%2Fb", ""), (b"/prefix/%2F", ""), (b"/prefix/a%2fb%2F", ""), (b"/prefix/a/b%2Fc", ""),
    (b"/api/prefix/a%2Fb", "/api"), (b"/prefix/a%2Fb", "/api"),
    (b"/slots/abc", ""), (b"/slots/%61bc", ""), (b"/slots/abc?next=%2Fstate", ""), (None, ""),
])
def test_a_prefix_key_a_query_and_other_escapes_pass(raw: bytes | None, root: str) -> None:
    assert not has_stray_encoded_slash(scope(raw, root))


def test_a_websocket_or_lifespan_scope_is_never_refused() -> None:
    assert not has_stray_encoded_slash({"type": "websocket", "raw_path": b"/slots%2Fabc"})


def test_the_app_answers_a_stray_encoded_slash_as_an_unknown_path() -> None:
    app = create_app(SETTINGS)
    http = TestClient(app)
    unknown = http.get("/nowhere").json()
    targets = [("GET", "/slots%2Fabc"), ("GET", "/slots/abc%2Fstate"), ("DELETE", "/slots%2Fabc"),
               ("PUT", "/slots/abc%2Fstate"), ("POST", "/slots/abc%2Ffork"), ("GET", "/prefix%2Fkey")]
    for method, path in targets:
        r = http.request(method, path)
        assert r.status_code == 404 and r.headers["content-type"] == PROBLEM, (method, path, r.text)
        assert all(r.json()[k] == unknown[k] for k in ("type", "title", "detail")), (method, path, r.text)
    counted = generate_latest(app.state.core.metrics.registry).decode()
    for method in ("DELETE", "PUT", "POST"):
        assert f'kda_http_requests_total{{method="{method}",route="unmatched",status="404"}}' in counted, counted


def test_the_api_key_is_checked_first() -> None:
    http = TestClient(create_app(Settings(num_layers=1, num_slots=2, num_heads=2, head_dim=8, api_key="k")))
    assert http.get("/slots%2Fabc").status_code == 401
    assert http.get("/slots%2Fabc", headers={"Authorization": "Bearer k"}).status_code == 404

