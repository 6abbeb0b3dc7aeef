"""/prefill against a live server: the float64 reference, continuation, encodings, gates."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_harness import HV, K, TOL, V, make_sequence, random_state, reference, rel

from kda_client.client import KDAClient
from service.wire.safetensors_codec import encode_safetensors, parse_safetensors


@pytest.mark.parametrize("encoding", ["safetensors", "json"])
def test_fresh_slots_match_the_reference(server, gen, encoding):
    """Three new sequences (1 token: the recurrent path; 37: one partial chunk; 150: three
    chunks) in one request equal the float64 reference from zero state."""
    seqs = [make_sequence(T, gen) for T in (1, 37, 150)]
    with KDAClient(server.url, encoding=encoding) as c:
        out = c.prefill(0, [(None, *s) for s in seqs])
        o_ref, final_ref = reference(seqs)
        assert len(set(out.slots)) == 3
        assert out.o_packed.shape == (188, HV, V) and out.o_packed.dtype == torch.float32
        assert [o.shape[0] for o in out.o] == [1, 37, 150]
        assert out.final_state.shape == (3, HV, V, K)
        assert rel(out.o_packed, o_ref) < TOL
        assert rel(out.final_state, final_ref) < TOL
        for n, slot in enumerate(out.slots):  # the pool holds what the response said
            assert torch.equal(c.get_state(slot)[0], out.final_state[n])
            assert c.slot_info(slot)["tokens_per_layer"] == [seqs[n][0].shape[0], 0]


GATES = {
    "softplus": dict(A_log=True, dt_bias=True),
    "lower_bound": dict(A_log=True, dt_bias=True, lower_bound=-5.0),
    "lower_bound_only": dict(lower_bound=-2.5),
    "l2norm_sigmoid_scale": dict(use_qk_l2norm=True, use_beta_sigmoid=True, scale=0.3),
    "neg_eigval": dict(use_beta_sigmoid=True, allow_neg_eigval=True, A_log=True),
}


@pytest.mark.parametrize("gate", sorted(GATES))
def test_options_and_initial_state_match_the_reference(client, gen, gate):
    """Every gate and input option, continuing from a random non-zero state put in by PUT."""
    options = dict(GATES[gate])
    fused = "A_log" in options or "lower_bound" in options
    if options.pop("A_log", False):
        options["A_log"] = torch.randn(HV, generator=gen) * 0.5
    if options.pop("dt_bias", False):
        options["dt_bias"] = torch.randn(HV, K, generator=gen) * 0.5
    seqs = [make_sequence(T, gen, raw_gate=fused) for T in (70, 9)]
    slots = client.alloc(2)
    initial = random_state(gen, 2)
    for slot, state in zip(slots, initial):
        client.put_state(slot, state)
    layer = 1
    out = client.prefill(layer, [(s, *seq) for s, seq in zip(slots, seqs)], **options)
    o_ref, final_ref = reference(seqs, initial[:, layer], **options)
    assert out.slots == slots
    assert rel(out.o_packed, o_ref) < TOL
    assert rel(out.final_state, final_ref) < TOL
    for slot, state, final in zip(slots, initial, out.final_state):
        after = client.get_state(slot)
        assert torch.equal(after[0], state[0])  # the other layer is untouched
        assert torch.equal(after[layer], final)


def test_one_request_equals_three_on_the_same_slot(client, gen):
    """The same 130 tokens in one request, or split 50 + 1 + 79 over three requests on one
    slot: same outputs and final state (and both equal the reference)."""
    q, k, v, g, beta = make_sequence(130, gen)
    whole, split = client.alloc(2)
    once = client.prefill(0, [(whole, q, k, v, g, beta)])
    outs, finals = [], []
    for a, b in ((0, 50), (50, 51), (51, 130)):
        part = client.prefill(0, [(split, q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b])])
        outs.append(part.o_packed)
        finals.append(part.final_state)
    o_ref, final_ref = reference([(q, k, v, g, beta)])
    assert rel(torch.cat(outs), once.o_packed) < 1e-5
    assert rel(finals[-1], once.final_state) < 1e-5
    assert rel(torch.cat(outs), o_ref) < TOL and rel(finals[-1], final_ref) < TOL
    assert torch.equal(client.get_state(split)[0], finals[-1][0])
    assert client.slot_info(split)["tokens_per_layer"] == [130, 0]


def test_json_and_binary_give_identical_results(server, gen):
    seqs = [make_sequence(T, gen) for T in (20, 65)]
    results = []
    for encoding in ("safetensors", "json"):
        with KDAClient(server.url, encoding=encoding) as c:
            slots = c.alloc(2)
            out = c.prefill(1, [(s, *seq) for s, seq in zip(slots, seqs)], use_qk_l2norm=True)
            results.append((out, [c.get_state(s) for s in slots]))
    (binary, binary_states), (js, json_states) = results
    assert torch.equal(binary.o_packed, js.o_packed)
    assert torch.equal(binary.final_state, js.final_state)
    for a, b in zip(binary_states, json_states):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(client, gen, dtype):
    """bf16/fp16 inputs: o comes back in v's dtype, close to the reference of the same
    (rounded) inputs; the fp32 state stays accurate."""
    seqs = [make_sequence(T, gen, dtype=dtype) for T in (40, 3)]
    out = client.prefill(0, [(None, *s) for s in seqs])
    o_ref, final_ref = reference(seqs)
    assert out.o_packed.dtype == dtype and out.final_state.dtype == torch.float32
    assert rel(out.o_packed, o_ref) < 1e-2
    assert rel(out.final_state, final_ref) < 1e-3


def test_declining_the_final_state(client, gen):
    seq = make_sequence(12, gen)
    out = client.prefill(0, [(None, *seq)], return_final_state=False)
    assert out.final_state is None
    assert rel(client.get_state(out.slots[0])[0], reference([seq])[1][0]) < TOL


def test_null_slots_allocate_and_named_slots_continue(client, gen):
    before = client.info()["free_slots"]
    named = client.alloc(1)[0]
    seqs = [make_sequence(T, gen) for T in (5, 6, 7)]
    out = client.prefill(0, [(None, *seqs[0]), (named, *seqs[1]), (None, *seqs[2])])
    assert out.slots[1] == named and len(set(out.slots)) == 3
    assert client.info()["free_slots"] == before - 3
    for slot, seq in zip(out.slots, seqs):
        assert client.slot_info(slot)["tokens_per_layer"] == [seq[0].shape[0], 0]


def test_accept_picks_the_response_encoding(server, gen):
    """A safetensors request answered in JSON when Accept asks for it, and vice versa."""
    q, k, v, g, beta = make_sequence(8, gen)
    request = {"layer": 0, "sequences": [{"slot": None, "length": 8}]}
    body = encode_safetensors({"q": q, "k": k, "v": v, "g": g, "beta": beta}, {"request": json.dumps(request)})
    r = httpx.post(f"{server.url}/prefill", content=bytes(body),
                   headers={"content-type": "application/x-safetensors", "accept": "application/json"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert set(doc) == {"slots", "o", "final_state"} and doc["o"]["shape"] == [8, HV, V]

    r = httpx.post(f"{server.url}/prefill", content=bytes(body),
                   headers={"content-type": "application/x-safetensors"})
    assert r.headers["content-type"] == "application/x-safetensors"  # default: the request's encoding
    tensors, metadata = parse_safetensors(bytearray(r.content))
    assert set(tensors) == {"o", "final_state"} and len(json.loads(metadata["response"])["slots"]) == 1
    assert rel(tensors["o"], reference([(q, k, v, g, beta)])[0]) < TOL
