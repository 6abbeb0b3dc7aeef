"""Every refusal of the KServe endpoint: an ``{"error": ...}`` with a 4xx status, which
tritonclient raises as InferenceServerException with a clear message, and no state change:
every live slot's export bit for bit, the free-slot count, and the live sequences (they
continue exactly where they were, afterwards)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import httpx
import pytest
import torch
import tritonclient.http as tc
from kserve_helpers import (
    MAX_BODY_MB, H, HV, K, LAYERS, TOL, V, infer, make_sequence, pool_image, random_state, reference, rel, result_tensor,
    seq_inputs, triton_inputs,
)
from tritonclient.utils import InferenceServerException

from kda_client.client import KDAClient

LIVE = ("live-sequence", 77)


@dataclass
class World:
    """What refusals must leave alone: REST slots with random state, and the live sequences
    ``LIVE`` with the tokens each has seen and its slot."""

    rest_slots: list[str]
    seen: dict[object, list[tuple[torch.Tensor, ...]]]
    sequence_slots: dict[object, str]

    @property
    def slots(self) -> list[str]:
        return self.rest_slots + list(self.sequence_slots.values())


@pytest.fixture(scope="module")
def world(server, client) -> World:
    gen = torch.Generator().manual_seed(11)
    with KDAClient(server.url) as rest:
        slots = rest.alloc(2)
        for slot, state in zip(slots, random_state(gen, 2)):
            rest.put_state(slot, state)
    seen, sequence_slots = {}, {}
    for sequence in LIVE:
        seq = make_sequence(5, gen)
        r = infer(client, seq_inputs(seq), sequence_id=sequence, start=True)
        seen[sequence] = [seq]
        sequence_slots[sequence] = r.get_response()["parameters"]["slot"]
    return World(slots, seen, sequence_slots)


@dataclass
class Ctx:
    server: Any
    client: tc.InferenceServerClient
    gen: torch.Generator
    world: World

    def tensors(self, T: int = 6, **replace: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**seq_inputs(make_sequence(T, self.gen)), **replace}

    def json_doc(self, **datatype: str) -> dict[str, Any]:
        """A 3-token request with JSON numbers; ``datatype`` overrides inputs' datatypes."""
        return {"inputs": [{"name": n, "shape": list(t.shape), "datatype": datatype.get(n, "FP32"),
                            "data": t.reshape(-1).tolist()} for n, t in self.tensors(3).items()]}

    def binary_body(self, declared: Optional[dict[str, int]] = None) -> tuple[bytes, dict[str, str]]:
        """(body, headers) of a 3-token binary request; ``declared`` overrides binary_data_size."""
        ts = self.tensors(3)
        inputs = [{"name": n, "shape": list(t.shape), "datatype": "FP32",
                   "parameters": {"binary_data_size": (declared or {}).get(n, t.numel() * 4)}} for n, t in ts.items()]
        head = json.dumps({"inputs": inputs}).encode()
        body = head + b"".join(t.numpy().tobytes() for t in ts.values())
        return body, {"inference-header-content-length": str(len(head))}

    def post(self, body: bytes, headers: Optional[dict[str, str]] = None) -> httpx.Response:
        return httpx.post(f"{self.server.url}/v2/models/kda/infer", content=body, headers=headers or {})


CASES: dict[str, tuple[Callable[[Ctx], Optional[httpx.Response]], int, tuple[str, ...]]] = {}


def case(status: int, *words: str) -> Callable[[Callable[[Ctx], Any]], Callable[[Ctx], Any]]:
    """Register a refusal: it calls tritonclient (which must raise) or returns a raw response."""
    def register(fn: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
        CASES[fn.__name__] = (fn, status, words)
        return fn
    return register


# -- sequences and slots ---------------------------------------------------------------

@case(400, "inference request for sequence 4242 to model 'kda' must specify the START flag")
def unknown_sequence_without_start(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id=4242)


@case(400, "sequence 'nope'", "START")
def unknown_sequence_with_end(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id="nope", end=True)


@case(400, "sequence '77'", "START")
def string_id_is_not_the_uint_id(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id="77")


@case(400, "sequence_id or slot, not both")
def sequence_and_slot(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id=77, params={"slot": c.world.rest_slots[0]})


@case(404, "unknown slot id 'nope'")
def unknown_slot(c: Ctx) -> None:
    infer(c.client, c.tensors(), params={"slot": "nope"})


# -- shapes and values: /prefill's checks, word for word ---------------------------------

@case(400, "k must be", f"[6, {HV * 2}, {K}]")
def k_shape(c: Ctx) -> None:
    infer(c.client, c.tensors(k=torch.randn(6, HV * 2, K)), sequence_id=77)


@case(400, "v must be", f"[6, {HV}, {V}]", f"[6, {HV + 1}, {V}]")
def v_heads(c: Ctx) -> None:
    infer(c.client, c.tensors(v=torch.randn(6, HV + 1, V)), sequence_id="live-sequence")


@case(400, "q must be [T, H, K]")
def q_head_dim(c: Ctx) -> None:
    infer(c.client, c.tensors(q=torch.randn(6, H, K + 1)), sequence_id=77)


@case(400, "g must be")
def g_tokens(c: Ctx) -> None:
    infer(c.client, c.tensors(g=-torch.rand(5, HV, K)), sequence_id=77)


@case(400, "beta must have 2 dimensions")
def beta_rank_on_start(c: Ctx) -> None:
    infer(c.client, c.tensors(beta=torch.rand(6, HV, 1)), sequence_id=77, start=True)


@case(400, "non-finite")
def nan_q(c: Ctx) -> None:
    infer(c.client, c.tensors(q=torch.full((6, H, K), float("nan"))), sequence_id=77)


@case(400, f"layer {LAYERS} out of range")
def layer_out_of_range(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id=77, params={"layer": LAYERS})


@case(400, "lower_bound must lie in")
def lower_bound_out_of_range(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id=77, params={"lower_bound": -6.0})


@case(400, "dt_bias needs A_log or lower_bound")
def dt_bias_alone(c: Ctx) -> None:
    infer(c.client, c.tensors(dt_bias=torch.zeros(HV, K)), sequence_id=77)


# -- datatypes ---------------------------------------------------------------------------

@case(400, "input 'q' has datatype 'INT32'", "FP32, BF16 or FP16")
def int32_q(c: Ctx) -> None:
    infer(c.client, c.tensors(q=torch.ones(6, H, K, dtype=torch.int32)), sequence_id=77)


@case(400, "input 'v' has datatype 'FP64'")
def fp64_v(c: Ctx) -> None:
    infer(c.client, c.tensors(v=torch.ones(6, HV, V, dtype=torch.float64)), sequence_id=77)


@case(400, "input 'q' is BF16", "binary data")
def bf16_as_json_numbers(c: Ctx) -> httpx.Response:
    return c.post(json.dumps(c.json_doc(q="BF16")).encode())


@case(400, "input 'k'", f"is {3 * H * K * 4} bytes, but its binary_data_size says 1")
def binary_size_disagrees_with_shape(c: Ctx) -> httpx.Response:
    return c.post(*c.binary_body({"k": 1}))


@case(400, "input 'beta'", f"shape [3, {HV + 1}] needs {3 * (HV + 1)} values, data holds 12")
def json_data_count_disagrees_with_shape(c: Ctx) -> httpx.Response:
    doc = c.json_doc()
    doc["inputs"][4]["shape"] = [3, HV + 1]
    return c.post(json.dumps(doc).encode())


@case(400, "input 'g'", "numbers only")
def json_data_of_strings(c: Ctx) -> httpx.Response:
    doc = c.json_doc()
    doc["inputs"][3]["data"] = [str(x) for x in doc["inputs"][3]["data"]]
    return c.post(json.dumps(doc).encode())


# -- documents, names, parameters, encodings ---------------------------------------------

@case(400, "missing input(s) ['beta']")
def missing_beta(c: Ctx) -> None:
    infer(c.client, {n: t for n, t in c.tensors().items() if n != "beta"})


@case(400, "unknown input(s) ['x']")
def unknown_input(c: Ctx) -> None:
    infer(c.client, c.tensors(x=torch.ones(2)))


@case(400, "unknown output 'state'")
def unknown_output(c: Ctx) -> None:
    infer(c.client, c.tensors(), outputs=[tc.InferRequestedOutput("state")])


@case(400, "unknown request parameter(s) ['use_l2norm']")
def unknown_parameter(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id=77, params={"use_l2norm": True})


@case(400, "layer must be an integer, got a string")
def layer_as_string(c: Ctx) -> None:
    infer(c.client, c.tensors(), sequence_id=77, params={"layer": "1"})


@case(404, "unknown model 'other'")
def unknown_model(c: Ctx) -> None:
    c.client.infer("other", triton_inputs(c.tensors()))


@case(400, "not valid JSON")
def not_json(c: Ctx) -> httpx.Response:
    return c.post(b'{"inputs": [')


@case(422, "inputs")
def schema_error(c: Ctx) -> httpx.Response:
    return c.post(json.dumps({"inputs": "q"}).encode())


@case(400, "exactly one of data, binary_data_size or shared_memory_region")
def data_and_binary_size(c: Ctx) -> httpx.Response:
    doc = c.json_doc()
    doc["inputs"][0]["parameters"] = {"binary_data_size": 4}
    return c.post(json.dumps(doc).encode())


@case(400, "Inference-Header-Content-Length")
def header_length_past_the_body(c: Ctx) -> httpx.Response:
    return c.post(b"{}", {"inference-header-content-length": "99"})


@case(400, "bytes of binary data", "follow the")
def binary_part_cut_short(c: Ctx) -> httpx.Response:
    body, headers = c.binary_body()
    return c.post(body[:-4], headers)


@case(415, "Content-Encoding 'gzip' is not supported")
def gzip_body(c: Ctx) -> None:
    c.client.infer("kda", triton_inputs(c.tensors()), request_compression_algorithm="gzip")


@case(400, "unknown shared memory region 'nowhere'")
def unknown_shared_memory_region(c: Ctx) -> None:
    out = tc.InferRequestedOutput("o")
    out.set_shared_memory("nowhere", 1 << 20)
    c.client.infer("kda", triton_inputs(c.tensors()), outputs=[out], sequence_id=77)


@case(413, "exceeds the 1048576-byte limit")
def body_over_the_limit(c: Ctx) -> None:
    per_token = 4 * (2 * H * K + HV * V + HV * K + HV)
    infer(c.client, c.tensors((MAX_BODY_MB << 20) // per_token + 50), sequence_id=77)


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_with_a_clear_error_and_no_state_change(server, client, world, gen, name):
    fn, status, words = CASES[name]
    before = pool_image(server.url, world.slots)
    try:
        response = fn(Ctx(server, client, gen, world))
    except InferenceServerException as e:
        got, message = e.status(), e.message()
    else:
        assert response is not None, f"{name} was accepted"
        assert response.headers["content-type"] == "application/json", response.text
        got, message = str(response.status_code), response.json()["error"]
    assert got == str(status), message
    for word in words:
        assert word in message, message
    assert pool_image(server.url, world.slots) == before


def test_live_sequences_continue_where_they_were(server, client, world, gen):
    """After every refusal above, each live sequence continues from exactly its own tokens,
    on the slot it started on."""
    for sequence in LIVE:
        seq = make_sequence(4, gen)
        r = infer(client, seq_inputs(seq), sequence_id=sequence, end=True)
        whole = tuple(torch.cat([s[i] for s in [*world.seen[sequence], seq]]) for i in range(5))
        o_ref, final_ref = reference([whole])
        assert rel(result_tensor(r, "o"), o_ref[-4:]) < TOL, sequence
        assert rel(result_tensor(r, "final_state"), final_ref[0]) < TOL, sequence
        assert httpx.get(f"{server.url}/slots/{world.sequence_slots[sequence]}").status_code == 404  # ended
