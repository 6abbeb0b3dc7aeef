"""The shared memory caps count what is mapped: a region unregistered while a prepared
prefill still leases it stays mapped (on a GPU page-locked) until that prefill is
released, so it keeps its place under ``--max-shm-regions`` and ``--max-shm-mb`` until
then; prepare, unregister and register again cannot map more than the caps say. Against a
live kda-serve with a framed socket, on 127.0.0.1."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch
from transport_helpers import (
    GEOMETRY_ARGS, TOL, Region, Server, make_sequence, prepare_and_run, reference, rel, shm_request, start_server,
)

from kda_client.framed import FramedExchange
from service.wire.frames import Op

REGION_BYTES = 1 << 20
LENGTHS = (5, 1)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    """A server mapping at most two regions (and 3 MiB), with a framed socket: (server, path)."""
    path = str(tmp_path / "kda.sock")
    srv = start_server([*GEOMETRY_ARGS, "--max-shm-regions", "2", "--max-shm-mb", "3", "--framed-socket", path],
                       tmp_path / "kda.log")
    yield srv, path
    assert srv.stop() == 0, srv.log_text()[-3000:]


def _register(url: str, region: Region) -> httpx.Response:
    return httpx.post(f"{url}/shm/regions", json=region.registration())


def test_a_region_unregistered_under_a_prepared_prefill_counts_until_its_release(
        server: tuple[Server, str], gen: torch.Generator) -> None:
    """Regions a, b registered (the cap: two); a prefill prepared on a; a unregistered: a
    third region is still refused (a is mapped for the prefill), naming the cap; once the
    prefill is released it is taken. The prepared run before the unregister is right (o and
    final states within TOL of the float64 reference)."""
    srv, path = server
    a, b, c = Region(REGION_BYTES), Region(REGION_BYTES), Region(REGION_BYTES)
    slots = httpx.post(f"{srv.url}/slots", json={"count": len(LENGTHS)}).json()["slots"]
    exchange = FramedExchange(path, None, 60)
    try:
        assert _register(srv.url, a).status_code == 201 and _register(srv.url, b).status_code == 201
        seqs = [make_sequence(n, gen) for n in LENGTHS]
        doc = shm_request(a, slots, seqs)
        prepared = prepare_and_run(exchange, doc)
        T, (HV, V), K = sum(LENGTHS), seqs[0][2].shape[1:], seqs[0][0].shape[2]
        o = a.get({"dtype": "float32", "shape": [T, HV, V], "shm": doc["outputs"]["o"]})
        final = a.get({"dtype": "float32", "shape": [len(LENGTHS), HV, V, K], "shm": doc["outputs"]["final_state"]})
        o_ref, final_ref = reference(seqs)
        assert rel(o, o_ref) < TOL and rel(final, final_ref) < TOL

        assert httpx.delete(f"{srv.url}/shm/regions/{a.name}").status_code == 204
        refused = _register(srv.url, c)
        assert refused.status_code == 400, refused.text
        problem = refused.json()
        assert problem["field"] == "name" and "--max-shm-regions" in problem["detail"], problem
        assert "still in use" in problem["detail"], problem
        assert exchange.request(Op.RELEASE, prepared).status == 204
        assert _register(srv.url, c).status_code == 201
    finally:
        exchange.close()
        for region in (a, b, c):
            httpx.delete(f"{srv.url}/shm/regions/{region.name}")
            region.unlink()
        for slot in slots:
            httpx.delete(f"{srv.url}/slots/{slot}")
