"""HTTP contract of the Ray Serve ingress over two CPU shards: the single server's API
(through the unchanged `service.client`), split prefills against the float64 reference,
moves, drains, a restarted ingress, and a killed shard (last: it restarts a replica)."""
from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("ray.serve")  # the ray extra; CI installs it

from ray_helpers import (  # noqa: E402
    HV, K, LAYERS, MAX_BODY_MB, SHARD_SLOTS, TOL, V, Cluster, make_sequence, reference, rel, shard_of,
)

from kda_client.client import BadRequest, KDAClient, SlotGone, SlotNotFound  # noqa: E402

pytestmark = pytest.mark.timeout(240)  # the first test also starts the cluster (~50 s on 2 cores)


def on_both(client: KDAClient, cluster: Cluster) -> tuple[str, str]:
    """One new slot on each shard: ``a`` where placement put it, ``b`` moved to the other
    one when needed (its id, naming its first shard, keeps working)."""
    a, b = client.alloc(2)
    other = next(s for s in cluster.shards if s != shard_of(a))
    if shard_of(b) != other:
        r = httpx.post(f"{cluster.url}/slots/{b}/move", json={"shard": other}, timeout=60)
        assert r.status_code == 200 and r.json() == {"slot": b, "shard": other}, r.text
    return a, b


def test_info_sums_the_shards(cluster: Cluster, client: KDAClient) -> None:
    info = client.info()
    assert info["num_slots"] == 2 * SHARD_SLOTS
    assert (info["num_layers"], info["num_heads"], info["head_k_dim"], info["head_v_dim"]) == (LAYERS, HV, K, V)
    assert info["free_slots"] + info["used_slots"] == 2 * SHARD_SLOTS
    assert httpx.get(f"{cluster.url}/health/ready").json() == {"status": "ready"}
    rows = httpx.get(f"{cluster.url}/shards").json()["shards"]
    assert [r["shard"] for r in rows] == cluster.shards and all(r["up"] and not r["draining"] for r in rows)


def test_new_slots_go_to_the_emptiest_shard(cluster: Cluster, client: KDAClient) -> None:
    free = {r["shard"]: r["free_slots"] for r in httpx.get(f"{cluster.url}/shards").json()["shards"]}
    emptiest = max(free, key=lambda s: (free[s], s == cluster.shards[0]))
    slots = client.alloc(3)
    assert {shard_of(s) for s in slots} == {emptiest}
    for s in slots:
        assert s.startswith(emptiest + ".") and client.slot_info(s)["tokens_per_layer"] == [0] * LAYERS
        client.free(s)


def test_split_prefill_matches_the_reference(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    a, b = on_both(client, cluster)
    seqs = [make_sequence(T, gen) for T in (70, 1, 33, 5)]
    slots = [b, None, a, None]  # interleaved: shard of b, new, shard of a, new
    out = client.prefill(0, [(s, *x) for s, x in zip(slots, seqs)])
    o_ref, final_ref = reference(seqs)
    assert rel(out.o_packed, o_ref) < TOL and rel(out.final_state, final_ref) < TOL
    assert out.slots[0] == b and out.slots[2] == a and None not in out.slots
    # continue every sequence: the states were kept, each on its shard
    more = [make_sequence(T, gen) for T in (9, 64, 2, 1)]
    out2 = client.prefill(0, [(s, *x) for s, x in zip(out.slots, more)])
    o_ref2, final_ref2 = reference(more, initial=final_ref)
    assert rel(out2.o_packed, o_ref2) < TOL and rel(out2.final_state, final_ref2) < TOL
    for s, x, y in zip(out.slots, seqs, more):
        assert client.slot_info(s)["tokens_per_layer"] == [x[0].shape[0] + y[0].shape[0], 0]
        client.free(s)


def test_prefill_reports_server_timing(cluster: Cluster, client: KDAClient, json_client: KDAClient,
                                      gen: torch.Generator) -> None:
    """The ingress serves the single server's /prefill route: Server-Timing in both
    encodings, on a request split over the two shards."""
    for c in (client, json_client):
        a, b = on_both(c, cluster)
        seqs = [make_sequence(T, gen) for T in (6, 9)]
        out = c.prefill(0, [(a, *seqs[0]), (b, *seqs[1])])
        assert set(out.server_timing) == {"decode", "validate", "kernel", "encode"}
        assert all(ms >= 0 for ms in out.server_timing.values()) and out.server_timing["kernel"] > 0
        o_ref, final_ref = reference(seqs)
        assert rel(out.o_packed, o_ref) < TOL and rel(out.final_state, final_ref) < TOL
        for s in (a, b):
            c.free(s)


def test_json_encoding_and_no_final_state(cluster: Cluster, json_client: KDAClient, gen: torch.Generator) -> None:
    a, b = on_both(json_client, cluster)
    seqs = [make_sequence(T, gen) for T in (3, 66)]
    out = json_client.prefill(1, [(a, *seqs[0]), (b, *seqs[1])], return_final_state=False)
    assert out.final_state is None and rel(out.o_packed, reference(seqs)[0]) < TOL
    for s in (a, b):
        assert json_client.slot_info(s)["tokens_per_layer"] == [0, seqs[(s == b)][0].shape[0]]
        json_client.free(s)


def test_refusals_change_nothing(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    a, b = on_both(client, cluster)
    before = {s: client.get_state(s) for s in (a, b)}
    used = client.info()["used_slots"]
    x = make_sequence(4, gen)
    ghost = a.rsplit(".", 1)[0] + ".AAAAAAAAAAAAAAAAAAAAAA"  # this incarnation, never issued: 404
    with pytest.raises(SlotNotFound) as e:  # the first unknown slot in request order, nothing run
        client.prefill(0, [(a, *x), (None, *x), ("not-an-id", *x), (ghost, *x), (b, *x)])
    assert e.value.problem["slot"] == "not-an-id"
    with pytest.raises(SlotNotFound) as e:  # an unknown id before an unroutable one comes first
        client.prefill(0, [(b, *x), (ghost, *x), ("not-an-id", *x)])
    assert e.value.problem["slot"] == ghost
    v_nan = x[2].clone()
    v_nan[-1, 0, 0] = float("nan")
    with pytest.raises(BadRequest) as e:  # validated whole, before any shard runs
        client.prefill(0, [(a, *x), (b, x[0], x[1], v_nan, x[3], x[4])])
    assert e.value.status == 400 and e.value.problem["field"] == "v"
    with pytest.raises(BadRequest) as e:
        client.prefill(LAYERS, [(a, *x), (b, *x)])
    assert e.value.status == 400 and e.value.problem["field"] == "layer"
    r = httpx.post(f"{cluster.url}/prefill", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.headers["content-type"] == "application/problem+json"
    r = httpx.post(f"{cluster.url}/prefill", content=b"x" * (MAX_BODY_MB * 2**20 + 1),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.info()["used_slots"] == used
    for s in (a, b):
        assert torch.equal(client.get_state(s), before[s])
        client.free(s)
    with pytest.raises(SlotNotFound):
        client.slot_info(a)


def test_slot_routes_follow_the_slot(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    a, b = on_both(client, cluster)
    state = torch.randn(LAYERS, HV, V, K, generator=gen)
    client.put_state(b, state)
    assert torch.equal(client.get_state(b), state)
    child = client.fork(b)
    assert shard_of(child) != shard_of(a) and torch.equal(client.get_state(child), state)  # where b lives now
    exported = httpx.get(f"{cluster.url}/slots/{b}/state").content
    assert exported == httpx.get(f"{cluster.url}/slots/{child}/state").content
    for s in (a, b, child):
        client.free(s)


def test_move_is_bit_exact_and_keeps_the_id(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    x = make_sequence(40, gen)
    out = client.prefill(0, [(None, *x)])
    slot = out.slots[0]
    state, info = client.get_state(slot), client.slot_info(slot)
    other = next(s for s in cluster.shards if s != shard_of(slot))
    r = httpx.post(f"{cluster.url}/slots/{slot}/move", json={"shard": other}, timeout=60)
    assert r.status_code == 200 and r.json() == {"slot": slot, "shard": other}
    assert torch.equal(client.get_state(slot), state)  # bit for bit
    assert client.slot_info(slot)["tokens_per_layer"] == info["tokens_per_layer"]
    y = make_sequence(17, gen)
    out2 = client.prefill(0, [(slot, *y)])
    o_ref, final_ref = reference([y], initial=out.final_state)
    assert out2.slots == [slot] and rel(out2.o_packed, o_ref) < TOL and rel(out2.final_state, final_ref) < TOL
    state = client.get_state(slot)
    assert torch.equal(state[0], out2.final_state[0])
    r = httpx.post(f"{cluster.url}/slots/{slot}/move", timeout=60)  # back, to the emptiest other shard
    assert r.status_code == 200 and r.json()["shard"] == shard_of(slot)
    assert torch.equal(client.get_state(slot), state)
    r = httpx.post(f"{cluster.url}/slots/{slot}/move", json={"shard": "nowhere"})
    assert r.status_code == 404 and r.json()["type"].endswith(":unknown-shard")
    client.free(slot)
    r = httpx.post(f"{cluster.url}/slots/{slot}/move", json={})
    assert r.status_code == 404 and r.json()["slot"] == slot


def test_drain_moves_every_slot_and_resume(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    source, target = cluster.shards
    slots = [client.alloc(1)[0] for _ in range(4)]
    states = {}
    for s in slots:
        states[s] = torch.randn(LAYERS, HV, V, K, generator=gen)
        client.put_state(s, states[s])
    r = httpx.post(f"{cluster.url}/shards/{source}/drain", timeout=120)
    assert r.status_code == 200 and r.json()["failed"] == [], r.text
    rows = {row["shard"]: row for row in httpx.get(f"{cluster.url}/shards").json()["shards"]}
    assert rows[source]["used_slots"] == 0 and rows[source]["draining"]
    for s in slots:
        assert torch.equal(client.get_state(s), states[s])
    # one at a time, so that both ingress replicas place some: each must see the drain
    # the other ran, even with placement figures it fetched just before it
    placed = [client.alloc(1)[0] for _ in range(6)]
    assert {shard_of(s) for s in placed} == {target}
    assert httpx.post(f"{cluster.url}/shards/{source}/resume").status_code == 204
    for s in slots + placed:
        client.free(s)
    for row in httpx.get(f"{cluster.url}/shards").json()["shards"]:
        assert not row["draining"]


def test_moved_slots_survive_an_ingress_restart(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    slot = client.alloc(1)[0]
    state = torch.randn(LAYERS, HV, V, K, generator=gen)
    client.put_state(slot, state)
    other = next(s for s in cluster.shards if s != shard_of(slot))
    assert httpx.post(f"{cluster.url}/slots/{slot}/move", json={"shard": other}, timeout=60).status_code == 200
    cluster.kill("ingress")  # their caches of the directory die with them; the directory actor does not
    cluster.wait_ready()
    assert torch.equal(client.get_state(slot), state)
    client.free(slot)


def test_metrics_label_each_shard(cluster: Cluster) -> None:
    text = httpx.get(f"{cluster.url}/metrics").text
    for shard in cluster.shards:
        assert f'kda_free_slots{{shard="{shard}"}}' in text
    assert "kda_http_requests_total" in text


def test_prefix_entries_live_on_one_shard_and_restore_anywhere(cluster: Cluster, client: KDAClient,
                                                               gen: torch.Generator) -> None:
    """Checkpoints through a split prefill land on the slots' shards; a restore on the
    entry's shard runs there, one that does not fit there moves the entry's bytes; publish,
    info and delete reach the shard that holds the key."""
    a, b = on_both(client, cluster)
    seqs = [[make_sequence(64, gen) for _ in range(2)] for _ in range(LAYERS)]
    for layer in range(LAYERS):
        client.prefill(layer, [(a, *seqs[layer][0]), (b, *seqs[layer][1])],
                       checkpoints=[[(64, "ray.a")], [(64, "ray.b")]])
    states = {"ray.a": client.get_state(a), "ray.b": client.get_state(b)}
    assert client.prefix_info("ray.a")["complete"] and client.prefix_info("ray.b")["complete"]

    here = client.alloc(prefix=["ray.a"])
    assert (here.matched, here.tokens, shard_of(here.slots[0])) == (1, 64, shard_of(a))
    assert torch.equal(client.get_state(here.slots[0]), states["ray.a"])
    client.free(here.slots[0])

    free = {r["shard"]: r["free_slots"] for r in httpx.get(f"{cluster.url}/shards").json()["shards"]}
    count = free[shard_of(a)] + 1  # more than the entry's shard holds: its bytes move
    moved = client.alloc(count, prefix=["ray.a"])
    assert moved.tokens == 64 and len(moved.slots) == count
    assert any(shard_of(s) != shard_of(a) for s in moved.slots)
    for s in moved.slots:
        assert torch.equal(client.get_state(s), states["ray.a"])
        assert client.slot_info(s)["tokens_per_layer"] == [64] * LAYERS
        client.free(s)

    client.publish(b, "ray.a")  # re-published from the other shard: one entry of the key remains
    got = client.alloc(prefix=["ray.a"])
    assert shard_of(got.slots[0]) != shard_of(a)  # b lives on the other shard (moved there: its id names its first)
    assert torch.equal(client.get_state(got.slots[0]), states["ray.b"])
    assert client.drop_prefix("ray.a") is True
    with pytest.raises(SlotNotFound):
        client.prefix_info("ray.a")
    assert client.drop_prefix("ray.a") is False  # idempotent: 204 again, nothing dropped
    for s in (a, b, got.slots[0]):
        client.free(s)


def test_a_dead_shard_loses_only_its_slots(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    a, b = on_both(client, cluster)
    x = make_sequence(8, gen)
    out = client.prefill(0, [(a, *x), (b, *x)])
    victim = shard_of(a)
    cluster.kill(victim)
    y = make_sequence(5, gen)
    out_b = client.prefill(0, [(b, *y)])  # the other shard serves on
    assert rel(out_b.o_packed, reference([y], initial=out.final_state[1:])[0]) < TOL
    for request in ([(a, *y)], [(b, *y), (a, *y)]):
        with pytest.raises(SlotGone) as e:  # a SlotNotFound: the id will never work again
            client.prefill(0, request)
        assert e.value.status == 410 and e.value.problem["slot"] == a, e.value.problem
        assert victim in e.value.problem["detail"]
    r = httpx.get(f"{cluster.url}/slots/{a}")
    assert r.status_code == 410 and r.json()["type"].endswith(":slot-gone")
    cluster.wait_ready()
    fresh = client.prefill(0, [(None, *y)], )  # the restarted shard takes new work
    assert rel(fresh.o_packed, reference([y])[0]) < TOL
    for s in (b, *fresh.slots):
        client.free(s)
