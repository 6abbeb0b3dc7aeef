"""Every kernel launch of the serving setup fits the shared memory of an H100/H200 block.

Compiled for sm_90 here (no GPU needed) by `sm90_shared_memory.py` in a process of its own,
since this folder's conftest interprets the kernels, with the serving layout's stride-1
arguments as constants as a launch specializes them. The state pass steps down to fewer
pipeline stages when a variant does not fit (`state.launch_fitting`); none of the serving
launches needs to here, and the checkpointed pass gets the plain pass's stages. A launch over the limit fails on the
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
LAUNCHES_PER_SETUP = 14  # intra, wy, state (narrow, wide) x (o fused; fused and split with checkpoints in the loop or at segment ends), output, recurrent


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
    stepped = [row for row in rows if row["launched_stages"] != row["stages"]]
    assert not stepped, f"launches that only fit with fewer stages than their config gives: {stepped}"
    # the checkpointed state pass runs with the stages of the plain one (it is not held to fewer)
    state = {(r["inputs"], r["K"], r["seq_heads"], r["fused_output"], r["checkpoints"]): r["launched_stages"]
             for r in rows if r["kernel"] == "state"}
    assert all(n == state[key[:4] + (False,)] for key, n in state.items() if key[3] and key[4])
