"""The gRPC front end's pieces in process: errors as status codes with HTTP's messages,
UNAVAILABLE while the kernels warm, the grpc extra and the port checked before serving,
and a port already taken failing the start."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
import pytest
import torch
from kserve_helpers import GEOMETRY_ARGS, HV, K, LAYERS, ROOT, V

from service.config import Settings
from service.core.server import ServerCore
from service.errors import API_KEY_REQUIRED, PERSISTENCE_UNAVAILABLE, InvalidRequest, NotReady, SchemaError, StateLost
from service.http.app import create_app
from service.kserve.endpoint import KServeEndpoint
from service.kserve.errors import UnknownModel
from service.kserve.rpc.codec import parse_infer_request
from service.kserve.rpc.status import Unauthenticated, Unimplemented, rpc_status
from service.shm.registry import ShmRegistry
from state_store import PoolFull, SnapshotError, UnknownSlot
from tritonclient.grpc import service_pb2 as pb

SETTINGS = dict(num_layers=LAYERS, num_slots=8, num_heads=HV, head_dim=K, head_v_dim=V)
Code = grpc.StatusCode


def test_errors_map_to_status_codes_with_the_http_messages():
    cases = [
        (InvalidRequest("q must be [T, H, K]"), Code.INVALID_ARGUMENT, "q must be [T, H, K]"),
        (SchemaError("inputs: bad", []), Code.INVALID_ARGUMENT, "inputs: bad"),
        (Unauthenticated(), Code.UNAUTHENTICATED, API_KEY_REQUIRED),
        (UnknownModel("unknown model 'x'"), Code.NOT_FOUND, "unknown model 'x'"),
        (UnknownSlot("s"), Code.NOT_FOUND, str(UnknownSlot("s"))),
        (StateLost("s"), Code.FAILED_PRECONDITION, StateLost("s").detail),
        (PoolFull(2, 1), Code.RESOURCE_EXHAUSTED, str(PoolFull(2, 1))),
        (SnapshotError("/x", "disk full"), Code.RESOURCE_EXHAUSTED, PERSISTENCE_UNAVAILABLE),
        (NotReady("warming"), Code.UNAVAILABLE, "warming"),
        (Unimplemented("TraceSetting"), Code.UNIMPLEMENTED, "kda-serve does not implement TraceSetting"),
    ]
    for error, code, message in cases:
        assert rpc_status(error) == (code, message), error


def test_infer_is_unavailable_while_the_kernels_warm():
    core = ServerCore(Settings(**SETTINGS))
    endpoint = KServeEndpoint(core, lambda: False, ShmRegistry())
    request = pb.ModelInferRequest(model_name="kda")
    for name, shape in (("q", [1, 2, K]), ("k", [1, 2, K]), ("v", [1, HV, V]), ("g", [1, HV, K]), ("beta", [1, HV])):
        request.inputs.add(name=name, datatype="FP32", shape=shape)
        request.raw_input_contents.append(torch.ones(shape).numpy().tobytes())
    parsed = parse_infer_request(request)
    with pytest.raises(NotReady) as e:
        asyncio.run(endpoint.infer("kda", "", parsed))
    assert rpc_status(e.value)[0] == Code.UNAVAILABLE and core.pool.stats().used == 0
    core.worker.close()


def test_grpc_port_is_checked_and_needs_the_extra(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="grpc_port must be in 0..65535"):
        Settings(**SETTINGS, grpc_port=70000)
    for name in [m for m in sys.modules if m.startswith("service.kserve.rpc")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "grpc", None)  # as if grpcio were not installed
    with pytest.raises(ValueError, match=r"--grpc-port needs the grpc extra \(from the checkout: pip install -e '\.\[grpc\]'\)"):
        create_app(Settings(**SETTINGS, grpc_port=8001))
    create_app(Settings(**SETTINGS))  # gRPC off: nothing of it is imported


def test_a_taken_grpc_port_fails_the_start(tmp_path):
    """SO_REUSEPORT is off: a port another socket holds is an error, never shared."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "service.cli", "--host", "127.0.0.1", "--port", "0", "--grpc-port", str(port),
             "--log-level", "warning", *GEOMETRY_ARGS],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot serve gRPC on 127.0.0.1:{port}" in done.stdout + done.stderr
