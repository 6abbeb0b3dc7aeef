"""The KServe v2 endpoint with the real tritonclient: health, metadata, Triton sequences
against the float64 reference and against REST /prefill, encodings, options, batching."""
from __future__ import annotations

import httpx
import pytest
import torch
import tritonclient.http as tc
from kserve_helpers import (
    HV, K, TOL, V, infer, make_sequence, metric, random_state, reference, rel, result_tensor, seq_inputs,
    triton_inputs,
)
from tritonclient.utils import InferenceServerException

from kda_client.client import KDAClient


def cat(seqs: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([s[i] for s in seqs]) for i in range(5))


def free_slots(server) -> int:
    return httpx.get(f"{server.url}/info").json()["free_slots"]


def test_health_and_metadata(server, client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("kda") and client.is_model_ready("kda", "1")
    assert not client.is_model_ready("other") and not client.is_model_ready("kda", "2")
    meta = client.get_server_metadata()
    assert meta["name"] == "kda-serve"
    assert {"binary_tensor_data", "sequence", "sequence(string_id)", "system_shared_memory"} <= set(meta["extensions"])
    assert "cuda_shared_memory" not in meta["extensions"] or torch.cuda.is_available()
    model = client.get_model_metadata("kda")
    assert model["name"] == "kda" and model["versions"] == ["1"]
    inputs = {t["name"]: t for t in model["inputs"]}
    assert inputs["q"]["shape"] == [-1, -1, K] and inputs["v"]["shape"] == [-1, HV, V]
    assert inputs["g"]["shape"] == [-1, HV, K] and inputs["beta"]["shape"] == [-1, HV]
    assert inputs["A_log"]["shape"] == [HV] and inputs["A_log"]["parameters"]["optional"] is True
    assert all(t["datatype"] == "FP32" and "BF16" in t["parameters"]["datatypes"] for t in model["inputs"])
    outputs = {t["name"]: t for t in model["outputs"]}
    assert outputs["o"]["shape"] == [-1, HV, V] and outputs["final_state"]["shape"] == [HV, V, K]
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("other")
    assert e.value.status() == "404" and "unknown model 'other'" in e.value.message()


def test_a_sequence_in_three_requests_equals_the_reference_and_one_rest_prefill(server, client, gen):
    """START, a continuation, END on layer 1 (T = 9 + 70 + 4: the middle one spans two
    chunks): o and the final state equal the float64 reference of all tokens at once and a
    single REST /prefill of them; END frees the slot and forgets the id."""
    seqs = [make_sequence(n, gen) for n in (9, 70, 4)]
    free = free_slots(server)
    results = [infer(client, seq_inputs(s), sequence_id=1001, start=i == 0, end=i == 2, params={"layer": 1})
               for i, s in enumerate(seqs)]
    o = torch.cat([result_tensor(r, "o") for r in results])
    o_ref, final_ref = reference([cat(seqs)])
    assert rel(o, o_ref) < TOL
    assert rel(result_tensor(results[-1], "final_state"), final_ref[0]) < TOL
    slot = results[0].get_response()["parameters"]["slot"]
    assert results[1].get_response()["parameters"]["slot"] == slot
    assert "parameters" not in results[2].get_response()  # ended: the slot is gone
    assert free_slots(server) == free
    with KDAClient(server.url) as rest:
        whole = rest.prefill(1, [(None, *cat(seqs))])
        rest.free(whole.slots[0])
    assert rel(o, whole.o_packed) < TOL and rel(result_tensor(results[-1], "final_state"), whole.final_state[0]) < TOL
    with pytest.raises(InferenceServerException) as e:
        infer(client, seq_inputs(seqs[0]), sequence_id=1001)
    assert e.value.status() == "400" and "must specify the START flag" in e.value.message()


def test_json_and_binary_tensors_agree(client, gen):
    """The same request as JSON numbers and as binary data, outputs asked both ways: equal
    bit for bit (JSON carries float32 exactly)."""
    tensors = seq_inputs(make_sequence(12, gen))
    results = {}
    for binary in (False, True):
        outputs = [tc.InferRequestedOutput("o", binary_data=binary), tc.InferRequestedOutput("final_state",
                                                                                            binary_data=not binary)]
        results[binary] = infer(client, tensors, binary=binary, outputs=outputs)
    o_ref, final_ref = reference([tuple(tensors.values())])
    for name in ("o", "final_state"):
        assert torch.equal(result_tensor(results[False], name), result_tensor(results[True], name)), name
    assert rel(result_tensor(results[True], "o"), o_ref) < TOL
    assert rel(result_tensor(results[True], "final_state"), final_ref[0]) < TOL
    json_only = results[False].get_response()["outputs"]
    assert "data" in json_only[0] and json_only[1]["parameters"]["binary_data_size"] == HV * V * K * 4


def test_bf16_in_binary_and_fp16_as_json(client, gen):
    seq = make_sequence(10, gen)
    o_ref, _ = reference([seq])
    bf16 = infer(client, seq_inputs(tuple(t.bfloat16() for t in seq)))
    assert bf16.get_output("o")["datatype"] == "BF16"
    assert result_tensor(bf16, "o").dtype == torch.bfloat16 and rel(result_tensor(bf16, "o"), o_ref) < 2e-2
    fp16 = infer(client, seq_inputs(tuple(t.half() for t in seq)), binary=False)
    assert fp16.get_output("o")["datatype"] == "FP16" and rel(result_tensor(fp16, "o"), o_ref) < 2e-2
    assert fp16.get_output("final_state")["datatype"] == "FP32"  # the pool's dtype


def test_string_and_uint64_sequence_ids_are_separate_sequences(client, gen):
    """Ids 42, "42", 2**64 - 1 and a UUID string run side by side, interleaved, each equal to
    the reference of its own tokens."""
    ids = [42, "42", (1 << 64) - 1, "e333c95a-07fc-42d2-ab16-033b1a566ed5"]
    seqs = {i: [make_sequence(n, gen) for n in (3, 5)] for i in ids}
    outs: dict[object, list[torch.Tensor]] = {i: [] for i in ids}
    for step in range(2):
        for i in ids:
            r = infer(client, seq_inputs(seqs[i][step]), sequence_id=i, start=step == 0, end=step == 1)
            outs[i].append(result_tensor(r, "o"))
    for i in ids:
        assert rel(torch.cat(outs[i]), reference([cat(seqs[i])])[0]) < TOL, i


def test_start_for_a_live_sequence_replaces_it_and_says_so(server, client, gen):
    first, second = make_sequence(6, gen), make_sequence(5, gen)
    old = infer(client, seq_inputs(first), sequence_id="restart-me", start=True).get_response()["parameters"]["slot"]
    free = free_slots(server)
    r = infer(client, seq_inputs(second), sequence_id="restart-me", start=True)
    assert rel(result_tensor(r, "final_state"), reference([second])[1][0]) < TOL  # from zero, not from `first`
    assert r.get_response()["parameters"]["slot"] != old and free_slots(server) == free
    assert httpx.get(f"{server.url}/slots/{old}").status_code == 404
    assert "sequence 'restart-me': sequence_start for a live sequence" in server.log_text()
    infer(client, seq_inputs(make_sequence(1, gen)), sequence_id="restart-me", end=True)


def test_slot_parameter_continues_a_slot_managed_through_rest(server, client, gen):
    seq = make_sequence(8, gen)
    state = random_state(gen)[0]
    with KDAClient(server.url) as rest:
        slot = rest.alloc()[0]
        rest.put_state(slot, state)
        r = infer(client, seq_inputs(seq), params={"slot": slot, "layer": 1})
        after = rest.get_state(slot)
        rest.free(slot)
    o_ref, final_ref = reference([seq], initial=state[1:2])
    assert rel(result_tensor(r, "o"), o_ref) < TOL and rel(after[1], final_ref[0]) < TOL
    assert torch.equal(after[1], result_tensor(r, "final_state")) and torch.equal(after[0], state[0])
    assert r.get_response()["parameters"]["slot"] == slot


def test_gate_and_flag_parameters_match_rest_prefill(server, client, gen):
    """A_log and dt_bias inputs with lower_bound, l2norm, beta sigmoid and scale as request
    parameters: the same outputs as REST /prefill with those options, and the reference."""
    seq = make_sequence(20, gen, raw_gate=True)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, K, generator=gen) * 0.5
    options = {"lower_bound": -4.0, "use_qk_l2norm": True, "use_beta_sigmoid": True, "scale": 0.3}
    r = infer(client, seq_inputs(seq, A_log=A_log, dt_bias=dt_bias), params=options)
    with KDAClient(server.url) as rest:
        out = rest.prefill(0, [(None, *seq)], A_log=A_log, dt_bias=dt_bias, **options)
        rest.free(out.slots[0])
    assert torch.equal(result_tensor(r, "o"), out.o_packed)
    assert torch.equal(result_tensor(r, "final_state"), out.final_state[0])
    o_ref, _ = reference([seq], A_log=A_log, dt_bias=dt_bias, **options)
    assert rel(result_tensor(r, "o"), o_ref) < TOL


def test_only_the_outputs_asked_for_and_the_request_id(server, client, gen):
    free = free_slots(server)
    r = client.infer("kda", triton_inputs(seq_inputs(make_sequence(4, gen))), request_id="req-7",
                     outputs=[tc.InferRequestedOutput("o", binary_data=False)])
    response = r.get_response()
    assert [o["name"] for o in response["outputs"]] == ["o"] and r.as_numpy("final_state") is None
    assert response["id"] == "req-7" and response["model_name"] == "kda" and response["model_version"] == "1"
    assert "parameters" not in response and free_slots(server) == free  # no sequence: the scratch slot is freed


def test_concurrent_sequences_share_kernel_launches(server, client):
    """Eight sequences of three requests each; each step's eight requests are sent at once
    (tritonclient's async_infer): every sequence equals its own reference, and requests were
    merged into shared launches as on /prefill."""
    before = httpx.get(f"{server.url}/metrics").text
    gens = [torch.Generator().manual_seed(500 + i) for i in range(8)]
    seqs = [[make_sequence(n, g) for n in (4, 9, 2)] for g in gens]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(3):
        pending = [client.async_infer("kda", triton_inputs(seq_inputs(seqs[i][step])), sequence_id=f"concurrent-{i}",
                                      sequence_start=step == 0, sequence_end=step == 2) for i in range(8)]
        for i, p in enumerate(pending):
            outs[i].append(result_tensor(p.get_result(), "o"))
    for i, o in enumerate(outs):
        assert rel(torch.cat(o), reference([cat(seqs[i])])[0]) < TOL, i
    after = httpx.get(f"{server.url}/metrics").text
    launches = metric(after, "kda_batch_requests_count") - metric(before, "kda_batch_requests_count")
    requests = metric(after, "kda_batch_requests_sum") - metric(before, "kda_batch_requests_sum")
    assert requests == 24 and launches < requests, (launches, requests)
