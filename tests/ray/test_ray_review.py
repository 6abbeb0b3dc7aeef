"""Review of the sharded deployment's contract, found by probing: a `ShardedCore` over two
real `ShardServer`s in this process (`local_shards`) for races and states a cluster cannot
be steered into, and the running application (`cluster`) for what only Serve can show."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve")  # the ray extra; CI installs it

from local_shards import SETTINGS, Local, fill_layers, prefill_inputs, run_local, slots_on  # noqa: E402
from ray_helpers import HV, K, LAYERS, MAX_BODY_MB, V, Cluster, make_sequence, shard_of  # noqa: E402

from kda_client.client import KDAClient  # noqa: E402
from service.core.inputs import Checkpoint  # noqa: E402
from service.errors import InvalidRequest, StateLost  # noqa: E402
from service.ray_serve.errors import ShardFault  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# -- the prefix cache: one entry per key, a restore never fails for a vanished entry ---------

def test_a_checkpoint_replaces_the_keys_entry_on_every_shard() -> None:
    """A single server's checkpoint replaces the entry of its key; sharded, an older entry
    of the key on another shard must not outlive it (and win a restore with more tokens)."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(11)
        (old,), (new,) = await slots_on(local, "a"), await slots_on(local, "b")
        await fill_layers(local, old, 12, gen)
        await local.core.publish(old, "k")  # the entry k: 12 tokens, on shard a
        await fill_layers(local, new, 5, gen, key="k")  # k checkpointed anew on shard b: 5 tokens
        slots, match = await local.core.alloc_prefix(["k"])
        assert match.tokens == 5, match
        assert torch.equal(await local.core.get_state(slots[0]), await local.core.get_state(new))
        info = await local.core.prefix_info("k")
        assert info.tokens == 5
        assert isinstance(await local.links["a"].shard.prefix_info("k"), ShardFault)  # no k on shard a

    run_local(scenario)


def test_a_restore_racing_a_delete_is_a_miss_not_a_404() -> None:
    """An entry deleted between the ingress's look at the shards and the read of its bytes
    (a restore on another shard) leaves POST /slots with a prefix what the single server
    answers: slots and no match, never 404 unknown-prefix (nor slots leaked)."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(12)
        (slot,) = await slots_on(local, "a")
        await fill_layers(local, slot, 7, gen)
        await local.core.publish(slot, "gone")
        await slots_on(local, "a", 3)  # shard a is full: a restore moves the entry's bytes

        async def drop_first(method: str, args: tuple[Any, ...]) -> None:
            if method == "prefix_state":
                local.links["a"].before = None
                await local.links["a"].shard.drop_prefix("gone")
        local.links["a"].before = drop_first
        used = (await local.core.info())["used_slots"]
        slots, match = await local.core.alloc_prefix(["gone"])
        assert (match.matched, match.tokens, len(slots)) == (0, 0, 1)
        assert torch.count_nonzero(await local.core.get_state(slots[0])) == 0
        assert (await local.core.info())["used_slots"] == used + 1

    run_local(scenario)


def test_a_restore_falls_back_when_the_entrys_shard_proves_full() -> None:
    """Placement figures may be stale (another ingress replica allocated meanwhile): when the
    entry's shard proves full, the restore moves the bytes to a shard with room rather than
    answering 503 while the deployment has free slots."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(13)
        (slot,) = await slots_on(local, "a")
        await fill_layers(local, slot, 9, gen)
        await local.core.publish(slot, "full")
        await local.core.info()
        await local.core._free_slots()  # figures read now: shard a has 3 free
        await local.links["a"].shard.alloc(3)  # behind this replica's back
        slots, match = await local.core.alloc_prefix(["full"])
        assert match.tokens == 9 and shard_of(slots[0]) == "b"
        assert torch.equal(await local.core.get_state(slots[0]), await local.core.get_state(slot))

    run_local(scenario, status_max_age_s=60.0)


def _total(text: str, sample: str) -> float:
    """The sum of ``sample``'s values over all its label sets in a Prometheus page."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == sample)


def test_a_restore_whose_bytes_move_counts_one_hit_and_its_tokens() -> None:
    """A restore served by moving an entry's bytes to another shard is a prefix hit of
    tokens x count, counted once by the ingress (the lending shard counts none), as a
    single server counts a restore."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(19)
        (slot,) = await slots_on(local, "a")
        await fill_layers(local, slot, 11, gen)
        await local.core.publish(slot, "moved")
        await local.links["a"].shard.alloc(SETTINGS.num_slots - 1)  # shard a full: the bytes must move
        slots, match = await local.core.alloc_prefix(["moved"], 2)
        assert match.tokens == 11 and {shard_of(s) for s in slots} == {"b"}
        text = (await local.core.render_metrics()).decode()
        assert _total(text, "kda_prefix_hits_total") == 1.0  # over the ingress and both shards
        assert _total(text, "kda_prefix_hit_tokens_total") == 22.0

    run_local(scenario)


def test_an_alloc_reads_stale_figures_anew_before_refusing() -> None:
    """Placement figures that say every shard is full while slots were freed since (through
    another ingress replica, or with the figures not yet aged out) are read anew before an
    allocation is refused: a pool with free slots never answers 503 (seen in CI: a test
    right after one that filled the pool got PoolFull)."""
    async def scenario(local: Local) -> None:
        taken = {name: await link.shard.alloc(SETTINGS.num_slots) for name, link in local.links.items()}
        await local.core._free_slots()  # figures read now: no room anywhere
        await local.links["b"].shard.free(taken["b"][0])  # behind this replica's back
        (slot,) = await local.core.alloc(1)
        assert shard_of(slot) == "b"

    run_local(scenario, status_max_age_s=60.0)


def test_stored_keys_are_dropped_elsewhere_in_one_call_per_shard() -> None:
    """A prefill storing several checkpoints (and a publish) drops their keys on every other
    shard in one call per shard, not one per key; an older entry of such a key there is gone."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(17)
        (old,) = await slots_on(local, "b")
        await fill_layers(local, old, 6, gen)
        await local.core.publish(old, "k1")  # an older entry of k1, on shard b
        first, second = await slots_on(local, "a", 2)
        (third,) = await slots_on(local, "b")
        calls: list[tuple[str, str]] = []
        for name, link in local.links.items():
            async def record(method: str, args: tuple[Any, ...], name: str = name) -> None:
                calls.append((name, method))
            link.before = record
        seqs = [make_sequence(128, gen), make_sequence(5, gen), make_sequence(7, gen)]
        marks = [[Checkpoint(64, "k1"), Checkpoint(128, "k2")], [Checkpoint(5, "k3")], [Checkpoint(7, "k4")]]
        await local.core.prefill(prefill_inputs([first, second, third], seqs, checkpoints=marks))
        for shard in ("a", "b"):
            assert [m for s, m in calls if s == shard] == ["check_prefill", "prefill", "drop_prefixes"], calls
        assert isinstance(await local.links["b"].shard.prefix_info("k1"), ShardFault)  # the older k1 is gone
        assert (await local.core.prefix_info("k1")).tokens == 64
        calls.clear()
        await local.core.publish(old, "k2")
        assert calls == [("b", "publish"), ("a", "drop_prefixes")], calls
        assert isinstance(await local.links["a"].shard.prefix_info("k2"), ShardFault)

    run_local(scenario)


# -- a split prefill is all or nothing; errors name the client's ids --------------------------

def test_a_split_prefill_with_a_lost_slot_changes_nothing() -> None:
    """A prefill over two shards naming a slot flagged state_lost is 409 naming that slot
    (the id its client holds), and the other shard's slot has not advanced."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(14)
        (good,), (lost,) = await slots_on(local, "a"), await slots_on(local, "b")
        local.links["b"].shard.core.pool.mark_lost([local.pool_token(lost)])
        before = await local.core.get_state(good)
        seqs = [make_sequence(4, gen), make_sequence(3, gen)]
        with pytest.raises(StateLost) as e:
            await local.core.prefill(prefill_inputs([good, lost], seqs))
        assert e.value.slot == lost and lost in e.value.detail
        assert torch.equal(await local.core.get_state(good), before)
        assert (await local.core.slot_info(good)).tokens_per_layer == [0] * LAYERS

    run_local(scenario)


def test_a_split_prefill_with_a_bad_checkpoint_changes_nothing() -> None:
    """A checkpoint offset that does not fit its slot is 400 naming the field by the
    request's sequence index (not the index within one shard's part), before any shard runs."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(16)
        (first,), (second,) = await slots_on(local, "a"), await slots_on(local, "b")
        await fill_layers(local, second, 2, gen)
        before = await local.core.get_state(first)
        seqs = [make_sequence(4, gen), make_sequence(4, gen)]
        marks = [[], [Checkpoint(4, "early")]]  # slot `second` holds 2 tokens: 4 is inside no chunk grid point
        with pytest.raises(InvalidRequest) as e:
            await local.core.prefill(prefill_inputs([first, second], seqs, checkpoints=marks))
        assert e.value.field == "sequences[1].checkpoints[0].offset", e.value.field
        assert torch.equal(await local.core.get_state(first), before)
        assert (await local.core.slot_info(first)).tokens_per_layer == [0] * LAYERS
        assert (await local.core.info())["used_slots"] == 2

    run_local(scenario)


def test_errors_about_a_lost_slot_name_the_clients_id() -> None:
    """On one shard too: the 409 names the slot id the client sent, not the pool's token."""
    async def scenario(local: Local) -> None:
        gen = torch.Generator().manual_seed(15)
        (lost,) = await slots_on(local, "a")
        local.links["a"].shard.core.pool.mark_lost([local.pool_token(lost)])
        with pytest.raises(StateLost) as e:
            await local.core.prefill(prefill_inputs([lost], [make_sequence(4, gen)]))
        assert e.value.slot == lost, e.value.slot
        with pytest.raises(StateLost) as e:
            await local.core.publish(lost, "never")
        assert e.value.slot == lost, e.value.slot

    run_local(scenario)


# -- /metrics counts what the ingress itself counts --------------------------------------------

def test_metrics_keep_the_ingress_counters() -> None:
    """Prefix misses (counted by the ingress: no shard ran a restore) and responses abandoned
    by their clients (counted by the ingress's routes) appear on /metrics."""
    async def scenario(local: Local) -> None:
        await local.core.alloc_prefix(["nowhere"])
        local.core.metrics.abandoned.inc()
        text = (await local.core.render_metrics()).decode()
        assert "kda_prefix_misses_total 1.0" in text, text
        assert "kda_responses_abandoned_total 1.0" in text

    run_local(scenario)


# -- through the running application --------------------------------------------------------

def _forgeries(a: str, b: str) -> list[str]:
    """Ids no client was given, each quoted for a path: ``b``'s shard and incarnation on
    ``a``'s token, a shard that does not exist, a very long one, non-ASCII ones, one with an
    encoded "/" before a route's own suffix."""
    shard, incarnation, token = a.split(".")
    other = b.rsplit(".", 1)[0]
    return [f"{other}.{token}", f"nowhere-9.{incarnation}.{token}", "x" * 4000,
            httpx.URL(f"/{shard}.{incarnation}.{token}\u00e9").raw_path.decode()[1:], "%C3%A9",
            f"{a}%2Fstate", f"{a}%2f", f"{a}.{token}"]


SLOT_ROUTES = [("GET", "/slots/{}", None), ("DELETE", "/slots/{}", None), ("POST", "/slots/{}/fork", None),
               ("GET", "/slots/{}/state", None), ("POST", "/slots/{}/publish", {"key": "forged"}),
               ("POST", "/slots/{}/move", {})]


def test_forged_slot_ids_are_404_on_every_slot_route(cluster: Cluster, client: KDAClient,
                                                     gen: torch.Generator) -> None:
    """A garbled or forged id is 404 (problem+json naming it) on every slot route, and
    nothing changes: the slot whose parts it borrows keeps its state, no slot is made."""
    held = _slots_on_two_shards(client)
    a, b = held[0], held[-1]
    state = torch.randn(LAYERS, HV, V, K, generator=gen)
    client.put_state(a, state)
    used = client.info()["used_slots"]
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        for forged in _forgeries(a, b):
            for method, path, body in SLOT_ROUTES:
                r = http.request(method, path.format(forged), json=body)
                assert r.status_code == 404, (method, path, forged[:80], r.status_code, r.text[:300])
                assert r.headers["content-type"] == "application/problem+json"
    assert client.info()["used_slots"] == used
    assert torch.equal(client.get_state(a), state)
    with pytest.raises(Exception):
        client.prefix_info("forged")
    for s in (a, b):
        client.free(s)


def test_ids_of_no_life_of_their_shard_are_404_not_410(cluster: Cluster, client: KDAClient) -> None:
    """An id naming a shard with an incarnation that shard never had (the other shard's, 0,
    one still to come) was never issued: 404 on every slot route, not the 410 of a slot lost
    with a process; nothing changes."""
    held = _slots_on_two_shards(client)
    a, b = held[0], held[-1]
    _, incarnation, token = a.split(".")
    used = client.info()["used_slots"]
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        for forged in (f"{shard_of(b)}.{incarnation}.{token}", f"{shard_of(b)}.0.{token}",
                       f"{shard_of(b)}.{'z' * 13}.{token}"):
            for method, path, body in SLOT_ROUTES:
                r = http.request(method, path.format(forged), json=body)
                assert r.status_code == 404, (method, path, forged, r.status_code, r.text[:300])
                assert r.headers["content-type"] == "application/problem+json"
    assert client.info()["used_slots"] == used
    for s in held:
        client.free(s)


def _slots_on_two_shards(client: KDAClient) -> list[str]:
    """New slots, allocated one at a time until the last one lies on another shard than
    the first (placement takes the emptiest shard, which earlier tests' leftovers may
    make the same one several times); at most the pool's slots."""
    held = client.alloc(1)
    while shard_of(held[-1]) == shard_of(held[0]):
        assert len(held) < client.info()["num_slots"], "every new slot went to one shard"
        held += client.alloc(1)
    return held


def test_a_prefix_alloc_over_the_pools_slots_is_400(cluster: Cluster, client: KDAClient,
                                                    gen: torch.Generator) -> None:
    """POST /slots with a prefix and a count above the whole pool's slots is the single
    server's 400 naming ``count`` (not 503), whether an entry matches or not; nothing is
    allocated."""
    slot = client.alloc(1)[0]
    for layer in range(LAYERS):
        client.prefill(layer, [(slot, *make_sequence(4, gen))])
    client.publish(slot, "review-capacity")
    info = client.info()
    for prefix in (["review-capacity"], ["review-nowhere"]):
        r = httpx.post(f"{cluster.url}/slots", json={"count": info["num_slots"] + 1, "prefix": prefix}, timeout=60)
        assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json", r.text
        assert r.json()["field"] == "count", r.json()
    assert client.info()["used_slots"] == info["used_slots"]
    assert client.drop_prefix("review-capacity") is True
    client.free(slot)


def test_a_shards_503_keeps_its_problem_and_retry_after(cluster: Cluster, client: KDAClient) -> None:
    """A fork on a full shard is the shard's PoolFull: 503 with Retry-After and the problem's
    members, through the ingress as from a single server."""
    free = {r["shard"]: r["free_slots"] for r in httpx.get(f"{cluster.url}/shards").json()["shards"]}
    mine = client.alloc(sum(free.values()))
    r = httpx.post(f"{cluster.url}/slots/{mine[0]}/fork", timeout=60)
    assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json", r.text
    assert r.headers.get("retry-after", "").isdigit() and r.json()["type"].endswith(":pool-full"), r.headers
    assert (r.json()["requested"], r.json()["free"]) == (1, 0)
    r = httpx.post(f"{cluster.url}/slots", json={"count": 1})
    assert r.status_code == 503 and r.headers.get("retry-after", "").isdigit()
    for s in mine:
        client.free(s)


def test_bodies_at_the_size_limit(cluster: Cluster, client: KDAClient, gen: torch.Generator) -> None:
    """A body of exactly --max-body-mb passes the ingress (and Serve's proxy) whole; one byte
    more is 413 and changes nothing."""
    from service.wire.state import encode_state_json

    slot = client.alloc(1)[0]
    state = torch.randn(LAYERS, HV, V, K, generator=gen)
    doc = bytes(encode_state_json(state))
    limit = MAX_BODY_MB * 2**20
    body = doc + b" " * (limit - len(doc))
    headers = {"content-type": "application/json"}
    r = httpx.put(f"{cluster.url}/slots/{slot}/state", content=body, headers=headers, timeout=60)
    assert r.status_code == 204, r.text
    assert torch.equal(client.get_state(slot), state)
    r = httpx.put(f"{cluster.url}/slots/{slot}/state", content=b" " + body, headers=headers, timeout=60)
    assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json"
    assert torch.equal(client.get_state(slot), state)
    client.free(slot)


def test_metrics_and_probes_through_the_ingress(cluster: Cluster, client: KDAClient) -> None:
    """/metrics counts a prefix miss made through the ingress; the probes answer."""
    def misses() -> float:
        text = httpx.get(f"{cluster.url}/metrics", timeout=60).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kda_prefix_misses_total"))
    assert httpx.get(f"{cluster.url}/health/live").json() == {"status": "live"}
    assert httpx.get(f"{cluster.url}/health/ready").status_code == 200
    before = misses()
    got = [client.alloc(prefix=["review-miss"]) for _ in range(4)]  # two ingress replicas: each counts
    assert all(g.matched == 0 for g in got)
    for _ in range(10):  # each page is one replica's count: over a few pages both are seen
        if misses() >= before + 2:
            break
    else:
        raise AssertionError(f"prefix misses stayed at {misses()} (from {before})")
    for g in got:
        client.free(g.slots[0])
