"""A bounded load test on loopback (`load_driver`): 64 clients each continuing its own
sequence, churn of alloc/fork/free, pool-full moments. No 5xx but pool-full 503s (each with
Retry-After), no lost update (every client ends at its own float64 reference), no slot left
behind, and the server's memory flat. ``KDA_LOAD_SECONDS`` sets the traffic's length
(default 50 s: about a minute in all on 2 cores)."""
from __future__ import annotations

import json
import os
from typing import Iterator

import httpx
import pytest
from load_driver import LoadConfig, run_load, server_args, verify
from reliability_helpers import Server, start_server

CONFIG = LoadConfig(clients=64, seconds=float(os.environ.get("KDA_LOAD_SECONDS", "50")))
RSS_GROWTH_LIMIT = 48 << 20  # bytes the server may grow between the warm mark and the end


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(server_args(CONFIG), tmp_path_factory.mktemp("load") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


def test_sixty_four_clients_churn_and_a_full_pool(server):
    report = run_load(server.url, server.process.pid, CONFIG)
    figures = report.figures()
    print(json.dumps(figures, indent=1))
    assert report.problems == []  # no 5xx, no unexpected status, every 503 pool-full with Retry-After
    assert not [key for key in report.statuses if key[1] >= 500 and key[1] != 503]
    assert report.pool_full > 0 and report.statuses[("fill", 201)] > 0, figures  # the pool did run full
    assert len(report.sequences) == CONFIG.clients
    assert min(len(s.inputs) for s in report.sequences) >= 5, "a client starved"
    assert verify(report) == []  # no lost or misapplied update
    assert httpx.get(f"{server.url}/info").json()["used_slots"] == CONFIG.clients  # churn left nothing
    assert report.rss_end - report.rss_warm < RSS_GROWTH_LIMIT, figures
