"""The prefix cache through KServe v2: ``checkpoints`` (a JSON string) stores states of a
sequence's requests, ``prefix`` with ``sequence_start`` starts a new sequence from the
longest complete entry; bad parameters are refused with nothing changed."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from kserve_helpers import LAYERS, infer, make_sequence, result_tensor, seq_inputs
from tritonclient.utils import InferenceServerException


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_checkpoints_then_a_sequence_started_from_the_prefix(server, client, gen):
    seqs = [make_sequence(100, gen) for _ in range(LAYERS)]
    finals = []
    for layer, seq in enumerate(seqs):
        marks = json.dumps([{"offset": 64, "key": "kserve.64"}])
        r = infer(client, seq_inputs(seq), sequence_id=5001, start=layer == 0, end=layer == LAYERS - 1,
                  params={"layer": layer, "checkpoints": marks})
        finals.append(result_tensor(r, "final_state"))
    info = httpx.get(f"{server.url}/prefix/kserve.64").json()
    assert (info["tokens"], info["complete"]) == (64, True)

    for layer, seq in enumerate(seqs):
        params = {"layer": layer, **({"prefix": json.dumps(["absent", "kserve.64"])} if layer == 0 else {})}
        r = infer(client, seq_inputs(tuple(t[64:] for t in seq)), sequence_id=5002, start=layer == 0,
                  end=layer == LAYERS - 1, params=params)
        if layer == 0:
            got = r.get_response()["parameters"]
            assert (got["prefix_matched"], got["prefix_key"], got["prefix_tokens"]) == (2, "kserve.64", 64)
        assert torch.equal(_bits(result_tensor(r, "final_state")), _bits(finals[layer])), layer


@pytest.mark.parametrize("params", [
    {"checkpoints": json.dumps([{"offset": 63, "key": "bad"}])},
    {"checkpoints": "not json"},
    {"checkpoints": json.dumps([{"offset": "64", "key": "bad"}])},
    {"checkpoints": 5},
    {"prefix": json.dumps(["k"])},  # without sequence_start
    {"prefix": json.dumps([1])},
])
def test_bad_prefix_parameters_are_refused_with_nothing_changed(server, client, gen, params):
    free = httpx.get(f"{server.url}/info").json()["free_slots"]
    with pytest.raises(InferenceServerException) as e:
        infer(client, seq_inputs(make_sequence(100, gen)), sequence_id=5003, params=params)
    assert e.value.status() == "400"
    assert httpx.get(f"{server.url}/info").json()["free_slots"] == free
    assert httpx.get(f"{server.url}/prefix/bad").status_code == 404


def test_a_failed_prefill_frees_the_restored_slot(server, client, gen):
    free = httpx.get(f"{server.url}/info").json()["free_slots"]
    with pytest.raises(InferenceServerException) as e:  # 30 is on no grid: the slot restored is freed again
        infer(client, seq_inputs(make_sequence(100, gen)), sequence_id=5004, start=True,
              params={"prefix": json.dumps(["kserve.64"]), "checkpoints": json.dumps([{"offset": 30, "key": "x"}])})
    assert e.value.status() == "400"
    assert httpx.get(f"{server.url}/info").json()["free_slots"] == free
