"""Helpers of the reliability tests: the service tests' harness (a real kda-serve process,
random inputs, the float64 reference), an image of the *whole* pool, raw HTTP over a
socket, and the server's resident memory.

The harness is ``tests/server_harness.py`` (tests/ is on pytest's pythonpath).
"""
from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence
from urllib.parse import urlsplit

import httpx
from server_harness import (  # noqa: F401  (re-exported for this folder's tests)
    GEOMETRY_ARGS, H, HV, K, LAYERS, SLOTS, Server, TOL, V, kill_9, make_sequence, metric, random_state, reference, rel,
    start_server, wait_for,
)

ROOT = Path(__file__).resolve().parents[2]


def load_module(name: str, path: Path) -> ModuleType:
    """The module at ``path`` as ``sys.modules[name]``, executed once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]



ST = "application/x-safetensors"
JSON = "application/json"
PROBLEM = "application/problem+json"


class WholePool:
    """Every live slot of a server that only these tests use: the test registers each slot
    it creates (`add`) or frees (`discard`), and `image` proves the list complete (the
    server's used-slot count equals it) before exporting every slot, bit for bit.
    ``http`` is a keep-alive client of the server (`close` it at the end)."""

    def __init__(self, url: str, headers: Optional[dict[str, str]] = None) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers=headers or {}, timeout=60)
        self.live: list[str] = []

    def close(self) -> None:
        self.http.close()

    def add(self, *slots: str) -> None:
        self.live.extend(slots)

    def discard(self, slot: str) -> None:
        self.live.remove(slot)

    def image(self) -> dict[str, object]:
        """{slot: exported bytes (state and token counts)} of every live slot, and the
        free-slot count."""
        info = self.http.get("/info").json()
        assert info["used_slots"] == len(self.live), (info, self.live)
        image: dict[str, object] = {}
        for slot in self.live:
            r = self.http.get(f"/slots/{slot}/state")
            assert r.status_code == 200, r.text
            image[slot] = r.content
            image[f"{slot}/lost"] = self.http.get(f"/slots/{slot}").json()["state_lost"]
        image["free_slots"] = info["free_slots"]
        return image


def assert_problem(r: httpx.Response, status: int, slug: Optional[str] = None) -> dict:
    """``r`` is an RFC 9457 problem with ``status`` (and type ``slug``); returns it."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"] == PROBLEM, r.headers
    problem = r.json()
    assert problem["status"] == status and problem["title"] and problem["detail"]
    if slug is not None:
        assert problem["type"] == f"urn:kda-serve:problem:{slug}", problem
    return problem


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")




def connect(url: str, timeout: float = 10.0, rcvbuf: Optional[int] = None) -> socket.socket:
    """A TCP connection to the server of ``url`` (a small receive buffer when asked)."""
    parts = urlsplit(url)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect((parts.hostname, parts.port))
    return s


def request_head(method: str, path: str, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length from ``s``: status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body
