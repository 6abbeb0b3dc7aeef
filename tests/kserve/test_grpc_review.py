"""A review of the gRPC front end's edges, on the folder's live server: requests whose bytes
are not a valid message (unary and on a stream, which answers them and reads on, in order
with the sequence around them), refusals that echo long values (their status code and a
bounded message, not the client's metadata limit), many concurrent unary calls on one
sequence (applied one at a time, whole), and unary calls cancelled by their deadline (each
applied whole or not at all, no slot left behind). Each refusal leaves the pool bit for bit
as it was."""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Iterator

import grpc
import httpx
import pytest
import torch
from kserve_helpers import (
    TOL, grpc_infer, make_sequence, pool_image, random_state, raw_request, reference, rel,
    response_slot, result_tensor, seq_inputs,
)
from tritonclient.grpc import InferResult
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from kda_client.client import KDAClient

SERVICE = "/inference.GRPCInferenceService"
NOT_A_MESSAGE = "the request is not a valid protobuf message"
MESSAGE_MAX_BYTES = 2048  # what a status message is cut to (service.kserve.rpc.status)
LONG = 200_000  # characters: far past grpcio's 8 KiB (soft) and 16 KiB (hard) metadata limits
# Bytes that are no message of the methods below: a tag without its value, a length past the
# end, a string field (1: the model's or region's name) that is not UTF-8, a group end tag
# that was never opened.
GARBAGE = {"cut_varint": b"\x08", "length_past_end": b"\x0a\x7f\x41", "not_utf8": b"\x0a\x02\xff\xfe",
           "stray_group_end": b"\x0c"}


def free_slots(server) -> int:
    return httpx.get(f"{server.url}/info").json()["free_slots"]



def seq_params(sequence: str, start: bool = False, end: bool = False) -> dict[str, pb.InferParameter]:
    return {"sequence_id": pb.InferParameter(string_param=sequence),
            "sequence_start": pb.InferParameter(bool_param=start), "sequence_end": pb.InferParameter(bool_param=end)}


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    """What ``call`` raised (it must raise an RpcError)."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc) as c:
        yield c


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def victims(server, grpc_client) -> Iterator[list[str]]:
    """Two REST slots with random states and a live sequence's slot: what refusals must not touch."""
    gen = torch.Generator().manual_seed(41)
    with KDAClient(server.url) as rest:
        slots = rest.alloc(2)
        for slot, state in zip(slots, random_state(gen, 2)):
            rest.put_state(slot, state)
        r = grpc_infer(grpc_client, seq_inputs(make_sequence(5, gen)), sequence_id="review-live", start=True)
        yield [*slots, response_slot(r)]
        grpc_infer(grpc_client, seq_inputs(make_sequence(1, gen)), sequence_id="review-live", end=True)
        for slot in slots:
            rest.free(slot)


# -- messages that do not parse -----------------------------------------------------------------

@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "SystemSharedMemoryRegister"])
@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_message_that_does_not_parse_is_invalid_argument_and_changes_nothing(server, channel, victims, method,
                                                                               kind):
    """grpcio would end the call UNKNOWN with a traceback in the log: it is bad input, so
    INVALID_ARGUMENT saying so, and nothing changes."""
    call = channel.unary_unary(f"{SERVICE}/{method}", request_serializer=bytes, response_deserializer=bytes)
    before = pool_image(server.url, victims)
    e = refused(lambda: call(GARBAGE[kind], timeout=30))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(NOT_A_MESSAGE), e
    assert pool_image(server.url, victims) == before
    assert "DecodeError" not in server.log_text()


def test_a_stream_answers_a_message_that_does_not_parse_and_reads_on(server, channel, victims, gen):
    """One stream: a sequence's START, a message that does not parse, a continuation, a
    request of the sequence for an unknown model, the END. Every request is answered (the
    two bad ones with an error, the sequence's refusal in its place between the requests
    around it), the stream ends OK, the sequence equals its reference, and nothing else
    changed."""
    chunks = [make_sequence(n, gen) for n in (7, 3, 5)]
    unknown_model = raw_request(seq_inputs(chunks[1]), "x", **seq_params("review-stream"))
    unknown_model.model_name = "other"
    messages = [raw_request(seq_inputs(chunks[0]), "a0", **seq_params("review-stream", start=True)).SerializeToString(),
                GARBAGE["not_utf8"],
                raw_request(seq_inputs(chunks[1]), "a1", **seq_params("review-stream")).SerializeToString(),
                unknown_model.SerializeToString(),
                raw_request(seq_inputs(chunks[2]), "a2", **seq_params("review-stream", end=True)).SerializeToString()]
    stream = channel.stream_stream(f"{SERVICE}/ModelStreamInfer", request_serializer=bytes,
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)
    before = pool_image(server.url, victims)
    answers = list(stream(iter(messages), timeout=60))
    assert pool_image(server.url, victims) == before
    errors = {a.infer_response.id: a.error_message for a in answers if a.error_message}
    assert len(answers) == 5 and errors.keys() == {"", "x"}, answers
    assert errors[""].startswith(NOT_A_MESSAGE) and "unknown model 'other'" in errors["x"], errors
    in_sequence = [a.infer_response.id for a in answers if a.infer_response.id != ""]
    assert in_sequence == ["a0", "a1", "x", "a2"]
    results = {a.infer_response.id: InferResult(a.infer_response) for a in answers if not a.error_message}
    o = torch.cat([result_tensor(results[f"a{i}"], "o") for i in range(3)])
    o_ref, final_ref = reference([tuple(torch.cat([c[i] for c in chunks]) for i in range(5))])
    assert rel(o, o_ref) < TOL and rel(result_tensor(results["a2"], "final_state"), final_ref[0]) < TOL
    assert "DecodeError" not in server.log_text()


def test_the_api_key_is_checked_before_the_message(keyed_server):
    """Without the key, bytes that do not parse are UNAUTHENTICATED like any request (a
    caller without the key learns nothing of its message), on a stream too; with it, or on
    the open ServerReady, INVALID_ARGUMENT."""
    key = (("authorization", "Bearer sesame"),)
    with grpc.insecure_channel(keyed_server.grpc) as c:
        infer = c.unary_unary(f"{SERVICE}/ModelInfer", request_serializer=bytes, response_deserializer=bytes)
        ready = c.unary_unary(f"{SERVICE}/ServerReady", request_serializer=bytes, response_deserializer=bytes)
        stream = c.stream_stream(f"{SERVICE}/ModelStreamInfer", request_serializer=bytes,
                                 response_deserializer=pb.ModelStreamInferResponse.FromString)
        assert refused(lambda: infer(GARBAGE["length_past_end"], timeout=30)).code() == grpc.StatusCode.UNAUTHENTICATED
        e = refused(lambda: list(stream(iter([GARBAGE["length_past_end"]]), timeout=30)))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        for call, metadata in ((infer, key), (ready, None)):
            e = refused(lambda: call(GARBAGE["length_past_end"], metadata=metadata, timeout=30))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(NOT_A_MESSAGE), e
        (answer,) = list(stream(iter([GARBAGE["length_past_end"]]), metadata=key, timeout=30))
        assert answer.error_message.startswith(NOT_A_MESSAGE)


# -- refusals that echo long values --------------------------------------------------------------

def _long_model(r: pb.ModelInferRequest) -> None:
    r.model_name = "é" * LONG  # 2 bytes of UTF-8 each, 6 percent-encoded


def _long_version(r: pb.ModelInferRequest) -> None:
    r.model_version = "9" * LONG


def _long_datatype(r: pb.ModelInferRequest) -> None:
    r.inputs[0].datatype = "x" * LONG


def _long_parameter_name(r: pb.ModelInferRequest) -> None:
    r.parameters["p" * LONG].bool_param = True


def _many_parameters(r: pb.ModelInferRequest) -> None:
    for i in range(5000):
        r.parameters[f"parameter_{i:05d}"].bool_param = True


def _long_slot(r: pb.ModelInferRequest) -> None:
    r.parameters["slot"].string_param = "s" * LONG


def _long_region(r: pb.ModelInferRequest) -> None:
    out = r.outputs.add(name="o")
    out.parameters["shared_memory_region"].string_param = "r" * LONG
    out.parameters["shared_memory_byte_size"].int64_param = 64


def _long_input_parameter(r: pb.ModelInferRequest) -> None:
    r.inputs[2].parameters["v" * LONG].bool_param = True


LONG_VALUES = {
    "model_name": (_long_model, grpc.StatusCode.NOT_FOUND, "unknown model 'ééé"),
    "model_version": (_long_version, grpc.StatusCode.NOT_FOUND, "unknown version '999"),
    "datatype": (_long_datatype, grpc.StatusCode.INVALID_ARGUMENT, "input 'q' has datatype 'xxx"),
    "parameter_name": (_long_parameter_name, grpc.StatusCode.INVALID_ARGUMENT, "unknown request parameter(s) ['ppp"),
    "many_parameters": (_many_parameters, grpc.StatusCode.INVALID_ARGUMENT,
                        "unknown request parameter(s) ['parameter_00000', 'parameter_00001'"),
    "slot": (_long_slot, grpc.StatusCode.NOT_FOUND, "unknown slot id 'sss"),
    "region": (_long_region, grpc.StatusCode.INVALID_ARGUMENT, "unknown shared memory region 'rrr"),
    "input_parameter": (_long_input_parameter, grpc.StatusCode.INVALID_ARGUMENT,
                        "input 'v': unknown parameter(s) ['vvv"),
}


@pytest.mark.parametrize("name", sorted(LONG_VALUES))
def test_a_refusal_echoing_a_long_value_keeps_its_status_code(server, stub, channel, victims, gen, name):
    """A message past the client's metadata limit would reach it as RESOURCE_EXHAUSTED
    ("received metadata size exceeds hard limit"), not the refusal: the message is cut to
    2 KiB of UTF-8 and the code stays; the stream's error message is the same text."""
    edit, code, start = LONG_VALUES[name]
    request = raw_request(seq_inputs(make_sequence(3, gen)), "long")
    edit(request)
    before = pool_image(server.url, victims)
    e = refused(lambda: stub.ModelInfer(request, timeout=30))
    assert (e.code(), e.details()[:len(start)]) == (code, start), (e.code(), e.details()[:200])
    assert len(e.details().encode()) <= MESSAGE_MAX_BYTES and e.details().endswith("bytes, cut)")
    stream = channel.stream_stream(f"{SERVICE}/ModelStreamInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)
    (answer,) = list(stream(iter([request]), timeout=30))
    assert answer.error_message == e.details()
    assert pool_image(server.url, victims) == before


def test_a_long_metadata_request_name_keeps_its_status_code(stub):
    for call, request in ((stub.ModelMetadata, pb.ModelMetadataRequest(name="m" * LONG)),
                          (stub.ModelConfig, pb.ModelConfigRequest(name="kda", version="7" * LONG)),
                          (stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest(name="n" * LONG))):
        e = refused(lambda: call(request, timeout=30))
        assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), e
        assert len(e.details().encode()) <= MESSAGE_MAX_BYTES and e.details().endswith("bytes, cut)")


# -- concurrency and cancellation ------------------------------------------------------------------

def _order(initial: torch.Tensor, chunks: dict[str, tuple[torch.Tensor, ...]],
           outputs: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    """The order the requests ran in, found from their outputs (each request's o is the
    reference's from the state the ones before it left), and the state after all."""
    state, order, left = initial, [], dict(chunks)
    while left:
        for name, chunk in left.items():
            o_ref, final_ref = reference([chunk], initial=state[None])
            if rel(outputs[name], o_ref) < TOL:
                order.append(name)
                state = final_ref[0]
                del left[name]
                break
        else:
            raise AssertionError(f"no request continues the state after {order}: {sorted(left)} were not run whole")
    return order, state


def test_concurrent_unary_calls_on_one_sequence_run_one_at_a_time(server, grpc_client, gen):
    """12 unary calls continuing one sequence, sent at once from 12 threads (each on its own
    channel): every one is applied whole, one after another in some order, each o equal to
    the reference continuing from the state the ones before it left; the token count is
    the sum; the END frees the slot."""
    free = free_slots(server)
    first = make_sequence(4, gen)
    r = grpc_infer(grpc_client, seq_inputs(first), sequence_id="review-many", start=True)
    slot = response_slot(r)
    chunks = {f"c{n}": make_sequence(n, gen) for n in range(1, 13)}
    outputs: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(chunks), timeout=60)

    def run(name: str) -> None:
        try:
            with grpc.insecure_channel(server.grpc) as c:
                barrier.wait()
                answer = pb_grpc.GRPCInferenceServiceStub(c).ModelInfer(
                    raw_request(seq_inputs(chunks[name]), name, **seq_params("review-many")), timeout=60)
                outputs[name] = result_tensor(InferResult(answer), "o")
        except BaseException as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    with KDAClient(server.url) as rest:
        assert rest.slot_info(slot)["tokens_per_layer"][0] == 4 + sum(range(1, 13))
    _, state = _order(reference([first])[1][0], chunks, outputs)
    last = make_sequence(2, gen)
    r = grpc_infer(grpc_client, seq_inputs(last), sequence_id="review-many", end=True)
    assert rel(result_tensor(r, "final_state"), reference([last], initial=state[None])[1][0]) < TOL
    assert free_slots(server) == free


def _settled(read: Callable[[], int], timeout: float = 60.0) -> int:
    """``read()`` once it gave the same value three times in a row, 0.5 s apart."""
    deadline, seen = time.monotonic() + timeout, [read()]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        seen = [*seen[-2:], read()]
        if len(seen) == 3 and len(set(seen)) == 1:
            return seen[0]
    raise AssertionError(f"did not settle: {seen}")


def test_unary_calls_cancelled_by_their_deadline_leave_nothing_half_applied(server, stub, grpc_client, gen):
    """24 scratch requests and 12 sequence STARTs of 200 tokens, each with a deadline of 1
    to 300 ms, all in flight at once: once the server settled no scratch slot is left, and
    each sequence is either bound whole (its continuation runs from exactly its START's
    state) or unknown (must specify START): the slots in use are the bound ones."""
    free = free_slots(server)
    rng = random.Random(7)
    starts = {f"review-cut-{i}": make_sequence(200, gen) for i in range(12)}
    scratch = seq_inputs(make_sequence(200, gen))
    calls = [stub.ModelInfer.future(raw_request(scratch, f"s{i}"), timeout=rng.uniform(0.001, 0.3)) for i in range(24)]
    calls += [stub.ModelInfer.future(raw_request(seq_inputs(chunk), sequence, **seq_params(sequence, start=True)),
                                     timeout=rng.uniform(0.001, 0.3)) for sequence, chunk in starts.items()]
    codes = []
    for call in calls:
        try:
            call.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert grpc.StatusCode.DEADLINE_EXCEEDED in codes  # cancellations happened (most mid-request)
    in_use = free - _settled(lambda: free_slots(server))
    bound = 0
    for sequence, chunk in starts.items():
        last = make_sequence(1, gen)
        try:
            r = grpc_infer(grpc_client, seq_inputs(last), sequence_id=sequence, end=True)
        except InferenceServerException as e:
            assert "must specify the START flag" in e.message(), e
            continue
        bound += 1
        expected = reference([tuple(torch.cat([a, b]) for a, b in zip(chunk, last))])[1][0]
        assert rel(result_tensor(r, "final_state"), expected) < TOL, sequence
    assert in_use == bound and free_slots(server) == free
