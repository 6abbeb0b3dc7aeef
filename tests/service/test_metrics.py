"""The Prometheus page of a real server: build information, the pool's gauges (read through
the core), requests in flight, the process's collectors, route labels of the docs routes,
requests the HTTP protocol refuses before any route, and ``--metrics-port`` (the page
without the API key, as Triton's 8002)."""
from __future__ import annotations

import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import httpx
import pytest
import torch
from server_harness import GEOMETRY_ARGS, ROOT, SLOTS, Server, free_port, kill_9, make_sequence, metric, start_server

from kda_client.client import KDAClient


def _page(url: str, **headers: str) -> str:
    response = httpx.get(f"{url}/metrics", headers=headers)
    assert response.status_code == 200, response.text
    return response.text


def _version(distribution: str, missing: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return missing


def test_build_info_names_version_backend_device_and_triton(server: Server) -> None:
    labels = {"version": _version("kda-serve", "unknown"), "backend": "torch", "device": "cpu",
              "triton": _version("triton", "none")}
    assert metric(_page(server.url), "kda_build_info", **labels) == 1.0, _page(server.url)


def test_pool_gauges_follow_the_slots(server: Server) -> None:
    before = _page(server.url)
    assert metric(before, "kda_pool_slots") == SLOTS
    used, free = metric(before, "kda_used_slots"), metric(before, "kda_free_slots")
    assert used + free == SLOTS and metric(before, "kda_state_lost_slots") == 0
    with KDAClient(server.url) as client:
        slots = client.alloc(3)
        during = _page(server.url)
        for slot in slots:
            client.free(slot)
    assert (metric(during, "kda_used_slots"), metric(during, "kda_free_slots")) == (used + 3, free - 3)
    after = _page(server.url)
    assert (metric(after, "kda_used_slots"), metric(after, "kda_free_slots")) == (used, free)


def test_requests_in_flight_count_a_request_still_arriving(server: Server) -> None:
    """A request whose body is still on its way is in flight; once it ends it is not. (The
    scrape itself is in flight while the page is made.)"""
    idle = metric(_page(server.url), "kda_http_requests_in_flight")
    assert idle >= 1
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        busy = metric(_page(server.url), "kda_http_requests_in_flight")
        for _ in range(100):  # the server reads the first byte before it is counted for sure
            if busy == idle + 1:
                break
            busy = metric(_page(server.url), "kda_http_requests_in_flight")
        assert busy == idle + 1
    for _ in range(100):
        if metric(_page(server.url), "kda_http_requests_in_flight") == idle:
            break
    assert metric(_page(server.url), "kda_http_requests_in_flight") == idle


def test_process_metrics_are_on_the_page(server: Server) -> None:
    page = _page(server.url)
    assert metric(page, "process_resident_memory_bytes") > 0
    assert metric(page, "process_cpu_seconds_total") > 0
    assert metric(page, "process_open_fds") > 0
    assert "python_info{" in page and "python_gc_collections_total{" in page


def test_docs_routes_have_their_own_route_labels(server: Server) -> None:
    paths = ["/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"]
    before = _page(server.url)
    for path in [*paths, "/nowhere"]:
        httpx.get(server.url + path)
    after = _page(server.url)
    for path in paths:
        labels = {"route": path, "method": "GET", "status": "200"}
        assert metric(after, "kda_http_requests_total", **labels) == \
            metric(before, "kda_http_requests_total", **labels) + 1, path
    lost = {"route": "unmatched", "method": "GET", "status": "404"}
    assert metric(after, "kda_http_requests_total", **lost) == metric(before, "kda_http_requests_total", **lost) + 1


REFUSED = [  # what a client sends, the status it gets, the method label it is counted under
    pytest.param(b"NOT A REQUEST\r\n\r\n", "400", "unknown", id="malformed request line"),
    pytest.param(b"FROB /info HTTP/1.1\r\nHost: x\r\n\r\n", "400", "unknown", id="unknown method"),
    pytest.param(b"GET /info HTTP/1.1\r\n\r\n", "400", "GET", id="no Host header"),
    pytest.param(b"GET http://[::1 HTTP/1.1\r\nHost: x\r\n\r\n", "400", "GET", id="unparsable target"),
    pytest.param(b"GET /info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (65 << 10) + b"\r\n\r\n", "431", "GET",
                 id="headers over the limit"),
    pytest.param(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"  # runs; the request queued behind it never does
                 b"POST /prefill HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "400", "POST",
                 id="bad chunk size of a pipelined request"),
]


@pytest.mark.parametrize(("sent", "status", "method"), REFUSED)
def test_a_request_the_protocol_refuses_is_counted_and_the_server_serves_on(
        server: Server, sent: bytes, status: str, method: str) -> None:
    """A request the HTTP protocol answers before any route sees it (unparsable, or over a
    connection limit) counts once in ``kda_http_requests_total`` and
    ``kda_http_errors_total`` under the route ``unmatched``, its method ``unknown`` when
    its request line was not read that far; the server serves on."""
    labels = {"route": "unmatched", "method": method, "status": status}
    before = _page(server.url)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(sent)
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:300]
    after = _page(server.url)
    for family in ("kda_http_requests_total", "kda_http_errors_total"):
        assert metric(after, family, **labels) == metric(before, family, **labels) + 1, (family, after)
    assert httpx.get(f"{server.url}/health/live").status_code == 200


def test_the_metrics_port_serves_the_page_without_the_key(tmp_path: Path) -> None:
    port = free_port()
    server = start_server([*GEOMETRY_ARGS, "--api-key", "sesame", "--metrics-port", str(port)],
                          tmp_path / "kda-serve.log")
    try:
        assert httpx.get(f"{server.url}/metrics").status_code == 401  # the API port keeps the key
        keyed = _page(server.url, authorization="Bearer sesame")
        open_page = _page(f"http://127.0.0.1:{port}")
        assert metric(open_page, "kda_pool_slots") == SLOTS and "kda_build_info{" in open_page
        # one registry: the keyed scrape is counted on the open page
        assert metric(open_page, "kda_http_requests_total", route="/metrics", method="GET", status="200") >= 1
        assert "kda_build_info{" in keyed
    finally:
        assert server.stop() == 0, server.log_text()
    with socket.socket() as s:  # nothing listens there after shutdown (connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_busy_metrics_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "service.cli", *GEOMETRY_ARGS, "--port", str(free_port()),
                               "--metrics-port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "in use" in done.stderr, done.stderr


def test_state_lost_slots_after_a_crash(tmp_path: Path) -> None:
    """A slot that advanced after the last snapshot comes back from a kill -9 flagged
    state_lost, and the gauge counts it; before the crash ``kda_journal_bytes`` is the
    journal's size (the advance record)."""
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(tmp_path / "pool.snapshot"), "--snapshot-interval-s", "0"]
    server = start_server(args, tmp_path / "first.log")
    with KDAClient(server.url) as client:
        kept, advanced = client.alloc(2)
    assert server.stop() == 0  # the snapshot at shutdown holds both
    server = start_server(args, tmp_path / "second.log")
    with KDAClient(server.url) as client:
        client.prefill(0, [(advanced, *make_sequence(4, torch.Generator().manual_seed(3)))])  # journalled
    journal = tmp_path / "pool.snapshot.journal"
    assert metric(_page(server.url), "kda_journal_bytes") == journal.stat().st_size > 0  # its one record
    kill_9(server)
    server = start_server(args, tmp_path / "third.log")
    try:
        page = _page(server.url)
        assert (metric(page, "kda_used_slots"), metric(page, "kda_state_lost_slots")) == (2, 1)
        with KDAClient(server.url) as client:
            assert client.slot_info(advanced)["state_lost"] and not client.slot_info(kept)["state_lost"]
    finally:
        assert server.stop() == 0, server.log_text()
