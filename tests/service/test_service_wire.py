"""Wire codecs in process: safetensors parsing and writing, JSON tensors, media types."""
from __future__ import annotations

import base64
import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.core.inputs import PARAM_NAMES, PrefillParams
from service.errors import MalformedBody, NotAcceptable, UnsupportedMediaType
from service.wire.buffers import BodyBuffer
from service.wire.media import JSON, SAFETENSORS, negotiate, request_encoding
from service.wire.safetensors_codec import encode_safetensors, parse_safetensors
from service.wire.schema import PrefillOptions
from tensor_io.safetensors_format import MAX_REQUEST_HEADER_BYTES
from service.wire.tensors import tensor_from_json, tensor_to_json

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 100).to(dtype)


def test_round_trip_every_dtype_and_odd_sizes():
    """Odd byte counts misalign later tensors: those are copied out, the rest are views."""
    tensors = {"a": sample(torch.bfloat16, (3,)), "b": sample(torch.float32, (2, 5)),
               "c": sample(torch.float16, (0, 4)), "d": sample(torch.int64, (7,)), "e": sample(torch.int32, (1, 1, 3))}
    body = encode_safetensors(tensors, {"k": "v"})
    got, metadata = parse_safetensors(body)
    assert metadata == {"k": "v"} and list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_parsed_tensors_are_writable_views_over_the_body():
    body = encode_safetensors({"x": torch.arange(16, dtype=torch.float32), "y": torch.ones(4, 4)})
    got, _ = parse_safetensors(body)
    address = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    for t in got.values():
        assert address <= t.data_ptr() < address + len(body)  # inside the body: no copy
    got["x"][0] = 42.0
    assert parse_safetensors(body)[0]["x"][0] == 42.0


def test_interoperates_with_the_safetensors_library():
    tensors = {"q": sample(torch.float32, (4, 2, 8)), "beta": sample(torch.bfloat16, (4, 2))}
    ours = encode_safetensors(tensors)
    theirs = st_load(bytes(ours))
    assert all(torch.equal(theirs[n], t) for n, t in tensors.items())
    back, _ = parse_safetensors(bytearray(st_save(tensors, metadata={"request": "{}"})))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_parts_are_packed_along_dim0_like_cat():
    parts = [sample(torch.float32, (n, 2, 3), seed=n) for n in (1, 4, 2)]
    got, _ = parse_safetensors(encode_safetensors({"q": parts}))
    assert torch.equal(got["q"], torch.cat(parts))
    with pytest.raises(ValueError, match="trailing shape"):
        encode_safetensors({"q": [torch.ones(2, 3), torch.ones(2, 4)]})


def _raw(header, data: bytes = b"", header_len=None) -> bytearray:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)


def _t(dtype="F32", shape=(4,), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


MALFORMED = {
    "empty": (bytearray(), "shorter than the 8-byte"),
    "header past end": (_raw({}, header_len=100), "past the end"),
    "header over cap": (_raw({}, header_len=MAX_REQUEST_HEADER_BYTES + 1), "exceeds"),
    "not utf-8": (_raw(b"\xff\xfe"), "not valid JSON"),
    "not json": (_raw(b"{'a': 1}"), "not valid JSON"),
    "not an object": (_raw([]), "must be a JSON object"),
    "duplicate key": (_raw(b'{"a": {}, "a": {}}'), "duplicate key"),
    "deep nesting": (_raw(b"[" * 100000 + b"]" * 100000), "not valid JSON"),
    "metadata not strings": (_raw({"__metadata__": {"a": 1}}), "__metadata__"),
    "spec not object": (_raw({"q": [1]}), "exactly"),
    "spec extra key": (_raw({"q": {**_t(), "x": 1}}, b"\0" * 16), "exactly"),
    "unknown dtype": (_raw({"q": _t(dtype="F64", shape=(2,))}, b"\0" * 16), "dtype"),
    "float dim": (_raw({"q": _t(shape=(4.0,))}, b"\0" * 16), "shape"),
    "bool dim": (_raw({"q": _t(shape=(True,))}, b"\0" * 16), "shape"),
    "negative dim": (_raw({"q": _t(shape=(-4,))}, b"\0" * 16), "shape"),
    "rank 9": (_raw({"q": _t(shape=(1,) * 9, offsets=(0, 4))}, b"\0" * 4), "shape"),
    "offsets reversed": (_raw({"q": _t(offsets=(16, 0))}, b"\0" * 16), "out of range"),
    "offsets past data": (_raw({"q": _t(offsets=(0, 16))}, b"\0" * 15), "out of range"),
    "bytes vs shape": (_raw({"q": _t(shape=(5,))}, b"\0" * 16), "needs 20 bytes"),
    "2^40 elements": (_raw({"q": _t(shape=(1 << 20, 1 << 20))}, b"\0" * 16), "needs"),
    "[2^63, 0]": (_raw({"q": _t(shape=(1 << 63, 0), offsets=(0, 0))}), r"more than 2\^48 elements"),
    "[2^31, 2^31, 0]": (_raw({"q": _t(shape=(1 << 31, 1 << 31, 0), offsets=(0, 0))}), r"more than 2\^48"),
    "dtype an object": (_raw({"q": _t(dtype={"F32": 1})}, b"\0" * 16), "dtype"),
    "overlap": (_raw({"q": _t(), "k": _t(offsets=(8, 24))}, b"\0" * 24), "overlaps"),
    "hole": (_raw({"q": _t(offsets=(4, 20))}, b"\0" * 20), "hole"),
    "trailing bytes": (_raw({"q": _t()}, b"\0" * 20), "cover 16 of 20"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_safetensors_are_refused(case):
    body, message = MALFORMED[case]
    with pytest.raises(MalformedBody, match=message):
        parse_safetensors(body)


@pytest.mark.parametrize("dtype", DTYPES)
def test_json_tensor_round_trip(dtype):
    t = sample(dtype, (3, 2, 5))
    doc = tensor_to_json(t)
    assert doc["dtype"] == str(dtype).removeprefix("torch.") and doc["shape"] == [3, 2, 5]
    assert base64.b64decode(doc["data"]) == t.view(torch.uint8).numpy().tobytes()  # little-endian, row-major
    assert torch.equal(tensor_from_json(doc["dtype"], doc["shape"], doc["data"], field="x"), t)
    assert tensor_from_json("float32", [0, 3], "", field="x").shape == (0, 3)


@pytest.mark.parametrize("data,message", [
    ("AAAA", "needs 8 bytes"),            # too short for float32[2]
    ("AAAAAAAAAA==", "decodes to 7"),     # the right length, two pads: 7 bytes
    ("AAAAAAAAA=A=", "not valid base64"),  # discontinuous padding
    ("AAAAAA AAAA=", "not valid base64"),
    ("AAAAAAAAAA\u00e9=", "not valid base64"),
])
def test_bad_json_tensor_data(data, message):
    with pytest.raises(MalformedBody, match=message) as e:
        tensor_from_json("float32", [2], data, field="q")
    assert e.value.field == "q"


def test_request_encoding():
    assert request_encoding("application/json") == JSON
    assert request_encoding("Application/X-Safetensors; foo=bar") == SAFETENSORS
    for bad in (None, "", "text/plain", "application/octet-stream"):
        with pytest.raises(UnsupportedMediaType):
            request_encoding(bad)


@pytest.mark.parametrize("accept,default,want", [
    (None, JSON, JSON),
    ("*/*", SAFETENSORS, SAFETENSORS),
    ("application/*", JSON, JSON),
    ("application/json", SAFETENSORS, JSON),
    ("application/x-safetensors, application/json;q=0.5", JSON, SAFETENSORS),
    ("application/json;q=0.1, */*;q=0.9", JSON, SAFETENSORS),
    ("application/json;q=0, */*", JSON, SAFETENSORS),
    ("text/html, application/json", SAFETENSORS, JSON),
])
def test_negotiate(accept, default, want):
    assert negotiate(accept, (SAFETENSORS, JSON), default) == want


@pytest.mark.parametrize("accept", ["text/html", "application/json;q=0, application/x-safetensors;q=0"])
def test_negotiate_refuses(accept):
    with pytest.raises(NotAcceptable):
        negotiate(accept, (SAFETENSORS, JSON), JSON)


def test_body_buffer():
    buf = BodyBuffer(6)
    buf.add(b"abc")
    buf.add(b"def")
    assert buf.finish() == bytearray(b"abcdef")
    short = BodyBuffer(6)
    short.add(b"abc")
    with pytest.raises(MalformedBody, match="3 of its 6"):
        short.finish()
    with pytest.raises(MalformedBody, match="longer"):
        BodyBuffer(2).add(b"abc")
    unknown = BodyBuffer()
    unknown.add(b"xy")
    assert unknown.finish() == bytearray(b"xy")


def test_the_request_schema_names_every_prefill_param_with_its_default():
    """The documented JSON options (`PrefillOptions`) and the core's `PrefillParams` hold the
    same fields with the same defaults (layer required on the wire): one cannot drift."""
    fields = PrefillOptions.model_fields
    assert set(fields) - {"sequences"} == set(PARAM_NAMES)
    assert fields["layer"].is_required()
    assert {n: fields[n].default for n in PARAM_NAMES if n != "layer"} == \
        {n: getattr(PrefillParams(), n) for n in PARAM_NAMES if n != "layer"}
