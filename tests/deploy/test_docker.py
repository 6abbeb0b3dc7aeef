"""The Docker image's contract, checked without a Docker engine: its ENTRYPOINT and
HEALTHCHECK name things the project has, and the container's command line (the image's
ENV, the entrypoint) starts a server whose health probe then passes."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from route_helpers import api_routes

from service.http.app import create_app
from service.config import Settings
from service.http.healthcheck import READY_PATH

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instruction(name: str) -> str:
    """The (continuation-joined) argument of the last ``name`` instruction in the Dockerfile."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    found = re.findall(rf"^{name}\s+(.*)$", joined, flags=re.MULTILINE)
    assert found, f"Dockerfile has no {name}"
    return found[-1].strip()


def image_env() -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", instruction("ENV")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_entrypoint_is_the_console_script() -> None:
    assert json.loads(instruction("ENTRYPOINT")) == ["kda-serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["kda-serve"].split(":")
    assert callable(getattr(__import__(module, fromlist=[func]), func))


def test_healthcheck_probes_a_route_the_app_serves() -> None:
    cmd = json.loads(instruction("HEALTHCHECK").split("CMD", 1)[1])
    assert cmd[:2] == ["python", "-m"] and cmd[2] == "service.http.healthcheck"
    paths = {route.path for route in api_routes(create_app(Settings()))}  # included routers walked
    assert READY_PATH in paths


def test_image_listens_on_all_interfaces_and_exposes_its_port() -> None:
    env = image_env()
    assert env["KDA_HOST"] == "0.0.0.0"
    assert instruction("EXPOSE").split() == [env["KDA_PORT"]]
    assert instruction("USER") != "root"


def test_container_command_line_starts_and_its_healthcheck_passes(tmp_path: Path) -> None:
    port = free_port()
    # The image's environment, but on loopback: tests send traffic to 127.0.0.1 only.
    env = {**os.environ, **image_env(), "KDA_HOST": "127.0.0.1", "KDA_PORT": str(port),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": str(ROOT)}
    script = shutil.which("kda-serve", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "service.cli"]
    probe = [sys.executable, "-m", "service.http.healthcheck"]
    assert subprocess.run(probe, env=env, cwd=ROOT, capture_output=True).returncode == 1  # nothing listens yet
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            if subprocess.run(probe, env=env, cwd=ROOT, capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail("healthcheck never passed:\n" + (tmp_path / "server.log").read_text())
        assert httpx.get(f"http://127.0.0.1:{port}{READY_PATH}").status_code == 200
    finally:
        server.terminate()
        assert server.wait(30) == 0
        log.close()
