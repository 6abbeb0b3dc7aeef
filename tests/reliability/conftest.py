"""Fixtures of the reliability tests (each test module starts the servers it needs)."""
from __future__ import annotations

import zlib
from typing import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The float64 reference runs thousands of tiny ops: one thread, not a pool spinning
    against the server process on a 2-core machine. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test's name: fresh inputs per test, reproducible runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
