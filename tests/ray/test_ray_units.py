"""Units of the sharded deployment that need no Ray cluster: ids, incarnations, the slot
directory, placement, faults and payloads through pickle, metrics, flags, and a
`ShardServer` in this process (moves bit for bit, restarts clean and after a crash)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.serve")  # the ray extra; CI installs it

from ray_helpers import HV, K, LAYERS, ROOT, TOL, V, make_sequence, reference, rel  # noqa: E402

from service.config import Settings  # noqa: E402
from service.errors import InvalidRequest, SchemaError  # noqa: E402
from service.core.metrics import Metrics  # noqa: E402
from service.ray_serve.config import parse_scale_out  # noqa: E402
from service.ray_serve.directory import SlotDirectory  # noqa: E402
from service.ray_serve.errors import ShardFault, SlotGone, SlotMoving  # noqa: E402
from service.ray_serve.ids import SlotName, check_shard_name, parse_slot_id  # noqa: E402
from service.ray_serve.incarnation import Incarnation, ShardFiles  # noqa: E402
from service.ray_serve.metrics import merge_metrics  # noqa: E402
from service.ray_serve.payload import Array, ShardPrefill, SlotCargo, TakeFailed  # noqa: E402
from service.core.inputs import REQUIRED_TENSORS, PrefillParams  # noqa: E402
from service.ray_serve.router import ShardedCore, plan_placement  # noqa: E402
from service.ray_serve.shard import ShardServer  # noqa: E402
from state_store import PoolFull, UnknownSlot  # noqa: E402

SETTINGS = Settings(device="cpu", num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                    batch_window_ms=0.0)


def test_ids_round_trip_and_refuse_other_forms() -> None:
    name = SlotName("shard-3", 1_764_470_000_123, "AbC_-09xyz")
    assert parse_slot_id(str(name)) == name
    for bad in ("", "a.b", "a.b.c.d", "sh ard.1.x", "s.UPPER.x", "s.1.has.dot", "s.1.", 7):
        assert parse_slot_id(bad) is None  # type: ignore[arg-type]
    assert check_shard_name("gpu_7-a") == "gpu_7-a"
    for bad in ("", "a.b", "x" * 33):
        with pytest.raises(ValueError):
            check_shard_name(bad)


def test_incarnation_lost_window() -> None:
    chain = Incarnation(number=100, lost_through=40, earlier=frozenset({7, 39, 40, 60}))
    seen = [chain.lost(n) for n in (0, 7, 38, 39, 40, 41, 60, 100, 101)]
    assert seen == [False, True, False, True, True, False, False, False, False]  # only its own lives are lost
    fresh = Incarnation.fresh(clock=lambda: 5.0)  # no record: any earlier number may be a life, none later
    assert fresh == Incarnation(5000, 4999) and fresh.lost(4999) and not fresh.lost(5000) and not fresh.lost(5001)


def _crash_after_open(state_dir: Path, name: str) -> int:
    """Open an incarnation in another process that then dies without closing it."""
    code = textwrap.dedent(f"""
        import os
        from service.ray_serve.incarnation import ShardFiles
        print(ShardFiles({str(state_dir)!r}, {name!r}).open(5).number, flush=True)
        os._exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return int(out.stdout)


def test_incarnation_record_clean_and_crashed(tmp_path: Path) -> None:
    clock = iter([1.0, 1.0, 3.0, 2.0]).__next__  # the third start's clock runs behind
    files = ShardFiles(str(tmp_path), "s", clock=clock)
    first = files.open(1)
    assert first == Incarnation(1000, 999, frozenset())
    files.close()
    second = ShardFiles(str(tmp_path), "s", clock=clock).open(1)  # after a clean stop: the chain goes on
    assert second == Incarnation(1001, 999, frozenset({1000}))
    # (second never closes: the lock is this process's; a crashed process below)
    crashed = _crash_after_open(tmp_path / "c", "s")
    after = ShardFiles(str(tmp_path / "c"), "s").open(1)
    assert after.number > crashed and after.lost_through == after.number - 1 and after.lost(crashed)
    assert not after.lost(crashed - 1) and not after.lost(0)  # never a life of this shard: never issued here
    record = json.loads((tmp_path / "c" / "s.incarnation.json").read_text())
    assert record["clean"] is False and record["earlier"] == [crashed]


def test_a_successor_waits_for_the_lock(tmp_path: Path) -> None:
    holder = ShardFiles(str(tmp_path), "s")
    holder.open(1)
    with pytest.raises(TimeoutError, match="still held"):
        ShardFiles(str(tmp_path), "s").open(0.2)
    threading.Timer(0.3, holder.close).start()
    started = time.monotonic()
    ShardFiles(str(tmp_path), "s").open(10)
    assert 0.2 < time.monotonic() - started < 5


def test_directory_persists_moves_and_draining(tmp_path: Path) -> None:
    path = str(tmp_path / "dir.json")
    d = SlotDirectory(path)
    d.record("tok", "b.1.t2")
    d.record("tok", "c.2.t3")  # moved again
    d.record("other", "a.1.t9")
    d.set_draining("a", True)
    d.forget("other")
    again = SlotDirectory(path)
    assert again.lookup(["tok", "other", "never"]) == {"tok": "c.2.t3"}
    assert again.origins(["t3", "t2", "t9"]) == {"t3": "tok"}
    assert again.draining() == ["a"]
    assert SlotDirectory(None).lookup(["tok"]) == {}


def test_placement_prefers_the_emptiest_then_spreads() -> None:
    assert plan_placement({"a": 3, "b": 5}, 2) == {"b": 2}
    assert plan_placement({"a": 3, "b": 5}, 7) == {"b": 5, "a": 2}
    assert plan_placement({"a": 4, "b": 4}, 1) == {"a": 1}  # ties by name
    with pytest.raises(PoolFull) as e:
        plan_placement({"a": 1, "b": 2}, 4)
    assert (e.value.requested, e.value.free) == (4, 3)


def test_faults_and_payloads_survive_pickle() -> None:
    for error in (PoolFull(3, 1), UnknownSlot("s.1.x"), SlotGone("s.1.x", "gone"), SlotMoving("s.1.x"),
                  InvalidRequest("bad", field="q"), SchemaError("bad", [{"loc": ["body"]}])):
        back = pickle.loads(pickle.dumps(ShardFault.of(error))).error()
        assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 4, 5).to(dtype)
        assert torch.equal(pickle.loads(pickle.dumps(Array.of(t))).tensor(), t)
        assert torch.equal(Array.of(t[:, 1:3]).tensor(), t[:, 1:3])  # not contiguous: copied once


def test_arrays_travel_out_of_band() -> None:
    """Ray pickles with protocol 5 and a buffer callback: a request's tensor bytes must
    leave as one out-of-band buffer each (copied once into the object store), not inside
    the pickle stream."""
    gen = torch.Generator().manual_seed(3)
    request = _request([None, "a.1.x"], [make_sequence(300, gen), make_sequence(200, gen)])
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(request, protocol=5, buffer_callback=buffers.append)
    tensor_bytes = sum(request.tensors[n].data.nbytes for n in ("q", "k", "v", "g", "beta"))
    assert sum(memoryview(b).nbytes for b in buffers) == tensor_bytes and len(stream) < 4096
    back = pickle.loads(stream, buffers=buffers)
    assert torch.equal(back.tensors["v"].tensor(), request.tensors["v"].tensor())


def test_metrics_merge_labels_shards() -> None:
    ingress, s0 = Metrics(lambda: 0.0), Metrics(lambda: 3.0)
    ingress.requests.labels("/prefill", "POST", "200").inc()
    s0.tokens.inc(7)
    text = merge_metrics(ingress.render(), {"s0": s0.render()}).decode()
    assert 'kda_prefill_tokens_total{shard="s0"} 7.0' in text
    assert 'kda_free_slots{shard="s0"} 3.0' in text
    assert 'kda_http_requests_total{method="POST",route="/prefill",status="200"} 1.0' in text
    assert "kda_prefill_tokens_total{}" not in text  # the ingress has no kernel families


def test_flags_and_environment() -> None:
    settings, scale_out = parse_scale_out(["--shards", "3", "--gpus-per-shard", "0.5"], {"KDA_NUM_SLOTS": "8",
                                                                                        "KDA_STATE_DIR": "/d"})
    assert settings.num_slots == 8 and scale_out.shards == 3 and scale_out.gpus_per_shard == 0.5
    assert scale_out.shard_names == ["shard-0", "shard-1", "shard-2"]
    assert scale_out.directory_path == "/d/kda-serve.directory.json"
    for argv in (["--shards", "0"], ["--snapshot-path", "/x"], ["--shard-prefix", "a.b"], ["--metrics-port", "8002"]):
        with pytest.raises(SystemExit):
            parse_scale_out(argv, {})
    from ray.serve import Application

    from service.ray_serve.deploy import app_builder
    assert isinstance(app_builder({"shards": 2, "gpus_per_shard": 0, "device": "cpu"}), Application)  # serve run


# -- a shard in this process --------------------------------------------------------------

def _request(slots: list, seqs: list) -> ShardPrefill:
    packed = [torch.cat([s[i] for s in seqs]) for i in range(5)]
    return ShardPrefill(slots, [s[0].shape[0] for s in seqs], PrefillParams(layer=0),
                        {name: Array.of(t) for name, t in zip(REQUIRED_TENSORS, packed)})


def _ok(reply: object) -> object:
    assert not isinstance(reply, ShardFault), reply.error() if isinstance(reply, ShardFault) else reply
    return reply


def test_shard_move_is_bit_exact_and_turns_requests_away() -> None:
    async def scenario() -> None:
        source, target = ShardServer("a", SETTINGS, None), ShardServer("b", SETTINGS, None)
        await source.start()
        await target.start()
        gen = torch.Generator().manual_seed(1)
        seq = make_sequence(20, gen)
        result = _ok(await source.prefill(_request([None], [seq])))
        slot = result.slots[0]
        before = _ok(await source.get_state(slot)).tensor().clone()
        # a prefill already inside the shard finishes before the take reads the state
        second = make_sequence(3, gen)
        running = asyncio.ensure_future(source.prefill(_request([slot], [second])))
        await asyncio.sleep(0)
        cargo = _ok(await source.take(slot))
        _ok(await running)
        moving = await source.prefill(_request([slot], [second]))
        assert isinstance(moving, ShardFault) and isinstance(moving.error(), SlotMoving)
        state = cargo.state.tensor()
        assert not torch.equal(state, before)  # the running prefill was in it
        assert cargo.tokens_per_layer == [23, 0]
        new = _ok(await target.put(cargo))
        assert torch.equal(_ok(await target.get_state(new)).tensor(), state)
        assert _ok(await target.slot_info(new)).tokens_per_layer == [23, 0]
        _ok(await source.release(slot))
        gone = await source.slot_info(slot)
        assert isinstance(gone, ShardFault) and isinstance(gone.error(), UnknownSlot)
        assert str(gone.error()) == str(UnknownSlot(slot))  # named by its id, not the pool's token
        failed = await target.put(await source.take(slot))
        assert isinstance(failed, TakeFailed) and isinstance(failed.fault.error(), UnknownSlot)
        full = _ok(await target.alloc(3))
        refused = await target.put(SlotCargo(Array.of(state), [0, 0], False))
        assert isinstance(refused, ShardFault) and isinstance(refused.error(), PoolFull)
        assert len(full) == 3
        await source.close()
        await target.close()

    asyncio.run(scenario())


def test_shard_restarts_clean_and_after_a_crash(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    seq = make_sequence(9, gen)

    async def first_life() -> tuple[str, str, torch.Tensor]:
        shard = ShardServer("a", SETTINGS, str(tmp_path))
        await shard.start()
        kept, freed = _ok(await shard.alloc(2))
        out = _ok(await shard.prefill(_request([kept], [seq])))
        _ok(await shard.free(freed))
        await shard.close()  # clean: last snapshot written
        return kept, freed, out.final_state.tensor().clone()

    kept, freed, final = asyncio.run(first_life())
    assert rel(final, reference([seq])[1]) < TOL

    async def second_life() -> None:
        shard = ShardServer("a", SETTINGS, str(tmp_path))
        await shard.start()
        assert torch.equal(_ok(await shard.get_state(kept)).tensor()[0], final[0])  # restored
        missing = await shard.slot_info(freed)
        assert isinstance(missing, ShardFault) and isinstance(missing.error(), UnknownSlot)  # freed: 404
        await shard.close()

    asyncio.run(second_life())
    # a third life allocates and dies without stopping (another process, os._exit)
    code = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_ray_units import SETTINGS
        from service.ray_serve.shard import ShardServer
        async def main():
            shard = ShardServer("a", SETTINGS, {str(tmp_path)!r})
            await shard.start()
            print((await shard.alloc(1))[0], flush=True)
            os._exit(1)
        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lost = out.stdout.strip()
    assert parse_slot_id(lost) is not None, out.stderr

    async def fourth_life() -> None:
        shard = ShardServer("a", SETTINGS, str(tmp_path))
        await shard.start()
        reply = await shard.check([lost])
        assert isinstance(reply, ShardFault) and isinstance(reply.error(), SlotGone), reply
        assert "stopped without a clean shutdown" in reply.error().detail
        assert _ok(await shard.slot_info(kept)).slot_id  # the snapshot's slots survive the crash
        await shard.close()

    asyncio.run(fourth_life())


def test_ingress_app_keeps_the_api_key_and_body_limit() -> None:
    """The ingress wears the single server's middleware (the routes behind need a cluster)."""
    from fastapi.testclient import TestClient

    from service.ray_serve.ingress import create_ingress_app
    from service.ray_serve.router import ShardedCore

    settings = dataclasses.replace(SETTINGS, api_key="sesame", max_body_mb=0.001)
    core = ShardedCore(settings, {"a": object()}, object())  # type: ignore[dict-item,arg-type]
    with TestClient(create_ingress_app(core, settings)) as http:
        assert http.get("/health/live").json() == {"status": "live"}
        r = http.get("/info")
        assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
        r = http.post("/prefill", content=b"x" * 2048, headers={"authorization": "Bearer sesame",
                                                                 "content-type": "application/json"})
        assert r.status_code == 413
        paths = http.get("/openapi.json", headers={"authorization": "Bearer sesame"}).json()["paths"]
        assert {"/slots/{slot_id}/move", "/shards", "/shards/{name}/drain", "/prefill"} <= set(paths)


def test_the_ingress_gives_request_ids_and_trace_context() -> None:
    """The ingress wears the single server's request id middleware (create_rest_app)."""
    from fastapi.testclient import TestClient

    from service.ray_serve.ingress import create_ingress_app

    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with TestClient(create_ingress_app(_placeholder_core(), SETTINGS)) as http:
        r = http.post("/prefill", content=b"{}", headers={"content-type": "application/vnd.kda.shm+json",
                                                          "x-request-id": "ray-1", "traceparent": parent})
        assert r.status_code == 415 and r.headers["x-request-id"] == "ray-1" and r.json()["request_id"] == "ray-1"
        assert r.headers["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
        assert r.headers["traceparent"] != parent


# -- the ingress's REST routes are the single server's -------------------------------------

def _placeholder_core(settings: Settings = SETTINGS) -> ShardedCore:
    """A `ShardedCore` whose shard and directory links are never called (a call fails)."""
    return ShardedCore(settings, {"a": object()}, object())  # type: ignore[dict-item,arg-type]


def test_sharded_core_implements_the_core_protocol() -> None:
    from route_helpers import assert_core_attributes, assert_implements_core_api

    assert_implements_core_api(ShardedCore)
    assert_core_attributes(_placeholder_core())


def test_the_ingress_mounts_the_single_servers_rest_routes() -> None:
    """Every REST route of the single app is served by the ingress from the same endpoint
    of the same module; the ingress adds only move and the shard routes."""
    from route_helpers import endpoints

    from service.http.app import create_app
    from service.ray_serve.ingress import create_ingress_app

    single = {key: where for key, where in endpoints(create_app(SETTINGS)).items() if not key[1].startswith("/v2")}
    ingress = endpoints(create_ingress_app(_placeholder_core(), SETTINGS))
    assert {key: ingress.get(key) for key in single} == single
    own = {key: where for key, where in ingress.items() if key not in single}
    assert set(own) == {("POST", "/slots/{slot_id}/move"), ("GET", "/shards"), ("POST", "/shards/{name}/drain"),
                        ("POST", "/shards/{name}/resume")}
    assert {module for module, _ in own.values()} == {"service.ray_serve.ingress"}


def test_the_ingress_refuses_shared_memory_with_a_clear_4xx() -> None:
    """No region registry on a sharded deployment: a shared memory /prefill is 415 and the
    region routes 404, each a problem saying so, and no shard is asked anything."""
    from fastapi.testclient import TestClient

    from service.ray_serve.ingress import create_ingress_app

    with TestClient(create_ingress_app(_placeholder_core(), SETTINGS)) as http:
        r = http.post("/prefill", content=b"{}", headers={"content-type": "application/vnd.kda.shm+json"})
        assert r.status_code == 415 and r.headers["content-type"] == "application/problem+json"
        assert "reads no shared memory" in r.json()["detail"]
        for method, path in [("POST", "/shm/regions"), ("GET", "/shm/regions"), ("GET", "/shm/regions/x"),
                             ("DELETE", "/shm/regions/x")]:
            body = {"name": "x", "key": "/x", "byte_size": 8} if method == "POST" else None
            r = http.request(method, path, json=body)
            assert r.status_code == 404 and r.json()["type"].endswith(":shared-memory-unavailable"), (path, r.text)
            assert "reads no shared memory" in r.json()["detail"]


def test_ingress_bodies_reach_serve_as_picklable_bytes() -> None:
    """Serve pickles every ASGI message from the ingress replica to its proxy: the body
    pieces the routes send as memoryviews (uncopied tensor bytes) leave as bytes."""
    from service.ray_serve.ingress import PicklableBodies

    data = torch.arange(12, dtype=torch.float32)
    sent: list[dict] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": memoryview(data.numpy()).cast("B"),  # type: ignore[operator]
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"end", "more_body": False})  # type: ignore[operator]

    async def collect(message: dict) -> None:
        sent.append(message)

    asyncio.run(PicklableBodies(app)({"type": "http"}, None, collect))  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(sent))
    assert [m["type"] for m in back] == ["http.response.start", "http.response.body", "http.response.body"]
    assert isinstance(back[1]["body"], bytes) and back[1]["body"] == data.numpy().tobytes()
    assert back[2]["body"] == b"end" and back[1]["more_body"] and not back[2]["more_body"]
