"""The README runs as pasted: every block marked ``<!-- run -->`` is extracted and run against
a live server on 127.0.0.1, within a bounded time. Bash blocks run each on their own (the curl
block starts its own toy server; ``.venv/bin/activate`` puts a ``kda-serve`` of this checkout
on PATH); the Python blocks run in order as one session against one server with the
Quickstart's default pool and a gRPC port, which must hold no slot afterwards (the examples
free what they allocate). Only the ports are rewritten, to free ones."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_harness import ROOT, free_port, start_server

README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^<!-- run -->\n```(bash|python)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README) if lang == language]


def with_ports(code: str, ports: dict[int, int]) -> str:
    for old, new in ports.items():
        code = re.sub(rf"(?<![\d.]){old}(?!\d)", str(new), code)
    return code


def test_the_readme_marks_its_runnable_blocks() -> None:
    assert len(blocks("bash")) >= 1 and len(blocks("python")) >= 3
    assert README.count("<!-- run -->") == len(BLOCK.findall(README))  # every marker precedes a block


def fake_checkout(tmp_path: Path) -> Path:
    """A directory whose ``.venv/bin/activate`` puts this checkout's ``kda-serve`` on PATH."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "kda-serve"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m service.cli "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return tmp_path


@pytest.mark.parametrize("index", range(len(blocks("bash"))))
def test_bash_block_runs(tmp_path: Path, index: int) -> None:
    code = with_ports(blocks("bash")[index], {8010: free_port()})
    cwd = fake_checkout(tmp_path)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if "state.safetensors" in code:
        assert (cwd / "state.safetensors").read_bytes()[8:9] == b"{"  # a safetensors header, not an error body


def test_python_blocks_run_as_one_session(tmp_path: Path) -> None:
    server = start_server([], tmp_path / "server.log", grpc=True)  # the Quickstart's default pool
    try:
        http_port = int(server.url.rsplit(":", 1)[1])
        grpc_port = int(server.grpc.rsplit(":", 1)[1])
        code = "\n\n".join(with_ports(b, {8000: http_port, 8001: grpc_port}) for b in blocks("python"))
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stdout + done.stderr
        info = httpx.get(f"{server.url}/info").json()
        assert info["used_slots"] == 0, info  # every example freed what it allocated
    finally:
        assert server.stop() == 0
