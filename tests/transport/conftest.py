"""Fixtures of the transport tests: one live kda-serve (the service tests' geometry)."""
from __future__ import annotations

import zlib
from typing import Iterator

import pytest
import torch
from transport_helpers import GEOMETRY_ARGS, Server, start_server
from server_harness import one_torch_thread  # noqa: F401  (autouse fixture for this folder)


@pytest.fixture(scope="session")
def framed_socket(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of the folder server's framed socket (``--framed-socket``)."""
    return str(tmp_path_factory.mktemp("framed-socket") / "kda.sock")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, framed_socket: str) -> Iterator[Server]:
    """The one server of this folder; SIGTERM at the end must exit 0 with no traceback logged."""
    srv = start_server([*GEOMETRY_ARGS, "--batch-window-ms", "20", "--framed-socket", framed_socket],
                       tmp_path_factory.mktemp("transport") / "kda.log")
    yield srv
    status = srv.stop()
    assert status == 0, f"kda-serve exited {status} on SIGTERM:\n{srv.log_text()}"
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Seeded from the test's name: fresh inputs per test, reproducible runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
