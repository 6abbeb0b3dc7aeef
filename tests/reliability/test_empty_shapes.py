"""Zero-element tensors with huge dims (``[2^63, 0]``, ``[2^40, 2^40, 0]``: 0 bytes, so every
byte count agrees) in every decoder: JSON and safetensors prefills, shared memory prefills,
KServe JSON, binary and shared memory inputs, and ``PUT /slots/{id}/state`` in both
encodings; and a safetensors ``dtype`` that is a JSON object. Each is a 4xx in the front
end's own error form (never a 500), and the whole pool is bit-identical afterwards."""
from __future__ import annotations

import json
import os
import secrets
import struct
from typing import Any, Callable, Iterator

import pytest
import torch
from reliability_helpers import GEOMETRY_ARGS, JSON, PROBLEM, ST, WholePool, make_sequence, start_server

from service.wire.tensors import tensor_to_json

SHM_JSON = "application/vnd.kda.shm+json"
SHAPES = {"2^63x0": [1 << 63, 0], "2^40x2^40x0": [1 << 40, 1 << 40, 0], "0x2^64": [0, 1 << 64],
          "2^31x2^31x0": [1 << 31, 1 << 31, 0]}  # the last: 2^62 elements, too many for numpy's byte count


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    srv = start_server(GEOMETRY_ARGS, tmp_path_factory.mktemp("empty-shapes") / "kda-serve.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture(scope="module")
def pool(server: Any) -> Iterator[WholePool]:
    whole = WholePool(server.url)
    slot = whole.http.post("/slots").json()["slots"][0]
    whole.add(slot)
    q, k, v, g, beta = make_sequence(6, torch.Generator().manual_seed(3))
    doc = {"layer": 0, "sequences": [{"slot": slot, "length": 6}],
           **{n: tensor_to_json(t) for n, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta))}}
    assert whole.http.post("/prefill", json=doc).status_code == 200
    yield whole
    whole.close()


@pytest.fixture(scope="module")
def region(server: Any, pool: WholePool) -> Iterator[str]:
    name = f"kda-empty-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    assert pool.http.post("/shm/regions", json={"name": name, "key": "/" + name, "byte_size": 1 << 16}).status_code == 201
    yield name
    pool.http.delete(f"/shm/regions/{name}")
    os.unlink(f"/dev/shm/{name}")


def _valid_tensors() -> dict[str, torch.Tensor]:
    return dict(zip(("q", "k", "v", "g", "beta"), make_sequence(4, torch.Generator().manual_seed(5))))


def _safetensors(header: dict[str, Any], data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def _st_prefill(shape: list[int], dtype: Any = "F32") -> bytes:
    """A safetensors prefill whose q is ``shape`` (0 bytes), the rest valid."""
    tensors = _valid_tensors()
    header: dict[str, Any] = {"__metadata__": {"request": json.dumps(
        {"layer": 0, "sequences": [{"slot": None, "length": 4}]})}}
    data, offset = b"", 0
    for name, t in tensors.items():
        if name == "q":
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset]}
            continue
        raw = t.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    return _safetensors(header, data)


def _json_prefill(shape: list[int]) -> bytes:
    doc: dict[str, Any] = {"layer": 0, "sequences": [{"slot": None, "length": 4}],
                           **{n: tensor_to_json(t) for n, t in _valid_tensors().items()}}
    doc["q"] = {"dtype": "float32", "shape": shape, "data": ""}
    return json.dumps(doc).encode()


def _shm_prefill(region: str, shape: list[int]) -> bytes:
    ref = {"region": region, "offset": 0, "byte_size": 0}
    doc: dict[str, Any] = {"layer": 0, "sequences": [{"slot": None, "length": 4}],
                           "outputs": {"o": {"region": region, "offset": 0, "byte_size": 4096},
                                       "final_state": {"region": region, "offset": 8192, "byte_size": 16384}}}
    for name, t in _valid_tensors().items():
        doc[name] = {"dtype": "float32", "shape": shape if name == "q" else list(t.shape),
                     "shm": {**ref, "offset": 1024 * len(doc), "byte_size": 0 if name == "q" else t.numel() * 4}}
    return json.dumps(doc).encode()


def _v2(shape: list[int], how: str, region: str) -> tuple[dict[str, str], bytes]:
    inputs, binary = [], b""
    for name, t in _valid_tensors().items():
        spec: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": shape if name == "q" else list(t.shape)}
        if name != "q" or how == "json":
            spec["data"] = [] if name == "q" else t.reshape(-1).tolist()
        elif how == "binary":
            spec["parameters"] = {"binary_data_size": 0}
        else:
            spec["parameters"] = {"shared_memory_region": region, "shared_memory_byte_size": 0}
        inputs.append(spec)
    head = json.dumps({"inputs": inputs}).encode()
    return {"content-type": "application/octet-stream", "inference-header-content-length": str(len(head))}, \
        head + binary


def _put_st(shape: list[int]) -> bytes:
    return _safetensors({"state": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})


def _put_json(shape: list[int]) -> bytes:
    return json.dumps({"state": {"dtype": "float32", "shape": shape, "data": ""}}).encode()


CASES: dict[str, Callable[[str, str, list[int]], tuple[str, str, dict[str, str], bytes]]] = {
    "prefill-json": lambda slot, region, shape: ("POST", "/prefill", {"content-type": JSON}, _json_prefill(shape)),
    "prefill-safetensors": lambda slot, region, shape: ("POST", "/prefill", {"content-type": ST}, _st_prefill(shape)),
    "prefill-shm": lambda slot, region, shape: ("POST", "/prefill", {"content-type": SHM_JSON},
                                                _shm_prefill(region, shape)),
    "v2-json": lambda slot, region, shape: ("POST", "/v2/models/kda/infer", *_v2(shape, "json", region)),
    "v2-binary": lambda slot, region, shape: ("POST", "/v2/models/kda/infer", *_v2(shape, "binary", region)),
    "v2-shm": lambda slot, region, shape: ("POST", "/v2/models/kda/infer", *_v2(shape, "shm", region)),
    "put-state-safetensors": lambda slot, region, shape: ("PUT", f"/slots/{slot}/state", {"content-type": ST},
                                                          _put_st(shape)),
    "put-state-json": lambda slot, region, shape: ("PUT", f"/slots/{slot}/state", {"content-type": JSON},
                                                   _put_json(shape)),
}


def _assert_refused(r: Any, path: str) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:400])
    if path.startswith("/v2"):
        assert r.headers["content-type"] == "application/json" and set(r.json()) == {"error"}, r.text[:400]
    else:
        assert r.headers["content-type"] == PROBLEM and r.json()["detail"], r.text[:400]


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_a_huge_empty_shape_is_a_4xx_in_every_decoder(pool: WholePool, region: str, case: str, shape: str) -> None:
    before = pool.image()
    method, path, headers, body = CASES[case](pool.live[0], region, SHAPES[shape])
    r = pool.http.request(method, path, content=body, headers=headers)
    _assert_refused(r, path)
    assert pool.image() == before


@pytest.mark.parametrize("dtype", [{"a": 1}, ["F32"], 7, None, True], ids=["object", "list", "int", "null", "bool"])
@pytest.mark.parametrize("where", ["prefill", "put-state"])
def test_a_safetensors_dtype_that_is_not_a_string_is_a_400(pool: WholePool, dtype: Any, where: str) -> None:
    before = pool.image()
    if where == "prefill":
        r = pool.http.post("/prefill", content=_st_prefill([0], dtype=dtype), headers={"content-type": ST})
    else:
        body = _safetensors({"state": {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]}})
        r = pool.http.put(f"/slots/{pool.live[0]}/state", content=body, headers={"content-type": ST})
    _assert_refused(r, "/")
    assert r.status_code == 400 and "dtype" in r.json()["detail"], r.text
    assert pool.image() == before


def test_no_case_reached_a_500(pool: WholePool) -> None:
    """The same keep-alive client sent every case above and still works; the server's
    metrics count no 5xx at all."""
    text = pool.http.get("/metrics").text
    assert 'status="500"' not in text and "kda_http_requests_total" in text
