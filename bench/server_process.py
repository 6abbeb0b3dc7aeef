"""A `kda-serve` process for the benchmarks: started on a free loopback port, ready once
``/health/ready`` answers 200 (its kernels warm), its output kept in a log file, stopped
with SIGTERM (SIGKILL when it does not exit). Benchmarks do not import the tests; this is
their one launcher."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running ``python -m service.cli`` and the file its output goes to."""

    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> int:
        """SIGTERM (drain, exit), SIGKILL after 60 s; the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        return self.process.returncode


def start_server(args: Sequence[str], log: Optional[Path] = None, timeout_s: float = 180.0) -> Server:
    """kda-serve with the CLI flags ``args`` on a free loopback port, once ready; its stdout
    and stderr go to ``log`` (a new file in the temporary directory when None; shown when
    it fails to come up)."""
    if log is None:
        fd, name = tempfile.mkstemp(prefix="kda-serve-", suffix=".log")
        os.close(fd)
        log = Path(name)
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", str(port),
                                    "--log-level", "warning", *args], cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": path}, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kda-serve exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health/ready", timeout=2, trust_env=False).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"kda-serve not ready after {timeout_s:.0f} s:\n{server.log_tail()}")
