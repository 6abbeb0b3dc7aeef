"""The prefix cache against a real server: checkpoints written by a prefill, slots restored
from the longest complete entry, publish, info and delete; refusals that change nothing;
LRU and budgets, the host tier, concurrency, metrics and the snapshot round trip."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from server_harness import GEOMETRY_ARGS, LAYERS, HV, K, V, make_sequence, metric, pool_image, start_server

from kda_client import BadRequest, KDAClient, KDAError, PrefixAlloc, SlotNotFound

ENTRY_MB = LAYERS * HV * V * K * 4 / (1 << 20)  # one fp32 entry of the test geometry


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _layers(gen: torch.Generator, T: int) -> list[tuple[torch.Tensor, ...]]:
    return [make_sequence(T, gen) for _ in range(LAYERS)]


def _rest(seq: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[start:] for t in seq)


def test_restore_plus_the_rest_equals_an_uninterrupted_prefill_bit_for_bit(client: KDAClient, gen):
    T, cut = 200, 128
    inputs = _layers(gen, T)
    plain, marked = client.alloc(2)
    full_o = []
    for layer, seq in enumerate(inputs):
        full_o.append(client.prefill(layer, [(plain, *seq)]).o_packed)
        out = client.prefill(layer, [(marked, *seq)], checkpoints=[[(cut, "bits.128"), (T, "bits.end")]])
        assert torch.equal(_bits(out.o_packed), _bits(full_o[-1]))  # checkpoints change nothing of the prefill
        info = client.prefix_info("bits.128")
        assert (info["layers"], info["complete"], info["tokens"]) == (layer + 1, layer + 1 == LAYERS, cut)
    whole = client.get_state(plain)
    assert torch.equal(_bits(client.get_state(marked)), _bits(whole))

    restored = client.alloc(prefix=["nothing", "bits.128"])
    assert isinstance(restored, PrefixAlloc)
    assert (restored.matched, restored.key, restored.tokens) == (2, "bits.128", cut)
    (slot,) = restored.slots
    assert client.slot_info(slot)["tokens_per_layer"] == [cut] * LAYERS
    for layer, seq in enumerate(inputs):
        o = client.prefill(layer, [(slot, *_rest(seq, cut))]).o_packed
        assert torch.equal(_bits(o), _bits(full_o[layer][cut:])), layer
    assert torch.equal(_bits(client.get_state(slot)), _bits(whole))

    end = client.alloc(prefix=["bits.128", "bits.end"])  # the longest entry wins
    assert (end.matched, end.tokens) == (2, T)
    assert torch.equal(_bits(client.get_state(end.slots[0])), _bits(whole))
    for s in (plain, marked, slot, *end.slots):
        client.free(s)


def test_checkpoints_on_a_continued_slot_and_in_a_varlen_batch(client: KDAClient, gen):
    a, b = client.alloc(2)
    first = [make_sequence(64, gen) for _ in range(LAYERS)]
    second = [make_sequence(100, gen) for _ in range(LAYERS)]
    other = [make_sequence(70, gen) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        client.prefill(layer, [(a, *first[layer])])
        client.prefill(layer, [(b, *first[layer])])
    for layer in range(LAYERS):
        client.prefill(layer, [(None, *other[layer]), (a, *second[layer])],
                       checkpoints=[[(64, f"v.other.{layer}")], [(128, "v.a.128")]])
        client.prefill(layer, [(b, *(t[:64] for t in second[layer]))])  # b: the same 128 tokens, no checkpoint
    restored = client.alloc(prefix=["v.a.128"])
    assert restored.tokens == 128
    assert torch.equal(_bits(client.get_state(restored.slots[0])), _bits(client.get_state(b)))
    assert client.prefix_info("v.other.0")["complete"] is False  # one layer each: never served
    assert client.alloc(prefix=["v.other.0", "v.other.1"]).matched == 0


def test_an_entry_missing_a_layer_never_matches(client: KDAClient, gen):
    slot = client.alloc()[0]
    client.prefill(0, [(slot, *make_sequence(64, gen))], checkpoints=[[(64, "partial")]])
    assert client.prefix_info("partial")["layers"] == 1
    got = client.alloc(prefix=["partial"])
    assert (got.matched, got.key, got.tokens) == (0, None, 0)
    assert client.slot_info(got.slots[0])["tokens_per_layer"] == [0] * LAYERS
    assert not client.get_state(got.slots[0]).any()


@pytest.mark.parametrize("marks, field", [
    ([(63, "x")], "sequences[0].checkpoints[0].offset"),
    ([(0, "x")], "sequences[0].checkpoints[0].offset"),
    ([(101, "x")], "sequences[0].checkpoints[0].offset"),
    ([(64, "x"), (64, "y")], "sequences[0].checkpoints[1].offset"),
    ([(64, "x"), (100, "x")], "sequences[0].checkpoints[1].key"),
    ([(64, "")], "sequences[0].checkpoints[0].key"),
    ([(64, "k" * 129)], "sequences[0].checkpoints[0].key"),
])
def test_bad_checkpoints_are_refused_with_nothing_changed(client: KDAClient, server, gen, marks, field):
    slot = client.alloc()[0]
    client.prefill(0, [(slot, *make_sequence(10, gen))])  # 10 tokens before: the grid is 10 + 64 j
    marks = [(offset + 10 if offset else 0, key) for offset, key in marks]
    before = pool_image(server.url, [slot])
    with pytest.raises(BadRequest) as e:
        client.prefill(0, [(slot, *make_sequence(100, gen))], checkpoints=[marks])
    assert e.value.status == 400 and e.value.problem["field"] == field
    assert pool_image(server.url, [slot]) == before
    for _, key in marks:
        if key and len(key) <= 128:
            with pytest.raises(SlotNotFound):
                client.prefix_info(key)


def test_the_grid_counts_from_the_slots_tokens_before(client: KDAClient, server, gen):
    slot = client.alloc()[0]
    client.prefill(0, [(slot, *make_sequence(10, gen))])
    before = pool_image(server.url, [slot])
    with pytest.raises(BadRequest):  # 64 is on the grid of a fresh slot, not of one holding 10 tokens
        client.prefill(0, [(slot, *make_sequence(100, gen))], checkpoints=[[(64, "grid")]])
    assert pool_image(server.url, [slot]) == before
    client.prefill(0, [(slot, *make_sequence(100, gen))], checkpoints=[[(74, "grid")]])
    assert client.prefix_info("grid")["tokens"] == 74


def test_publish_info_delete(client: KDAClient, server, gen):
    slot = client.alloc()[0]
    for layer in range(LAYERS):
        client.prefill(layer, [(slot, *make_sequence(30, gen))])
    entry = client.publish(slot, "pub/with/slashes")
    assert {k: entry[k] for k in ("key", "tokens", "layers", "complete", "tier")} == {
        "key": "pub/with/slashes", "tokens": 30, "layers": LAYERS, "complete": True, "tier": "device"}
    assert entry["bytes"] == LAYERS * HV * V * K * 4
    state = client.get_state(slot)
    client.prefill(0, [(slot, *make_sequence(5, gen))])  # the entry is a copy: advancing the slot leaves it
    client.free(slot)
    got = client.alloc(prefix=["pub/with/slashes"])
    assert torch.equal(_bits(client.get_state(got.slots[0])), _bits(state))
    assert client.prefix_info("pub/with/slashes")["key"] == "pub/with/slashes"
    assert client.drop_prefix("pub/with/slashes") is True
    with pytest.raises(SlotNotFound):
        client.prefix_info("pub/with/slashes")
    assert client.alloc(prefix=["pub/with/slashes"]).matched == 0


def test_delete_is_idempotent_and_a_bad_key_is_refused(client: KDAClient, server, gen):
    """DELETE /prefix/{key} answers 204 whether or not the entry exists (the header says
    which); a key no entry can have is a 400 problem+json that drops nothing."""
    _publish_new(client, "del.kept", gen)
    for _ in range(2):
        reply = httpx.delete(f"{server.url}/prefix/never%2Fstored")
        assert (reply.status_code, reply.headers["kda-prefix-dropped"], reply.content) == (204, "false", b"")
    assert client.drop_prefix("never/stored") is False
    reply = httpx.delete(f"{server.url}/prefix/{'x' * 129}")
    assert reply.status_code == 400 and reply.headers["content-type"].startswith("application/problem+json")
    assert reply.json()["field"] == "key"
    with pytest.raises(BadRequest):
        client.drop_prefix("y" * 129)
    assert client.prefix_info("del.kept")["complete"]  # nothing else was dropped
    assert httpx.delete(f"{server.url}/prefix/del.kept").headers["kda-prefix-dropped"] == "true"
    assert client.drop_prefix("del.kept") is False


def test_publish_refusals_change_nothing(client: KDAClient, server, gen):
    slot = client.alloc()[0]
    client.prefill(0, [(slot, *make_sequence(30, gen))])  # layer 1 holds 0 tokens
    before = pool_image(server.url, [slot])
    with pytest.raises(KDAError) as e:
        client.publish(slot, "unequal")
    assert e.value.status == 409 and e.value.problem["type"].endswith("prefix-conflict")
    with pytest.raises(BadRequest) as e:
        client.publish(slot, "")
    assert e.value.status == 400 and e.value.problem["field"] == "key"
    with pytest.raises(SlotNotFound):
        client.publish("no-such-slot", "k")
    assert pool_image(server.url, [slot]) == before
    with pytest.raises(SlotNotFound):
        client.prefix_info("unequal")
    with pytest.raises(BadRequest) as e:
        client.alloc(prefix=["ok", ""])
    assert e.value.problem["field"] == "prefix[1]"
    assert pool_image(server.url, [slot]) == before


def test_metrics_count_hits_misses_and_tokens(client: KDAClient, server, gen):
    page = lambda: httpx.get(f"{server.url}/metrics").text  # noqa: E731
    start = page()
    slot = client.alloc()[0]
    for layer in range(LAYERS):
        client.prefill(layer, [(slot, *make_sequence(20, gen))])
    client.publish(slot, "metrics")
    client.alloc(prefix=["metrics"])
    client.alloc(prefix=["absent"])
    end = page()
    assert metric(end, "kda_prefix_hits_total") - metric(start, "kda_prefix_hits_total") == 1
    assert metric(end, "kda_prefix_misses_total") - metric(start, "kda_prefix_misses_total") == 1
    assert metric(end, "kda_prefix_hit_tokens_total") - metric(start, "kda_prefix_hit_tokens_total") == 20
    assert metric(end, "kda_prefix_entries", tier="device") >= 1
    assert metric(end, "kda_prefix_bytes", tier="device") >= LAYERS * HV * V * K * 4


def test_concurrent_publish_restore_and_delete(server, gen):
    state = None
    with KDAClient(server.url) as c:
        slot = c.alloc()[0]
        for layer in range(LAYERS):
            c.prefill(layer, [(slot, *make_sequence(40, gen))])
        state = c.get_state(slot)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            with KDAClient(server.url) as c:
                for i in range(15):
                    op = (n + i) % 3
                    if op == 0:
                        c.publish(slot, "race")
                    elif op == 1:
                        got = c.alloc(prefix=["race"])
                        if got.matched:
                            assert torch.equal(_bits(c.get_state(got.slots[0])), _bits(state))
                            assert c.slot_info(got.slots[0])["tokens_per_layer"] == [40] * LAYERS
                        c.free(got.slots[0])
                    else:
                        assert c.drop_prefix("race") in (True, False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _publish_new(c: KDAClient, key: str, gen: torch.Generator, tokens: int = 8) -> torch.Tensor:
    slot = c.alloc()[0]
    for layer in range(LAYERS):
        c.prefill(layer, [(slot, *make_sequence(tokens, gen))])
    c.publish(slot, key)
    state = c.get_state(slot)
    c.free(slot)
    return state


def _wait_for_tier(c: KDAClient, key: str, tier: str, timeout_s: float = 10.0) -> None:
    """Until the entry ``key`` is in ``tier`` (a promotion runs after the restore's answer)."""
    deadline = time.monotonic() + timeout_s
    while c.prefix_info(key)["tier"] != tier:
        assert time.monotonic() < deadline, f"{key!r} never reached the {tier} tier"
        time.sleep(0.02)


def test_lru_budget_host_tier_and_snapshot_round_trip(tmp_path, gen):
    snapshot = tmp_path / "pool.safetensors"
    args = [*GEOMETRY_ARGS, "--prefix-cache-mb", str(2 * ENTRY_MB), "--prefix-cache-host-mb", str(ENTRY_MB),
            "--snapshot-path", str(snapshot), "--snapshot-interval-s", "0"]
    srv = start_server(args, tmp_path / "small.log")
    try:
        with KDAClient(srv.url) as c:
            states = {key: _publish_new(c, key, gen) for key in ("a", "b")}
            assert c.alloc(prefix=["a"]).matched == 1  # a use: "b" is now the least recent
            states["c"] = _publish_new(c, "c", gen)  # "b" moves to the host tier
            assert [c.prefix_info(k)["tier"] for k in "abc"] == ["device", "host", "device"]
            got = c.alloc(prefix=["b"])  # restored from the host tier, then moved up ...
            assert torch.equal(_bits(c.get_state(got.slots[0])), _bits(states["b"]))
            _wait_for_tier(c, "b", "device")
            assert [c.prefix_info(k)["tier"] for k in "abc"] == ["host", "device", "device"]  # ... "a" down
            states["d"] = _publish_new(c, "d", gen)  # "c" moves down, the host tier drops "a"
            with pytest.raises(SlotNotFound):
                c.prefix_info("a")
            assert [c.prefix_info(k)["tier"] for k in "bcd"] == ["device", "host", "device"]
            page = httpx.get(f"{srv.url}/metrics").text
            assert metric(page, "kda_prefix_evictions_total", tier="device") == 3
            assert metric(page, "kda_prefix_evictions_total", tier="host") == 1
            assert metric(page, "kda_prefix_bytes", tier="host") == LAYERS * HV * V * K * 4
        assert srv.stop() == 0
        srv = start_server(args, tmp_path / "again.log")
        with KDAClient(srv.url) as c:
            assert [c.prefix_info(k)["tier"] for k in "bcd"] == ["device", "host", "device"]
            for key in "bcd":
                got = c.alloc(prefix=[key])
                assert got.tokens == 8
                assert torch.equal(_bits(c.get_state(got.slots[0])), _bits(states[key]))
    finally:
        srv.stop()


def test_a_server_without_cache_refuses_checkpoints_and_publish(tmp_path, gen):
    srv = start_server([*GEOMETRY_ARGS, "--prefix-cache-mb", "0"], tmp_path / "off.log")
    try:
        with KDAClient(srv.url) as c:
            slot = c.alloc()[0]
            before = pool_image(srv.url, [slot])
            with pytest.raises(KDAError) as e:
                c.prefill(0, [(slot, *make_sequence(64, gen))], checkpoints=[[(64, "k")]])
            assert e.value.status == 409
            with pytest.raises(KDAError) as e:
                c.publish(slot, "k")
            assert e.value.status == 409
            assert pool_image(srv.url, [slot]) == before
            assert c.alloc(prefix=["k"]).matched == 0
    finally:
        srv.stop()


def test_checkpoints_over_shared_memory_store_what_the_binary_path_stores(server, client: KDAClient, gen):
    """The same prefill with checkpoints through the client's POSIX shared memory transport
    (`POST /prefill` naming regions): the entry restores the same state bit for bit as the
    entry the binary request stored, in every layer."""
    T, cut = 150, 64
    inputs = _layers(gen, T)
    via_body, via_shm = client.alloc(2)
    with KDAClient(server.url, transport="shm") as shm:
        for layer, seq in enumerate(inputs):
            client.prefill(layer, [(via_body, *seq)], checkpoints=[[(cut, "shm.body")]])
            shm.prefill(layer, [(via_shm, *seq)], checkpoints=[[(cut, "shm.regions")]])
    assert client.prefix_info("shm.regions")["complete"] and client.prefix_info("shm.body")["complete"]
    restored = [client.alloc(prefix=[key]) for key in ("shm.body", "shm.regions")]
    assert all((r.matched, r.tokens) == (1, cut) for r in restored)
    assert torch.equal(_bits(client.get_state(restored[0].slots[0])), _bits(client.get_state(restored[1].slots[0])))
    for s in (via_body, via_shm, *restored[0].slots, *restored[1].slots):
        client.free(s)
    for key in ("shm.body", "shm.regions"):
        client.drop_prefix(key)
