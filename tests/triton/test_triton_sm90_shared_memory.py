"""Every kernel launch of the serving setup fits the shared memory of an H100/H200 block.

Compiled for sm_90 here (no GPU needed) by `sm90_shared_memory.py` in a process of its own,
since this folder's conftest interprets the kernels. A launch over the limit fails on the
GPU before it runs: the server's warm-up with fp32 inputs at K = V = 128 did, on an H200
(2026-12-01), and /health/ready stayed 503. With CUDA the same launches also run there
(`test_triton_gpu.py::test_fp32_inputs`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sm90_shared_memory import SM90_MAX_SHARED

SCRIPT = Path(__file__).with_name("sm90_shared_memory.py")
HEAD_DIMS = (64, 128, 256)
LAUNCHES_PER_SETUP = 10  # intra, wy, state (narrow, wide) x (o fused, fused with checkpoints, split), output, recurrent


def test_every_launch_fits_sm90_shared_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, HEAD_DIMS)], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(HEAD_DIMS) * 2 * LAUNCHES_PER_SETUP
    assert all(row["shared"] > 0 for row in rows)
    too_big = [row for row in rows if row["shared"] > SM90_MAX_SHARED]
    assert not too_big, f"over {SM90_MAX_SHARED} bytes: {too_big}"
