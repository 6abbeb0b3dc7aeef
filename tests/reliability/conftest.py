"""Fixtures of the reliability tests (each test module starts the servers it needs)."""
from __future__ import annotations

import zlib

import pytest
import torch
from server_harness import one_torch_thread  # noqa: F401  (autouse fixture for this folder)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test's name: fresh inputs per test, reproducible runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
