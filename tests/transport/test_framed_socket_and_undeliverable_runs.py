"""The framed socket and prepared prefills, against live kda-serve processes over their
real protocols:

- a prepared RUN whose outputs cannot be written into the client's region (its object's
  file refuses the bytes, as a full /dev/shm does; here the server's RLIMIT_FSIZE) is a 400
  naming ``outputs`` that changes no slot, on a pool with spare rows and on one without,
  and the next RUN goes on from the states before it, within `TOL` of the float64
  reference;
- a framed socket that a live server listens on is not taken over by a second server
  started with the same ``--framed-socket``: the second start is refused (exit status 2,
  one line), and the first goes on serving the path.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
import pytest
import torch
from transport_helpers import (
    GEOMETRY_ARGS, TOL, Region, Server, dumps, file_size_limit, make_sequence, pool_image, prepare_and_run,
    reference, rel, registered_region, shm_request, start_server,
)

from kda_client.framed import FramedExchange
from kda_client.small import Response
from service.wire.frames import Op

LENGTHS = (6, 1, 9)  # two chunked sequences around a one-token (recurrent) one
OUTPUTS_AT = 512 << 10  # where o and the final states go in the 1 MiB region
FILE_LIMIT = 256 << 10  # RLIMIT_FSIZE below them (and far above the server's log)


POOLS = {"spare rows": [], "in place": ["--spare-rows", "0"]}
"""The pools a run commits on: new states to spare rows, or over its rows (copied first)."""


@pytest.fixture(scope="module", params=sorted(POOLS))
def framed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A server with a framed socket, on each pool of `POOLS`: (server, socket path)."""
    folder = tmp_path_factory.mktemp("framed-review")
    path = str(folder / "kda.sock")
    server = start_server([*GEOMETRY_ARGS, *POOLS[request.param], "--framed-socket", path], folder / "kda.log")
    yield server, path
    assert server.stop() == 0, server.log_text()[-3000:]


@pytest.fixture
def region(framed: tuple[Server, str]) -> Iterator[Region]:
    """A registered POSIX shared memory region of 1 MiB."""
    with registered_region(framed[0].url) as r:
        yield r


def _doc_with_outputs_at(region: Region, slots: Sequence[str], seqs: Sequence[Sequence[torch.Tensor]]
                         ) -> dict[str, Any]:
    """`shm_request` with o (f32 [T, HV, V]) at `OUTPUTS_AT` and the final states (f32
    [N, HV, V, K]) right after it."""
    doc = shm_request(region, slots, seqs)
    out = doc["outputs"]
    out["o"]["offset"] = OUTPUTS_AT
    out["final_state"]["offset"] = OUTPUTS_AT + out["o"]["byte_size"]
    return doc


def _outputs(region: Region, doc: dict[str, Any], seqs: Sequence[Sequence[torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [T, HV, V] and the final states [N, HV, V, K] (f32) where ``doc`` put them."""
    T, N = sum(int(s[0].shape[0]) for s in seqs), len(seqs)
    HV, V, K = seqs[0][2].shape[1], seqs[0][2].shape[2], seqs[0][0].shape[2]
    out = doc["outputs"]
    o = region.get({"dtype": "float32", "shape": [T, HV, V], "shm": out["o"]})
    final = region.get({"dtype": "float32", "shape": [N, HV, V, K], "shm": out["final_state"]})
    return o, final


def _problem(answer: Response, status: int, field: str) -> dict[str, Any]:
    """A framed refusal: ``status``, an RFC 9457 problem naming ``field``."""
    problem = json.loads(answer.body)
    assert answer.status == status and problem["status"] == status, problem
    assert problem["type"].startswith("urn:kda-serve:problem:") and problem["detail"], problem
    assert problem.get("field") == field, problem
    return problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU server writes outputs through the region's page-locked "
                    "mapping (its pages taken when pinned), not through the file a size limit refuses")
def test_a_run_whose_outputs_cannot_be_written_changes_nothing(framed: tuple[Server, str], region: Region,
                                                               gen: torch.Generator) -> None:
    """RUN, then RUN with the outputs' bytes refused by the file (400 ``outputs``: the
    slots' states and token counts as before it), then RUN again: it continues the first,
    o and the final states within `TOL` of the float64 reference."""
    server, path = framed
    slots = httpx.post(f"{server.url}/slots", json={"count": len(LENGTHS)}).json()["slots"]
    exchange = FramedExchange(path, None, 60)
    try:
        first = [make_sequence(n, gen) for n in LENGTHS]
        doc = _doc_with_outputs_at(region, slots, first)
        prepared = prepare_and_run(exchange, doc)
        _doc_with_outputs_at(region, slots, [make_sequence(n, gen) for n in LENGTHS])  # new values for the refused run
        before = pool_image(server.url, slots)
        with file_size_limit(server.process.pid, FILE_LIMIT):
            refused = exchange.request(Op.RUN, prepared)
        problem = _problem(refused, 400, "outputs")
        assert "could not be written" in problem["detail"], problem
        assert pool_image(server.url, slots) == before
        second = [make_sequence(n, gen) for n in LENGTHS]
        _doc_with_outputs_at(region, slots, second)
        assert exchange.request(Op.RUN, prepared).status == 200
        o, final = _outputs(region, doc, second)
        o_ref, final_ref = reference(second, initial=reference(first)[1])
        assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL
        assert exchange.request(Op.RELEASE, prepared).status == 204
    finally:
        exchange.close()
        for slot in slots:
            httpx.delete(f"{server.url}/slots/{slot}")


def test_a_live_framed_socket_is_not_taken_over(framed: tuple[Server, str], region: Region,
                                                gen: torch.Generator, tmp_path: Path) -> None:
    """A second server started with the first's ``--framed-socket`` is refused (exit 2,
    one line naming the socket), and the path still reaches the first: a framed PREFILL
    on one of its slots answers o within `TOL` of the float64 reference."""
    server, path = framed
    try:
        intruder = start_server([*GEOMETRY_ARGS, "--framed-socket", path], tmp_path / "second.log", timeout=60)
    except RuntimeError:
        intruder = None
    if intruder is not None:
        intruder.stop()
        pytest.fail("a second server started on the framed socket a live server listens on")
    lines = (tmp_path / "second.log").read_text().strip().splitlines()
    assert lines[-1].startswith("kda-serve: ") and path in lines[-1] and "Traceback" not in "\n".join(lines), lines
    slot = httpx.post(f"{server.url}/slots", json={"count": 1}).json()["slots"]
    seqs = [make_sequence(7, gen)]
    doc = shm_request(region, slot, seqs)
    exchange = FramedExchange(path, None, 60)
    try:
        answer = exchange.request(Op.PREFILL, dumps(doc))
        assert answer.status == 200, answer.body
        o, final = _outputs(region, doc, seqs)
        o_ref, final_ref = reference(seqs)
        assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL
    finally:
        exchange.close()
        httpx.delete(f"{server.url}/slots/{slot[0]}")
