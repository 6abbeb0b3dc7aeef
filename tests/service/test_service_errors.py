"""Every refusal of the HTTP contract: the status, an RFC 9457 problem naming the field,
and the pool unchanged (each live slot's export bit for bit, and the free-slot count)."""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from server_harness import (
    MAX_BODY_MB, H, HV, K, LAYERS, SLOTS, V, make_sequence, make_victims, metric, pool_image, random_state,
    wait_for,
)

from kda_client.client import KDAClient, PoolFullError
from service.wire.safetensors_codec import encode_safetensors
from service.wire.tensors import tensor_to_json

ST = "application/x-safetensors"
JSON = "application/json"


@pytest.fixture(scope="module")
def victims(server) -> list[str]:
    """Three live slots with random state and recorded tokens; the last one is freed again
    (a freed id must be refused like an unknown one)."""
    return make_victims(server.url, torch.Generator().manual_seed(7), layer=0)


@dataclass
class Ctx:
    slots: list[str]  # three live slots, then a freed one
    gen: torch.Generator

    def tensors(self, lengths=(6, 3), **replace: torch.Tensor) -> dict[str, torch.Tensor]:
        seq = make_sequence(sum(lengths), self.gen)
        out = dict(zip(("q", "k", "v", "g", "beta"), seq))
        out.update(replace)
        return out

    def request(self, lengths=(6, 3), slots=None, **options: Any) -> dict[str, Any]:
        slots = slots if slots is not None else self.slots[:len(lengths)]
        return {"layer": 0, "sequences": [{"slot": s, "length": n} for s, n in zip(slots, lengths)], **options}

    def json_body(self, request: Optional[dict] = None, **tensors: torch.Tensor) -> bytes:
        doc = {**(request or self.request()), **{n: tensor_to_json(t) for n, t in self.tensors(**tensors).items()}}
        return json.dumps(doc).encode()

    def st_body(self, request: Optional[dict] = None, tensors: Optional[dict] = None, **replace) -> bytes:
        tensors = tensors if tensors is not None else self.tensors(**replace)
        return bytes(encode_safetensors(tensors, {"request": json.dumps(request or self.request())}))


def raw_safetensors(header: Any, data: bytes = b"", header_len: Optional[int] = None) -> bytes:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(text) if header_len is None else header_len) + text + data


def nan_at(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


def _prefill_json(body: Callable[[Ctx], bytes]) -> Callable[[Ctx], tuple]:
    return lambda c: ("POST", "/prefill", {"content-type": JSON}, body(c))


def _prefill_st(body: Callable[[Ctx], bytes]) -> Callable[[Ctx], tuple]:
    return lambda c: ("POST", "/prefill", {"content-type": ST}, body(c))


def _with_data(c: Ctx, name: str, data: str) -> bytes:
    doc = json.loads(c.json_body())
    doc[name]["data"] = data
    return json.dumps(doc).encode()


def _tensor_json(c: Ctx, name: str, **fields: Any) -> bytes:
    doc = json.loads(c.json_body())
    doc[name].update(fields)
    return json.dumps(doc).encode()


F32_16 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
BAD = {
    # malformed bodies: 400
    "json-syntax": (_prefill_json(lambda c: b'{"layer": 0,'), 400, "malformed-body", None),
    "json-bad-base64": (_prefill_json(lambda c: _with_data(c, "q", "!" * len(json.loads(c.json_body())["q"]["data"]))),
                        400, "malformed-body", "q"),
    "json-base64-length": (_prefill_json(lambda c: _with_data(c, "v", "AAAA")), 400, "malformed-body", "v"),
    "json-bytes-vs-shape": (_prefill_json(lambda c: _tensor_json(c, "k", shape=[9, H, K + 1])), 400,
                            "malformed-body", "k"),
    "st-truncated": (_prefill_st(lambda c: c.st_body()[:-10]), 400, "malformed-body", None),
    "st-shorter-than-length": (_prefill_st(lambda c: b"\x01\x02"), 400, "malformed-body", None),
    "st-header-past-end": (_prefill_st(lambda c: raw_safetensors({"q": F32_16}, b"\0" * 16, header_len=10**6)),
                           400, "malformed-body", None),
    "st-header-over-cap": (_prefill_st(lambda c: raw_safetensors({}, header_len=1 << 40)), 400, "malformed-body", None),
    "st-header-not-json": (_prefill_st(lambda c: raw_safetensors(b"\xff{not json")), 400, "malformed-body", None),
    "st-header-not-object": (_prefill_st(lambda c: raw_safetensors([1, 2])), 400, "malformed-body", None),
    "st-overlap": (_prefill_st(lambda c: raw_safetensors(
        {"q": F32_16, "k": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24)),
        400, "malformed-body", "k"),
    "st-offsets-out-of-range": (_prefill_st(lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)), 400, "malformed-body", "q"),
    "st-dtype-vs-bytes": (_prefill_st(lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-shape-2^40": (_prefill_st(lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 16]}}, b"\0" * 16)),
        400, "malformed-body", "q"),
    "st-negative-dim": (_prefill_st(lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-unknown-dtype": (_prefill_st(lambda c: raw_safetensors(
        {"q": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-no-request": (_prefill_st(lambda c: bytes(encode_safetensors(c.tensors()))), 400, "malformed-body",
                      "__metadata__.request"),
    "st-request-not-json": (_prefill_st(lambda c: bytes(encode_safetensors(c.tensors(), {"request": "{"}))),
                            400, "malformed-body", "__metadata__.request"),
    # schema errors: 422
    "json-not-object": (_prefill_json(lambda c: b"[1, 2]"), 422, "schema-error", None),
    "json-missing-q": (_prefill_json(lambda c: json.dumps({k: v for k, v in json.loads(c.json_body()).items()
                                                           if k != "q"}).encode()), 422, "schema-error", None),
    "json-unknown-member": (_prefill_json(lambda c: c.json_body(c.request(use_qk_l2_norm=True))), 422,
                            "schema-error", None),
    "json-layer-as-string": (_prefill_json(lambda c: c.json_body({**c.request(), "layer": "0"})), 422,
                             "schema-error", None),
    "json-negative-shape": (_prefill_json(lambda c: _tensor_json(c, "q", shape=[-9, H, K])), 422, "schema-error", None),
    "json-no-sequences": (_prefill_json(lambda c: c.json_body({**c.request(), "sequences": []})), 422,
                          "schema-error", None),
    "json-scale-nan": (_prefill_json(lambda c: c.json_body(c.request()).replace(b'"layer": 0', b'"layer": 0, "scale": NaN')),
                       422, "schema-error", None),
    "st-missing-beta": (_prefill_st(lambda c: c.st_body(tensors={k: v for k, v in c.tensors().items() if k != "beta"})),
                        422, "schema-error", None),
    "st-extra-tensor": (_prefill_st(lambda c: c.st_body(tensors={**c.tensors(), "junk": torch.ones(2)})), 422,
                        "schema-error", None),
    "st-request-schema": (_prefill_st(lambda c: c.st_body({**c.request(), "layer": 0.5})), 422, "schema-error", None),
    # well-formed but wrong: 400
    "q-int-dtype": (_prefill_json(lambda c: c.json_body(q=torch.ones(9, H, K, dtype=torch.int32))), 400,
                    "invalid-request", "q"),
    "q-head-dim": (_prefill_st(lambda c: c.st_body(q=torch.randn(9, H, K + 1))), 400, "invalid-request", "q"),
    "q-heads-not-dividing": (_prefill_st(lambda c: c.st_body(q=torch.randn(9, 3, K), k=torch.randn(9, 3, K))), 400,
                             "invalid-request", "q"),
    "k-shape": (_prefill_st(lambda c: c.st_body(k=torch.randn(9, H * 2, K))), 400, "invalid-request", "k"),
    "v-heads": (_prefill_st(lambda c: c.st_body(v=torch.randn(9, HV * 2, V))), 400, "invalid-request", "v"),
    "v-tokens": (_prefill_st(lambda c: c.st_body(v=torch.randn(8, HV, V))), 400, "invalid-request", "v"),
    "g-rank": (_prefill_st(lambda c: c.st_body(g=-torch.rand(9, HV * K))), 400, "invalid-request", "g"),
    "beta-shape": (_prefill_st(lambda c: c.st_body(beta=torch.rand(9, HV, 1))), 400, "invalid-request", "beta"),
    "lengths-not-summing": (_prefill_st(lambda c: c.st_body(c.request(lengths=(6, 4)))), 400, "invalid-request",
                            "sequences"),
    "zero-length": (_prefill_st(lambda c: c.st_body(c.request(lengths=(9, 0)))), 400, "invalid-request",
                    "sequences[1].length"),
    "negative-length": (_prefill_st(lambda c: c.st_body(c.request(lengths=(10, -1)))), 400, "invalid-request",
                        "sequences[1].length"),
    "layer-too-big": (_prefill_st(lambda c: c.st_body({**c.request(), "layer": LAYERS})), 400, "invalid-request",
                      "layer"),
    "layer-negative": (_prefill_st(lambda c: c.st_body({**c.request(), "layer": -1})), 400, "invalid-request", "layer"),
    "slot-twice": (_prefill_st(lambda c: c.st_body(c.request(slots=[c.slots[1], c.slots[1]]))), 400,
                   "invalid-request", "sequences[1].slot"),
    "more-sequences-than-slots": (_prefill_st(lambda c: c.st_body(c.request(lengths=(1,) * (SLOTS + 1),
                                                                            slots=[None] * (SLOTS + 1)),
                                                                  lengths=(1,) * (SLOTS + 1))),
                                  400, "invalid-request", "sequences"),
    "nan-q": (_prefill_st(lambda c: c.st_body(q=nan_at(c.tensors()["q"], float("nan")))), 400, "invalid-request", "q"),
    "inf-k": (_prefill_json(lambda c: c.json_body(k=nan_at(c.tensors()["k"], float("inf")))), 400,
              "invalid-request", "k"),
    "neg-inf-v": (_prefill_st(lambda c: c.st_body(v=nan_at(c.tensors()["v"], -float("inf")))), 400,
                  "invalid-request", "v"),
    "inf-g": (_prefill_st(lambda c: c.st_body(g=nan_at(c.tensors()["g"], -float("inf")))), 400, "invalid-request", "g"),
    "nan-beta": (_prefill_json(lambda c: c.json_body(beta=nan_at(c.tensors()["beta"], float("nan")))), 400,
                 "invalid-request", "beta"),
    "nan-bf16-q": (_prefill_st(lambda c: c.st_body(tensors={**{n: t.bfloat16() for n, t in c.tensors().items()},
                                                            "q": nan_at(c.tensors()["q"], float("nan")).bfloat16()})),
                   400, "invalid-request", "q"),
    "nan-A_log": (_prefill_st(lambda c: c.st_body(tensors={**c.tensors(), "A_log": nan_at(torch.zeros(HV), float("nan"))})),
                  400, "invalid-request", "A_log"),
    "A_log-shape": (_prefill_st(lambda c: c.st_body(tensors={**c.tensors(), "A_log": torch.zeros(HV + 1)})), 400,
                    "invalid-request", "A_log"),
    "dt_bias-alone": (_prefill_st(lambda c: c.st_body(tensors={**c.tensors(), "dt_bias": torch.zeros(HV, K)})), 400,
                      "invalid-request", "dt_bias"),
    "lower_bound-below": (_prefill_st(lambda c: c.st_body(c.request(lower_bound=-6.0))), 400, "invalid-request",
                          "lower_bound"),
    "lower_bound-zero": (_prefill_st(lambda c: c.st_body(c.request(lower_bound=0.0))), 400, "invalid-request",
                         "lower_bound"),
    "scale-negative": (_prefill_json(lambda c: c.json_body(c.request(scale=-1.0))), 400, "invalid-request", "scale"),
    # slots
    "unknown-slot": (_prefill_st(lambda c: c.st_body(c.request(lengths=(3, 3, 3), slots=[c.slots[0], "nope", None]))),
                     404, "unknown-slot", None),
    "freed-slot": (_prefill_json(lambda c: c.json_body(c.request(slots=[None, c.slots[3]]))), 404, "unknown-slot", None),
    "get-unknown": (lambda c: ("GET", "/slots/nope", {}, None), 404, "unknown-slot", None),
    "delete-freed": (lambda c: ("DELETE", f"/slots/{c.slots[3]}", {}, None), 404, "unknown-slot", None),
    "fork-unknown": (lambda c: ("POST", "/slots/nope/fork", {}, None), 404, "unknown-slot", None),
    "get-state-unknown": (lambda c: ("GET", "/slots/nope/state", {}, None), 404, "unknown-slot", None),
    "alloc-zero": (lambda c: ("POST", "/slots", {"content-type": JSON}, b'{"count": 0}'), 422, "schema-error", None),
    "alloc-string": (lambda c: ("POST", "/slots", {"content-type": JSON}, b'{"count": "2"}'), 422, "schema-error", None),
    "alloc-over-capacity": (lambda c: ("POST", "/slots", {"content-type": JSON},
                                       json.dumps({"count": SLOTS + 1}).encode()), 400, "invalid-request", "count"),
    # state uploads
    "put-unknown": (lambda c: ("PUT", "/slots/nope/state", {"content-type": ST},
                               bytes(encode_safetensors({"state": random_state(c.gen)[0]}))), 404, "unknown-slot", None),
    "put-shape": (lambda c: ("PUT", f"/slots/{c.slots[0]}/state", {"content-type": ST},
                             bytes(encode_safetensors({"state": torch.zeros(LAYERS, HV, K, V)}))), 400,
                  "invalid-request", "state"),
    "put-dtype": (lambda c: ("PUT", f"/slots/{c.slots[0]}/state", {"content-type": JSON},
                             json.dumps({"state": tensor_to_json(random_state(c.gen)[0].bfloat16())}).encode()),
                  400, "invalid-request", "state"),
    "put-nan": (lambda c: ("PUT", f"/slots/{c.slots[1]}/state", {"content-type": ST},
                           bytes(encode_safetensors({"state": nan_at(random_state(c.gen)[0], float("nan"))}))),
                400, "invalid-request", "state"),
    "put-two-tensors": (lambda c: ("PUT", f"/slots/{c.slots[1]}/state", {"content-type": ST},
                                   bytes(encode_safetensors({"state": random_state(c.gen)[0], "x": torch.ones(1)}))),
                        422, "schema-error", None),
    "put-bad-safetensors": (lambda c: ("PUT", f"/slots/{c.slots[1]}/state", {"content-type": ST}, b"\x08" + b"\0" * 9),
                            400, "malformed-body", None),
    "put-json-bad-base64": (lambda c: ("PUT", f"/slots/{c.slots[1]}/state", {"content-type": JSON},
                                       json.dumps({"state": {"dtype": "float32", "shape": [1], "data": "A==="}}).encode()),
                            400, "malformed-body", "state"),
    # media types
    "prefill-text-plain": (lambda c: ("POST", "/prefill", {"content-type": "text/plain"}, c.json_body()), 415,
                           "unsupported-media-type", "Content-Type"),
    "prefill-no-content-type": (lambda c: ("POST", "/prefill", {}, c.st_body()), 415, "unsupported-media-type",
                                "Content-Type"),
    "put-octet-stream": (lambda c: ("PUT", f"/slots/{c.slots[0]}/state", {"content-type": "application/octet-stream"},
                                    b"x"), 415, "unsupported-media-type", "Content-Type"),
    "prefill-accept-html": (lambda c: ("POST", "/prefill", {"content-type": ST, "accept": "text/html"}, c.st_body()),
                            406, "not-acceptable", "Accept"),
    "unknown-route": (lambda c: ("GET", "/nowhere", {}, None), 404, "not-found", None),
    "wrong-method": (lambda c: ("PATCH", "/prefill", {}, None), 405, "method-not-allowed", None),
}


def assert_problem(r: httpx.Response, status: int, slug: str, field: Optional[str]) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["type"] == f"urn:kda-serve:problem:{slug}" and problem["status"] == status
    assert problem["title"] and problem["detail"]
    if field is not None:
        assert problem.get("field") == field, problem
    return problem


@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_and_pool_unchanged(server, victims, gen, case):
    build, status, slug, field = BAD[case]
    method, path, headers, body = build(Ctx(victims, gen))
    before = pool_image(server.url, victims[:3])
    r = httpx.request(method, f"{server.url}{path}", headers=headers, content=body)
    assert_problem(r, status, slug, field)
    assert pool_image(server.url, victims[:3]) == before


def test_problem_details_name_the_shapes_seen(server, victims, gen):
    body = Ctx(victims, gen).st_body(v=torch.randn(9, HV * 2, V))
    r = httpx.post(f"{server.url}/prefill", content=body, headers={"content-type": ST})
    detail = assert_problem(r, 400, "invalid-request", "v")["detail"]
    assert f"[9, {HV * 2}, {V}]" in detail and f"[9, {HV}, {V}]" in detail


def _raw_http(server, head: str, body: bytes = b"") -> bytes:
    """Send a hand-made request, stop sending, and read what comes back."""
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head.encode() + body)
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            chunks.append(data)
            if b"\r\n\r\n" in b"".join(chunks) and b'"status"' in chunks[-1]:
                break
        return b"".join(chunks)


def test_content_length_over_the_limit_is_refused_before_reading(server, victims, gen):
    """A 2 GB Content-Length against the 1 MiB limit: 413 after a few bytes, nothing read."""
    before = pool_image(server.url, victims[:3])
    head = ("POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
            f"Content-Length: {2 << 30}\r\n\r\n")
    reply = _raw_http(server, head, b"\0" * 1000)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"application/problem+json" in reply
    assert b"payload-too-large" in reply
    assert pool_image(server.url, victims[:3]) == before


def test_chunked_body_over_the_limit_is_refused_while_reading(server, victims):
    """No Content-Length: the bytes are counted as they arrive, 413 past the limit."""
    before = pool_image(server.url, victims[:3])
    chunk = b"\0" * 65536
    frames = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(MAX_BODY_MB * 16 + 2))
    head = ("POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    reply = _raw_http(server, head, frames)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"payload-too-large" in reply
    assert pool_image(server.url, victims[:3]) == before


def test_pool_full_is_503_with_retry_after(server, victims, gen):
    with KDAClient(server.url) as c:
        filler = c.alloc(c.info()["free_slots"])
        try:
            before = pool_image(server.url, victims[:3])
            assert before["free_slots"] == 0
            with pytest.raises(PoolFullError) as e:
                c.alloc()
            assert e.value.retry_after == 1 and e.value.problem["type"].endswith(":pool-full")
            with pytest.raises(PoolFullError):
                c.fork(victims[0])
            with pytest.raises(PoolFullError):  # the named slot is not touched either
                c.prefill(0, [(victims[1], *make_sequence(3, gen)), (None, *make_sequence(3, gen))])
            r = httpx.post(f"{server.url}/slots")
            assert_problem(r, 503, "pool-full", None)
            assert r.headers["retry-after"] == "1"
            assert pool_image(server.url, victims[:3]) == before
            c.prefill(0, [(filler[0], *make_sequence(3, gen))])  # named slots still work when full
        finally:
            for slot in filler:
                c.free(slot)


def _send_and_hang_up(server, head: str, body: bytes) -> None:
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head.encode() + body)


def _prefill_count(server, status: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return metric(text, "kda_http_requests_total", route="/prefill", method="POST", status=status)


def test_client_gone_mid_upload_changes_nothing(server, victims, gen):
    before = pool_image(server.url, victims[:3])
    seen = _prefill_count(server, "400")
    body = Ctx(victims, gen).st_body(Ctx(victims, gen).request(slots=[victims[0], None]))
    head = (f"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: {ST}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    _send_and_hang_up(server, head, body[: len(body) // 2])
    assert wait_for(lambda: _prefill_count(server, "400") == seen + 1)  # the server saw it go
    assert pool_image(server.url, victims[:3]) == before


def test_client_gone_before_the_response_frees_the_slots_it_allocated(server, victims, gen):
    """The whole request arrives, then the client hangs up during the batch window: the
    prefill runs, but the new slot nobody will hear of is freed again."""
    free = pool_image(server.url, [])["free_slots"]
    body = Ctx(victims, gen).st_body(Ctx(victims, gen).request(lengths=(9,), slots=[None]), lengths=(9,))
    head = (f"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: {ST}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    seen = _prefill_count(server, "499")
    _send_and_hang_up(server, head, body)
    assert wait_for(lambda: _prefill_count(server, "499") == seen + 1)
    assert pool_image(server.url, [])["free_slots"] == free


def _abandoned(server) -> float:
    return metric(httpx.get(f"{server.url}/metrics").text, "kda_responses_abandoned_total")


@pytest.mark.parametrize("route", ["/slots", "/slots/{victim}/fork"])
def test_client_gone_before_new_slot_ids_arrive_frees_them(server, victims, route):
    """POST /slots (three slots) and a fork, each sent whole and the connection closed at
    once: the slots made for them are freed again (499), as nobody can ever name them."""
    free = pool_image(server.url, [])["free_slots"]
    gone = _abandoned(server)
    body = json.dumps({"count": 3}).encode() if route == "/slots" else b""
    head = (f"POST {route.format(victim=victims[0])} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    _send_and_hang_up(server, head, body)
    assert wait_for(lambda: _abandoned(server) == gone + 1)
    assert pool_image(server.url, [])["free_slots"] == free
