"""Whether the Prometheus page counts exactly what its help texts say, on every front end of
one real server (HTTP JSON and safetensors, shared memory, the framed socket's PREFILL and
prepared RUN, KServe REST, gRPC unary and stream): tokens and sequences once per applied
prefill and never for one refused (422 diverged); a prepared run's launch in the launch
histograms; a framed client gone before its reply counted as an abandoned response; and
no label a client can grow without bound (unknown model names, unknown paths)."""
from __future__ import annotations

import json
import queue
import socket
from pathlib import Path
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import tritonclient.grpc as gc
import tritonclient.http as tc
from server_harness import GEOMETRY_ARGS, HV, K, V, Server, make_sequence, metric, start_server, wait_for
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from kda_client.client import KDAClient
from kda_client.errors import KDAError
from kda_client.framed import FramedExchange
from service.wire.frames import PREPARED_ID, Op, request_frame

NAMES = ("q", "k", "v", "g", "beta")
SHM_JSON = "application/vnd.kda.shm+json"
Seq = tuple[torch.Tensor, ...]


class Refused(Exception):
    """A front end's refusal (its status and body in the message)."""


class Region:
    """A POSIX shared memory object of ``size`` bytes, registered with the server as a client would."""

    def __init__(self, url: str, size: int) -> None:
        self.name = f"kda-metrics-{socket.gethostname()}-{id(self):x}"
        self.path = Path("/dev/shm") / self.name
        self.path.write_bytes(b"")
        with open(self.path, "r+b") as f:
            f.truncate(size)
        self.memory = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        registration = {"name": self.name, "key": "/" + self.name, "byte_size": size}
        assert httpx.post(f"{url}/shm/regions", json=registration).status_code == 201

    def request(self, slots: Sequence[object], seqs: Sequence[Seq]) -> dict[str, object]:
        """A shared memory prefill document of ``seqs`` on layer 0, its inputs written here
        from offset 0 and its outputs placed after them."""
        doc: dict[str, object] = {"layer": 0, "sequences": [{"slot": s, "length": int(x[0].shape[0])}
                                                           for s, x in zip(slots, seqs)]}
        offset = 0
        for i, name in enumerate(NAMES):
            packed = torch.cat([x[i] for x in seqs]).float()
            n = packed.numel() * 4
            self.memory[offset:offset + n].view(torch.float32).copy_(packed.flatten())
            doc[name] = {"dtype": "float32", "shape": list(packed.shape),
                         "shm": {"region": self.name, "offset": offset, "byte_size": n}}
            offset += -(-n // 64) * 64
        T = sum(int(x[0].shape[0]) for x in seqs)
        o_size, final_size = T * HV * V * 4, len(seqs) * HV * V * K * 4
        doc["outputs"] = {"o": {"region": self.name, "offset": offset, "byte_size": o_size},
                          "final_state": {"region": self.name, "offset": offset + -(-o_size // 64) * 64,
                                          "byte_size": final_size}}
        return doc

    def close(self, url: str) -> None:
        httpx.delete(f"{url}/shm/regions/{self.name}")
        self.path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A server with every front end on: gRPC, the framed socket; and its socket's path."""
    folder = tmp_path_factory.mktemp("metrics-accuracy")
    path = str(folder / "kda.sock")
    srv = start_server([*GEOMETRY_ARGS, "--framed-socket", path], folder / "kda.log", grpc=True)
    yield srv, path
    assert srv.stop() == 0, srv.log_text()
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.fixture
def region(full: tuple[Server, str]) -> Iterator[Region]:
    r = Region(full[0].url, 32 << 20)
    yield r
    r.close(full[0].url)


def _page(server: Server) -> str:
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def _counts(server: Server) -> tuple[float, float]:
    page = _page(server)
    return metric(page, "kda_prefill_tokens_total"), metric(page, "kda_prefill_sequences_total")


def _diverging(T: int, gen: torch.Generator) -> Seq:
    """Inputs whose update overflows the state (v = 3e38, beta 1): a 422, rolled back."""
    q, k, v, g, beta = make_sequence(T, gen)
    return q, torch.randn(k.shape, generator=gen), torch.full_like(v, 3e38), g, torch.ones_like(beta)


def _tensors(seq: Seq) -> dict[str, torch.Tensor]:
    return dict(zip(NAMES, seq))


def _kserve_rest(server: Server, seq: Seq) -> None:
    client = tc.InferenceServerClient(urlsplit(server.url).netloc)
    try:
        inputs = []
        for name, t in _tensors(seq).items():
            x = tc.InferInput(name, list(t.shape), np_to_triton_dtype(t.numpy().dtype))
            x.set_data_from_numpy(t.numpy(), binary_data=True)
            inputs.append(x)
        client.infer("kda", inputs)
    finally:
        client.close()


def _grpc_inputs(seq: Seq) -> list[gc.InferInput]:
    inputs = []
    for name, t in _tensors(seq).items():
        x = gc.InferInput(name, list(t.shape), np_to_triton_dtype(t.numpy().dtype))
        x.set_data_from_numpy(t.numpy())
        inputs.append(x)
    return inputs


def _grpc_unary(server: Server, seq: Seq) -> None:
    with gc.InferenceServerClient(server.grpc) as client:
        client.infer("kda", _grpc_inputs(seq))


def _grpc_stream(server: Server, seq: Seq) -> None:
    answers: "queue.Queue[object]" = queue.Queue()
    with gc.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put(error))
        client.async_stream_infer("kda", _grpc_inputs(seq))
        error = answers.get(timeout=60)
        client.stop_stream()
    if error is not None:
        raise error  # type: ignore[misc]


def _http(encoding: str) -> Callable[[Server, str, Seq], None]:
    def send(server: Server, slot: str, seq: Seq) -> None:
        with KDAClient(server.url, encoding=encoding) as client:
            client.prefill(0, [(slot, *seq)])
    return send


FRONT_ENDS = ["http-json", "http-safetensors", "http-shm", "framed-prefill", "kserve-rest", "grpc-unary",
              "grpc-stream"]


def _prefill(front_end: str, full: tuple[Server, str], region: Region, slot: str, seq: Seq) -> None:
    """One prefill of ``seq`` through ``front_end`` (on ``slot`` where it names one; KServe
    runs on a scratch slot); raises when it is refused."""
    server, path = full
    if front_end.startswith("http-") and front_end != "http-shm":
        return _http(front_end.removeprefix("http-"))(server, slot, seq)
    if front_end == "http-shm":
        response = httpx.post(f"{server.url}/prefill", content=json.dumps(region.request([slot], [seq])),
                              headers={"content-type": SHM_JSON}, timeout=60)
        if response.status_code != 200:
            raise Refused(response.status_code, response.text)
        return None
    if front_end == "framed-prefill":
        frames = FramedExchange(path, None, 60)
        try:
            answer = frames.request(Op.PREFILL, json.dumps(region.request([slot], [seq])).encode())
        finally:
            frames.close()
        if answer.status != 200:
            raise Refused(answer.status, answer.body)
        return None
    send = {"kserve-rest": _kserve_rest, "grpc-unary": _grpc_unary, "grpc-stream": _grpc_stream}[front_end]
    return send(server, seq)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_tokens_are_counted_once_per_applied_prefill_and_never_for_a_diverged_one(
        full: tuple[Server, str], region: Region, front_end: str) -> None:
    server = full[0]
    gen = torch.Generator().manual_seed(FRONT_ENDS.index(front_end))
    with KDAClient(server.url) as client:
        (slot,) = client.alloc(1)
        try:
            tokens, sequences = _counts(server)
            _prefill(front_end, full, region, slot, make_sequence(7, gen))
            assert _counts(server) == (tokens + 7, sequences + 1)
            with pytest.raises((KDAError, Refused, InferenceServerException)) as refused:
                _prefill(front_end, full, region, slot, _diverging(5, gen))
            assert "422" in str(refused.value) or "diverge" in str(refused.value) or "non-finite" in str(
                refused.value), refused.value
            assert _counts(server) == (tokens + 7, sequences + 1)
        finally:
            client.free(slot)


def test_a_prepared_run_counts_its_tokens_and_its_launch(full: tuple[Server, str], region: Region) -> None:
    """A RUN is a kernel launch of one request: counted in the launch histograms like a
    batched prefill's (refused ones too, as the batcher counts them), and its tokens once,
    but not those of a run refused (422)."""
    server, path = full
    gen = torch.Generator().manual_seed(11)
    frames = FramedExchange(path, None, 60)
    with KDAClient(server.url) as client:
        slots = client.alloc(2)
        answer = frames.request(Op.PREPARE, json.dumps(region.request(
            slots, [make_sequence(3, gen), make_sequence(2, gen)])).encode())
        assert answer.status == 201, answer.body
        prepared = PREPARED_ID.pack(json.loads(answer.body)["prepared"])
        names = ("kda_batch_requests_count", "kda_batch_requests_sum", "kda_batch_sequences_sum",
                 "kda_batch_tokens_sum", "kda_prefill_tokens_total", "kda_prefill_sequences_total")
        before = [metric(_page(server), name) for name in names]
        assert frames.request(Op.RUN, prepared).status == 200
        region.request(slots, [_diverging(3, gen), make_sequence(2, gen)])  # the next run's inputs, in place
        assert frames.request(Op.RUN, prepared).status == 422
        after = [metric(_page(server), name) for name in names]
        assert [b - a for a, b in zip(before, after)] == [2, 2, 4, 10, 5, 2]
        assert frames.request(Op.RELEASE, prepared).status == 204
        for slot in slots:
            client.free(slot)
    frames.close()


def test_a_framed_client_gone_before_its_reply_is_an_abandoned_response(
        full: tuple[Server, str], region: Region) -> None:
    """A PREFILL that made a slot, its client gone before the reply: the slot is freed, the
    response counted in ``kda_responses_abandoned_total`` and the request as status 499,
    as over HTTP."""
    server, path = full
    gen = torch.Generator().manual_seed(12)
    page = _page(server)
    free, gone = metric(page, "kda_free_slots"), metric(page, "kda_responses_abandoned_total")
    left = metric(page, "kda_framed_requests_total", op="prefill", status="499")
    doc = region.request([None], [make_sequence(3000, gen)])  # long enough to leave before the reply
    for _ in range(2):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            sock.sendall(request_frame(Op.PREFILL, json.dumps(doc).encode()))
    assert wait_for(lambda: metric(_page(server), "kda_responses_abandoned_total") == gone + 2, timeout=60), \
        _page(server)
    assert wait_for(lambda: metric(_page(server), "kda_free_slots") == free, timeout=30)
    assert metric(_page(server), "kda_framed_requests_total", op="prefill", status="499") == left + 2


def _series(page: str) -> list[str]:
    """The page's samples, without their values."""
    return [line.rpartition(" ")[0] for line in page.splitlines() if line and not line.startswith("#")]


def _samples(page: str) -> int:
    return len(_series(page))


def test_clients_cannot_grow_the_page_with_names_of_their_own(full: tuple[Server, str]) -> None:
    """2,000 distinct unknown model names over KServe REST and gRPC, and 2,000 unknown paths
    (slot ids, prefix keys, region names, anything): after each kind has been seen once,
    the page gains no sample (routes are templates, models and methods are not labels)."""
    server = full[0]
    names = [f"model-{i}" for i in range(2000)]
    with httpx.Client(base_url=server.url, timeout=30) as http, gc.InferenceServerClient(server.grpc) as grpc:
        def once(i: int, name: str) -> None:
            assert http.post(f"/v2/models/{name}/infer", json={"inputs": []}).status_code == 404
            assert http.get(f"/v2/models/{name}/versions/{i}/ready").status_code == 404
            assert http.get(f"/no/such/{name}").status_code == 404
            assert http.get(f"/slots/{name}").status_code == 404
            assert http.get(f"/prefix/{name}").status_code == 404
            assert http.get(f"/shm/regions/{name}").status_code in (400, 404)
            with pytest.raises(InferenceServerException):
                grpc.get_model_metadata(name)
            with pytest.raises(InferenceServerException):
                grpc.infer(name, [])
        once(0, names[0])
        _page(server)  # the scrape's own series appear on the next page
        first = _page(server)
        size = _samples(first)  # each kind of request seen once
        for i, name in enumerate(names[1:], start=1):
            once(i, name)
        page = _page(server)
    assert _samples(page) == size, sorted(set(_series(page)) - set(_series(first)))
    assert not any(name in page for name in ("model-1999", "/no/such", "model-0"))
