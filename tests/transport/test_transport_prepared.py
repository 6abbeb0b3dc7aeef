"""Prepared prefills over the framed socket (PREPARE, RUN, RELEASE) against a live server:
each run equals a PREFILL of the same document bit for bit and the float64 reference, step
after step and interleaved with plain prefills of the same slots, journaled as they are (a kill -9 flags
the slots a run advanced after the snapshot); a run with bad values or
on a freed slot or an unregistered region is refused and changes nothing, and the next run
goes on; what PREPARE refuses changes nothing; ids are per connection and never reused; a
connection that ends releases what it prepared; the sync and async clients' `prepare`."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
import pytest
import torch
from transport_helpers import (
    GEOMETRY_ARGS, HV, K, TOL, Region, Server, dumps, make_sequence, pool_image, reference, rel, shm_request,
    start_server,
)
from server_harness import kill_9, metric, wait_for

from kda_client.client import AsyncKDAClient, BadRequest, KDAClient
from kda_client.framed import FramedExchange
from kda_client.small import Response
from service.wire.frames import PREPARED_ID, Op

LENGTHS = (70, 1, 130)  # two chunked sequences around a one-token (recurrent) one


@pytest.fixture
def region(server: Server) -> Iterator[Region]:
    """A registered POSIX shared memory region of 1 MiB."""
    r = Region(1 << 20)
    assert httpx.post(f"{server.url}/shm/regions", json=r.registration()).status_code == 201
    yield r
    httpx.delete(f"{server.url}/shm/regions/{r.name}")
    r.unlink()


@pytest.fixture
def frames(framed_socket: str) -> Iterator[FramedExchange]:
    exchange = FramedExchange(framed_socket, None, 60)
    yield exchange
    exchange.close()


@pytest.fixture
def slots(server: Server) -> Iterator[list[str]]:
    """Three new slots, freed after the test (those still live)."""
    with KDAClient(server.url) as client:
        made = client.alloc(len(LENGTHS))
        yield made
        for slot in made:
            if httpx.get(f"{server.url}/slots/{slot}").status_code == 200:
                client.free(slot)


def _sequences(gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    return [make_sequence(n, gen) for n in LENGTHS]


def _prepare(frames: FramedExchange, doc: dict[str, Any], server: Server) -> bytes:
    """PREPARE ``doc``: the RUN / RELEASE payload of its id."""
    answer = frames.request(Op.PREPARE, dumps(doc))
    assert answer.status == 201, answer.body
    reply = json.loads(answer.body)
    assert reply["slots"] == [s["slot"] for s in doc["sequences"]]
    # the server runs on the GPU where there is one, and captures there
    assert reply["graphed"] == torch.cuda.is_available(), server.log_text()[-3000:]
    return PREPARED_ID.pack(reply["prepared"])


def _outputs(region: Region, doc: dict[str, Any], seqs: Sequence[Sequence[torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """o and the final states where ``doc`` put them."""
    T, N = sum(int(s[0].shape[0]) for s in seqs), len(seqs)
    out = doc["outputs"]
    o = region.get({"dtype": "float32", "shape": [T, *seqs[0][2].shape[1:]], "shm": out["o"]})
    final = region.get({"dtype": "float32", "shape": [N, *seqs[0][2].shape[1:], seqs[0][0].shape[2]],
                        "shm": out["final_state"]})
    return o, final


def _problem(answer: Response, status: int) -> dict[str, Any]:
    problem = json.loads(answer.body)
    assert answer.status == status and problem["status"] == status, problem
    assert problem["type"].startswith("urn:kda-serve:problem:") and problem["detail"]
    return problem


def test_prepared_runs_equal_prefills_and_the_reference(server: Server, frames: FramedExchange, region: Region,
                                                        slots: list[str], gen: torch.Generator) -> None:
    with KDAClient(server.url) as client:
        twins = client.alloc(len(LENGTHS))
    options = dict(use_qk_l2norm=True, use_beta_sigmoid=True)
    prepared = _prepare(frames, shm_request(region, slots, _sequences(gen), **options), server)
    state = None
    for _ in range(3):  # each run starts from the states the last one left
        seqs = _sequences(gen)
        doc = shm_request(region, twins, seqs, **options)  # the new inputs, where the prepared prefill reads them
        assert frames.request(Op.PREFILL, dumps(doc)).status == 200
        o_plain, final_plain = _outputs(region, doc, seqs)
        answer = frames.request(Op.RUN, prepared)
        assert answer.status == 200 and answer.body == b"", answer.body
        assert [p.split(";")[0] for p in answer.headers["server-timing"].split(", ")] == [
            "refill", "rows", "queue", "wait", "settle", "deliver", "total"]
        o_run, final_run = _outputs(region, doc, seqs)
        assert torch.equal(o_run, o_plain) and torch.equal(final_run, final_plain)
        o_ref, state = reference(seqs, initial=state, **options)
        assert rel(o_run, o_ref) < TOL and rel(final_run, state) < TOL
    for slot, n in zip(slots, LENGTHS):
        assert httpx.get(f"{server.url}/slots/{slot}").json()["tokens_per_layer"][0] == 3 * n
    assert frames.request(Op.RELEASE, prepared).status == 204
    with KDAClient(server.url) as client:
        for slot in twins:
            client.free(slot)



def test_a_runs_tokens_are_counted_before_any_later_request_sees_its_slots(
        server: Server, frames: FramedExchange, region: Region, slots: list[str], gen: torch.Generator) -> None:
    """A RUN's reply leaves before the server counts the run's tokens (the run is on the
    event loop): a request sent the moment the reply arrives still sees them counted."""
    prepared = _prepare(frames, shm_request(region, slots, _sequences(gen)), server)
    with httpx.Client(base_url=server.url) as http:
        before = [http.get(f"/slots/{slot}").json()["tokens_per_layer"][0] for slot in slots]
        for run in range(1, 4):
            assert frames.request(Op.RUN, prepared).status == 200
            counts = [http.get(f"/slots/{slot}").json()["tokens_per_layer"][0] for slot in slots]
            assert counts == [b + run * n for b, n in zip(before, LENGTHS)]
    assert frames.request(Op.RELEASE, prepared).status == 204

def test_the_gate_tensors_are_read_once_when_prepared(server: Server, frames: FramedExchange, region: Region,
                                                      slots: list[str], gen: torch.Generator) -> None:
    """A_log and dt_bias of the document are read at PREPARE: bytes changed after it change
    no run (the packed inputs are read anew at every run)."""
    with KDAClient(server.url) as client:
        twins = client.alloc(len(LENGTHS))
    A_log, dt_bias = torch.rand(HV, generator=gen), torch.randn(HV, K, generator=gen)
    seqs = [make_sequence(n, gen, raw_gate=True) for n in LENGTHS]
    doc = shm_request(region, slots, seqs, lower_bound=-5.0)
    doc["A_log"], doc["dt_bias"] = region.put(region.size - 8192, A_log), region.put(region.size - 4096, dt_bias)
    prepared = _prepare(frames, doc, server)
    region.put(region.size - 8192, A_log + 1.0)  # after PREPARE: not what the prepared prefill runs with
    assert frames.request(Op.RUN, prepared).status == 200
    o_run, final_run = _outputs(region, doc, seqs)
    twin = dict(doc, sequences=[dict(s, slot=t) for s, t in zip(doc["sequences"], twins)],
                A_log=region.put(region.size - 12288, A_log))
    assert frames.request(Op.PREFILL, dumps(twin)).status == 200
    o_plain, final_plain = _outputs(region, doc, seqs)
    assert torch.equal(o_run, o_plain) and torch.equal(final_run, final_plain)
    with KDAClient(server.url) as client:
        for slot in twins:
            client.free(slot)


def test_prepared_runs_and_prefills_of_the_same_slots_follow_each_other(
        server: Server, frames: FramedExchange, region: Region, slots: list[str], gen: torch.Generator) -> None:
    prepared = _prepare(frames, shm_request(region, slots, _sequences(gen)), server)
    state = None
    for way in ("run", "prefill", "run"):
        seqs = _sequences(gen)
        doc = shm_request(region, slots, seqs)
        answer = frames.request(Op.RUN, prepared) if way == "run" else frames.request(Op.PREFILL, dumps(doc))
        assert answer.status == 200, answer.body
        o, final = _outputs(region, doc, seqs)
        o_ref, state = reference(seqs, initial=state)
        assert rel(o, o_ref) < TOL and rel(final, state) < TOL, way


@pytest.mark.parametrize("case", ["NaN in q", "Inf in beta", "a growing log decay", "a slot freed",
                                  "its region unregistered", "its object shrank"])
def test_a_refused_run_changes_nothing(server: Server, frames: FramedExchange, region: Region, slots: list[str],
                                       gen: torch.Generator, case: str) -> None:
    seqs = _sequences(gen)
    doc = shm_request(region, slots, seqs)
    prepared = _prepare(frames, doc, server)
    assert frames.request(Op.RUN, prepared).status == 200  # the slots hold states now
    bad = [list(s) for s in _sequences(gen)]
    if case == "NaN in q":
        bad[2][0][5, 0, 1] = float("nan")
    elif case == "Inf in beta":
        bad[0][4][3, 1] = float("inf")
    elif case == "a growing log decay":
        bad[1][3][0, 0, 0] = 0.5
    shm_request(region, slots, bad)
    live = slots[1:] if case == "a slot freed" else slots
    if case == "a slot freed":
        assert httpx.delete(f"{server.url}/slots/{slots[0]}").status_code == 204
    if case == "its region unregistered":
        assert httpx.delete(f"{server.url}/shm/regions/{region.name}").status_code == 204
    if case == "its object shrank":  # on a GPU its graph copies from the pages pinned at PREPARE
        os.truncate(region.path, region.size // 2)
    before = pool_image(server.url, live)
    answer = frames.request(Op.RUN, prepared)
    problem = _problem(answer, {"a slot freed": 404}.get(case, 400))
    if case == "NaN in q" or case == "Inf in beta":
        assert problem["field"] == case.split()[-1] and "non-finite" in problem["detail"]
    if case == "a growing log decay":
        assert problem["field"] == "g" and "0.5" in problem["detail"]
    if case == "its object shrank":
        assert problem["field"] == "shared_memory_region" and "shrank" in problem["detail"], problem
    assert pool_image(server.url, live) == before
    if case in ("a slot freed", "its region unregistered", "its object shrank"):
        return
    after = _sequences(gen)  # good values again: the next run goes on from the states before the refusal
    shm_request(region, slots, after)
    assert frames.request(Op.RUN, prepared).status == 200
    o, final = _outputs(region, doc, after)
    o_ref, final_ref = reference(after, initial=reference(seqs)[1])
    assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL


@pytest.fixture(scope="module")
def in_place_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose pool has no spare rows (``--spare-rows 0``): launches update their rows
    in place, copied first (on a GPU a prepared decode step's kernel saves them as it reads)."""
    folder = tmp_path_factory.mktemp("in-place")
    srv = start_server([*GEOMETRY_ARGS, "--spare-rows", "0", "--framed-socket", str(folder / "kda.sock")],
                       folder / "kda.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def test_a_refused_decode_step_changes_nothing(server: Server, frames: FramedExchange, region: Region,
                                               slots: list[str], gen: torch.Generator) -> None:
    """A prepared decode step writing its new states to spare rows (committed by moving the
    slots' rows): a NaN (400) and an update that diverges (422: v = 3e38 with
    unit-variance k and beta 1 overflows the state) change no slot, and the next step goes
    on from the states before them."""
    _refused_decode_steps_change_nothing(server, frames, region, slots, gen)


def test_a_refused_in_place_decode_step_changes_nothing(in_place_server: Server, gen: torch.Generator) -> None:
    """The same on a pool without spare rows: the rows a refusal writes back were copied
    first (on a GPU by the decode kernel as it reads them)."""
    r = Region(1 << 20)
    assert httpx.post(f"{in_place_server.url}/shm/regions", json=r.registration()).status_code == 201
    exchange = FramedExchange(str(in_place_server.log.parent / "kda.sock"), None, 60)
    try:
        with KDAClient(in_place_server.url) as client:
            made = client.alloc(len(LENGTHS))
            _refused_decode_steps_change_nothing(in_place_server, exchange, r, made, gen)
            for slot in made:
                client.free(slot)
    finally:
        exchange.close()
        httpx.delete(f"{in_place_server.url}/shm/regions/{r.name}")
        r.unlink()


def _refused_decode_steps_change_nothing(server: Server, frames: FramedExchange, region: Region,
                                         slots: list[str], gen: torch.Generator) -> None:
    """Two prepared decode steps on ``slots``, a NaN step and a diverging one between them:
    the refusals change no slot, the second step continues the first."""
    steps = [[make_sequence(1, gen) for _ in LENGTHS] for _ in range(2)]
    prepared = _prepare(frames, shm_request(region, slots, steps[0]), server)
    assert frames.request(Op.RUN, prepared).status == 200
    state = reference(steps[0])[1]
    nan = [[t.clone() for t in s] for s in steps[1]]
    nan[1][0][0, 0, 1] = float("nan")
    huge = [list(s) for s in steps[1]]
    huge[2][1], huge[2][2], huge[2][4] = (torch.randn(1, *huge[2][1].shape[1:], generator=gen),
                                         torch.full_like(huge[2][2], 3e38), torch.ones_like(huge[2][4]))
    for bad, status in ((nan, 400), (huge, 422)):
        shm_request(region, slots, bad)
        before = pool_image(server.url, slots)
        problem = _problem(frames.request(Op.RUN, prepared), status)
        assert problem["field"] == ("q" if status == 400 else "sequences"), problem
        assert pool_image(server.url, slots) == before
    doc = shm_request(region, slots, steps[1])
    assert frames.request(Op.RUN, prepared).status == 200
    o, final = _outputs(region, doc, steps[1])
    o_ref, final_ref = reference(steps[1], initial=state)
    assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL


@pytest.mark.parametrize("case", ["a new slot", "checkpoints", "an unknown slot", "a bad shape", "an unknown region"])
def test_what_prepare_refuses_changes_nothing(server: Server, frames: FramedExchange, region: Region,
                                             slots: list[str], gen: torch.Generator, case: str) -> None:
    seqs = _sequences(gen)
    named: list[Any] = list(slots)
    if case == "a new slot":
        named[1] = None
    elif case == "an unknown slot":
        named[2] = "no-such-slot"
    doc = shm_request(region, named, seqs)
    if case == "checkpoints":
        doc["sequences"][0]["checkpoints"] = [{"offset": 64, "key": "k1"}]
    elif case == "a bad shape":
        doc["g"]["shape"][2] += 1
        doc["g"]["shm"]["byte_size"] = doc["g"]["shm"]["byte_size"] // (doc["g"]["shape"][2] - 1) * doc["g"]["shape"][2]
    elif case == "an unknown region":
        doc["v"]["shm"]["region"] = "nobody"
    before = pool_image(server.url, slots)
    held = metric(httpx.get(f"{server.url}/metrics").text, "kda_prepared_prefills")
    answer = frames.request(Op.PREPARE, dumps(doc))
    problem = _problem(answer, 404 if case == "an unknown slot" else 400)
    want_field = {"a new slot": "sequences[1].slot", "checkpoints": "checkpoints", "a bad shape": "g"}
    if case in want_field:
        assert problem["field"] == want_field[case], problem
    assert pool_image(server.url, slots) == before
    assert metric(httpx.get(f"{server.url}/metrics").text, "kda_prepared_prefills") == held


def test_prepared_ids_are_per_connection_and_never_reused(server: Server, framed_socket: str, region: Region,
                                                          slots: list[str], gen: torch.Generator) -> None:
    doc = shm_request(region, slots, _sequences(gen))
    first = FramedExchange(framed_socket, None, 60)
    second = FramedExchange(framed_socket, None, 60)
    try:
        one = _prepare(first, doc, server)
        assert first.request(Op.RELEASE, one).status == 204
        two = _prepare(first, doc, server)
        assert two != one
        for stale in (one, PREPARED_ID.pack(999)):
            assert _problem(first.request(Op.RUN, stale), 404)["type"].endswith("unknown-prepared")
        _problem(second.request(Op.RUN, two), 404)  # another connection's id
        _problem(first.request(Op.RUN, b"\x00\x01"), 400)  # not an id
        _problem(first.request(Op.RELEASE, one), 404)  # released already
        assert first.request(Op.RUN, two).status == 200
    finally:
        first.close()
        second.close()


def test_a_connection_that_ends_releases_what_it_prepared(server: Server, framed_socket: str, region: Region,
                                                          slots: list[str], gen: torch.Generator) -> None:
    def held() -> float:
        return metric(httpx.get(f"{server.url}/metrics").text, "kda_prepared_prefills")

    before = held()
    exchange = FramedExchange(framed_socket, None, 60)
    for _ in range(2):
        _prepare(exchange, shm_request(region, slots, _sequences(gen)), server)
    assert held() == before + 2
    exchange.close()
    assert wait_for(lambda: held() == before, timeout=30)


def test_client_prepared_runs_equal_prefills_and_the_reference(server: Server, framed_socket: str,
                                                               gen: torch.Generator) -> None:
    """`KDAClient.prepare`: each `run` of packed inputs equals `prefill` of the same inputs
    on twin slots bit for bit and the reference; a refused step raises and changes nothing;
    inputs of other shapes are refused before anything is sent; the region goes with it."""
    regions = {r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()}
    with KDAClient(server.url, transport="shm", framed_socket=framed_socket) as client:
        slots, twins = client.alloc(len(LENGTHS)), client.alloc(len(LENGTHS))
        with client.prepare(0, [(s, *x) for s, x in zip(slots, _sequences(gen))], use_qk_l2norm=True) as prepared:
            state = None
            for _ in range(2):
                seqs = _sequences(gen)
                packed = [torch.cat([s[i] for s in seqs]) for i in range(5)]
                out = prepared.run(*packed)
                want = client.prefill(0, [(t, *x) for t, x in zip(twins, seqs)], use_qk_l2norm=True)
                assert out.slots == slots and out.lengths == list(LENGTHS)
                assert torch.equal(out.o_packed, want.o_packed) and torch.equal(out.final_state, want.final_state)
                assert set(out.server_timing) == {"refill", "rows", "queue", "wait", "settle", "deliver", "total"}
                o_ref, state = reference(seqs, initial=state, use_qk_l2norm=True)
                assert rel(out.o_packed, o_ref) < TOL and rel(out.final_state, state) < TOL
            before = pool_image(server.url, slots)
            packed[0][0, 0, 0] = float("nan")
            with pytest.raises(BadRequest) as refused:
                prepared.run(*packed)
            assert refused.value.problem["field"] == "q"
            assert pool_image(server.url, slots) == before
            with pytest.raises(ValueError, match="as prepared"):
                prepared.run(packed[0][:-1], *packed[1:])
            assert len({r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()} - regions) >= 1
        with pytest.raises(ValueError, match="released"):
            prepared.run(*packed)
        for slot in slots + twins:
            client.free(slot)
    assert {r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()} == regions
    with KDAClient(server.url, transport="shm") as client, pytest.raises(ValueError, match="framed socket"):
        client.prepare(0, [("any", *_sequences(gen)[0])])


def test_async_client_prepared_runs_equal_the_sync_clients(server: Server, framed_socket: str,
                                                           gen: torch.Generator) -> None:
    """`AsyncKDAClient.prepare`: its runs give the sync client's numbers bit for bit, and its
    region goes with it."""
    steps = [_sequences(gen) for _ in range(2)]
    first = _sequences(gen)
    regions = {r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()}

    async def over_asyncio(slots: list[str]) -> list[Any]:
        async with AsyncKDAClient(server.url, transport="shm", framed_socket=framed_socket) as client:
            async with await client.prepare(0, [(s, *x) for s, x in zip(slots, first)]) as prepared:
                return [await prepared.run(*(torch.cat([s[i] for s in seqs]) for i in range(5))) for seqs in steps]

    with KDAClient(server.url, transport="shm", framed_socket=framed_socket) as client:
        a, b = client.alloc(len(LENGTHS)), client.alloc(len(LENGTHS))
        with client.prepare(0, [(s, *x) for s, x in zip(a, first)]) as prepared:
            want = [prepared.run(*(torch.cat([s[i] for s in seqs]) for i in range(5))) for seqs in steps]
        got = asyncio.run(over_asyncio(b))
        for x, y in zip(want, got):
            assert torch.equal(x.o_packed, y.o_packed) and torch.equal(x.final_state, y.final_state)
        for slot in a + b:
            client.free(slot)
    assert {r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()} == regions


def test_prepared_runs_are_journaled_so_a_kill_9_flags_their_slots(tmp_path: Path, gen: torch.Generator) -> None:
    """A RUN advances its slots in place as a prefill does, journaled first: after a
    snapshot at a clean stop, a slot advanced only by a RUN before a ``kill -9`` comes back
    as of the snapshot and flagged state_lost; a slot the RUN did not name stays clean."""
    path, sock = tmp_path / "pool.snapshot", str(tmp_path / "kda.sock")
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(path), "--snapshot-interval-s", "0", "--framed-socket", sock]
    first = start_server(args, tmp_path / "first.log")
    with KDAClient(first.url) as client:
        ran, kept = client.alloc(2)
        saved = {s: client.prefill(0, [(s, *make_sequence(20, gen))]).final_state[0] for s in (ran, kept)}
    assert first.stop() == 0
    second = start_server(args, tmp_path / "second.log")
    region = Region(1 << 20)
    try:
        assert httpx.post(f"{second.url}/shm/regions", json=region.registration()).status_code == 201
        frames = FramedExchange(sock, None, 60)
        prepared = _prepare(frames, shm_request(region, [ran], [make_sequence(5, gen)]), second)
        assert frames.request(Op.RUN, prepared).status == 200
        kill_9(second)
        frames.close()
    finally:
        region.unlink()
    third = start_server(args, tmp_path / "third.log")
    try:
        with KDAClient(third.url) as client:
            assert client.slot_info(ran)["state_lost"] and not client.slot_info(kept)["state_lost"]
            for slot in (ran, kept):
                assert torch.equal(client.get_state(slot)[0], saved[slot])
                assert client.slot_info(slot)["tokens_per_layer"] == [20, 0]
    finally:
        assert third.stop() == 0
