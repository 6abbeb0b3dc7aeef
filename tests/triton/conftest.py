"""Triton backend tests: on a machine without CUDA the kernels run under the Triton
interpreter on CPU tensors; with CUDA they run compiled on the GPU.

TRITON_INTERPRET must be set before the kernels are decorated, so this conftest sets it
and imports them at collection time. It then restores the variable, and sets it again only
around the tests of this folder: the other folders (torch backend on CPU tensors) see the
environment they started with.
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import kernels.triton_backend  # noqa: F401,E402  (decorates the kernels as interpreted)

    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture(autouse=True)
def _interpret_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["fused", "split"])
def output_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force o to be computed inside the state pass ("fused") or by the separate output
    kernel ("split"); the backend otherwise picks by the number of sequence-heads."""
    from kernels.triton_kernels import config

    monkeypatch.setattr(config, "FUSE_MIN_SEQ_HEADS", 0 if request.param == "fused" else 1 << 62)
    return request.param


@pytest.fixture
def device() -> str:
    """Where the grid tests run: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if HAS_CUDA else "cpu"
