"""`service.http.protocol_choice`: kda-serve's own HTTP protocol while uvicorn's private hooks
are where it expects them; uvicorn's stock httptools protocol, with a warning, when they are
not. The fallback is forced in a real server by making `service.http.protocol` fail to
import (a ``sitecustomize`` on the server's path), as a uvicorn that moved a name would."""
from __future__ import annotations

import socket
from pathlib import Path

import httpx
from server_harness import ROOT, start_server
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.http.protocol import KDAHttpConnection
from service.http.protocol_choice import choose_protocol, missing_hooks

BLOCK_PROTOCOL = (
    "import sys\n"
    "sys.modules['service.http.protocol'] = None  # any import of it raises ImportError\n"
)


def test_this_uvicorn_has_every_hook_and_kda_protocol_is_chosen() -> None:
    assert missing_hooks(HttpToolsProtocol, RequestResponseCycle) == []
    assert choose_protocol() == (KDAHttpConnection, None)


def test_missing_hooks_names_a_method_and_a_field_gone() -> None:
    class Protocol(HttpToolsProtocol):
        _start_asgi_task = None  # type: ignore[assignment]  # moved away in a future uvicorn

    class Cycle:
        def __init__(self) -> None:
            self.body = b""

    missing = missing_hooks(Protocol, Cycle)
    assert "HttpToolsProtocol._start_asgi_task" in missing
    assert "RequestResponseCycle.more_body" in missing and "RequestResponseCycle.body" not in missing
    assert "HttpToolsProtocol.parser" not in missing


def test_a_server_whose_protocol_does_not_import_serves_on_the_stock_one(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_PROTOCOL)
    log = tmp_path / "server.log"
    server = start_server(["--num-heads", "1", "--head-dim", "2"], log,
                          env={"PYTHONPATH": f"{site}:{ROOT}"})
    try:
        with httpx.Client(base_url=server.url) as http:
            slot = http.post("/slots", json={"count": 1}).raise_for_status().json()["slots"][0]
            assert http.get(f"/slots/{slot}").status_code == 200
            assert http.delete(f"/slots/{slot}").status_code == 204
        # uvicorn's own answer to a malformed Content-Length (kda-serve's is problem+json)
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
            answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400") and b"problem+json" not in answer, answer
    finally:
        assert server.stop() == 0
    text = server.log_text()
    assert "serving with uvicorn's stock httptools protocol" in text, text
    assert "service.http.protocol does not import" in text, text
    assert "Traceback" not in text, text
