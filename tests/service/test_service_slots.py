"""Slots, state export/import, /info, /metrics and the OpenAPI document, on a live server."""
from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from safetensors.torch import load as st_load
from server_harness import HV, K, LAYERS, SLOTS, TOL, V, make_sequence, metric, random_state, reference, rel

from kda_client.client import KDAClient, SlotNotFound
from service.version import __version__


def test_alloc_free_and_counts(client):
    free = client.info()["free_slots"]
    slots = client.alloc(3)
    assert len(set(slots)) == 3 and all(re.fullmatch(r"[A-Za-z0-9_-]{20,}", s) for s in slots)
    assert client.info()["free_slots"] == free - 3
    for s in slots:
        assert torch.count_nonzero(client.get_state(s)) == 0  # a new slot starts at zero
        client.free(s)
    assert client.info()["free_slots"] == free
    with pytest.raises(SlotNotFound):
        client.get_state(slots[0])


def test_post_slots_without_a_body_allocates_one(server):
    r = httpx.post(f"{server.url}/slots")
    assert r.status_code == 201 and len(r.json()["slots"]) == 1


def test_slot_metadata(client, gen):
    slot = client.alloc()[0]
    info = client.slot_info(slot)
    assert set(info) == {"slot", "created", "last_used", "tokens_per_layer", "state_lost"}
    assert info["slot"] == slot and info["tokens_per_layer"] == [0] * LAYERS and info["state_lost"] is False
    client.prefill(1, [(slot, *make_sequence(9, gen))])
    later = client.slot_info(slot)
    assert later["tokens_per_layer"] == [0, 9]
    assert later["created"] == info["created"] and later["last_used"] >= info["last_used"]


def test_fork_copies_then_diverges(client, gen):
    seq = make_sequence(30, gen)
    source = client.prefill(0, [(None, *seq)]).slots[0]
    child = client.fork(source)
    assert child != source
    assert torch.equal(client.get_state(child), client.get_state(source))
    assert client.slot_info(child)["tokens_per_layer"] == [30, 0]
    before = client.get_state(source)
    more = make_sequence(10, gen)
    client.prefill(0, [(child, *more)])
    assert torch.equal(client.get_state(source), before)  # the source is untouched
    _, final_ref = reference([tuple(torch.cat([a, b]) for a, b in zip(seq, more))])
    assert rel(client.get_state(child)[0], final_ref[0]) < TOL


@pytest.mark.parametrize("get_as,put_as", [("safetensors", "safetensors"), ("json", "json"),
                                           ("safetensors", "json"), ("json", "safetensors")])
def test_export_import_round_trip(server, gen, get_as, put_as):
    with KDAClient(server.url, encoding=get_as) as getter, KDAClient(server.url, encoding=put_as) as putter:
        source = getter.alloc()[0]
        state = random_state(gen)[0]
        putter.put_state(source, state)
        exported = getter.get_state(source)
        assert exported.dtype == torch.float32 and torch.equal(exported, state)
        target = putter.alloc()[0]
        putter.put_state(target, exported)
        assert torch.equal(getter.get_state(target), state)


def test_export_is_a_standard_safetensors_file(client, gen, server):
    slot = client.prefill(0, [(None, *make_sequence(5, gen))]).slots[0]
    r = httpx.get(f"{server.url}/slots/{slot}/state")
    assert r.headers["content-type"] == "application/x-safetensors"
    tensors = st_load(r.content)  # the reference implementation reads it
    assert list(tensors) == ["state"] and tensors["state"].shape == (LAYERS, HV, V, K)
    assert torch.equal(tensors["state"], client.get_state(slot))


def test_info_fields(client):
    info = client.info()
    self_test = info.pop("self_test")
    assert info == {
        "version": __version__, "num_layers": LAYERS, "num_slots": SLOTS, "num_heads": HV, "head_k_dim": K, "head_v_dim": V,
        "state_dtype": "float32", "device": "cpu", "backend": "torch",
        "free_slots": info["free_slots"], "used_slots": SLOTS - info["free_slots"], "gate_layers": [],
        "spare_rows": SLOTS,  # the default: one per slot
    }
    assert self_test["status"] == "passed" and self_test["failures"] == [] and self_test["toolchain"]["backend"] == "torch"


def test_metrics_move(client, server, gen):
    scrape = lambda: httpx.get(f"{server.url}/metrics").text  # noqa: E731
    before = scrape()
    client.prefill(0, [(None, *make_sequence(11, gen)), (None, *make_sequence(4, gen))])
    with pytest.raises(SlotNotFound):
        client.slot_info("no-such-slot")
    after = scrape()
    ok = dict(route="/prefill", method="POST", status="200")
    missing = dict(route="/slots/{slot_id}", method="GET", status="404")
    assert metric(after, "kda_http_requests_total", **ok) == metric(before, "kda_http_requests_total", **ok) + 1
    assert metric(after, "kda_http_errors_total", **missing) == metric(before, "kda_http_errors_total", **missing) + 1
    assert metric(after, "kda_prefill_tokens_total") == metric(before, "kda_prefill_tokens_total") + 15
    assert metric(after, "kda_prefill_sequences_total") == metric(before, "kda_prefill_sequences_total") + 2
    assert metric(after, "kda_batch_requests_count") > metric(before, "kda_batch_requests_count")
    assert metric(after, "kda_kernel_seconds_count") > metric(before, "kda_kernel_seconds_count")
    assert metric(after, "kda_queue_seconds_count") > metric(before, "kda_queue_seconds_count")
    assert metric(after, "kda_free_slots") == client.info()["free_slots"]


def test_health_and_openapi(server):
    assert httpx.get(f"{server.url}/health/live").json() == {"status": "live"}
    assert httpx.get(f"{server.url}/health/ready").json() == {"status": "ready"}
    schema = httpx.get(f"{server.url}/openapi.json").json()
    prefill = schema["paths"]["/prefill"]["post"]
    assert set(prefill["requestBody"]["content"]) == {"application/json", "application/x-safetensors",
                                                       "application/vnd.kda.shm+json"}  # shared memory (tests/transport)
    assert set(prefill["responses"]["200"]["content"]) == {"application/json", "application/x-safetensors"}
    assert "application/problem+json" in prefill["responses"]["404"]["content"]
    for name in ("PrefillJSONRequest", "PrefillOptions", "JSONTensor", "Problem", "StateJSON"):
        assert name in schema["components"]["schemas"]
    put = schema["paths"]["/slots/{slot_id}/state"]["put"]
    assert set(put["requestBody"]["content"]) == {"application/json", "application/x-safetensors"}
    json.dumps(schema)  # serializable as is
