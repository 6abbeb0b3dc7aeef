"""Every refusal of the gRPC endpoint: a status code mapped from HTTP's (INVALID_ARGUMENT for
400, NOT_FOUND for 404, RESOURCE_EXHAUSTED past the message limit), the same message as the
same request over HTTP, and no state change: every live slot's export bit for bit (through
the REST state export), the free-slot count, and the live sequences, which continue exactly
where they were afterwards. Then the API key, on a server of its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import grpc
import pytest
import torch
import tritonclient.grpc as gc
import tritonclient.http as tc
from kserve_helpers import (
    MAX_BODY_MB, H, HV, K, LAYERS, TOL, V, grpc_infer, grpc_inputs, infer, make_sequence, pool_image,
    random_state, reference, rel, response_slot, result_tensor, seq_inputs, triton_inputs, wait_for,
)
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from kda_client.client import KDAClient

LIVE = ("grpc-live", 78)


@dataclass
class World:
    """REST slots with random state and live sequences (tokens seen, slot) refusals must not touch."""

    rest_slots: list[str]
    seen: dict[object, list[tuple[torch.Tensor, ...]]]
    sequence_slots: dict[object, str]

    @property
    def slots(self) -> list[str]:
        return self.rest_slots + list(self.sequence_slots.values())


@pytest.fixture(scope="module")
def world(server, grpc_client) -> World:
    gen = torch.Generator().manual_seed(12)
    with KDAClient(server.url) as rest:
        slots = rest.alloc(2)
        for slot, state in zip(slots, random_state(gen, 2)):
            rest.put_state(slot, state)
    seen, sequence_slots = {}, {}
    for sequence in LIVE:
        seq = make_sequence(5, gen)
        r = grpc_infer(grpc_client, seq_inputs(seq), sequence_id=sequence, start=True)
        seen[sequence], sequence_slots[sequence] = [seq], response_slot(r)
    return World(slots, seen, sequence_slots)


@dataclass
class Via:
    """One transport's way to send a request: ``infer(tensors, **infer_kwargs)``; ``client``
    is tritonclient's (grpc or http)."""

    client: Any
    infer: Callable[..., Any]
    inputs: Callable[[dict[str, torch.Tensor]], list[Any]]


@dataclass
class Ctx:
    world: World
    tensors: dict[str, torch.Tensor]  # 6 tokens, fixed per case so both transports see the same request
    stub: pb_grpc.GRPCInferenceServiceStub

    def with_(self, **replace: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**self.tensors, **replace}

    def raw(self, **edit: Any) -> pb.ModelInferRequest:
        """The request as a hand-made ModelInferRequest, sequence 78."""
        request = pb.ModelInferRequest(model_name="kda")
        for name, t in self.tensors.items():
            request.inputs.add(name=name, datatype="FP32", shape=list(t.shape))
            request.raw_input_contents.append(t.numpy().tobytes())
        request.parameters["sequence_id"].int64_param = 78
        return request


Case = Callable[[Ctx, Via], Any]
CASES: dict[str, tuple[Case, str, Optional[str], tuple[str, ...]]] = {}


def case(code: str, http: Optional[str], *words: str) -> Callable[[Case], Case]:
    """Register a refusal: gRPC status ``code``; ``http`` the status the same request gets over
    HTTP (then the messages must be equal), None for a gRPC-only case (``via`` is gRPC's)."""
    def register(fn: Case) -> Case:
        CASES[fn.__name__] = (fn, code, http, words)
        return fn
    return register


# -- sequences and slots --------------------------------------------------------------------

@case("INVALID_ARGUMENT", "400", "inference request for sequence 4343 to model 'kda' must specify the START flag")
def unknown_sequence_without_start(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id=4343)


@case("INVALID_ARGUMENT", "400", "sequence 'nope'", "START")
def unknown_sequence_with_end(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id="nope", end=True)


@case("INVALID_ARGUMENT", "400", "sequence '78'", "START")
def string_id_is_not_the_uint_id(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id="78")


@case("INVALID_ARGUMENT", "400", "sequence_id or slot, not both")
def sequence_and_slot(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id=78, params={"slot": c.world.rest_slots[0]})


@case("NOT_FOUND", "404", "unknown slot id 'nope'")
def unknown_slot(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, params={"slot": "nope"})


# -- shapes, values and datatypes: /prefill's checks, word for word ---------------------------

@case("INVALID_ARGUMENT", "400", "k must be", f"[6, {HV * 2}, {K}]")
def k_shape(c: Ctx, via: Via) -> None:
    via.infer(c.with_(k=torch.randn(6, HV * 2, K)), sequence_id=78)


@case("INVALID_ARGUMENT", "400", "v must be", f"[6, {HV + 1}, {V}]")
def v_heads(c: Ctx, via: Via) -> None:
    via.infer(c.with_(v=torch.randn(6, HV + 1, V)), sequence_id="grpc-live")


@case("INVALID_ARGUMENT", "400", "q must be [T, H, K]")
def q_head_dim(c: Ctx, via: Via) -> None:
    via.infer(c.with_(q=torch.randn(6, H, K + 1)), sequence_id=78)


@case("INVALID_ARGUMENT", "400", "beta must have 2 dimensions")
def beta_rank_on_start(c: Ctx, via: Via) -> None:
    via.infer(c.with_(beta=torch.rand(6, HV, 1)), sequence_id=78, start=True)


@case("INVALID_ARGUMENT", "400", "non-finite")
def nan_q(c: Ctx, via: Via) -> None:
    via.infer(c.with_(q=torch.full((6, H, K), float("nan"))), sequence_id=78)


@case("INVALID_ARGUMENT", "400", f"layer {LAYERS} out of range")
def layer_out_of_range(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id=78, params={"layer": LAYERS})


@case("INVALID_ARGUMENT", "400", "dt_bias needs A_log or lower_bound")
def dt_bias_alone(c: Ctx, via: Via) -> None:
    via.infer(c.with_(dt_bias=torch.zeros(HV, K)), sequence_id=78)


@case("INVALID_ARGUMENT", "400", "input 'q' has datatype 'INT32'", "FP32, BF16 or FP16")
def int32_q(c: Ctx, via: Via) -> None:
    via.infer(c.with_(q=torch.ones(6, H, K, dtype=torch.int32)), sequence_id=78)


@case("INVALID_ARGUMENT", "400", "input 'v' has datatype 'FP64'")
def fp64_v(c: Ctx, via: Via) -> None:
    via.infer(c.with_(v=torch.ones(6, HV, V, dtype=torch.float64)), sequence_id=78)


# -- names and parameters ---------------------------------------------------------------------

@case("INVALID_ARGUMENT", "400", "missing input(s) ['beta']")
def missing_beta(c: Ctx, via: Via) -> None:
    via.infer({n: t for n, t in c.tensors.items() if n != "beta"})


@case("INVALID_ARGUMENT", "400", "unknown input(s) ['x']")
def unknown_input(c: Ctx, via: Via) -> None:
    via.infer(c.with_(x=torch.ones(2)))


@case("INVALID_ARGUMENT", "400", "unknown output 'state'")
def unknown_output(c: Ctx, via: Via) -> None:
    out = gc.InferRequestedOutput("state") if isinstance(via.client, gc.InferenceServerClient) else \
        tc.InferRequestedOutput("state")
    via.infer(c.tensors, outputs=[out])


@case("INVALID_ARGUMENT", "400", "unknown request parameter(s) ['use_l2norm']")
def unknown_parameter(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id=78, params={"use_l2norm": True})


@case("INVALID_ARGUMENT", "400", "layer must be an integer, got a string")
def layer_as_string(c: Ctx, via: Via) -> None:
    via.infer(c.tensors, sequence_id=78, params={"layer": "1"})


@case("NOT_FOUND", "404", "unknown model 'other'")
def unknown_model(c: Ctx, via: Via) -> None:
    via.client.infer("other", via.inputs(c.tensors))


@case("INVALID_ARGUMENT", "400", "unknown shared memory region 'nowhere'")
def unknown_shared_memory_region(c: Ctx, via: Via) -> None:
    out = gc.InferRequestedOutput("o") if isinstance(via.client, gc.InferenceServerClient) else \
        tc.InferRequestedOutput("o")
    out.set_shared_memory("nowhere", 1 << 20)
    via.infer(c.tensors, outputs=[out], sequence_id=78)


# -- gRPC's own framing: raw_input_contents, contents, parameters (hand-made messages) ---------

@case("INVALID_ARGUMENT", None, "input 'k'", f"is {6 * H * K * 4} bytes, but its raw_input_contents says 4")
def raw_size_disagrees_with_shape(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.raw_input_contents[1] = b"\0" * 4
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "6 raw_input_contents entries, but only 5 input(s)")
def raw_entry_too_many(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.raw_input_contents.append(b"\0" * 8)
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "input 'beta' must carry its bytes in exactly one of contents, raw_input_contents "
                                "or shared_memory_region, got none")
def raw_entry_missing(c: Ctx, via: Via) -> None:
    request = c.raw()
    del request.raw_input_contents[4]
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "contents must not be given when the request uses raw_input_contents")
def contents_and_raw(c: Ctx, via: Via) -> None:
    request = c.raw()
    del request.raw_input_contents[0]
    request.inputs[0].contents.fp32_contents.extend(c.tensors["q"].reshape(-1).tolist())
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "input 'q' is BF16", "never as numbers (contents)")
def bf16_as_contents(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.ClearField("raw_input_contents")
    for x, t in zip(request.inputs, c.tensors.values()):
        x.contents.fp32_contents.extend(t.reshape(-1).tolist())
    request.inputs[0].datatype = "BF16"
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "input 'g': shape", "needs", "data holds")
def contents_count_disagrees_with_shape(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.ClearField("raw_input_contents")
    for x, t in zip(request.inputs, c.tensors.values()):
        x.contents.fp32_contents.extend(t.reshape(-1).tolist())
    del request.inputs[3].contents.fp32_contents[-1]
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "binary_data_output false asks for outputs as JSON numbers")
def json_outputs_over_grpc(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.parameters["binary_data_output"].bool_param = False
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "input 'v': unknown parameter(s) ['binary_data_size']")
def binary_data_size_is_http_only(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.inputs[2].parameters["binary_data_size"].int64_param = 6 * HV * V * 4
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "request: parameter 'layer' has no value")
def parameter_without_value(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.parameters["layer"].CopyFrom(pb.InferParameter())
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "input 'q': shape must be a list of at most 8 non-negative ints, got [6, -2, 16]")
def negative_shape(c: Ctx, via: Via) -> None:
    request = c.raw()
    request.inputs[0].shape[1] = -2
    c.stub.ModelInfer(request)


@case("INVALID_ARGUMENT", None, "input 'q': shape [1099511627776, 1099511627776, 0] describes more than 2^")
def empty_shape_no_tensor_can_have(c: Ctx, via: Via) -> None:
    """0 bytes, but [2^40, 2^40, 0] is no tensor's: the one shape check (`tensor_io.shapes`)."""
    request = c.raw()
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([1 << 40, 1 << 40, 0])
    request.raw_input_contents[0] = b""
    c.stub.ModelInfer(request)


@case("RESOURCE_EXHAUSTED", None, "larger than max")
def message_over_the_limit(c: Ctx, via: Via) -> None:
    per_token = 4 * (2 * H * K + HV * V + HV * K + HV)
    T = (MAX_BODY_MB << 20) // per_token + 50
    via.infer(seq_inputs(make_sequence(T, torch.Generator().manual_seed(3))), sequence_id=78)


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    """(status, message) of a refused call, from tritonclient or the raw stub."""
    try:
        call()
    except InferenceServerException as e:
        return str(e.status()).removeprefix("StatusCode."), e.message()
    except grpc.RpcError as e:
        return e.code().name, e.details()
    raise AssertionError("the request was accepted")


@pytest.fixture(scope="module")
def stub(server) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.grpc) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_with_the_status_and_message_of_http_and_no_state_change(server, client, grpc_client, world, stub,
                                                                          gen, name):
    fn, code, http, words = CASES[name]
    ctx = Ctx(world, seq_inputs(make_sequence(6, gen)), stub)
    over_grpc = Via(grpc_client, lambda t, **kw: grpc_infer(grpc_client, t, **kw), grpc_inputs)
    before = pool_image(server.url, world.slots)
    got, message = _outcome(lambda: fn(ctx, over_grpc))
    assert got == code, message
    for word in words:
        assert word in message, message
    assert pool_image(server.url, world.slots) == before
    if http is not None:
        over_http = Via(client, lambda t, **kw: infer(client, t, **kw), triton_inputs)
        assert _outcome(lambda: fn(ctx, over_http)) == (http, message)


def test_live_sequences_continue_where_they_were(server, grpc_client, world, gen):
    """After every refusal above, each live sequence continues from exactly its own tokens."""
    for sequence in LIVE:
        seq = make_sequence(4, gen)
        r = grpc_infer(grpc_client, seq_inputs(seq), sequence_id=sequence, end=True)
        whole = tuple(torch.cat([s[i] for s in [*world.seen[sequence], seq]]) for i in range(5))
        o_ref, final_ref = reference([whole])
        assert rel(result_tensor(r, "o"), o_ref[-4:]) < TOL, sequence
        assert rel(result_tensor(r, "final_state"), final_ref[0]) < TOL, sequence


def test_the_api_key_guards_every_call_but_the_health_probes(keyed_server, gen):
    """Without ``authorization: Bearer <key>`` (or with a wrong one) every RPC but
    ServerLive and ServerReady is UNAUTHENTICATED with HTTP's 401 message, infer and
    streams included; with it, everything works."""
    import httpx

    http_message = httpx.get(f"{keyed_server.url}/v2/models/kda").json()["error"]
    tensors = seq_inputs(make_sequence(3, gen))
    with gc.InferenceServerClient(keyed_server.grpc) as c:
        assert c.is_server_live() and c.is_server_ready()
        for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}):
            for call in (lambda: c.get_server_metadata(headers=headers),
                         lambda: c.is_model_ready("kda", headers=headers),
                         lambda: c.get_model_metadata("kda", headers=headers),
                         lambda: c.get_system_shared_memory_status(headers=headers),
                         lambda: c.infer("kda", grpc_inputs(tensors), headers=headers)):
                assert _outcome(call) == ("UNAUTHENTICATED", http_message)
        errors: list[Any] = []
        c.start_stream(callback=lambda result, error: errors.append(error))
        try:  # the stream may have ended already: tritonclient then refuses to send on it
            c.async_stream_infer("kda", grpc_inputs(tensors))
        except InferenceServerException:
            pass
        assert wait_for(lambda: len(errors) == 1)
        c.stop_stream()
        assert len(errors) == 1 and "UNAUTHENTICATED" in str(errors[0]) and http_message in str(errors[0])
        key = {"authorization": "Bearer sesame"}
        assert c.get_model_metadata("kda", headers=key).name == "kda"
        r = c.infer("kda", grpc_inputs(tensors), headers=key)
        assert rel(result_tensor(r, "o"), reference([tuple(tensors.values())])[0]) < TOL
