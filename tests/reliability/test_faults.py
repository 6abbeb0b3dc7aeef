"""Faults against real kda-serve processes: clients that vanish mid-upload and mid-response,
SIGTERM while requests are in flight, and ``kill -9`` followed by a restart on the same
``--snapshot-path`` (the state comes back as of the last snapshot, and a slot that advanced
after it is flagged ``state_lost`` in its metadata and the log, never passed off as current).
"""
from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import httpx
import pytest
import torch
from reliability_helpers import (
    GEOMETRY_ARGS, HV, K, LAYERS, PROBLEM, SLOTS, ST, TOL, V, Server, WholePool, connect, make_sequence, metric, random_state,
    kill_9, read_response, reference, rel, request_head, start_server, wait_for,
)

from kda_client.client import KDAClient, SlotNotFound
from service.wire.prefill import decode_prefill_response
from service.wire.safetensors_codec import encode_safetensors
from state_store import PoolGeometry, snapshot

Seq = tuple[torch.Tensor, ...]


def prefill_body(layer: int, sequences: Sequence[tuple[Optional[str], Seq]]) -> bytes:
    """A safetensors /prefill body: ``sequences`` of (slot or None, (q, k, v, g, beta))."""
    tensors = {name: torch.cat([seq[i] for _, seq in sequences]) for i, name in enumerate(("q", "k", "v", "g", "beta"))}
    request = {"layer": layer, "sequences": [{"slot": slot, "length": seq[0].shape[0]} for slot, seq in sequences]}
    return bytes(encode_safetensors(tensors, {"request": json.dumps(request)}))


def prefill_head(length: Optional[int]) -> bytes:
    framing = ("Content-Length", str(length)) if length is not None else ("Transfer-Encoding", "chunked")
    return request_head("POST", "/prefill", [("Content-Type", ST), framing])


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics").text


def prefill_count(url: str, status: str) -> float:
    return metric(scrape(url), "kda_http_requests_total", route="/prefill", method="POST", status=status)


# -- clients that vanish ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server([*GEOMETRY_ARGS, "--batch-window-ms", "20"], tmp_path_factory.mktemp("faults") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture(scope="module")
def pool(server: Server) -> Iterator[WholePool]:
    """Two live slots with random state: every slot of the module's server."""
    whole = WholePool(server.url)
    gen = torch.Generator().manual_seed(3)
    with KDAClient(server.url) as c:
        slots = c.alloc(2)
        for slot, state in zip(slots, random_state(gen, 2)):
            c.put_state(slot, state)
    whole.add(*slots)
    yield whole
    whole.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("cut", [0.0, 0.5, 0.99])
def test_a_client_gone_mid_upload_changes_nothing(server, pool, gen, framing, cut):
    """A request on a live slot and a new one, cut off after ``cut`` of its body (headers
    only at 0): the server sees the client go (a 400 in its metrics), allocates nothing
    and touches no state."""
    before = pool.image()
    body = prefill_body(0, [(pool.live[0], make_sequence(40, gen)), (None, make_sequence(9, gen))])
    sent = body[: int(len(body) * cut)]
    if framing == "chunked":
        sent = b"%x\r\n" % len(sent) + sent + b"\r\n" if sent else b""
    seen = prefill_count(server.url, "400")
    with connect(server.url) as s:
        s.sendall(prefill_head(len(body) if framing == "content-length" else None) + sent)
        time.sleep(0.05)
    assert wait_for(lambda: prefill_count(server.url, "400") == seen + 1)
    assert pool.image() == before


def test_a_client_gone_mid_response_leaves_no_new_slot_and_no_half_state(server, pool, gen):
    """A live slot continues by 40 tokens and a new slot gets 24k (a 12 MB response); the
    client reads 64 KiB of the answer through a tiny receive window and hangs up. The new
    slot, whose id the client never read in full, is freed; the live slot holds exactly its
    state after the 40 tokens (the launch is all or nothing), and its token count says so."""
    named = pool.live[1]
    with KDAClient(server.url) as c:
        start_state = c.get_state(named)
    seq, big = make_sequence(40, gen), make_sequence(24576, gen)
    body = prefill_body(1, [(named, seq), (None, big)])
    tokens = httpx.get(f"{server.url}/slots/{named}").json()["tokens_per_layer"]
    free = httpx.get(f"{server.url}/info").json()["free_slots"]
    gone = metric(scrape(server.url), "kda_responses_abandoned_total")
    with connect(server.url, timeout=60, rcvbuf=4096) as s:
        s.sendall(prefill_head(len(body)) + body)
        received = b""
        while len(received) < 65536:
            chunk = s.recv(4096)
            assert chunk, "the server closed before answering"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 ")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset on close
    assert wait_for(lambda: metric(scrape(server.url), "kda_responses_abandoned_total") == gone + 1, timeout=30)
    info = httpx.get(f"{server.url}/info").json()
    assert info["free_slots"] == free and info["used_slots"] == len(pool.live)
    with KDAClient(server.url) as c:
        after = c.get_state(named)
    _, final_ref = reference([seq], start_state[1][None])
    assert rel(after[1], final_ref[0]) < TOL and torch.equal(after[0], start_state[0])
    tokens[1] += 40
    assert httpx.get(f"{server.url}/slots/{named}").json()["tokens_per_layer"] == tokens


# -- SIGTERM ---------------------------------------------------------------------------


def test_sigterm_drains_in_flight_requests_writes_a_snapshot_and_exits_0(tmp_path, gen):
    """Six prefills wait in a 2 s batch window when SIGTERM arrives: all six are answered
    (200, equal to the reference), the process snapshots and exits 0, and a restart on the
    same snapshot path has every slot, bit for bit as the responses said."""
    path = tmp_path / "pool.snapshot"
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(path), "--batch-window-ms", "2000", "--snapshot-interval-s", "0",
            "--log-level", "info"]
    srv = start_server(args, tmp_path / "first.log")
    with KDAClient(srv.url) as c:
        named = c.alloc(3)
    seqs = [make_sequence(n, gen) for n in (1, 70, 33, 5, 130, 64)]
    slots: list[Optional[str]] = [*named, None, None, None]
    sockets = [connect(srv.url, timeout=60) for _ in seqs]
    try:
        for s, slot, seq in zip(sockets, slots, seqs):
            body = prefill_body(0, [(slot, seq)])
            s.sendall(prefill_head(len(body)) + body)
        time.sleep(1.0)  # received, and waiting in the batch window for another second
        srv.process.send_signal(signal.SIGTERM)
        replies = [read_response(s) for s in sockets]
    finally:
        for s in sockets:
            s.close()
    assert srv.process.wait(60) == 0, srv.log_text()
    assert "wrote snapshot generation 1" in srv.log_text() and "Traceback" not in srv.log_text()
    finals = {}
    for (status, headers, body), seq in zip(replies, seqs):
        assert status == 200, body[:300]
        got_slots, o, final = decode_prefill_response(bytearray(body), headers["content-type"])
        o_ref, final_ref = reference([seq])
        assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL
        finals[got_slots[0]] = final[0]
    assert set(named) <= set(finals) and len(finals) == 6

    again = start_server(args, tmp_path / "second.log")
    try:
        with KDAClient(again.url) as c:
            assert c.info()["used_slots"] == 6
            for slot, final in finals.items():
                state = c.get_state(slot)
                assert torch.equal(state[0], final) and torch.count_nonzero(state[1]) == 0
                assert not c.slot_info(slot)["state_lost"]
    finally:
        assert again.stop() == 0


# -- kill -9 -----------------------------------------------------------------------------


def test_kill_9_restores_the_last_snapshot_and_flags_what_advanced_after_it(tmp_path, gen):
    """Snapshot at a clean stop; then, on the restarted server, slot b advances, c is
    freed, d gets a new state, e is created and advanced: kill -9. The next restart has a
    and b, d as of the snapshot, b and d flagged state_lost (metadata, log, and a 409 for
    a prefill continuing from them), c freed again, e unknown."""
    path = tmp_path / "pool.snapshot"
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(path), "--snapshot-interval-s", "0"]
    first = start_server(args, tmp_path / "first.log")
    with KDAClient(first.url) as c:
        a, b, c_, d = c.alloc(4)
        snapshot_states = {}
        for slot in (a, b, c_, d):
            snapshot_states[slot] = c.prefill(0, [(slot, *make_sequence(20, gen))]).final_state[0]
    assert first.stop() == 0

    second = start_server(args, tmp_path / "second.log")
    with KDAClient(second.url) as c:
        c.prefill(0, [(b, *make_sequence(7, gen))])
        c.free(c_)
        c.put_state(d, random_state(gen)[0])
        e = c.prefill(0, [(None, *make_sequence(3, gen))]).slots[0]
    kill_9(second)

    third = start_server(args, tmp_path / "third.log")
    try:
        with KDAClient(third.url) as c:
            assert c.info()["used_slots"] == 3
            for slot in (a, b, d):
                assert torch.equal(c.get_state(slot)[0], snapshot_states[slot])
                assert c.slot_info(slot)["tokens_per_layer"] == [20, 0]
            assert not c.slot_info(a)["state_lost"]
            assert c.slot_info(b)["state_lost"] and c.slot_info(d)["state_lost"]
            for slot in (c_, e):
                with pytest.raises(SlotNotFound):
                    c.slot_info(slot)
            c.prefill(0, [(a, *make_sequence(4, gen))])  # a is fine
            r = httpx.post(f"{third.url}/prefill", content=prefill_body(0, [(b, make_sequence(4, gen))]),
                           headers={"content-type": ST})
            assert r.status_code == 409 and r.headers["content-type"] == PROBLEM
            assert r.json()["type"] == "urn:kda-serve:problem:state-lost" and r.json()["slot"] == b
            assert c.get_state(b)[0].equal(snapshot_states[b])  # the refusal changed nothing
            c.put_state(b, random_state(gen)[0])  # a new state clears the flag ...
            assert not c.slot_info(b)["state_lost"]
            c.prefill(0, [(b, *make_sequence(4, gen))])  # ... and the slot serves again
        log = third.log_text()
        assert "flagged state_lost" in log and b in log and d in log and e in log
        assert a not in log.split("flagged state_lost")[1]
    finally:
        assert third.stop() == 0


def snapshot_holds(path: Path, slot: str, layer: int, state: torch.Tensor) -> bool:
    """Whether the snapshot file at ``path`` holds ``slot`` with ``state`` on ``layer``."""
    if not path.exists():
        return False
    read = snapshot.read(path, PoolGeometry(LAYERS, SLOTS, HV, K, V, torch.float32, torch.device("cpu")))
    rows = {info.slot_id: info.row for info in read.slots}
    return slot in rows and torch.equal(read.pool[layer, rows[slot]], state)


def test_periodic_snapshots_survive_kill_9_and_a_late_update_is_never_silently_wrong(tmp_path, gen):
    """With --snapshot-interval-s 0.2: an update followed by a periodic snapshot survives
    kill -9 exactly. An update killed right after its response either made it into a
    snapshot (its state, not flagged) or did not (the snapshot's state, flagged): both are
    honest, and the run checks whichever happened (the journal test above forces the
    second)."""
    path = tmp_path / "pool.snapshot"
    args = [*GEOMETRY_ARGS, "--snapshot-path", str(path), "--snapshot-interval-s", "0.2"]
    srv = start_server(args, tmp_path / "0.log")
    with KDAClient(srv.url) as c:
        out = c.prefill(1, [(None, *make_sequence(50, gen))])
    slot, saved = out.slots[0], out.final_state[0]
    assert wait_for(lambda: snapshot_holds(path, slot, 1, saved), timeout=30)  # a periodic snapshot took it
    kill_9(srv)

    srv = start_server(args, tmp_path / "1.log")
    with KDAClient(srv.url) as c:
        state, info = c.get_state(slot), c.slot_info(slot)
        assert torch.equal(state[1], saved) and not info["state_lost"]
        newer = c.prefill(1, [(slot, *make_sequence(9, gen))]).final_state[0]
    kill_9(srv)  # right after the response: a periodic snapshot may or may not have run

    srv = start_server(args, tmp_path / "2.log")
    try:
        with KDAClient(srv.url) as c:
            state, info = c.get_state(slot), c.slot_info(slot)
        if info["state_lost"]:  # the update missed the snapshot: the old state, flagged
            assert torch.equal(state[1], saved) and slot in srv.log_text()
        else:  # the update made it into a snapshot
            assert torch.equal(state[1], newer)
    finally:
        assert srv.stop() == 0
