"""Finite inputs that would leave NaN/Inf in a slot never do: a given log decay > 0 is
refused up front (400 naming g); an update that diverges anyway (v near float32's
largest value, long unnormalised q/k) is rolled back from the launch's row copies and
answered 422 naming the sequences, on every front end, and the slot is left exactly as
it was, not flagged, and continues normally. Requests merged into the same launch as a
diverging one are unaffected. KServe's JSON never carries a NaN literal.

The server runs with a long batch window so that concurrent requests share launches.
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest
import torch
from reliability_helpers import (
    GEOMETRY_ARGS, H, HV, JSON, K, TOL, V, WholePool, assert_problem, make_sequence, metric, reference, rel,
    start_server,
)

from kda_client.client import BadRequest, KDAClient
from service.wire.state import decode_state_json
from service.wire.tensors import tensor_to_json

WINDOW_MS = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = start_server([*GEOMETRY_ARGS, "--batch-window-ms", str(WINDOW_MS)],
                       tmp_path_factory.mktemp("transactions") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture
def pool(server: Any) -> Iterator[WholePool]:
    whole = WholePool(server.url)
    yield whole
    for slot in list(whole.live):
        whole.http.delete(f"/slots/{slot}")
    whole.close()


def _advanced_slot(pool: WholePool, gen: torch.Generator) -> str:
    """A slot that holds a non-zero state (20 tokens on layer 0)."""
    with KDAClient(pool.url) as c:
        slot = c.prefill(0, [(None, *make_sequence(20, gen))]).slots[0]
    pool.add(slot)
    return slot


def _huge_v(T: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """v = 3e38 (finite: float32 ends at 3.4e38), unit-variance k and beta 1: the first
    update k v^T already overflows where |k_i| > 1.13."""
    q, _, v, g, _ = make_sequence(T, gen)
    return q, torch.randn(T, H, K, generator=gen), torch.full_like(v, 3e38), g, torch.ones(T, HV)


def _unnormalised(T: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """400 tokens of N(0, 1) q and k, no l2norm, decay ~1, beta 1: the state's norm grows
    without bound (each update multiplies it by about |k|^2 ~ K)."""
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    return q, k, v, torch.full((T, HV, K), -1e-4), torch.ones(T, HV)


def test_a_positive_log_decay_is_refused_up_front(pool: WholePool, gen: torch.Generator) -> None:
    slot = _advanced_slot(pool, gen)
    before = pool.image()
    q, k, v, g, beta = make_sequence(8, gen)
    g[3, 1, 2] = 80.0
    with KDAClient(pool.url) as c, pytest.raises(BadRequest) as e:
        c.prefill(0, [(slot, q, k, v, g, beta)])
    assert e.value.status == 400 and e.value.problem["field"] == "g", e.value.problem
    assert "80" in e.value.problem["detail"], e.value.problem
    assert pool.image() == before


@pytest.mark.parametrize("inputs", [_huge_v, _unnormalised], ids=["v=3e38", "unnormalised-qk"])
def test_a_diverging_update_is_rolled_back_and_answered_422(pool: WholePool, gen: torch.Generator,
                                                            inputs: Any) -> None:
    """One request of two sequences, the second diverging: 422 naming sequence 1, neither
    slot changed (the first's update is rolled back with it), nothing flagged lost, and
    both continue afterwards exactly as the float64 reference from their old states."""
    a, b = _advanced_slot(pool, gen), _advanced_slot(pool, gen)
    states = {s: _state(pool, s) for s in (a, b)}
    before = pool.image()
    T = 400 if inputs is _unnormalised else 12
    with KDAClient(pool.url) as c:
        with pytest.raises(BadRequest) as e:
            c.prefill(0, [(a, *make_sequence(7, gen)), (b, *inputs(T, gen))])
        problem = e.value.problem
        assert e.value.status == 422 and problem["type"].endswith(":update-diverged"), problem
        assert problem["sequences"] == [1], problem
        assert pool.image() == before
        assert not any(pool.http.get(f"/slots/{s}").json()["state_lost"] for s in (a, b))
        seqs = [make_sequence(9, gen), make_sequence(5, gen)]
        out = c.prefill(0, [(a, *seqs[0]), (b, *seqs[1])])
    initial = torch.stack([states[s][0] for s in (a, b)])
    want_o, want_h = reference(seqs, initial=initial)
    assert rel(out.o_packed, want_o) < TOL and rel(out.final_state, want_h) < TOL


def test_a_diverging_request_on_new_slots_leaves_no_slot_behind(pool: WholePool, gen: torch.Generator) -> None:
    free = pool.http.get("/info").json()["free_slots"]
    r = pool.http.post("/prefill", content=_json_prefill([None], [_huge_v(5, gen)]), headers={"content-type": JSON})
    problem = assert_problem(r, 422, "update-diverged")
    assert problem["sequences"] == [0]
    assert pool.http.get("/info").json()["free_slots"] == free


def test_requests_sharing_a_launch_with_a_diverging_one_succeed(pool: WholePool, gen: torch.Generator) -> None:
    """Three requests in one launch (the batch window): the diverging one is refused and
    rolled back, the two others are applied and match the float64 reference."""
    slots = [_advanced_slot(pool, gen) for _ in range(3)]
    initial = {s: _state(pool, s) for s in slots}
    before = pool.image()
    seqs = [make_sequence(6, gen), _huge_v(6, gen), make_sequence(6, gen)]

    def send(i: int) -> httpx.Response:
        return httpx.post(f"{pool.url}/prefill", content=_json_prefill([slots[i]], [seqs[i]]),
                          headers={"content-type": JSON}, timeout=60)

    launches = metric(pool.http.get("/metrics").text, "kda_batch_requests_count")
    with ThreadPoolExecutor(3) as ex:
        replies = list(ex.map(send, range(3)))
    assert [r.status_code for r in replies] == [200, 422, 200], [r.text[:300] for r in replies]
    assert metric(pool.http.get("/metrics").text, "kda_batch_requests_count") == launches + 1  # one launch
    assert pool.image()[slots[1]] == before[slots[1]]
    for i in (0, 2):
        _, want = reference([seqs[i]], initial=initial[slots[i]][0][None])
        assert rel(_state(pool, slots[i])[0], want[0]) < TOL


def _state(pool: WholePool, slot: str) -> torch.Tensor:
    """The slot's state [L, HV, V, K] as the server exports it."""
    return decode_state_json(pool.http.get(f"/slots/{slot}/state", headers={"accept": JSON}).content)


def test_kserve_refuses_a_diverging_update_and_never_sends_nan(server: Any, gen: torch.Generator) -> None:
    q, k, v, g, beta = _huge_v(5, gen)
    inputs = [{"name": n, "datatype": "FP32", "shape": list(t.shape), "data": t.reshape(-1).tolist()}
              for n, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta))]
    doc = {"inputs": inputs, "outputs": [{"name": "o", "parameters": {"binary_data": False}},
                                         {"name": "final_state", "parameters": {"binary_data": False}}]}
    r = httpx.post(f"{server.url}/v2/models/kda/infer", json=doc, timeout=60)
    assert r.status_code == 422 and r.headers["content-type"] == "application/json", r.text[:300]
    assert "non-finite" in _strict_json(r.text)["error"]


def _strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper: a NaN or Infinity literal fails."""
    def refuse(literal: str) -> None:
        raise AssertionError(f"{literal} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _json_prefill(slots: list[Any], seqs: list[tuple[torch.Tensor, ...]]) -> bytes:
    packed = [torch.cat([s[i] for s in seqs]) for i in range(5)]
    doc = {"layer": 0, "sequences": [{"slot": s, "length": int(x[0].shape[0])} for s, x in zip(slots, seqs)],
           **{n: tensor_to_json(t) for n, t in zip(("q", "k", "v", "g", "beta"), packed)}}
    return json.dumps(doc).encode()


def test_the_reference_agrees_that_these_inputs_diverge(gen: torch.Generator) -> None:
    """The cases above are real divergences: the float32 recurrence itself leaves
    non-finite values (so refusing them loses nothing a correct kernel could give)."""
    for inputs, T in ((_huge_v, 12), (_unnormalised, 400)):
        o, h = reference([inputs(T, gen)], dtype=torch.float32)
        assert not (torch.isfinite(o).all() and torch.isfinite(h).all()), inputs.__name__
    assert math.isfinite(3e38)
