"""Fixtures of the KServe tests: one live kda-serve, driven with the real tritonclient over
HTTP and over gRPC."""
from __future__ import annotations

import zlib
from typing import Iterator
from urllib.parse import urlsplit

import pytest
import torch
import tritonclient.grpc as gc
import tritonclient.http as tc
from kserve_helpers import GEOMETRY_ARGS, MAX_BODY_MB, Server, start_server
from server_harness import one_torch_thread  # noqa: F401  (autouse fixture for this folder)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The one server of this folder (a start costs seconds of a 2-core machine; every test
    leaves it as it found it): the service tests' geometry, a 20 ms batch window
    (concurrent requests merge), a 1 MiB body limit, gRPC on. SIGTERM at the end must exit
    0, and no request may have reached the catch-all 500 (no traceback in the log)."""
    srv = start_server([*GEOMETRY_ARGS, "--batch-window-ms", "20", "--max-body-mb", str(MAX_BODY_MB)],
                       tmp_path_factory.mktemp("kserve") / "kda-serve.log", grpc=True)
    yield srv
    status = srv.stop()
    assert status == 0, f"kda-serve exited {status} on SIGTERM:\n{srv.log_text()}"
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server, its API key "sesame", gRPC on (one per module that asks for it)."""
    srv = start_server([*GEOMETRY_ARGS, "--api-key", "sesame"], tmp_path_factory.mktemp("grpc-key") / "kda.log",
                       grpc=True)
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(urlsplit(server.url).netloc, concurrency=8, network_timeout=120.0)
    yield c
    c.close()


@pytest.fixture(scope="session")
def grpc_client(server: Server) -> Iterator[gc.InferenceServerClient]:
    c = gc.InferenceServerClient(server.grpc)
    yield c
    c.close()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Seeded from the test's name: fresh inputs per test, reproducible runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
