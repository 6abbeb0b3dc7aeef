"""The KServe v2 gRPC endpoint with the real tritonclient.grpc: health, metadata, Triton
sequences equal bit for bit to the same requests over HTTP (and to the float64 reference),
one sequence table for both transports, 32 concurrent clients, and the gRPC metrics."""
from __future__ import annotations

import threading
from typing import Callable

import grpc
import httpx
import pytest
import torch
import tritonclient.grpc as gc
from kserve_helpers import (
    HV, K, TOL, V, grpc_infer, grpc_inputs, infer, make_sequence, metric, raw_request, reference, rel, response_slot,
    result_tensor, seq_inputs,
)
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException


def cat(seqs: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([s[i] for s in seqs]) for i in range(5))


def free_slots(server) -> int:
    return httpx.get(f"{server.url}/info").json()["free_slots"]


def refusal(call: Callable[[], object]) -> InferenceServerException:
    """What ``call`` raised (it must raise InferenceServerException)."""
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value



def test_health_and_metadata_match_http(server, client, grpc_client):
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("kda") and grpc_client.is_model_ready("kda", "1")
    assert not grpc_client.is_model_ready("other") and not grpc_client.is_model_ready("kda", "2")
    meta = grpc_client.get_server_metadata(as_json=True)
    assert meta == {k: v for k, v in client.get_server_metadata().items()}
    model = grpc_client.get_model_metadata("kda", as_json=True)
    over_http = client.get_model_metadata("kda")
    assert model["name"] == "kda" and model["versions"] == ["1"] and model["platform"] == "kda-serve"
    for kind in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model[kind]] == \
               [(t["name"], t["datatype"], t["shape"]) for t in over_http[kind]]
    config = grpc_client.get_model_config("kda", as_json=True)["config"]
    inputs = {t["name"]: t for t in config["input"]}
    assert inputs["v"]["dims"] == ["-1", str(HV), str(V)] and inputs["A_log"]["optional"] is True
    assert "optional" not in inputs["q"] and config["output"][1]["dims"] == [str(HV), str(V), str(K)]
    assert "sequence_batching" in config
    assert grpc_client.get_model_repository_index(as_json=True)["models"] == [
        {"name": "kda", "version": "1", "state": "READY"}]
    pairs = [(lambda: grpc_client.get_model_metadata("other"), lambda: client.get_model_metadata("other")),
             (lambda: grpc_client.get_model_config("kda", "2"), lambda: client.get_model_metadata("kda", "2"))]
    for call, http_call in pairs:
        e, h = refusal(call), refusal(http_call)
        assert e.status() == "StatusCode.NOT_FOUND" and h.status() == "404" and e.message() == h.message()
    with pytest.raises(InferenceServerException) as e:
        grpc_client.get_inference_statistics("kda")
    assert e.value.status() == "StatusCode.UNIMPLEMENTED" and "does not implement ModelStatistics" in e.value.message()


def test_a_sequence_in_three_requests_equals_the_same_over_http_bit_for_bit(server, client, grpc_client, gen):
    """START, a continuation and END on layer 1 (T = 9 + 70 + 4), once over gRPC and once
    over HTTP: o, final_state and the slot's life agree bit for bit, and with the float64
    reference. A continuation after END is refused with HTTP's message."""
    seqs = [make_sequence(n, gen) for n in (9, 70, 4)]
    free = free_slots(server)
    over_grpc = [grpc_infer(grpc_client, seq_inputs(s), sequence_id=2001, start=i == 0, end=i == 2,
                            params={"layer": 1}) for i, s in enumerate(seqs)]
    over_http = [infer(client, seq_inputs(s), sequence_id=2002, start=i == 0, end=i == 2, params={"layer": 1})
                 for i, s in enumerate(seqs)]
    for g, h in zip(over_grpc, over_http):
        for name in ("o", "final_state"):
            assert torch.equal(result_tensor(g, name), result_tensor(h, name)), name
        assert (response_slot(g) is None) == (response_slot(h) is None)
    o_ref, final_ref = reference([cat(seqs)])
    assert rel(torch.cat([result_tensor(r, "o") for r in over_grpc]), o_ref) < TOL
    assert rel(result_tensor(over_grpc[-1], "final_state"), final_ref[0]) < TOL
    assert response_slot(over_grpc[0]) == response_slot(over_grpc[1]) and response_slot(over_grpc[2]) is None
    assert free_slots(server) == free
    e = refusal(lambda: grpc_infer(grpc_client, seq_inputs(seqs[0]), sequence_id=2001))
    h = refusal(lambda: infer(client, seq_inputs(seqs[0]), sequence_id=2001))
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and h.status() == "400"
    assert e.message() == h.message() and "must specify the START flag" in e.message()


def test_one_sequence_table_for_both_transports(server, client, grpc_client, gen):
    """START over HTTP, continue over gRPC, END over HTTP: one sequence, equal to the reference."""
    seqs = [make_sequence(n, gen) for n in (5, 6, 7)]
    first = infer(client, seq_inputs(seqs[0]), sequence_id="both-ways", start=True)
    second = grpc_infer(grpc_client, seq_inputs(seqs[1]), sequence_id="both-ways")
    last = infer(client, seq_inputs(seqs[2]), sequence_id="both-ways", end=True)
    assert response_slot(first) == response_slot(second)
    o = torch.cat([result_tensor(r, "o") for r in (first, second, last)])
    o_ref, final_ref = reference([cat(seqs)])
    assert rel(o, o_ref) < TOL and rel(result_tensor(last, "final_state"), final_ref[0]) < TOL


def test_bf16_fp16_options_outputs_and_id_match_http(client, grpc_client, gen):
    """BF16 and FP16 inputs, gate inputs with options, only the outputs asked for and the
    request id: the same bytes as over HTTP."""
    seq = make_sequence(10, gen, raw_gate=True)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, K, generator=gen) * 0.5
    options = {"lower_bound": -4.0, "use_qk_l2norm": True, "use_beta_sigmoid": True, "scale": 0.3}
    for dtype in (torch.bfloat16, torch.float16):
        tensors = seq_inputs(tuple(t.to(dtype) for t in seq), A_log=A_log.to(dtype), dt_bias=dt_bias.to(dtype))
        g, h = grpc_infer(grpc_client, tensors, params=options), infer(client, tensors, params=options)
        assert result_tensor(g, "o").dtype == dtype
        assert torch.equal(result_tensor(g, "o"), result_tensor(h, "o"))
        assert torch.equal(result_tensor(g, "final_state"), result_tensor(h, "final_state"))
    plain = make_sequence(10, gen)  # no gate options: g must be a log decay (<= 0)
    r = grpc_client.infer("kda", grpc_inputs(seq_inputs(plain)), request_id="req-9",
                          outputs=[gc.InferRequestedOutput("final_state")])
    response = r.get_response()
    assert [o.name for o in response.outputs] == ["final_state"] and r.as_numpy("o") is None
    assert response.id == "req-9" and response.model_name == "kda" and response.model_version == "1"
    assert rel(result_tensor(r, "final_state"), reference([plain])[1][0]) < TOL


def test_uint64_and_string_sequence_ids(server, grpc_client, gen):
    """A uint64 id past int64 (uint64_param, which tritonclient cannot send) and a string
    id run side by side; the int64 and uint64 forms of one number are one sequence; a
    negative int64 id is refused."""
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc))
    big = pb.InferParameter(uint64_param=(1 << 64) - 1)
    seqs = [make_sequence(n, gen) for n in (3, 4)]
    start = stub.ModelInfer(raw_request(seq_inputs(seqs[0]), sequence_id=big,
                                        sequence_start=pb.InferParameter(bool_param=True)))
    end = stub.ModelInfer(raw_request(seq_inputs(seqs[1]), sequence_id=big,
                                      sequence_end=pb.InferParameter(bool_param=True)))
    o = torch.cat([torch.frombuffer(bytearray(r.raw_output_contents[0]), dtype=torch.float32) for r in (start, end)])
    assert rel(o.reshape(-1, HV, V), reference([cat(seqs)])[0]) < TOL
    first = grpc_infer(grpc_client, seq_inputs(seqs[0]), sequence_id=31, start=True)  # int64_param
    last = gc.InferResult(stub.ModelInfer(raw_request(seq_inputs(seqs[1]), sequence_id=pb.InferParameter(
        uint64_param=31), sequence_end=pb.InferParameter(bool_param=True))))
    o = torch.cat([result_tensor(first, "o"), result_tensor(last, "o")])
    assert rel(o, reference([cat(seqs)])[0]) < TOL
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(raw_request(seq_inputs(seqs[0]), sequence_id=pb.InferParameter(int64_param=-5)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "uint64" in e.value.details()


def test_32_concurrent_clients(server):
    """32 clients, each on its own channel and thread, each a sequence of three requests:
    every sequence equals its own reference, requests shared launches, and /metrics counts
    the 96 calls as ModelInfer OK."""
    before = httpx.get(f"{server.url}/metrics").text
    seqs = [[make_sequence(n, torch.Generator().manual_seed(900 + i)) for n in (3, 6, 2)] for i in range(32)]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    errors: list[BaseException] = []
    barrier = threading.Barrier(32, timeout=60)

    def run(i: int) -> None:
        try:
            with gc.InferenceServerClient(server.grpc) as c:
                for step, s in enumerate(seqs[i]):
                    barrier.wait()
                    r = grpc_infer(c, seq_inputs(s), sequence_id=f"many-{i}", start=step == 0, end=step == 2)
                    outs[i].append(result_tensor(r, "o"))
        except BaseException as e:  # reported below, with the barrier broken so nobody waits
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i, o in enumerate(outs):
        assert rel(torch.cat(o), reference([cat(seqs[i])])[0]) < TOL, i
    after = httpx.get(f"{server.url}/metrics").text
    calls = metric(after, "kda_grpc_requests_total", method="ModelInfer", status="OK") - \
        metric(before, "kda_grpc_requests_total", method="ModelInfer", status="OK")
    launches = metric(after, "kda_batch_requests_count") - metric(before, "kda_batch_requests_count")
    assert calls == 96 and launches < 96, (calls, launches)


def test_metrics_count_grpc_calls_by_method_and_status(server, grpc_client, gen):
    before = httpx.get(f"{server.url}/metrics").text
    grpc_client.is_server_ready()
    with pytest.raises(InferenceServerException):
        grpc_infer(grpc_client, seq_inputs(make_sequence(2, gen)), sequence_id="never-started")
    after = httpx.get(f"{server.url}/metrics").text
    for method, status in (("ServerReady", "OK"), ("ModelInfer", "INVALID_ARGUMENT")):
        assert metric(after, "kda_grpc_requests_total", method=method, status=status) == \
            metric(before, "kda_grpc_requests_total", method=method, status=status) + 1, (method, status)
    assert metric(after, "kda_grpc_request_seconds_count", method="ModelInfer") > 0
