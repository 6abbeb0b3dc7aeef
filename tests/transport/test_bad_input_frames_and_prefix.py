"""Bad input against one live kda-serve (framed socket, prefix cache of 64
MB, gRPC): the framed socket's PREPARE / RUN / RELEASE and raw frames, the prefix cache's
HTTP routes, and the KServe v2 ``checkpoints`` / ``prefix`` parameters. Every refusal must
be a 4xx in the surface's own error form, the process must serve on, and the slots (state
and token counts, `pool_image`), the free-slot count and the prefix cache must be as before."""
from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import quote

import httpx
import pytest
import torch
import tritonclient.grpc as gc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype
from transport_helpers import (
    GEOMETRY_ARGS, HV, K, LAYERS, SLOTS, V, Region, Server, dumps, make_sequence, pool_image, shm_request, start_server,
)
from server_harness import metric

from kda_client.framed import FramedExchange
from kda_client.small import Response
from service.wire.frames import MAX_FRAME, PREPARED_ID, Op, request_frame, split_reply
from service.wire.schema import PREFIX_DROPPED_HEADER

NAMES = ("q", "k", "v", "g", "beta")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's server: framed socket, a 64 MB prefix cache, a 1 s body timeout, gRPC."""
    tmp = tmp_path_factory.mktemp("bad-input")
    s = start_server([*GEOMETRY_ARGS, "--framed-socket", str(tmp / "kda.sock"), "--prefix-cache-mb", "64",
                      "--body-timeout-s", "1"], tmp / "kda.log", grpc=True)
    yield s
    assert s.stop() == 0, s.log_text()[-5000:]


@pytest.fixture(scope="module")
def sock_path(srv: Server) -> str:
    return str(srv.log.parent / "kda.sock")


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def region(srv: Server) -> Iterator[Region]:
    r = Region(1 << 20)
    assert httpx.post(f"{srv.url}/shm/regions", json=r.registration()).status_code == 201
    yield r
    httpx.delete(f"{srv.url}/shm/regions/{r.name}")
    r.unlink()


@pytest.fixture(scope="module")
def victims(srv: Server) -> list[str]:
    """Two slots holding random states and tokens on layer 0 (5 and 3): what a refusal must
    leave alone."""
    gen = torch.Generator().manual_seed(11)
    with httpx.Client(base_url=srv.url) as c:
        slots = c.post("/slots", json={"count": 2}).json()["slots"]
    from kda_client.client import KDAClient
    with KDAClient(srv.url) as client:
        for slot, n in zip(slots, (5, 3)):
            client.put_state(slot, torch.randn(LAYERS, HV, V, K, generator=gen) * 0.3)
            client.prefill(0, [(slot, *make_sequence(n, gen))])
    return slots


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def frames(sock_path: str) -> Iterator[FramedExchange]:
    exchange = FramedExchange(sock_path, None, 30)
    yield exchange
    exchange.close()


# ----------------------------------------------------------------------------- helpers


def _image(srv: Server, http: httpx.Client, slots: list[str]) -> dict[str, Any]:
    """`pool_image` plus the prefix cache's entry count and the held prepared prefills."""
    image = pool_image(srv.url, slots)
    page = http.get("/metrics").text
    image["prefix_entries"] = metric(page, "kda_prefix_entries", tier="device") + metric(
        page, "kda_prefix_entries", tier="host")
    image["prepared"] = metric(page, "kda_prepared_prefills")
    return image


def _alive(srv: Server, http: httpx.Client) -> None:
    assert srv.process.poll() is None, srv.log_text()[-3000:]
    assert http.get("/health/live").status_code == 200


def _problem(answer: Response, statuses: tuple[int, ...], field: Optional[str] = None) -> dict[str, Any]:
    """A framed refusal: one of ``statuses``, an RFC 9457 problem naming ``field`` (when given)."""
    problem = json.loads(answer.body)
    assert answer.status in statuses and problem["status"] == answer.status, (answer.status, problem)
    assert problem["type"].startswith("urn:kda-serve:problem:") and problem["detail"], problem
    if field is not None:
        assert problem.get("field") == field, problem
    return problem


def _http_problem(r: httpx.Response, statuses: tuple[int, ...], field: Optional[str] = None) -> dict[str, Any]:
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    problem = r.json()
    assert problem["status"] == r.status_code and problem["detail"], problem
    if field is not None:
        assert problem.get("field") == field, problem
    return problem


def _raw(path: str, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def _read_reply(s: socket.socket) -> tuple[int, str, bytes]:
    """The next reply, read exactly (never into the one after it: replies to frames sent
    together may arrive in one piece)."""
    (size,) = struct.unpack(">I", _read_exactly(s, 4))
    return split_reply(_read_exactly(s, size))


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "the server closed the connection before its reply"
        data += chunk
    return data


def _prepared_id(answer: Response) -> bytes:
    assert answer.status == 201, answer.body
    return PREPARED_ID.pack(json.loads(answer.body)["prepared"])


def _seqs(gen: torch.Generator, lengths: tuple[int, ...] = (5, 3)) -> list[tuple[torch.Tensor, ...]]:
    return [make_sequence(n, gen) for n in lengths]


# ----------------------------------------------------------------------------- framed: documents


def _edit(case: str, doc: dict[str, Any], region: Region, slots: list[str]) -> None:
    out = doc["outputs"]
    if case == "outputs missing":
        del doc["outputs"]
    elif case == "outputs.o missing":
        del out["o"]
    elif case == "final_state missing":
        del out["final_state"]
    elif case == "duplicate slots":
        doc["sequences"][1]["slot"] = slots[0]
    elif case == "zero-length sequence":
        doc["sequences"][1]["length"] = 0
    elif case == "negative length":
        doc["sequences"][1]["length"] = -3
    elif case == "huge length":
        doc["sequences"][1]["length"] = 1 << 62
    elif case == "o in an unknown region":
        out["o"]["region"] = "no-such-region"
    elif case == "final_state in an unknown region":
        out["final_state"]["region"] = "no-such-region"
    elif case == "input past the region":
        doc["q"]["shm"]["offset"] = region.size
    elif case == "input offset 2^70":
        doc["q"]["shm"]["offset"] = 1 << 70
    elif case == "o byte_size 2^64":
        out["o"]["byte_size"] = 1 << 64
    elif case == "o too small":
        out["o"]["byte_size"] -= 4
    elif case == "final_state past the region":
        out["final_state"]["offset"] = region.size - 8
    elif case == "offset a string":
        doc["k"]["shm"]["offset"] = "0"
    elif case == "negative offset":
        doc["k"]["shm"]["offset"] = -64
    elif case == "int32 dtype":
        doc["v"]["dtype"] = "int32"
    elif case == "byte_size off by one":
        doc["beta"]["shm"]["byte_size"] += 1
    elif case == "rank-0 shape":
        doc["beta"]["shape"] = []
    elif case == "layer out of range":
        doc["layer"] = LAYERS
    elif case == "slot not a string":
        doc["sequences"][0]["slot"] = 5
    elif case == "sequences an object":
        doc["sequences"] = {"slot": slots[0], "length": 5}
    elif case == "no sequences":
        doc["sequences"] = []
    elif case == "more sequences than slots":
        doc["sequences"] = [{"slot": f"s{i}", "length": 1} for i in range(SLOTS + 1)]
    elif case == "A_log in an unknown region":
        doc["A_log"] = {"dtype": "float32", "shape": [HV], "shm": {"region": "nope", "offset": 0, "byte_size": 4 * HV}}
    elif case == "scale 0":
        doc["scale"] = 0.0
    elif case == "lower_bound out of range":
        doc["lower_bound"] = -100.0
    elif case == "unknown field":
        doc["bogus"] = 1
    else:
        raise AssertionError(case)


DOC_CASES = {  # case: (statuses, field)
    "outputs missing": ((422,), None),
    "outputs.o missing": ((422,), None),
    "final_state missing": ((400,), "outputs.final_state"),
    "duplicate slots": ((400,), "sequences[1].slot"),
    "zero-length sequence": ((400,), "sequences[1].length"),
    "negative length": ((400,), "sequences[1].length"),
    "huge length": ((400,), None),
    "o in an unknown region": ((400,), "shared_memory_region"),
    "final_state in an unknown region": ((400,), "shared_memory_region"),
    "input past the region": ((400,), "q.shm"),
    "input offset 2^70": ((400,), "q.shm"),
    "o byte_size 2^64": ((400,), "outputs.o"),
    "o too small": ((400,), "outputs.o"),
    "final_state past the region": ((400,), "outputs.final_state"),
    "offset a string": ((422,), None),
    "negative offset": ((422,), None),
    "int32 dtype": ((422,), None),
    "byte_size off by one": ((400,), "beta.shm.byte_size"),
    "rank-0 shape": ((400,), "beta.shm.byte_size"),
    "layer out of range": ((400,), "layer"),
    "slot not a string": ((422,), None),
    "sequences an object": ((422,), None),
    "no sequences": ((422,), None),
    "more sequences than slots": ((400,), None),
    "A_log in an unknown region": ((400,), "shared_memory_region"),
    "scale 0": ((400,), "scale"),
    "lower_bound out of range": ((400,), "lower_bound"),
    "unknown field": ((422,), None),
}


@pytest.mark.parametrize("op", [Op.PREPARE, Op.PREFILL], ids=["prepare", "prefill"])
@pytest.mark.parametrize("case", sorted(DOC_CASES))
def test_framed_bad_documents_are_problems_and_change_nothing(srv, http, frames, region, victims, gen, case, op):
    doc = shm_request(region, victims, _seqs(gen))
    _edit(case, doc, region, victims)
    before = _image(srv, http, victims)
    statuses, field = DOC_CASES[case]
    _problem(frames.request(op, dumps(doc)), statuses, field)
    assert frames.request(Op.PING, b"").status == 200  # the connection serves on
    assert _image(srv, http, victims) == before
    _alive(srv, http)


@pytest.mark.parametrize("payload, status", [
    (b"", 400), (b"\xff\xfe", 400), (b"[]", 422), (b"null", 422), (b"{}", 422), (b"[" * 400_000 + b"]" * 400_000, 400),
], ids=["empty", "not utf-8", "array", "null", "empty object", "deep nesting"])
@pytest.mark.parametrize("op", [Op.PREPARE, Op.PREFILL], ids=["prepare", "prefill"])
def test_framed_payloads_that_are_no_document(srv, http, frames, victims, op, payload, status):
    before = _image(srv, http, victims)
    _problem(frames.request(op, payload), (status,))
    assert frames.request(Op.PING, b"").status == 200
    assert _image(srv, http, victims) == before
    _alive(srv, http)


@pytest.mark.parametrize("name, value", [("A_log", "nan"), ("A_log", "inf"), ("dt_bias", "nan"), ("dt_bias", "-inf")])
def test_a_non_finite_gate_is_refused_at_prepare(srv, http, frames, region, victims, gen, name, value):
    """A_log and dt_bias are read once, at PREPARE: a NaN or Inf there is its 400, not a
    prepared prefill whose every run would be refused (or worse)."""
    doc = shm_request(region, victims, [make_sequence(n, gen, raw_gate=True) for n in (5, 3)])
    A_log, dt_bias = torch.rand(HV, generator=gen), torch.randn(HV, K, generator=gen)
    (A_log if name == "A_log" else dt_bias).view(-1)[1] = float(value)
    doc["A_log"], doc["dt_bias"] = region.put(region.size - 8192, A_log), region.put(region.size - 4096, dt_bias)
    before = _image(srv, http, victims)
    problem = _problem(frames.request(Op.PREPARE, dumps(doc)), (400,), name)
    assert "non-finite" in problem["detail"]
    assert _image(srv, http, victims) == before


# ----------------------------------------------------------------------------- framed: RUN / RELEASE


@pytest.mark.parametrize("case", ["k nan", "v -inf", "g nan", "beta -inf"])
def test_a_run_with_non_finite_k_v_g_or_beta_changes_nothing(srv, http, frames, region, gen, case):
    """The existing suite covers q and beta +inf; the other packed inputs the same way."""
    slots = http.post("/slots", json={"count": 2}).json()["slots"]
    try:
        prepared = _prepared_id(frames.request(Op.PREPARE, dumps(shm_request(region, slots, _seqs(gen)))))
        assert frames.request(Op.RUN, prepared).status == 200
        bad = [list(s) for s in _seqs(gen)]
        name, value = case.split()
        bad[1][NAMES.index(name)].view(-1)[2] = float(value)
        shm_request(region, slots, bad)
        before = _image(srv, http, slots)
        _problem(frames.request(Op.RUN, prepared), (400,), name)
        assert _image(srv, http, slots) == before
        assert frames.request(Op.RELEASE, prepared).status == 204
    finally:
        for s in slots:
            http.delete(f"/slots/{s}")


@pytest.mark.parametrize("payload, status", [
    (b"", 400), (b"\x00\x00\x01", 400), (b"\x00\x00\x00\x01\x00", 400), (b"\x00" * 8, 400),
    (PREPARED_ID.pack(0), 404), (PREPARED_ID.pack(0xFFFFFFFF), 404),
], ids=["empty", "3 bytes", "5 bytes", "8 bytes", "id 0", "id 2^32-1"])
@pytest.mark.parametrize("op", [Op.RUN, Op.RELEASE], ids=["run", "release"])
def test_run_and_release_with_bad_ids_leave_the_held_prefill_alone(srv, http, frames, region, gen, op, payload, status):
    slots = http.post("/slots", json={"count": 2}).json()["slots"]
    try:
        prepared = _prepared_id(frames.request(Op.PREPARE, dumps(shm_request(region, slots, _seqs(gen)))))
        assert frames.request(Op.RUN, prepared).status == 200
        before = _image(srv, http, slots)
        _problem(frames.request(op, payload), (status,))
        assert _image(srv, http, slots) == before
        assert frames.request(Op.RUN, prepared).status == 200  # still held, still runs
        assert frames.request(Op.RELEASE, prepared).status == 204
    finally:
        for s in slots:
            http.delete(f"/slots/{s}")


def test_a_run_after_its_slot_was_freed_and_its_row_reused_changes_no_one(srv, http, frames, region, gen):
    """Free a prepared slot, then allocate new slots (which take the freed rows): the RUN is
    a 404 naming the freed slot, and the new slots stay zero with no tokens."""
    slots = http.post("/slots", json={"count": 2}).json()["slots"]
    prepared = _prepared_id(frames.request(Op.PREPARE, dumps(shm_request(region, slots, _seqs(gen)))))
    assert frames.request(Op.RUN, prepared).status == 200
    assert http.delete(f"/slots/{slots[0]}").status_code == 204
    fresh = http.post("/slots", json={"count": 4}).json()["slots"]
    before = _image(srv, http, fresh + slots[1:])
    problem = _problem(frames.request(Op.RUN, prepared), (404,))
    assert slots[0] in problem["detail"]
    assert _image(srv, http, fresh + slots[1:]) == before
    for s in fresh:
        assert http.get(f"/slots/{s}").json()["tokens_per_layer"] == [0] * LAYERS
    assert frames.request(Op.RELEASE, prepared).status == 204
    for s in fresh + slots[1:]:
        http.delete(f"/slots/{s}")


def test_a_run_after_its_region_was_replaced_under_the_same_name(srv, http, frames, gen):
    """Unregister the prepared prefill's region and register another object under its name:
    the RUN is refused (400, shared_memory_region), nothing changes, and writes nothing into
    the new object; RELEASE still answers 204."""
    old, new = Region(1 << 20), Region(1 << 20)
    slots = http.post("/slots", json={"count": 2}).json()["slots"]
    try:
        assert http.post("/shm/regions", json=old.registration()).status_code == 201
        prepared = _prepared_id(frames.request(Op.PREPARE, dumps(shm_request(old, slots, _seqs(gen)))))
        assert frames.request(Op.RUN, prepared).status == 200
        assert http.delete(f"/shm/regions/{old.name}").status_code == 204
        assert http.post("/shm/regions", json=new.registration(name=old.name)).status_code == 201
        new.memory.fill_(7)
        before = _image(srv, http, slots)
        _problem(frames.request(Op.RUN, prepared), (400,), "shared_memory_region")
        assert _image(srv, http, slots) == before
        assert bool((new.memory == 7).all()), "the refused run wrote into the new object"
        assert frames.request(Op.RELEASE, prepared).status == 204
        _alive(srv, http)
    finally:
        http.delete(f"/shm/regions/{old.name}")
        old.unlink()
        new.unlink()
        for s in slots:
            http.delete(f"/slots/{s}")


def test_prepared_runs_at_unaligned_offsets_equal_prefills(srv, http, frames, region, gen):
    """Every tensor at an odd byte offset (allowed: the document names bytes): a RUN writes
    the same o and final states, and leaves the same slot states, as a PREFILL of the same
    document on twin slots, bit for bit."""
    seqs = _seqs(gen, (7, 1, 4))
    slots, twins = (http.post("/slots", json={"count": 3}).json()["slots"] for _ in range(2))
    doc: dict[str, Any] = {"layer": 1, "sequences": [{"slot": s, "length": int(x[0].shape[0])}
                                                    for s, x in zip(slots, seqs)]}
    offset = 3
    for i, name in enumerate(NAMES):
        raw = torch.cat([x[i] for x in seqs]).contiguous().view(-1).view(torch.uint8)
        region.memory[offset:offset + raw.numel()].copy_(raw)
        doc[name] = {"dtype": "float32", "shape": list(torch.cat([x[i] for x in seqs]).shape),
                     "shm": {"region": region.name, "offset": offset, "byte_size": raw.numel()}}
        offset += raw.numel() + 5
    T, N = sum(int(x[0].shape[0]) for x in seqs), len(seqs)
    o_size, f_size = T * HV * V * 4, N * HV * V * K * 4
    doc["outputs"] = {"o": {"region": region.name, "offset": offset, "byte_size": o_size},
                      "final_state": {"region": region.name, "offset": offset + o_size + 1, "byte_size": f_size}}
    out_bytes = lambda: region.memory[offset:offset + o_size + 1 + f_size].clone()  # noqa: E731
    try:
        prepared = _prepared_id(frames.request(Op.PREPARE, dumps(doc)))
        assert frames.request(Op.RUN, prepared).status == 200
        ran = out_bytes()
        twin = dict(doc, sequences=[dict(s, slot=t) for s, t in zip(doc["sequences"], twins)])
        assert frames.request(Op.PREFILL, dumps(twin)).status == 200
        assert torch.equal(out_bytes(), ran)
        for a, b in zip(slots, twins):
            assert http.get(f"/slots/{a}/state").content == http.get(f"/slots/{b}/state").content
            assert http.get(f"/slots/{a}").json()["tokens_per_layer"] == http.get(f"/slots/{b}").json()["tokens_per_layer"]
        assert frames.request(Op.RELEASE, prepared).status == 204
    finally:
        for s in slots + twins:
            http.delete(f"/slots/{s}")


def test_the_257th_prepared_prefill_is_refused_and_a_closed_connection_releases_all(srv, http, sock_path, region,
                                                                                   gen):
    slot = http.post("/slots", json={"count": 1}).json()["slots"]
    doc = dumps(shm_request(region, slot, [make_sequence(1, gen)]))
    held = lambda: metric(http.get("/metrics").text, "kda_prepared_prefills")  # noqa: E731
    start = held()
    exchange = FramedExchange(sock_path, None, 30)
    try:
        ids = [_prepared_id(exchange.request(Op.PREPARE, doc)) for _ in range(256)]
        before = _image(srv, http, slot)
        _problem(exchange.request(Op.PREPARE, doc), (400,))
        assert _image(srv, http, slot) == before and held() == start + 256
        assert exchange.request(Op.RELEASE, ids[100]).status == 204
        _prepared_id(exchange.request(Op.PREPARE, doc))  # room for one again
    finally:
        exchange.close()
    deadline = time.monotonic() + 20
    while held() != start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() == start
    http.delete(f"/slots/{slot[0]}")


# ----------------------------------------------------------------------------- framed: raw frames


def test_a_stalled_frame_head_has_its_connection_closed(srv, http, sock_path):
    with _raw(sock_path, timeout=4) as s:
        s.sendall(b"\x00\x00")  # half of a frame's length, then nothing
        started = time.monotonic()
        try:
            closed = s.recv(16) == b""
        except socket.timeout:
            closed = False
        assert closed and time.monotonic() - started < 4, "the server still holds the stalled connection"
    _alive(srv, http)


def test_a_frame_length_that_lies_short(srv, http, sock_path, victims):
    """A PING announcing 1 byte followed by 4 more: those 4 are the next frame's length
    (0x61626364, over 1 MiB): a 413, then the connection is closed; nothing changed."""
    before = _image(srv, http, victims)
    with _raw(sock_path) as s:
        s.sendall(struct.pack(">I", 1) + bytes([Op.PING]) + b"abcd")
        assert _read_reply(s)[0] == 200
        status, _, body = _read_reply(s)
        assert status == 413 and json.loads(body)["status"] == 413
        assert s.recv(16) == b""
    assert _image(srv, http, victims) == before
    _alive(srv, http)


def test_a_frame_of_exactly_the_limit_is_read_and_answered(srv, http, sock_path, victims):
    before = _image(srv, http, victims)
    with _raw(sock_path) as s:
        s.sendall(struct.pack(">I", MAX_FRAME) + bytes([Op.PREPARE]) + b" " * (MAX_FRAME - 1))
        status, _, body = _read_reply(s)
        assert status == 400 and json.loads(body)["type"].endswith("malformed-body")
        s.sendall(request_frame(Op.PING, b""))
        assert _read_reply(s)[0] == 200
    assert _image(srv, http, victims) == before


def test_frames_after_a_half_close_are_answered(srv, http, sock_path):
    with _raw(sock_path) as s:
        s.sendall(request_frame(Op.PING, b"") + request_frame(255, b"") + request_frame(Op.RUN, b"\x00"))
        s.shutdown(socket.SHUT_WR)
        assert [_read_reply(s)[0] for _ in range(3)] == [200, 400, 400]
        assert s.recv(16) == b""
    _alive(srv, http)


def test_an_api_key_guards_every_op(tmp_path: Path, gen):
    """With --api-key: PREFILL, PREPARE, RUN, RELEASE before AUTH are each 401 (the
    connection stays open), AUTH with an empty payload or the key plus a newline is 401,
    and nothing changes; a frame too large before AUTH is still a 413."""
    key = "probe-key"
    path = str(tmp_path / "kda.sock")
    s = start_server([*GEOMETRY_ARGS, "--framed-socket", path, "--api-key", key], tmp_path / "kda.log")
    headers = {"Authorization": f"Bearer {key}"}
    r = Region(1 << 20)
    try:
        with httpx.Client(base_url=s.url, headers=headers) as h:
            assert h.post("/shm/regions", json=r.registration()).status_code == 201
            slots = h.post("/slots", json={"count": 2}).json()["slots"]
            doc = dumps(shm_request(r, slots, _seqs(gen)))
            before = pool_image(s.url, slots, headers)
            with _raw(path) as sock:
                for op, payload in ((Op.PREFILL, doc), (Op.PREPARE, doc), (Op.RUN, PREPARED_ID.pack(1)),
                                    (Op.RELEASE, PREPARED_ID.pack(1)), (Op.AUTH, b""), (Op.AUTH, key.encode() + b"\n"),
                                    (Op.PREPARE, doc)):
                    sock.sendall(request_frame(op, payload))
                    status, _, body = _read_reply(sock)
                    assert status == 401 and json.loads(body)["status"] == 401, (op, body)
                sock.sendall(struct.pack(">I", MAX_FRAME + 1))
                assert _read_reply(sock)[0] == 413
            assert pool_image(s.url, slots, headers) == before
            assert metric(h.get("/metrics").text, "kda_prepared_prefills") == 0
            assert h.get("/health/live").status_code == 200
    finally:
        r.unlink()
        assert s.stop() == 0


# ----------------------------------------------------------------------------- prefix cache over HTTP


@pytest.fixture(scope="module")
def published(srv: Server, victims: list[str]) -> str:
    """A complete entry "probe.good" (a slot with 7 tokens in every layer)."""
    gen = torch.Generator().manual_seed(5)
    from kda_client.client import KDAClient
    with KDAClient(srv.url) as client:
        slot = client.alloc(1)[0]
        for layer in range(LAYERS):
            client.prefill(layer, [(slot, *make_sequence(7, gen))])
        client.publish(slot, "probe.good")
        client.free(slot)
    return "probe.good"


ALLOC_CASES = {  # body: (statuses, field)
    "prefix a string": ({"count": 1, "prefix": "probe.good"}, (422,), None),
    "prefix an object": ({"count": 1, "prefix": {"probe.good": 1}}, (422,), None),
    "prefix of ints": ({"count": 1, "prefix": [1]}, (422,), None),
    "prefix of nulls": ({"count": 1, "prefix": [None]}, (422,), None),
    "prefix key of 129": ({"count": 1, "prefix": ["probe.good", "x" * 129]}, (400,), "prefix[1]"),
    "prefix count 0": ({"count": 0, "prefix": ["probe.good"]}, (422,), None),
    "prefix count over the pool": ({"count": SLOTS + 1, "prefix": ["probe.good"]}, (400,), "count"),
    "prefix count 10^20": ({"count": 10 ** 20, "prefix": ["probe.good"]}, (400,), "count"),
    "prefix count a string": ({"count": "1", "prefix": ["probe.good"]}, (422,), None),
    "prefix unknown field": ({"count": 1, "prefix": ["probe.good"], "x": 1}, (422,), None),
}


@pytest.mark.parametrize("case", sorted(ALLOC_CASES))
def test_bad_prefix_allocations_change_nothing(srv, http, victims, published, case):
    body, statuses, field = ALLOC_CASES[case]
    before = _image(srv, http, victims)
    _http_problem(http.post("/slots", json=body), statuses, field)
    assert _image(srv, http, victims) == before
    _alive(srv, http)


def test_prefix_lists_empty_or_long_allocate_one_zero_slot(srv, http, published):
    """`prefix: []` and 50 000 keys (none stored but the last) are answered promptly, each
    with exactly one slot; the long list matches its last key."""
    free = http.get("/info").json()["free_slots"]
    r = http.post("/slots", json={"count": 1, "prefix": []})
    assert r.status_code == 201 and r.json()["prefix"] == {"matched": 0, "key": None, "tokens": 0}
    started = time.monotonic()
    keys = [f"probe.absent.{i}" for i in range(50_000)] + [published]
    r2 = http.post("/slots", json={"count": 1, "prefix": keys})
    assert time.monotonic() - started < 5
    assert r2.status_code == 201 and r2.json()["prefix"] == {"matched": 50_001, "key": published, "tokens": 7}
    assert http.get("/info").json()["free_slots"] == free - 2
    for s in r.json()["slots"] + r2.json()["slots"]:
        assert http.delete(f"/slots/{s}").status_code == 204


PUBLISH_CASES = {  # body: (statuses, field)
    "key an int": ({"key": 1}, (422,), None),
    "key null": ({"key": None}, (422,), None),
    "key of 129": ({"key": "x" * 129}, (400,), "key"),
    "key empty": ({"key": ""}, (400,), "key"),
    "no key": ({}, (422,), None),
    "unknown field": ({"key": "probe.x", "x": 1}, (422,), None),
    "body a list": (["probe.x"], (422,), None),
}


@pytest.mark.parametrize("case", sorted(PUBLISH_CASES))
def test_bad_publish_bodies_change_nothing(srv, http, victims, case):
    body, statuses, field = PUBLISH_CASES[case]
    before = _image(srv, http, victims)
    _http_problem(http.post(f"/slots/{victims[0]}/publish", json=body), statuses, field)
    assert _image(srv, http, victims) == before
    assert http.get("/prefix/probe.x").status_code == 404


def test_publish_of_an_unknown_slot_and_of_unequal_layers(srv, http, victims):
    before = _image(srv, http, victims)
    _http_problem(http.post("/slots/" + "s" * 5000 + "/publish", json={"key": "probe.y"}), (404,))
    problem = _http_problem(http.post(f"/slots/{victims[0]}/publish", json={"key": "probe.y"}), (409,))
    assert problem["type"].endswith("prefix-conflict")  # layer 0 holds 5 tokens, layer 1 none
    assert _image(srv, http, victims) == before
    assert http.get("/prefix/probe.y").status_code == 404


@pytest.mark.parametrize("path, method, status, field", [
    ("/prefix/", "GET", 404, None), ("/prefix/", "DELETE", 400, "key"),
    ("/prefix/%2F", "GET", 404, None), ("/prefix/a%2Fb%2F", "GET", 404, None),
    ("/prefix/%00", "GET", 404, None), ("/prefix/%FF", "GET", 404, None),
    ("/prefix/" + "x" * 129, "GET", 404, None), ("/prefix/" + "%F0%9F%98%80" * 129, "DELETE", 400, "key"),
])
def test_odd_prefix_paths(srv, http, victims, published, path, method, status, field):
    before = _image(srv, http, victims)
    _http_problem(http.request(method, path), (status,), field)
    assert _image(srv, http, victims) == before
    assert http.get(f"/prefix/{published}").json()["complete"]


def test_publish_with_a_lone_surrogate_key_is_a_4xx_and_stores_nothing(srv, http, victims, published):
    slot = http.post("/slots", json={"count": 1}).json()["slots"][0]
    before = _image(srv, http, victims + [slot])
    r = http.post(f"/slots/{slot}/publish", content=b'{"key": "\\ud800review"}',
                  headers={"content-type": "application/json"})
    try:
        _http_problem(r, (400, 422))
        assert _image(srv, http, victims + [slot]) == before
    finally:
        _alive(srv, http)
        http.delete(f"/slots/{slot}")


# ----------------------------------------------------------------------------- KServe v2 parameters


def _v2_doc(gen: torch.Generator, params: dict[str, Any], T: int = 3) -> bytes:
    seq = make_sequence(T, gen)
    return json.dumps({"inputs": [{"name": n, "shape": list(t.shape), "datatype": "FP32",
                                   "data": t.reshape(-1).tolist()} for n, t in zip(NAMES, seq)],
                       "parameters": params}).encode()


V2_CASES = {
    "checkpoints null": {"checkpoints": "null"},
    "checkpoints an object": {"checkpoints": '{"offset": 3, "key": "probe.v2"}'},
    "checkpoints of numbers": {"checkpoints": "[1, 2]"},
    "checkpoint without key": {"checkpoints": '[{"offset": 3}]'},
    "checkpoint extra field": {"checkpoints": '[{"offset": 3, "key": "probe.v2", "x": 1}]'},
    "checkpoint offset NaN": {"checkpoints": '[{"offset": NaN, "key": "probe.v2"}]'},
    "checkpoint offset Infinity": {"checkpoints": '[{"offset": Infinity, "key": "probe.v2"}]'},
    "checkpoint offset float": {"checkpoints": '[{"offset": 3.0, "key": "probe.v2"}]'},
    "checkpoint offset bool": {"checkpoints": '[{"offset": true, "key": "probe.v2"}]'},
    "checkpoint offset 10^30": {"checkpoints": '[{"offset": 1000000000000000000000000000000, "key": "probe.v2"}]'},
    "checkpoint key of 129": {"checkpoints": json.dumps([{"offset": 3, "key": "x" * 129}])},
    "checkpoint key twice": {"checkpoints": '[{"offset": 3, "key": "probe.v2"}, {"offset": 3, "key": "probe.v2"}]'},
    "prefix a bare string": {"prefix": "probe.good"},
    "prefix an object": {"prefix": '{"probe.good": 1}'},
    "prefix key empty": {"prefix": '[""]'},
    "prefix key of 129": {"prefix": json.dumps(["x" * 129])},
    "prefix a bool": {"prefix": True},
    "prefix not json": {"prefix": "[probe.good"},
}
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("params", [pytest.param(p, id=k) for k, p in V2_CASES.items()] + [
    pytest.param({"checkpoints": DEEP}, id="checkpoints deeply nested"),
    pytest.param({"prefix": DEEP}, id="prefix deeply nested"),
])
def test_v2_bad_prefix_parameters_are_400s_that_change_nothing(srv, http, victims, published, gen, params):
    before = _image(srv, http, victims)
    r = http.post("/v2/models/kda/infer", content=_v2_doc(gen, {"sequence_id": 4242, "sequence_start": True, **params}))
    assert r.status_code == 400, r.text[:300]
    assert set(r.json()) == {"error"} and r.json()["error"]
    assert _image(srv, http, victims) == before
    assert http.get("/prefix/probe.v2").status_code == 404
    _alive(srv, http)


def _grpc_tensors(gen: torch.Generator) -> list[gc.InferInput]:
    inputs = []
    for name, t in zip(NAMES, make_sequence(3, gen)):
        x = gc.InferInput(name, list(t.shape), np_to_triton_dtype(t.numpy().dtype))
        x.set_data_from_numpy(t.numpy())
        inputs.append(x)
    return inputs


@pytest.mark.parametrize("params", [
    pytest.param({"checkpoints": '{"offset": 3}'}, id="checkpoints an object"),
    pytest.param({"prefix": '[""]'}, id="prefix key empty"),
    pytest.param({"checkpoints": DEEP}, id="checkpoints deeply nested"),
])
def test_grpc_bad_prefix_parameters_are_invalid_argument(srv, http, victims, published, gen, params):
    before = _image(srv, http, victims)
    client = gc.InferenceServerClient(srv.grpc)
    try:
        with pytest.raises(InferenceServerException) as e:
            client.infer("kda", _grpc_tensors(gen), sequence_id=4343, sequence_start=True, parameters=params)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT", (e.value.status(), e.value.message())
    finally:
        client.close()
    assert _image(srv, http, victims) == before
    _alive(srv, http)


def test_a_prefix_match_on_a_lone_surrogate_key_neither_500s_nor_leaks_a_slot(srv, http, gen):
    bad = json.dumps([{"offset": 3, "key": "\ud801review"}])  # ASCII JSON with a \\ud801 escape
    for layer in range(LAYERS):  # a complete entry: the same sequence's checkpoint in every layer
        params = {"sequence_id": 4444, "layer": layer, "checkpoints": bad, "sequence_start": layer == 0}
        r = http.post("/v2/models/kda/infer", content=_v2_doc(gen, params))
        assert r.status_code in (200, 400), r.text[:300]
    free = http.get("/info").json()["free_slots"]
    r = http.post("/slots", content=b'{"count": 1, "prefix": ["\\ud801review"]}',
                  headers={"content-type": "application/json"})
    try:
        assert r.status_code < 500, r.text[:300]
        made = len(r.json().get("slots", [])) if r.status_code == 201 else 0
        assert http.get("/info").json()["free_slots"] == free - made
        for s in r.json().get("slots", []) if r.status_code == 201 else []:
            http.delete(f"/slots/{s}")
    finally:
        _alive(srv, http)


@pytest.mark.parametrize("key", ["line\nbreak", "a/b\n/c", "\u00e9\n"])
def test_a_key_with_newlines_or_slashes_is_named_by_its_routes(srv, http, key):
    """Any valid key names its entry in ``/prefix/{key}`` (percent-encoded): published,
    found by GET, dropped by DELETE (204, the header saying it was there), then gone (404
    unknown-prefix, not the router's not-found)."""
    gen = torch.Generator().manual_seed(9)
    from kda_client.client import KDAClient
    with KDAClient(srv.url) as client:
        slot = client.alloc(1)[0]
        for layer in range(LAYERS):
            client.prefill(layer, [(slot, *make_sequence(3, gen))])
        client.publish(slot, key)
        client.free(slot)
    path = "/prefix/" + quote(key, safe="")
    got = http.get(path)
    assert got.status_code == 200 and got.json()["key"] == key and got.json()["tokens"] == 3
    dropped = http.delete(path)
    assert dropped.status_code == 204 and dropped.headers[PREFIX_DROPPED_HEADER] == "true"
    gone = http.get(path)
    assert gone.status_code == 404 and gone.json()["type"].endswith("unknown-prefix")
