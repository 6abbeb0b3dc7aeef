"""The kernel self-test before ready: a server whose kernels disagree with the float64
reference never becomes ready. A fault is injected with the test-only setting
``--self-test-fault PATH`` (it corrupts o of that one path after its kernel ran); the server
must then stay 503 on /health/ready (400 on KServe's probe), refuse prefills, and say in
/info and in its log which path failed and which toolchain compiled it. Without a fault,
every path passes and /info lists them. Units run the self-test in-process (CPU; the GPU's
Triton paths where there is one, marked ``gpu``)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Iterator, Optional

import httpx
import pytest
import torch
from reliability_helpers import GEOMETRY_ARGS, ROOT, Server, make_sequence
from server_harness import free_port, server_python_path

from kda_client.client import KDAClient, ServiceUnavailable
from service.config import Settings
from service.core.self_test import run_self_test
from service.core.server import ServerCore
from service.errors import NotReady

FAULT = "decode/bfloat16/lower_bound"


def _start_unready(args: list[str], log: Any) -> Server:
    """kda-serve on a free port, waited for until its /info answers (not until ready)."""
    port = free_port()
    out = open(log, "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": server_python_path()}, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert process.poll() is None, server.log_text()
        try:
            httpx.get(f"{server.url}/info", timeout=2)
            return server
        except httpx.TransportError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(server.log_text())


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _start_unready([*GEOMETRY_ARGS, "--self-test-fault", FAULT], tmp_path_factory.mktemp("faulty") / "kda.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def _self_test(server: Server, timeout: float = 120.0) -> dict[str, Any]:
    """/info's self_test once it is no longer pending."""
    deadline = time.monotonic() + timeout
    while True:
        report = httpx.get(f"{server.url}/info", timeout=10).json()["self_test"]
        if report["status"] != "pending" or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def test_a_kernel_mismatch_keeps_the_server_unready(faulty: Server, gen: torch.Generator) -> None:
    report = _self_test(faulty)
    assert report["status"] == "failed", report
    assert [f["path"] for f in report["failures"]] == [FAULT], report
    assert "o error" in report["failures"][0]["detail"]
    backend = "triton" if torch.cuda.is_available() else "torch"  # the server's default device: CUDA when there is one
    assert report["toolchain"]["backend"] == backend and report["toolchain"]["torch"] == torch.__version__
    assert len(report["paths"]) >= 18 and "chunked/float32/given" in report["paths"]
    for _ in range(3):  # stays so
        ready = httpx.get(f"{faulty.url}/health/ready", timeout=10)
        assert ready.status_code == 503, ready.text
        assert FAULT in ready.json()["detail"] and "Compiled by" in ready.json()["detail"]
        assert httpx.get(f"{faulty.url}/v2/health/ready", timeout=10).status_code == 400
        time.sleep(0.3)
    with KDAClient(faulty.url) as c, pytest.raises(ServiceUnavailable) as e:
        c.prefill(0, [(None, *make_sequence(4, gen))])
    assert FAULT in e.value.problem["detail"]
    assert httpx.get(f"{faulty.url}/info").json()["used_slots"] == 0  # the refused prefill allocated nothing
    log = faulty.log_text()
    assert "kernel self-test FAILED" in log and FAULT in log and "torch" in log


def test_a_healthy_server_reports_every_path_passed(tmp_path: Any) -> None:
    srv = _start_unready(GEOMETRY_ARGS, tmp_path / "kda.log")
    try:
        report = _self_test(srv)
        assert report["status"] == "passed" and report["failures"] == [], report
        assert {"decode/float16/softplus", "chunked/bfloat16/lower_bound"} <= set(report["paths"])
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "kernel self-test passed" in srv.log_text()
    finally:
        assert srv.stop() == 0


DEVICES = [
    ("cpu", "torch"),
    pytest.param("cuda", "triton", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a CUDA device")]),
]


@pytest.mark.parametrize("device, backend", DEVICES)
def test_the_self_test_passes_and_catches_each_injected_fault(device: str, backend: str) -> None:
    """Every path passes on a sound backend; a fault in any one path fails that path alone
    (on the GPU: the wide and pieces layouts of the Triton kernels too), the last being a
    ``flags/`` path whose kernels never flag the NaN inputs nor fail their input check, and
    a ``check:`` fault whose input check fails finite inputs. A fault naming no path fails
    the test rather than passing it unnoticed."""
    core = ServerCore(Settings(device=device, backend=backend, num_layers=1, num_slots=2, num_heads=4,
                               head_dim=16, head_v_dim=32))
    report = run_self_test(core.geometry, core.backend, core.gates)
    assert report.passed, report.describe()
    paths = [r.path for r in report.results]
    kinds = {p.split("/")[0] for p in paths}
    assert kinds == {"decode", "chunked", "flags"}
    assert {p.split("/")[1] for p in paths} == {"float32", "bfloat16", "float16"}
    assert paths[-1].startswith("flags/")
    if device == "cuda":
        assert any(p.endswith("/wide") for p in paths)
    for fault in (paths[0], paths[-1]):
        bad = run_self_test(core.geometry, core.backend, core.gates, fault=fault)
        assert [r.path for r in bad.failures] == [fault], bad.describe()
    assert "input check passed a NaN" in bad.describe()  # the flags/ fault: no flag, no input check
    check = run_self_test(core.geometry, core.backend, core.gates, fault="check:" + paths[0])
    assert [r.path for r in check.failures] == [paths[0]], check.describe()
    assert "input check failed finite inputs" in check.describe()  # a check that fails clean inputs
    typo = run_self_test(core.geometry, core.backend, core.gates, fault="decode/float64/none")
    assert not typo.passed and "names no path" in typo.describe()
    core.worker.close()


def test_a_self_test_fault_is_a_setting_not_a_global() -> None:
    """Two cores in one process, warmed up (which runs the self-test): the one given the
    fault fails and stays unready (`check_ready` names the path), the other passes and is
    ready."""
    args = dict(device="cpu", num_layers=1, num_slots=2, num_heads=2, head_dim=16)
    import asyncio

    async def readiness(core: ServerCore) -> Optional[str]:
        try:
            await core.check_ready()
            return None
        except NotReady as e:
            return e.detail

    async def run() -> tuple[bool, bool, Optional[str], Optional[str]]:
        faulty, sound = ServerCore(Settings(**args, self_test_fault=FAULT)), ServerCore(Settings(**args))
        try:
            assert await readiness(faulty) == "warming the kernels"
            passed = (await faulty.warmup()).passed, (await sound.warmup()).passed
            return (*passed, await readiness(faulty), await readiness(sound))
        finally:
            faulty.worker.close()
            sound.worker.close()

    faulty_passed, sound_passed, faulty_unready, sound_unready = asyncio.run(run())
    assert (faulty_passed, sound_passed) == (False, True)
    assert faulty_unready is not None and FAULT in faulty_unready and sound_unready is None
