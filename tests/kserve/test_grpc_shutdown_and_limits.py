"""gRPC at SIGTERM and the shared memory region names, against real kda-serve processes.

- From the moment SIGTERM arrives, while uvicorn still drains an HTTP request in flight,
  gRPC answers ServerReady and ModelReady false and refuses new calls and new streams
  (UNAVAILABLE); a gRPC call already in flight and the HTTP request are answered whole,
  and the process exits 0.
- A region name has at most `REGION_NAME_MAX` characters on both protocols: longer ones
  are refused (gRPC INVALID_ARGUMENT, HTTP 400) naming the field, and nothing is registered.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import httpx
import pytest
import torch
import tritonclient.grpc as gc
import tritonclient.utils.shared_memory as shm
from kserve_helpers import (
    GEOMETRY_ARGS, TOL, grpc_infer, grpc_inputs, make_sequence, metric, reference, rel, result_tensor, seq_inputs,
    start_server, wait_for,
)
from tritonclient.utils import InferenceServerException

from service.kserve.protocol import REGION_NAME_MAX
from service.wire.prefill import decode_prefill_response
from service.wire.safetensors_codec import encode_safetensors

ST = "application/x-safetensors"
Seq = tuple[torch.Tensor, ...]


def _refusal(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


# -- SIGTERM -------------------------------------------------------------------------------


def prefill_body(seq: Seq) -> bytes:
    """A safetensors /prefill body of one sequence on a new slot, layer 0."""
    tensors = dict(zip(("q", "k", "v", "g", "beta"), seq))
    request = {"layer": 0, "sequences": [{"slot": None, "length": seq[0].shape[0]}]}
    return bytes(encode_safetensors(tensors, {"request": json.dumps(request)}))


class HeldPrefill:
    """A /prefill whose body is sent in two parts: the first at once, the second when
    `release` is called (chunked, so the server waits on the body meanwhile)."""

    def __init__(self, url: str, body: bytes) -> None:
        self._release = threading.Event()
        self._half = len(body) // 2
        self._body = body
        self._pool = ThreadPoolExecutor(1)
        self.response = self._pool.submit(httpx.post, f"{url}/prefill", content=self._parts(),
                                          headers={"Content-Type": ST, "Accept": ST}, timeout=60)

    def _parts(self) -> Iterator[bytes]:
        yield self._body[:self._half]
        if not self._release.wait(25):  # within the server's 30 s body timeout
            raise TimeoutError("the held prefill was never released")
        yield self._body[self._half:]

    def release(self) -> httpx.Response:
        self._release.set()
        try:
            return self.response.result(timeout=60)
        finally:
            self._pool.shutdown()


def http_in_flight(url: str) -> float:
    """HTTP requests in flight, the /metrics request reading it included."""
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, "kda_http_requests_in_flight")


def http_refused(url: str) -> bool:
    """Whether a new HTTP connection is refused (the server stopped listening)."""
    try:
        httpx.get(f"{url}/health/live", timeout=5)
    except httpx.TransportError:
        return True
    return False


def used_slots(url: str) -> int:
    return httpx.get(f"{url}/info", timeout=10).json()["used_slots"]


def new_stream_error(client: gc.InferenceServerClient, tensors: dict[str, torch.Tensor]) -> Optional[Any]:
    """The error a new stream gets, refused at once or at its first request (None when
    that request is answered)."""
    outcome: "queue.Queue[Any]" = queue.Queue()
    client.start_stream(callback=lambda result, error: outcome.put(error))
    try:
        try:
            client.async_stream_infer("kda", grpc_inputs(tensors), request_id="late")
        except InferenceServerException:  # the stream ended already: its error went to the callback
            pass
        return outcome.get(timeout=30)
    finally:
        client.stop_stream()


def test_sigterm_makes_grpc_unready_and_refuses_new_work_while_http_drains(tmp_path, gen):
    """A /prefill whose body is half sent and a gRPC ModelInfer waiting in the 2 s batch
    window when SIGTERM arrives: while the /prefill is held, gRPC answers ServerReady and
    ModelReady false, refuses a new ModelInfer and a new stream UNAVAILABLE, and HTTP no
    longer accepts connections; the ModelInfer in flight and the /prefill are answered (equal
    to the reference), and the process exits 0."""
    server = start_server([*GEOMETRY_ARGS, "--batch-window-ms", "2000"], tmp_path / "kda-serve.log", grpc=True)
    held_seq, grpc_seq, late_seq = (make_sequence(n, gen) for n in (7, 5, 3))
    try:
        held = HeldPrefill(server.url, prefill_body(held_seq))
        assert wait_for(lambda: http_in_flight(server.url) >= 2, timeout=20), "the held /prefill never arrived"
        with gc.InferenceServerClient(server.grpc) as c, ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(grpc_infer, c, seq_inputs(grpc_seq))
            assert wait_for(lambda: used_slots(server.url) == 1, timeout=20), "the gRPC call never arrived"
            server.process.send_signal(signal.SIGTERM)
            assert wait_for(lambda: not c.is_server_ready(client_timeout=10), timeout=10)
            assert not c.is_model_ready("kda", client_timeout=10)
            assert c.is_server_live(client_timeout=10)
            e = _refusal(lambda: c.infer("kda", grpc_inputs(seq_inputs(late_seq)), client_timeout=10))
            assert e.status() == "StatusCode.UNAVAILABLE" and "shutting down" in e.message(), e
            error = new_stream_error(c, seq_inputs(late_seq))
            assert error is not None and "UNAVAILABLE" in str(error.status()), error
            assert wait_for(lambda: http_refused(server.url), timeout=10)  # uvicorn acts on its next tick
            assert server.process.poll() is None  # still draining the held /prefill
            answered = in_flight.result(timeout=30)
        assert rel(result_tensor(answered, "o"), reference([grpc_seq])[0]) < TOL
        response = held.release()
        assert response.status_code == 200, response.text[:300]
        _, o, final = decode_prefill_response(bytearray(response.content), response.headers["content-type"])
        o_ref, final_ref = reference([held_seq])
        assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL
        assert server.process.wait(30) == 0, server.log_text()
    finally:
        server.stop()
    assert "Traceback" not in server.log_text(), server.log_text()


# -- region names --------------------------------------------------------------------------


@pytest.fixture
def shm_key(client) -> Iterator[str]:
    """A POSIX shared memory object of 4 KiB; every region is unregistered after the test,
    so a failure leaves the shared server clean."""
    key = f"/kda_names_{os.getpid()}"
    handle = shm.create_shared_memory_region("names", key, 4096)
    try:
        yield key
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def registered(client) -> set[str]:
    return {r["name"] for r in client.get_system_shared_memory_status()}


@pytest.mark.parametrize("length", [REGION_NAME_MAX + 1, 200_000])
def test_grpc_refuses_a_region_name_past_the_limit(client, grpc_client, shm_key, length):
    e = _refusal(lambda: grpc_client.register_system_shared_memory("n" * length, shm_key, 4096))
    assert e.status() == "StatusCode.INVALID_ARGUMENT", e
    assert f"name has at most {REGION_NAME_MAX} characters, got {length}" in e.message(), e.message()
    assert registered(client) == set()


def test_http_refuses_a_region_name_past_the_limit(client, shm_key):
    e = _refusal(lambda: client.register_system_shared_memory("n" * (REGION_NAME_MAX + 1), shm_key, 4096))
    assert e.status() == "400", e
    assert f"name has at most {REGION_NAME_MAX} characters, got {REGION_NAME_MAX + 1}" in e.message(), e.message()
    assert registered(client) == set()


def test_a_name_at_the_limit_registers_on_both_protocols(client, grpc_client, shm_key):
    name = "n" * REGION_NAME_MAX
    grpc_client.register_system_shared_memory(name, shm_key, 4096)
    assert registered(client) == {name}
    client.unregister_system_shared_memory(name)
    client.register_system_shared_memory(name, shm_key, 4096)
    assert set(grpc_client.get_system_shared_memory_status(as_json=True)["regions"]) == {name}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cuda") is None,
                    reason="needs a CUDA device and cuda-python")
def test_cuda_registration_refuses_a_name_past_the_limit_on_both_protocols(client, grpc_client):
    """The name is checked before the handle is opened (this one opens nothing)."""
    name, handle = "n" * (REGION_NAME_MAX + 1), b"\0" * 64
    e = _refusal(lambda: grpc_client.register_cuda_shared_memory(name, handle, 0, 16))
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "name has at most" in e.message(), e.message()
    e = _refusal(lambda: client.register_cuda_shared_memory(name, handle, 0, 16))
    assert e.status() == "400" and "name has at most" in e.message(), e.message()
    assert client.get_cuda_shared_memory_status() == []
