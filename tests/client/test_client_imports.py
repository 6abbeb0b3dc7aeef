"""The client is its own package: importing it (and the `service.client` re-export) loads
no part of the server stack, so an engine can embed it without FastAPI, Starlette, uvicorn
or Triton."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_STACK = ("fastapi", "starlette", "uvicorn", "triton", "kernels", "state_store")
_PROBE = """
import json, sys
import {module}
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))
"""


def _top_level_modules_after_import(module: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(module=module)], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["kda_client", "service.client"])
def test_importing_the_client_loads_no_server_module(module: str) -> None:
    loaded = _top_level_modules_after_import(module)
    assert "httpx" in loaded and "torch" in loaded  # the probe saw the client's own imports
    assert not loaded & set(SERVER_STACK), f"{module} pulled in {sorted(loaded & set(SERVER_STACK))}"


def test_service_client_is_the_same_client() -> None:
    import kda_client
    import service.client

    assert service.client.KDAClient is kda_client.KDAClient
    assert service.client.AsyncKDAClient is kda_client.AsyncKDAClient
    assert set(service.client.__all__) == set(kda_client.__all__)
