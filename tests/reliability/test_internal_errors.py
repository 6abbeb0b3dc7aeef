"""A 500 (a bug that escapes a route) is answered in the front end's own error format and
closes the keep-alive connection properly: ``Connection: close`` on the response, then the
server closes, so a client's next request goes out on a fresh connection instead of failing.

The real app (`create_app`, CPU, a small pool) is served by uvicorn through
`KDAHttpConnection` in a thread, with two test routes added that raise: ``/boom`` and
``/v2/boom`` (the KServe front end's prefix).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Iterator

import httpx
import pytest
import uvicorn
from reliability_helpers import connect, read_response, request_head
from server_harness import free_port

from service.config import Settings
from service.http.app import create_app
from service.http.protocol import KDAHttpConnection


def _raise() -> None:
    raise RuntimeError("a bug")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = create_app(Settings(device="cpu", num_layers=1, num_slots=4, num_heads=2, head_dim=16))
    app.add_api_route("/boom", _raise, methods=["GET", "POST"])
    app.add_api_route("/v2/boom", _raise, methods=["GET", "POST"])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=KDAHttpConnection,
                                           log_level="critical", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    yield base
    server.should_exit = True
    thread.join(30)


@pytest.mark.parametrize("path, media", [("/boom", "application/problem+json"), ("/v2/boom", "application/json")])
def test_a_500_closes_the_connection_with_connection_close(url: str, path: str, media: str) -> None:
    s = connect(url)
    try:
        s.sendall(request_head("GET", path, []))
        status, headers, body = read_response(s)
        assert status == 500
        assert headers["content-type"] == media, headers
        assert headers.get("connection") == "close", headers
        doc = json.loads(body)
        if path.startswith("/v2"):
            assert set(doc) == {"error"} and "RuntimeError" in doc["error"], doc
        else:
            assert doc["status"] == 500 and doc["type"].endswith("internal-error") and "RuntimeError" in doc["detail"]
        s.settimeout(10)
        assert s.recv(1) == b""  # the server closed its side
    finally:
        s.close()


def test_a_keep_alive_client_carries_on_after_a_500(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        for path in ("/boom", "/v2/boom"):
            assert client.get(path).status_code == 500
            assert client.get("/health/live").status_code == 200
            assert client.post(path, content=b"x" * 100).status_code == 500
            assert client.get("/info").status_code == 200
