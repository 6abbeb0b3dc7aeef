"""``kda-serve`` as a user runs it (`service.cli`, in a subprocess): ``--version``; each start
refused (too large a pool, a bad gate file, a port in use, a framed socket that cannot be made,
a snapshot that cannot be used) is one line on stderr and exit status 2, with no traceback;
the banner comes only once the port listens and the snapshot is restored; warm-up is logged
with its duration; one log format, and ``--log-format json`` gives one JSON object per line."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx
import pytest
from server_harness import ROOT, free_port, start_server

from service.version import __version__

TOY = ["--num-layers", "1", "--num-slots", "4", "--num-heads", "1", "--head-dim", "2"]


def cli(args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "service.cli", "--host", "127.0.0.1", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_refused(done: subprocess.CompletedProcess[str], why: str) -> None:
    """Exit 2, one line on stderr that says ``why``, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kda-serve: ") and re.search(why, lines[0]), lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert "listening on" not in done.stdout


def test_version_flag() -> None:
    done = cli(["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"kda-serve {__version__}"


def test_a_pool_that_does_not_fit_is_refused_in_one_line() -> None:
    done = cli(["--device", "cpu", "--num-layers", "4096", "--num-slots", "4096", "--num-heads", "32",
                "--head-dim", "128"])
    assert_refused(done, r"pool of shape \[4096, 4096, 32, 128, 128\] and 4096 spare rows needs \d+ bytes .* available")


def test_a_bad_gate_file_is_refused_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "gates.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    assert_refused(cli([*TOY, "--gate-params", str(bad)]), rf"{re.escape(str(bad))}: not a safetensors file")
    assert_refused(cli([*TOY, "--gate-params", str(tmp_path / "missing")]), r"No such file")


def test_a_port_in_use_is_refused_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_refused(cli([*TOY, "--port", str(port)]), rf"cannot listen on 127\.0\.0\.1:{port}: Address already in use")


def test_a_framed_socket_that_cannot_be_made_is_refused_in_one_line(tmp_path: Path) -> None:
    assert_refused(cli([*TOY, "--port", "0", "--framed-socket", str(tmp_path / "no-such-folder" / "kda.sock")]),
                   "framed socket .*no folder")
    (tmp_path / "a-file").write_text("not a socket")
    assert_refused(cli([*TOY, "--port", "0", "--framed-socket", str(tmp_path / "a-file")]),
                   "framed socket .*not a socket")
    assert (tmp_path / "a-file").read_text() == "not a socket"


def test_a_snapshot_that_cannot_be_used_is_refused_in_one_line(tmp_path: Path) -> None:
    snapshot = tmp_path / "pool.snapshot"
    snapshot.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    done = cli([*TOY, "--port", str(free_port()), "--snapshot-path", str(snapshot)])
    assert_refused(done, r"refused the snapshot: snapshot .*pool\.snapshot")
    assert snapshot.read_bytes() == b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"  # left as it was


def _read_until(stream, pattern: str, deadline: float) -> list[str]:
    """Lines of ``stream`` up to and including the first matching ``pattern``."""
    lines = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if re.search(pattern, line):
            return lines
    pytest.fail("no line matched %r in:\n%s" % (pattern, "\n".join(lines)))


def _start(args: Sequence[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "service.cli", "--host", "127.0.0.1", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_banner_comes_after_the_restore_and_the_port_listens_then(tmp_path: Path) -> None:
    snapshot = tmp_path / "pool.snapshot"
    first = start_server([*TOY, "--snapshot-path", str(snapshot)], tmp_path / "first.log")
    httpx.post(f"{first.url}/slots", json={"count": 2}).raise_for_status()
    assert first.stop() == 0 and snapshot.exists()

    port = free_port()
    server = _start([*TOY, "--port", str(port), "--snapshot-path", str(snapshot)])
    try:
        lines = _read_until(server.stdout, r"kda-serve: listening on", time.monotonic() + 90)
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # listening when the banner is out
            pass
        assert re.fullmatch(rf"kda-serve: listening on http://127\.0\.0\.1:{port} \(pool \[1, 4, 1, 2, 2\] float32 "
                            r"on cpu, backend torch; /health/ready once the kernels are warm\)", lines[-1]), lines[-1]
        assert any("pool.snapshot" in line for line in lines[:-1]), lines  # the restore was logged before
        warm = _read_until(server.stdout, r"kernels warm in", time.monotonic() + 90)[-1]
        assert re.search(r"kernels warm in \d+\.\d s \(torch on cpu\)", warm), warm
        assert httpx.get(f"http://127.0.0.1:{port}/info").json()["used_slots"] == 2
    finally:
        server.terminate()
        assert server.wait(30) == 0
    rest = server.stdout.read()
    server.stdout.close()
    for line in lines + rest.splitlines():  # one format: ours, uvicorn's loggers included
        assert line.startswith("kda-serve: listening") or re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ",
                                                                   line), line


def test_json_logs_are_one_object_per_line() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", str(port),
                               "--log-format", "json", *TOY], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "kda-serve: listening on" in server.stdout.readline()
        deadline = time.monotonic() + 90
        while httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/slots/nope", headers={"X-Request-ID": "lookup-7"}).status_code == 404
    finally:
        server.terminate()
        assert server.wait(30) == 0
    records = [json.loads(line) for line in server.stderr.read().splitlines()]
    server.stdout.close()
    server.stderr.close()
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records), records
    loggers = {r["logger"] for r in records}
    assert {"kda_serve.app", "uvicorn.error", "uvicorn.access"} <= loggers, loggers
    access = [r for r in records if "/slots/nope" in r["message"] and r["logger"] == "uvicorn.access"]
    assert access and access[0].get("request_id") == "lookup-7", records  # the request's own id, in its log line
    assert len(access[0].get("trace_id", "")) == 32, access
    assert any(re.search(r"kernels warm in \d+\.\d s", r["message"]) for r in records), records


def test_json_lines_carry_the_request_id_and_the_traceback() -> None:
    import io
    import logging

    from service.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kda_serve.test_json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("with %s", "an id", extra={"request_id": "req-1"})
        logger.warning("without")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "with an id" and first["request_id"] == "req-1" and first["level"] == "WARNING"
    assert "request_id" not in second
    assert "RuntimeError: boom" in third["exc_info"]


def test_info_says_the_version(tmp_path: Path) -> None:
    server = start_server(TOY, tmp_path / "server.log")
    try:
        assert httpx.get(f"{server.url}/info").json()["version"] == __version__
    finally:
        assert server.stop() == 0
