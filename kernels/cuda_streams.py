"""`on_stream`: make a CUDA stream current for a block, as ``torch.cuda.stream`` does, for
the hot path.

``torch.cuda.stream(s)`` looks up the current device on entry through
``torch.cuda.is_available()`` (an NVML check and environment lookups) two or three times;
on the H200 host's request path those contexts showed in about 3% of the server's samples
(py-spy, 2026-12-04). Here the stream's own device index is used instead: one current-stream
query, one set, one restore.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make ``stream`` the current stream (and its device the current device) for the
    block; the previous stream of that device and the previous device afterwards."""
    device = torch.cuda.current_device()
    previous = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)  # also makes the stream's device current
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
        if device != stream.device_index:
            torch.cuda.set_device(device)
