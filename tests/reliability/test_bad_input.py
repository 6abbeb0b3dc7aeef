"""The bad-input matrix against a live server: each refusal is a 4xx RFC 9457 problem and the
*whole* pool (every live slot's export, bit for bit, its state_lost flag, and the free-slot
count) is identical before and after.

The cases of ``tests/service/test_service_errors.py`` (its table ``BAD``) run here again, on
a server these tests alone use, so that the image covers every live slot; ``MORE`` adds the
cases that table lacks. The wire-level cases (Content-Length lies, a 2 GB body against a
1 GB limit, a real over-the-cap safetensors header) follow.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

import pytest
import torch
from reliability_helpers import (
    GEOMETRY_ARGS, HV, JSON, K, LAYERS, PROBLEM, ROOT, ST, V, WholePool, assert_problem, connect, load_module,
    random_state, read_response, request_head, rss_bytes, start_server,
)
from server_harness import make_victims

from service.wire.safetensors_codec import encode_safetensors
from tensor_io.safetensors_format import MAX_REQUEST_HEADER_BYTES
from service.wire.tensors import tensor_to_json

errors = load_module("service_error_cases", ROOT / "tests" / "service" / "test_service_errors.py")
Ctx, raw_safetensors, nan_at = errors.Ctx, errors.raw_safetensors, errors.nan_at
BODY_LIMIT_MB = 1024
BODY_TIMEOUT_S = 1.0

Build = Callable[[Any], tuple[str, str, dict[str, str], Any]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server of the service tests' geometry with a 1 GiB body limit and a 1 s body
    timeout, used by this module alone. SIGTERM must exit 0 with no traceback logged."""
    srv = start_server([*GEOMETRY_ARGS, "--max-body-mb", str(BODY_LIMIT_MB), "--body-timeout-s", str(BODY_TIMEOUT_S)],
                       tmp_path_factory.mktemp("bad-input") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture(scope="module")
def pool(server: Any) -> Iterator[WholePool]:
    whole = WholePool(server.url)
    yield whole
    whole.close()


@pytest.fixture(scope="module")
def victims(server: Any, pool: WholePool) -> list[str]:
    """Three live slots with random state and recorded tokens, then a fourth freed again:
    the slots `Ctx` expects (a freed id must be refused like an unknown one)."""
    slots = make_victims(server.url, torch.Generator().manual_seed(8), layer=1)
    pool.add(*slots[:3])
    return slots


def _prefill(content_type: str, body: Callable[[Any], bytes]) -> Build:
    return lambda c: ("POST", "/prefill", {"content-type": content_type}, body(c))


def _json_with(c: Any, request: dict[str, Any], **tensors: torch.Tensor) -> bytes:
    """A JSON prefill body of ``request`` with ``tensors`` (as in `Ctx.json_body`, but
    with extra tensors such as A_log kept)."""
    return json.dumps({**request, **{n: tensor_to_json(t) for n, t in tensors.items()}}).encode()


def _gated(c: Any, **replace: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors of a valid request with a fused gate (A_log, dt_bias), ``replace`` applied."""
    gen = c.gen
    return {**c.tensors(), "A_log": torch.randn(HV, generator=gen), "dt_bias": torch.randn(HV, K, generator=gen),
            **replace}


def _poison(name: str, value: float) -> Build:
    """A request whose tensor ``name`` holds ``value`` (NaN or +-Inf) in one element."""
    def build(c: Any) -> tuple[str, str, dict[str, str], bytes]:
        tensors = _gated(c)
        tensors[name] = nan_at(tensors[name], value)
        if name in ("A_log", "dt_bias"):  # JSON for these, safetensors for the rest
            return "POST", "/prefill", {"content-type": JSON}, _json_with(c, c.request(), **tensors)
        return "POST", "/prefill", {"content-type": ST}, c.st_body(tensors=tensors)
    return build


def _put(content_type: str, body: Callable[[Any], bytes], slot: int = 0) -> Build:
    return lambda c: ("PUT", f"/slots/{c.slots[slot]}/state", {"content-type": content_type}, body(c))


def _put_state(value: torch.Tensor) -> bytes:
    return bytes(encode_safetensors({"state": value}))


F32_16 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
HUGE = [1 << 20, 1 << 20]  # 2^40 elements: 4 TiB of float32

# (tensor, value) pairs test_service_errors.BAD already sends; the rest of the grid is here.
_POISONED_THERE = {("q", "nan"), ("k", "inf"), ("v", "-inf"), ("g", "-inf"), ("beta", "nan"), ("A_log", "nan")}
_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}

MORE: dict[str, tuple[Build, int, str, Any]] = {
    # safetensors container
    "st-empty-body": (_prefill(ST, lambda c: b""), 400, "malformed-body", None),
    "st-header-length-u64-max": (_prefill(ST, lambda c: raw_safetensors({}, header_len=(1 << 64) - 1)), 400,
                                 "malformed-body", None),
    "st-offsets-reversed": (_prefill(ST, lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-offsets-past-2^64": (_prefill(ST, lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 64]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-offsets-float": (_prefill(ST, lambda c: raw_safetensors(
        {"q": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-hole": (_prefill(ST, lambda c: raw_safetensors(
        {"q": F32_16, "k": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}, b"\0" * 40)),
        400, "malformed-body", "k"),
    "st-trailing-bytes": (_prefill(ST, lambda c: raw_safetensors({"q": F32_16}, b"\0" * 20)), 400,
                          "malformed-body", None),
    "st-duplicate-tensor": (_prefill(ST, lambda c: raw_safetensors(
        b'{"q": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
        b'"q": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 16)), 400, "malformed-body", None),
    "st-bf16-vs-bytes": (_prefill(ST, lambda c: raw_safetensors(
        {"q": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16)), 400, "malformed-body", "q"),
    "st-shape-2^40-i64": (_prefill(ST, lambda c: raw_safetensors(
        {"q": {"dtype": "I64", "shape": HUGE, "data_offsets": [0, 8]}}, b"\0" * 8)), 400, "malformed-body", "q"),
    "st-metadata-not-strings": (_prefill(ST, lambda c: raw_safetensors({"__metadata__": {"request": 5}})), 400,
                                "malformed-body", "__metadata__"),
    "st-request-not-object": (_prefill(ST, lambda c: bytes(encode_safetensors(c.tensors(), {"request": "[1, 2]"}))),
                              422, "schema-error", None),
    # JSON tensors
    "json-shape-2^40": (_prefill(JSON, lambda c: errors._tensor_json(c, "q", shape=HUGE)), 400, "malformed-body", "q"),
    "json-base64-url-alphabet": (_prefill(JSON, lambda c: errors._with_data(
        c, "q", json.loads(c.json_body())["q"]["data"].replace("A", "-"))), 400, "malformed-body", "q"),
    "json-base64-whitespace": (_prefill(JSON, lambda c: errors._with_data(
        c, "q", " " + json.loads(c.json_body())["q"]["data"][1:])), 400, "malformed-body", "q"),
    "json-null": (_prefill(JSON, lambda c: b"null"), 422, "schema-error", None),
    "json-number": (_prefill(JSON, lambda c: b"42"), 422, "schema-error", None),
    "json-string": (_prefill(JSON, lambda c: b'"{}"'), 422, "schema-error", None),
    "json-deep-nesting": (_prefill(JSON, lambda c: b"[" * 100_000 + b"]" * 100_000), 400, "malformed-body", None),
    "json-not-utf8": (_prefill(JSON, lambda c: b'{"layer": "\xff\xfe"}'), 400, "malformed-body", None),
    # lengths, layer, heads
    "lengths-cancel-out": (_prefill(JSON, lambda c: c.json_body(c.request(lengths=(1 << 64, 9 - (1 << 64))))), 400,
                           "invalid-request", "sequences[1].length"),
    "empty-batch-tensors": (_prefill(ST, lambda c: c.st_body(c.request(lengths=(0,)), lengths=(0,))), 400,
                            "invalid-request", "sequences[0].length"),
    "layer-huge": (_prefill(JSON, lambda c: c.json_body({**c.request(), "layer": 10 ** 30})), 400,
                   "invalid-request", "layer"),
    "layer-bool": (_prefill(JSON, lambda c: c.json_body({**c.request(), "layer": True})), 422, "schema-error", None),
    "g-heads": (_prefill(ST, lambda c: c.st_body(g=-torch.rand(9, HV * 2, K))), 400, "invalid-request", "g"),
    "beta-heads": (_prefill(ST, lambda c: c.st_body(beta=torch.rand(9, HV + 1))), 400, "invalid-request", "beta"),
    "q-k-more-heads-than-pool": (_prefill(ST, lambda c: c.st_body(q=torch.randn(9, HV * 2, K),
                                                                  k=torch.randn(9, HV * 2, K))),
                                 400, "invalid-request", "q"),
    "dt_bias-heads": (_prefill(ST, lambda c: c.st_body(tensors=_gated(c, dt_bias=torch.zeros(HV * 2, K)))), 400,
                      "invalid-request", "dt_bias"),
    # slots
    "slot-twice-json": (_prefill(JSON, lambda c: c.json_body(c.request(slots=[c.slots[2], c.slots[2]]))), 400,
                        "invalid-request", "sequences[1].slot"),
    "slot-twice-freed": (_prefill(ST, lambda c: c.st_body(c.request(slots=[c.slots[3], c.slots[3]]))), 400,
                         "invalid-request", "sequences[1].slot"),
    "slot-id-too-long": (_prefill(JSON, lambda c: c.json_body(c.request(slots=["x" * 257, None]))), 422,
                         "schema-error", None),
    "fork-freed": (lambda c: ("POST", f"/slots/{c.slots[3]}/fork", {}, None), 404, "unknown-slot", None),
    "put-freed": (_put(ST, lambda c: _put_state(random_state(c.gen)[0]), slot=3), 404, "unknown-slot", None),
    "get-freed-metadata": (lambda c: ("GET", f"/slots/{c.slots[3]}", {}, None), 404, "unknown-slot", None),
    "slot-id-encoded-slash": (lambda c: ("GET", "/slots/..%2F..%2Finfo/state", {}, None), 404, "not-found", None),
    "slot-id-non-ascii": (lambda c: ("DELETE", "/slots/%C3%A9%00", {}, None), 404, "unknown-slot", None),
    # state uploads
    "put-json-shape-2^40": (_put(JSON, lambda c: json.dumps(
        {"state": {"dtype": "float32", "shape": HUGE, "data": "AAAA"}}).encode()), 400, "malformed-body", "state"),
    "put-st-shape-2^40": (_put(ST, lambda c: raw_safetensors(
        {"state": {"dtype": "F32", "shape": HUGE, "data_offsets": [0, 16]}}, b"\0" * 16)),
        400, "malformed-body", "state"),
    "put-heads": (_put(ST, lambda c: _put_state(torch.zeros(LAYERS, HV * 2, V, K))), 400, "invalid-request", "state"),
    "put-layers": (_put(ST, lambda c: _put_state(torch.zeros(LAYERS + 1, HV, V, K))), 400, "invalid-request",
                   "state"),
    "put-inf": (_put(ST, lambda c: _put_state(nan_at(random_state(c.gen)[0], float("inf")))), 400,
                "invalid-request", "state"),
    "put-neg-inf": (_put(JSON, lambda c: json.dumps(
        {"state": tensor_to_json(nan_at(random_state(c.gen)[0], float("-inf")))}).encode()),
        400, "invalid-request", "state"),
    "put-json-not-object": (_put(JSON, lambda c: b"[1]"), 422, "schema-error", None),
    "alloc-json-not-object": (lambda c: ("POST", "/slots", {"content-type": JSON}, b"[1]"), 422, "schema-error", None),
    "alloc-json-bad-syntax": (lambda c: ("POST", "/slots", {"content-type": JSON}, b'{"count": '), 422,
                              "schema-error", None),
}
# NaN and Inf in each tensor, beyond the pairs test_service_errors covers
_GRID = {(name, value) for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") for value in _VALUES}
POISONED = {pair: (_poison(pair[0], _VALUES[pair[1]]), 400, "invalid-request", pair[0])
            for pair in sorted(_GRID - _POISONED_THERE)}
MORE.update({f"{value}-in-{name}": case for (name, value), case in POISONED.items()})
CASES = {**{f"service:{name}": case for name, case in errors.BAD.items()},
         **{f"more:{name}": case for name, case in MORE.items()}}


def test_the_matrix_covers_nan_and_inf_in_every_tensor():
    assert set(POISONED) | _POISONED_THERE == _GRID
    assert {"nan-q", "inf-k", "neg-inf-v", "inf-g", "nan-beta", "nan-A_log"} <= set(errors.BAD)


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_and_the_whole_pool_unchanged(pool, victims, gen, case):
    build, status, slug, field = CASES[case]
    method, path, headers, body = build(Ctx(victims, gen))
    before = pool.image()
    r = pool.http.request(method, path, headers=headers, content=body)
    problem = assert_problem(r, status, slug)
    if field is not None:
        assert problem.get("field") == field, problem
    assert 400 <= status < 500
    assert pool.image() == before


def test_a_real_header_over_the_cap_is_refused_unparsed(pool, victims):
    """An 8 MiB + 8 header inside a body well under the body limit: refused for its size
    before a byte of it is parsed as JSON."""
    before = pool.image()
    header = b"{" + b" " * (MAX_REQUEST_HEADER_BYTES + 6) + b"}"
    r = pool.http.post("/prefill", content=raw_safetensors(header), headers={"content-type": ST})
    assert f"exceeds the {MAX_REQUEST_HEADER_BYTES}-byte limit" in assert_problem(r, 400, "malformed-body")["detail"]
    assert pool.image() == before


def test_a_content_length_larger_than_the_body_times_out_without_reserving_it(server, pool, victims):
    """A client announces 900 MiB, sends 100 bytes and waits: 408 after the body timeout,
    the server never set the announced size aside, and nothing changed."""
    before, rss = pool.image(), rss_bytes(server.process.pid)
    with connect(server.url) as s:
        start = time.monotonic()
        s.sendall(request_head("POST", "/prefill", [("Content-Type", ST), ("Content-Length", str(900 << 20))])
                  + b"\0" * 100)
        status, headers, body = read_response(s)
        waited = time.monotonic() - start
    assert status == 408 and headers["content-type"] == PROBLEM and headers["connection"] == "close"
    assert json.loads(body)["type"] == "urn:kda-serve:problem:request-timeout"
    assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 5
    assert rss_bytes(server.process.pid) - rss < 64 << 20
    assert pool.image() == before


def test_a_content_length_smaller_than_the_body_truncates_it(server, pool, victims, gen):
    """The server reads exactly Content-Length bytes: the rest is not a body. The truncated
    body is refused as malformed; the bytes after it are a broken next request, which the
    HTTP parser refuses and the connection closes."""
    before = pool.image()
    body = Ctx(victims, gen).st_body()
    declared = len(body) - 64
    with connect(server.url) as s:
        s.sendall(request_head("POST", "/prefill", [("Content-Type", ST), ("Content-Length", str(declared))])
                  + body[:declared])
        status, headers, reply = read_response(s)
        assert status == 400 and headers["content-type"] == PROBLEM
        assert json.loads(reply)["type"] == "urn:kda-serve:problem:malformed-body"
        s.sendall(body[declared:])
        status, headers, _ = read_response(s)
    assert status == 400 and headers.get("connection") == "close"
    assert pool.image() == before


@pytest.mark.parametrize("length", ["-1", "12abc", "1, 2", "+5"])
def test_a_malformed_content_length_is_refused_by_the_parser(server, pool, victims, length):
    """Framing the HTTP parser cannot trust (a request smuggling vector) never reaches the
    app: a 400 and the connection closed."""
    before = pool.image()
    with connect(server.url) as s:
        s.sendall(request_head("POST", "/prefill", [("Content-Type", ST), ("Content-Length", length)]) + b"\0" * 16)
        status, headers, _ = read_response(s)
    assert status == 400 and headers.get("connection") == "close"
    assert pool.image() == before


def test_content_length_and_chunked_together_are_refused(server, pool, victims):
    before = pool.image()
    with connect(server.url) as s:
        s.sendall(request_head("POST", "/prefill", [("Content-Type", ST), ("Content-Length", "5"),
                                                    ("Transfer-Encoding", "chunked")]) + b"0\r\n\r\n")
        status, _, _ = read_response(s)
    assert status == 400
    assert pool.image() == before


def test_two_gigabytes_against_a_one_gigabyte_limit_are_refused_before_reading(server, pool, victims):
    """Content-Length 2 GB against --max-body-mb 1024: a 413 problem while the client has
    sent 64 KiB, no memory set aside for the body, nothing changed."""
    before, rss = pool.image(), rss_bytes(server.process.pid)
    with connect(server.url) as s:
        start = time.monotonic()
        s.sendall(request_head("POST", "/prefill", [("Content-Type", ST), ("Content-Length", str(2 * 10 ** 9))])
                  + b"\0" * 65536)
        status, headers, body = read_response(s)
        elapsed = time.monotonic() - start
    assert status == 413 and headers["content-type"] == PROBLEM and headers["connection"] == "close"
    problem = json.loads(body)
    assert problem["type"] == "urn:kda-serve:problem:payload-too-large" and str(BODY_LIMIT_MB << 20) in problem["detail"]
    assert elapsed < 5 and rss_bytes(server.process.pid) - rss < 64 << 20
    assert pool.image() == before
