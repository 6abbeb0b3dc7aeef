"""Access: with ``--api-key`` every route but the health probes needs ``Authorization:
Bearer <key>`` (compared in constant time), 401 otherwise; slot ids are unguessable (128
random bits, URL-safe, unrelated to the pool row)."""
from __future__ import annotations

import ast
import base64
import inspect
import re
import textwrap
from typing import Iterator

import httpx
import pytest
import torch
from reliability_helpers import GEOMETRY_ARGS, Server, start_server
from starlette.routing import Route

from service.http.app import create_app
from kda_client.client import KDAClient
from service.config import Settings
from service.http.middleware import AuthMiddleware
from state_store import StatePool

KEY = "kda-test-key-7f3a9c1e"
ID = re.compile(r"[A-Za-z0-9_-]{22}")  # token_urlsafe(16): 128 bits in 22 characters
# Probes that orchestrators call without credentials: /health/* and KServe's /v2/health/*.
HEALTH = re.compile(r"^(/v2)?/health/(live|ready)$")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server([*GEOMETRY_ARGS, "--api-key", KEY], tmp_path_factory.mktemp("access") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    """A keep-alive client of the server that sends no credentials of its own."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def routes() -> list[tuple[str, str]]:
    """(method, concrete path) of every route the app serves, path parameters filled in:
    each operation of its OpenAPI document (the routers it includes, KServe v2 and any
    other, among them) and each plain route (FastAPI's docs)."""
    app = create_app(Settings(num_layers=1, num_slots=2, num_heads=2, head_dim=8, api_key=KEY))
    found = {(method.upper(), path) for path, operations in app.openapi()["paths"].items() for method in operations}
    for route in app.routes:
        if isinstance(route, Route):
            found.update((method, route.path) for method in route.methods or ())
    assert any(path.startswith("/v2/") for _, path in found), "the KServe routes are missing"
    return sorted((method, re.sub(r"\{[^}]+\}", "x", path)) for method, path in found)


ROUTES = routes()


def _ask(http: httpx.Client, method: str, path: str, authorization: str | None) -> httpx.Response:
    headers = {"authorization": authorization} if authorization is not None else {}
    return http.request(method, path, headers=headers)


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_but_health_needs_the_key(http, method, path):
    wrong = [None, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", KEY, "Bearer", f"Bearer  {KEY.upper()}"]
    if HEALTH.match(path):
        assert _ask(http, method, path, None).status_code != 401
        return
    for authorization in wrong:
        r = _ask(http, method, path, authorization)
        assert r.status_code == 401, (authorization, r.status_code, r.text[:200])
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert KEY not in r.text  # the key (or a guess at it) is never echoed
    assert _ask(http, method, path, f"Bearer {KEY}").status_code != 401
    assert _ask(http, method, path, f"bearer {KEY}").status_code != 401  # the scheme is case-insensitive


def test_the_health_probes_stay_open(http):
    for path in ("/health/live", "/health/ready"):
        assert _ask(http, "GET", path, None).status_code == 200


def test_unknown_paths_and_methods_are_401_not_404(http):
    """Without the key nothing about the API is revealed, not even which routes exist."""
    for method, path in [("GET", "/nowhere"), ("PATCH", "/prefill"), ("GET", "/slots"), ("POST", "/v2/x"),
                         ("GET", "/health/../info"), ("GET", "/health")]:
        assert _ask(http, method, path, None).status_code == 401, (method, path)


def test_the_key_is_compared_in_constant_time():
    """`hmac.compare_digest`, never ``==`` on the key (a timing oracle)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(AuthMiddleware)))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "hmac.compare_digest" in calls
    compared = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert not [c for c in compared if "key" in c or "token" in c], compared


def test_slot_ids_over_http_are_128_bit_url_safe_tokens(server):
    with KDAClient(server.url, api_key=KEY) as c:
        slots = c.alloc(32)
        slots.append(c.fork(slots[0]))
        for slot in slots:
            c.free(slot)
        again = c.alloc(32)  # the same rows again: new ids
        for slot in again:
            c.free(slot)
    for slot in slots + again:
        assert ID.fullmatch(slot), slot
        assert len(base64.urlsafe_b64decode(slot + "==")) == 16
    assert len(set(slots + again)) == len(slots) + len(again)


def test_slot_ids_carry_128_independent_random_bits():
    """4096 ids from alloc/free churn on one row: every bit position is set about half
    the time (within 6 sigma), and no two ids share their first 64 bits."""
    pool = StatePool(num_layers=1, num_slots=1, num_heads=1, head_k_dim=1, head_v_dim=1)
    n = 4096
    ids = []
    for _ in range(n):
        slot = pool.alloc()[0]
        ids.append(slot)
        pool.free(slot)
    raw = torch.tensor([list(base64.urlsafe_b64decode(s + "==")) for s in ids], dtype=torch.uint8)
    bit_values = torch.stack([(raw >> b) & 1 for b in range(8)], dim=-1).reshape(n, 128).double()
    ones = bit_values.mean(0)
    sigma = 0.5 / n ** 0.5
    assert float((ones - 0.5).abs().max()) < 6 * sigma, ones
    assert len({s[:11] for s in ids}) == n
    assert all(ID.fullmatch(s) for s in ids)
