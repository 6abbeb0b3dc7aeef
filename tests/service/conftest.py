"""Fixtures for the service tests: one shared kda-serve process for the HTTP tests."""
from __future__ import annotations

import zlib
from typing import Iterator

import pytest
import torch
from server_harness import GEOMETRY_ARGS, MAX_BODY_MB, Server, start_server

from kda_client.client import KDAClient
from server_harness import one_torch_thread  # noqa: F401  (autouse fixture for this folder)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: test geometry, a 20 ms batch window (so concurrent requests merge),
    a 1 MiB body limit. Stopped with SIGTERM at the end, which must exit 0 with no
    traceback logged (no request may have reached the catch-all 500)."""
    srv = start_server([*GEOMETRY_ARGS, "--batch-window-ms", "20", "--max-body-mb", str(MAX_BODY_MB)],
                       tmp_path_factory.mktemp("server") / "kda-serve.log")
    yield srv
    status = srv.stop()
    assert status == 0, f"kda-serve exited {status} on SIGTERM:\n{srv.log_text()}"
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture
def client(server: Server) -> Iterator[KDAClient]:
    with KDAClient(server.url) as c:
        yield c


@pytest.fixture
def json_client(server: Server) -> Iterator[KDAClient]:
    with KDAClient(server.url, encoding="json") as c:
        yield c


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test's name: fresh inputs per test, reproducible runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
