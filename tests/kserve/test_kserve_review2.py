"""A second review of the KServe v2 front end, on the folder's live server: binary data
extension headers whose length is no plain byte count, and inference bodies that name
another model (or version) than the URL. Each is refused with a 400 in the protocol's
``{"error": ...}`` form naming the field, and the pool (a live sequence's slot and a REST
slot with random state, and the free-slot count) is bit for bit as it was. Over gRPC, a
shared memory region name holding a "/" (no HTTP route could address it) is refused."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import httpx
import pytest
import torch
import tritonclient.utils.shared_memory as shm
from kserve_helpers import infer, make_sequence, pool_image, random_state, seq_inputs
from tritonclient.utils import InferenceServerException

from kda_client.client import KDAClient


@pytest.fixture(scope="module")
def slots(server, client) -> Iterator[list[str]]:
    """A REST slot with random state and a live sequence's slot: what refusals must leave alone."""
    gen = torch.Generator().manual_seed(29)
    with KDAClient(server.url) as rest:
        (rest_slot,) = rest.alloc(1)
        rest.put_state(rest_slot, random_state(gen, 1)[0])
    r = infer(client, seq_inputs(make_sequence(4, gen)), sequence_id="review2-live", start=True)
    live = [rest_slot, r.get_response()["parameters"]["slot"]]
    yield live
    infer(client, seq_inputs(make_sequence(1, gen)), sequence_id="review2-live", end=True)
    with KDAClient(server.url) as rest:
        rest.free(rest_slot)


def _json_body(gen: torch.Generator, **extra: Any) -> dict[str, Any]:
    """A 3-token request with JSON numbers, plus the top-level members ``extra``."""
    tensors = seq_inputs(make_sequence(3, gen))
    return {"inputs": [{"name": n, "shape": list(t.shape), "datatype": "FP32", "data": t.reshape(-1).tolist()}
                       for n, t in tensors.items()], **extra}


def _binary_body(gen: torch.Generator) -> tuple[bytes, int]:
    """A 3-token request with binary data: the body and its JSON part's length."""
    tensors = seq_inputs(make_sequence(3, gen))
    head = json.dumps({"inputs": [{"name": n, "shape": list(t.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": t.numel() * 4}}
                                  for n, t in tensors.items()]}).encode()
    return head + b"".join(t.numpy().tobytes() for t in tensors.values()), len(head)


def _refused_400(server, slots: list[str], response_of: Any, *words: str) -> None:
    before = pool_image(server.url, slots)
    r: httpx.Response = response_of()
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json", r.text
    for word in words:
        assert word in r.json()["error"], r.text
    assert pool_image(server.url, slots) == before


@pytest.mark.parametrize("length", [b"\xb2", b"\xb9\xb3", b"9" * 5000],
                         ids=["superscript", "superscripts", "5000-digits"])
def test_a_header_length_that_is_no_plain_byte_count_is_a_400(server, slots, gen, length):
    """``Inference-Header-Content-Length`` of superscript digits (latin-1 bytes that
    Python's str.isdigit takes but int() does not) or of more digits than int() reads:
    a 400 naming the header, not a 500."""
    body, _ = _binary_body(gen)
    _refused_400(server, slots, lambda: httpx.post(
        f"{server.url}/v2/models/kda/infer", content=body,
        headers={"Inference-Header-Content-Length": length, "Content-Type": "application/octet-stream"}),
        "Inference-Header-Content-Length")


def test_a_true_header_length_with_leading_zeros_still_works(server, gen):
    body, head = _binary_body(gen)
    r = httpx.post(f"{server.url}/v2/models/kda/infer", content=body,
                   headers={"Inference-Header-Content-Length": f"000{head}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("member,value,path", [
    ("model_name", "other", "/v2/models/kda/infer"),
    ("model_version", "2", "/v2/models/kda/infer"),
    ("model_version", "2", "/v2/models/kda/versions/1/infer"),
])
def test_a_body_naming_another_model_than_the_url_is_refused(server, slots, gen, member, value, path):
    """The body's ``model_name`` / ``model_version`` (tolerated: some clients echo them) that
    contradict the URL: a 400 naming the member and both values, nothing run."""
    doc = _json_body(gen, **{member: value})
    _refused_400(server, slots, lambda: httpx.post(f"{server.url}{path}", json=doc), member, repr(value))


def test_a_body_echoing_the_url_model_is_accepted(server, gen):
    r = httpx.post(f"{server.url}/v2/models/kda/versions/1/infer",
                   json=_json_body(gen, model_name="kda", model_version="1"))
    assert r.status_code == 200, r.text
    assert (r.json()["model_name"], r.json()["model_version"]) == ("kda", "1")


def test_grpc_refuses_a_region_name_with_a_slash(server, grpc_client):
    """SystemSharedMemoryRegister of the name "a/b", which no HTTP route could address
    (status, unregister: an encoded slash names no route): INVALID_ARGUMENT naming the
    field, and nothing registered."""
    key = f"/kda-review2-{os.getpid()}"
    handle = shm.create_shared_memory_region("review2", key, 4096)
    try:
        before = grpc_client.get_system_shared_memory_status(as_json=True)
        with pytest.raises(InferenceServerException) as e:
            grpc_client.register_system_shared_memory("review2/b", key, 4096)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value.message()
        assert "'/'" in e.value.message() and "'review2/b'" in e.value.message(), e.value.message()
        assert grpc_client.get_system_shared_memory_status(as_json=True) == before
    finally:
        grpc_client.unregister_system_shared_memory("review2/b")
        shm.destroy_shared_memory_region(handle)
