"""A prefill whose outputs cannot be written into the client's system shared memory region
is refused before it runs, over every transport that writes outputs there, against a live
kda-serve:

- the causes: the output bytes of a sparse object (made with ftruncate only, never touched
  there) while the server's /dev/shm is full (ENOSPC: the server runs in its own mount
  namespace with a small tmpfs on /dev/shm, which the test fills; skipped where mount
  namespaces are not allowed), and output bytes past the server's file size limit
  (EFBIG: its RLIMIT_FSIZE lowered with prlimit);
- the transports: ``POST /prefill`` by shared memory reference, the framed socket's
  PREFILL, and KServe v2 system shared memory over HTTP (tritonclient);
- each: a prefill, the refused one (a 400 naming the outputs; /v2 as its error form), the
  pool bit-identical (`pool_image`), then a prefill that continues the first, o and the
  final states within `TOL` of the float64 reference.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import tritonclient.http as tc
from transport_helpers import (
    GEOMETRY_ARGS, HV, K, NAMES, SHM_JSON, TOL, V, Region, Server, dumps, file_size_limit, make_sequence, pool_image,
    reference, rel, shm_request, start_server,
)
from tritonclient.utils import InferenceServerException

from kda_client.framed import FramedExchange
from service.wire.frames import Op

LENGTHS = (6, 1, 9)  # two chunked sequences around a one-token (recurrent) one
SHM_BYTES = 8 << 20  # the server's own /dev/shm
REGION_BYTES = 1 << 20
OUTPUTS_AT = 512 << 10  # where the refused request's outputs go: pages nothing touched before
FILE_LIMIT = 256 << 10  # RLIMIT_FSIZE below them (and far above the server's log)

PRIVATE_SHM = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x20000, 0x4000, 0x40000
size = ("size=" + os.environ["KDA_TEST_SHM_BYTES"]).encode()
if (libc.unshare(CLONE_NEWNS) or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
        or libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, size)):
    sys.exit("no private /dev/shm: " + os.strerror(ctypes.get_errno()))
from service.cli import main
sys.argv[0] = "kda-serve"
sys.exit(main())
"""
"""The server's entry: its own mount namespace with a tmpfs of KDA_TEST_SHM_BYTES on /dev/shm."""


@dataclass(frozen=True)
class Served:
    """The module's server, its framed socket, and the /dev/shm it sees as this process
    reaches it (None: the server shares this process's /dev/shm, which cannot be filled)."""

    server: Server
    socket: str
    shm_dir: Optional[str]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server with a framed socket and its own small /dev/shm where mount namespaces are
    allowed (root), else a plain one; SIGTERM at the end exits 0 with no traceback logged."""
    folder = tmp_path_factory.mktemp("undeliverable")
    socket = str(folder / "kda.sock")
    args = [*GEOMETRY_ARGS, "--framed-socket", socket]
    try:
        server = start_server(args, folder / "kda.log", entry=("-c", PRIVATE_SHM),
                              env={"KDA_TEST_SHM_BYTES": str(SHM_BYTES)})
        shm_dir: Optional[str] = f"/proc/{server.process.pid}/root/dev/shm"
    except RuntimeError:  # no mount namespace for an unprivileged user: the file size limit only
        server, shm_dir = start_server(args, folder / "kda-shared-shm.log"), None
    yield Served(server, socket, shm_dir)
    assert server.stop() == 0, server.log_text()[-3000:]
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


@pytest.fixture
def region(served: Served) -> Iterator[Region]:
    """A sparse object of `REGION_BYTES` in the server's /dev/shm, registered whole."""
    r = Region(REGION_BYTES, folder=served.shm_dir or "/dev/shm")
    assert httpx.post(f"{served.server.url}/shm/regions", json=r.registration()).status_code == 201
    yield r
    httpx.delete(f"{served.server.url}/shm/regions/{r.name}")
    r.unlink()


@contextmanager
def full_shm(served: Served) -> Iterator[None]:
    """The server's /dev/shm without a free page while the block runs (a filler object
    allocates them all; removed after)."""
    assert served.shm_dir is not None
    path = f"{served.shm_dir}/kda-test-filler-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fs = os.statvfs(served.shm_dir)
        os.posix_fallocate(fd, 0, fs.f_bavail * fs.f_frsize)
        assert os.statvfs(served.shm_dir).f_bavail == 0
        yield
    finally:
        os.close(fd)
        os.unlink(path)


Cause = Callable[[], ContextManager[None]]


@pytest.fixture(params=["full /dev/shm", "file size limit"])
def cause(request: pytest.FixtureRequest, served: Served) -> Cause:
    """What makes the output bytes at `OUTPUTS_AT` unwritable while its block runs."""
    if request.param == "file size limit":
        return lambda: file_size_limit(served.server.process.pid, FILE_LIMIT)
    if served.shm_dir is None:
        pytest.skip("the server could not get a /dev/shm of its own (a mount namespace needs root)")
    return lambda: full_shm(served)


@pytest.fixture
def slots(served: Served) -> Iterator[list[str]]:
    """`LENGTHS` new slots, freed after."""
    url = served.server.url
    ids = httpx.post(f"{url}/slots", json={"count": len(LENGTHS)}).json()["slots"]
    yield ids
    for slot in ids:
        httpx.delete(f"{url}/slots/{slot}")


def _sequences(gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    return [make_sequence(n, gen) for n in LENGTHS]


def _outputs_at(doc: dict[str, Any], offset: int) -> dict[str, Any]:
    """``doc`` (a `shm_request`) with o at ``offset`` and the final states right after it."""
    out = doc["outputs"]
    out["o"]["offset"] = offset
    out["final_state"]["offset"] = offset + -(-out["o"]["byte_size"] // 64) * 64
    return doc


def _outputs(region: Region, doc: dict[str, Any], seqs: Sequence[Sequence[torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [T, HV, V] and the final states [N, HV, V, K] (f32) where ``doc`` put them."""
    T = sum(int(s[0].shape[0]) for s in seqs)
    out = doc["outputs"]
    return (region.get({"dtype": "float32", "shape": [T, HV, V], "shm": out["o"]}),
            region.get({"dtype": "float32", "shape": [len(seqs), HV, V, K], "shm": out["final_state"]}))


def _assert_continues(region: Region, doc: dict[str, Any], first: Sequence[Sequence[torch.Tensor]],
                      second: Sequence[Sequence[torch.Tensor]]) -> None:
    """The outputs ``doc`` placed for ``second`` continue ``first``'s final states."""
    o, final = _outputs(region, doc, second)
    o_ref, final_ref = reference(second, initial=reference(first)[1])
    assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL


def _names_outputs(problem: dict[str, Any]) -> None:
    """A 400 problem saying the outputs could not be written, naming them."""
    assert problem["status"] == 400, problem
    assert problem.get("field", "").split(".")[0] == "outputs", problem
    assert "could not be written" in problem["detail"], problem


def _refused_then_continued(served: Served, region: Region, slots: list[str], cause: Cause, gen: torch.Generator,
                            send: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]) -> None:
    """Through ``send`` (a shared memory prefill document -> status, JSON body): a prefill,
    the refused one under ``cause`` (its outputs at `OUTPUTS_AT`), the pool unchanged, then
    a prefill continuing the first."""
    first = _sequences(gen)
    status, body = send(shm_request(region, slots, first))
    assert status == 200, body
    refused = _outputs_at(shm_request(region, slots, _sequences(gen)), OUTPUTS_AT)
    before = pool_image(served.server.url, slots)
    with cause():
        status, problem = send(refused)
    assert status == 400, problem
    _names_outputs(problem)
    assert pool_image(served.server.url, slots) == before
    second = _sequences(gen)
    doc = _outputs_at(shm_request(region, slots, second), OUTPUTS_AT)  # the refused bytes take them now
    status, body = send(doc)
    assert status == 200, body
    _assert_continues(region, doc, first, second)


def test_http_shm_prefill_whose_outputs_cannot_be_written_changes_nothing(
        served: Served, region: Region, slots: list[str], cause: Cause, gen: torch.Generator) -> None:
    """``POST /prefill`` by shared memory reference."""
    def send(doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        r = httpx.post(f"{served.server.url}/prefill", content=dumps(doc), headers={"content-type": SHM_JSON},
                       timeout=60)
        return r.status_code, r.json()

    _refused_then_continued(served, region, slots, cause, gen, send)


def test_framed_prefill_whose_outputs_cannot_be_written_changes_nothing(
        served: Served, region: Region, slots: list[str], cause: Cause, gen: torch.Generator) -> None:
    """The framed socket's PREFILL."""
    exchange = FramedExchange(served.socket, None, 60)
    try:
        def send(doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            answer = exchange.request(Op.PREFILL, dumps(doc))
            return answer.status, json.loads(answer.body)

        _refused_then_continued(served, region, slots, cause, gen, send)
    finally:
        exchange.close()


@dataclass(frozen=True)
class KServeRequest:
    """A KServe v2 infer of one sequence with every input and both outputs in a region: its
    inputs (written there already) and outputs, and the `shm_request` layout they follow."""

    inputs: list[tc.InferInput]
    outputs: list[tc.InferRequestedOutput]
    doc: dict[str, Any]


def _kserve_request(region: Region, seq: Sequence[torch.Tensor], outputs_at: Optional[int] = None) -> KServeRequest:
    """``seq`` written into ``region`` and the infer naming it (outputs at ``outputs_at``
    when given, else right after the inputs)."""
    doc = shm_request(region, [None], [seq])
    if outputs_at is not None:
        _outputs_at(doc, outputs_at)
    inputs = []
    for name in NAMES:
        x = tc.InferInput(name, doc[name]["shape"], "FP32")
        x.set_shared_memory(region.name, doc[name]["shm"]["byte_size"], offset=doc[name]["shm"]["offset"])
        inputs.append(x)
    outputs = []
    for name in ("o", "final_state"):
        out = tc.InferRequestedOutput(name)
        place = doc["outputs"][name]
        out.set_shared_memory(region.name, place["byte_size"], offset=place["offset"])
        outputs.append(out)
    return KServeRequest(inputs, outputs, doc)


def _infer(client: tc.InferenceServerClient, request: KServeRequest, **sequence: Any) -> dict[str, Any]:
    return client.infer("kda", request.inputs, outputs=request.outputs, **sequence).get_response()


def test_kserve_system_shm_infer_whose_outputs_cannot_be_written_changes_nothing(
        served: Served, region: Region, cause: Cause, gen: torch.Generator) -> None:
    """KServe v2 over HTTP, a sequence's inputs and outputs in system shared memory: the
    refusal is the protocol's error (400, ``{"error"}``) naming the output."""
    client = tc.InferenceServerClient(urlsplit(served.server.url).netloc, network_timeout=60.0)
    sequence_id = f"undeliverable-{os.getpid()}-{gen.initial_seed()}"
    try:
        first = make_sequence(7, gen)
        slot = _infer(client, _kserve_request(region, first), sequence_id=sequence_id,
                      sequence_start=True)["parameters"]["slot"]
        refused = _kserve_request(region, make_sequence(5, gen), OUTPUTS_AT)
        before = pool_image(served.server.url, [slot])
        with cause(), pytest.raises(InferenceServerException) as error:
            _infer(client, refused, sequence_id=sequence_id)
        assert error.value.status() == "400", error.value.message()
        assert "output" in error.value.message() and "could not be written" in error.value.message()
        assert pool_image(served.server.url, [slot]) == before
        second = make_sequence(5, gen)
        request = _kserve_request(region, second, OUTPUTS_AT)
        _infer(client, request, sequence_id=sequence_id, sequence_end=True)
        _assert_continues(region, request.doc, [first], [second])
    finally:
        client.close()
