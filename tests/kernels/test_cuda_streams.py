"""`kernels.cuda_streams.on_stream`: the stream is current inside the block and the previous
one after it, also when the block raises (GPU only)."""
from __future__ import annotations

import pytest
import torch

from kernels.cuda_streams import on_stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_on_stream_sets_and_restores_the_current_stream() -> None:
    before = torch.cuda.current_stream()
    side, inner = torch.cuda.Stream(), torch.cuda.Stream()
    with on_stream(side):
        assert torch.cuda.current_stream() == side
        x = torch.ones(1 << 20, device="cuda") * 2  # queued on the side stream
        with on_stream(inner):
            assert torch.cuda.current_stream() == inner
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == before
    side.synchronize()
    assert float(x.sum()) == 2.0 * (1 << 20)


def test_on_stream_restores_after_an_exception() -> None:
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError):
        with on_stream(torch.cuda.Stream()):
            raise RuntimeError("inside the block")
    assert torch.cuda.current_stream() == before
    assert torch.cuda.current_device() == before.device_index
