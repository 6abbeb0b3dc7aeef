"""Servers started with options: API key and settings from KDA_* variables, server gate
parameters, snapshot across a restart, idle expiry."""
from __future__ import annotations

import time

import httpx
import pytest
import torch
from safetensors.torch import save_file
from server_harness import GEOMETRY_ARGS, HV, K, LAYERS, TOL, V, make_sequence, metric, reference, rel, start_server

from kda_client.client import BadRequest, KDAClient, SlotNotFound, Unauthorized

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def gates() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "layers.0.A_log": torch.randn(HV, generator=gen) * 0.5,
        "layers.0.dt_bias": torch.randn(HV, K, generator=gen) * 0.5,
        "layers.1.A_log": torch.randn(HV, generator=gen) * 0.5,
        "layers.1.dt_bias": torch.randn(HV * K, generator=gen) * 0.5,
        "layers.1.lower_bound": torch.tensor(-4.0),
    }


@pytest.fixture(scope="module")
def configured(tmp_path_factory, gates):
    """API key and geometry from the environment, gate parameters from a file."""
    tmp = tmp_path_factory.mktemp("configured")
    save_file(gates, tmp / "gates.safetensors")
    env = {"KDA_API_KEY": KEY, "KDA_NUM_SLOTS": "8", "KDA_NUM_LAYERS": str(LAYERS), "KDA_NUM_HEADS": str(HV),
           "KDA_HEAD_DIM": str(K), "KDA_HEAD_V_DIM": str(V)}
    srv = start_server(["--gate-params", str(tmp / "gates.safetensors")], tmp / "log", env=env)
    yield srv
    assert srv.stop() == 0, srv.log_text()


def test_api_key_required_everywhere_but_health(configured):
    for method, path in [("GET", "/info"), ("GET", "/metrics"), ("POST", "/slots"), ("POST", "/prefill"),
                         ("GET", "/slots/x"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nowhere")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"},
                        {"authorization": KEY}):
            r = httpx.request(method, configured.url + path, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.headers["www-authenticate"].startswith("Bearer")
    for path in ("/health/live", "/health/ready"):
        assert httpx.get(configured.url + path).status_code == 200
    assert httpx.get(configured.url + "/info", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    with KDAClient(configured.url, api_key="nope") as c, pytest.raises(Unauthorized):
        c.info()


def test_settings_come_from_the_environment(configured):
    with KDAClient(configured.url, api_key=KEY) as c:
        info = c.info()
    assert (info["num_slots"], info["num_heads"], info["head_k_dim"], info["head_v_dim"]) == (8, HV, K, V)
    assert info["gate_layers"] == [0, 1]


@pytest.mark.parametrize("layer", [0, 1])
def test_server_gate_parameters_apply(configured, gates, gen, layer):
    """Raw g with the server's gate for the layer: softplus on layer 0, lower bound on 1."""
    seq = make_sequence(40, gen, raw_gate=True)
    with KDAClient(configured.url, api_key=KEY) as c:
        out = c.prefill(layer, [(None, *seq)], use_qk_l2norm=True, use_beta_sigmoid=True)
        with pytest.raises(BadRequest) as e:  # the server's gate and the request's cannot both apply
            c.prefill(layer, [(None, *seq)], A_log=torch.zeros(HV))
        assert e.value.problem["field"] == "A_log"
        c.free(out.slots[0])
    lb = gates.get(f"layers.{layer}.lower_bound")
    o_ref, final_ref = reference([seq], A_log=gates[f"layers.{layer}.A_log"], dt_bias=gates[f"layers.{layer}.dt_bias"],
                                 lower_bound=None if lb is None else float(lb), use_qk_l2norm=True,
                                 use_beta_sigmoid=True)
    assert rel(out.o_packed, o_ref) < TOL and rel(out.final_state, final_ref) < TOL


def test_bad_gate_file_stops_the_start(tmp_path):
    save_file({"layers.0.dt_bias": torch.zeros(HV, K)}, tmp_path / "gates.safetensors")
    with pytest.raises(RuntimeError, match="neither A_log nor lower_bound"):
        start_server([*GEOMETRY_ARGS, "--gate-params", str(tmp_path / "gates.safetensors")], tmp_path / "log")


def test_snapshot_on_shutdown_and_restore_on_start(tmp_path, gen):
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(tmp_path / "pool.snapshot")]
    first = start_server(args, tmp_path / "log1")
    try:
        with KDAClient(first.url) as c:
            out = c.prefill(1, [(None, *make_sequence(20, gen)), (None, *make_sequence(3, gen))])
            states = {s: c.get_state(s) for s in out.slots}
            infos = {s: c.slot_info(s) for s in out.slots}
    finally:
        assert first.stop() == 0, first.log_text()
    assert (tmp_path / "pool.snapshot").exists()
    second = start_server(args, tmp_path / "log2")
    try:
        with KDAClient(second.url) as c:
            assert c.info()["used_slots"] == 2
            for slot, state in states.items():
                assert torch.equal(c.get_state(slot), state)
                assert c.slot_info(slot)["tokens_per_layer"] == infos[slot]["tokens_per_layer"]
    finally:
        assert second.stop() == 0, second.log_text()


def test_idle_slots_expire(tmp_path):
    srv = start_server([*GEOMETRY_ARGS, "--slot-ttl-s", "0.5"], tmp_path / "log")
    try:
        with KDAClient(srv.url) as c:
            slot = c.alloc()[0]
            time.sleep(1.5)  # the sweep runs every ttl / 4
            metrics = httpx.get(f"{srv.url}/metrics").text
            assert metric(metrics, "kda_slots_expired_total") >= 1
            with pytest.raises(SlotNotFound):
                c.slot_info(slot)
    finally:
        assert srv.stop() == 0, srv.log_text()
