"""The shared memory transport of POST /prefill against a live server: results equal the
binary HTTP path bit for bit and the float64 reference; every bounds violation is a 400
problem that changes no slot; registration, unregistration, leases and the client's
cleanup leave no region or mapping behind."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import torch
from transport_helpers import (
    HV, K, SHM_JSON, TOL, V, Region, Server, assert_continuation_matches, dumps, make_sequence, pool_image,
    prefill_and_continue, reference, rel, shm_request,
)

from kda_client.client import AsyncKDAClient, BadRequest, KDAClient


def _server_maps(server: Server) -> str:
    return open(f"/proc/{server.process.pid}/maps").read()


def _post(server: Server, doc: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/prefill", content=dumps(doc), headers={"content-type": SHM_JSON}, timeout=60)


def test_client_shm_equals_binary_and_reference(server: Server, gen: torch.Generator) -> None:
    first = [make_sequence(70, gen), make_sequence(1, gen), make_sequence(130, gen)]
    second = [make_sequence(40, gen), make_sequence(65, gen), make_sequence(3, gen)]
    with KDAClient(server.url) as binary, KDAClient(server.url, transport="shm") as shm:
        outs = [prefill_and_continue(client, first, second, use_qk_l2norm=True) for client in (binary, shm)]
        assert all("kernel" in b.server_timing for _, b in outs)
        for slot in outs[0][0].slots + outs[1][0].slots:
            binary.free(slot)
    assert_continuation_matches(first, second, outs, use_qk_l2norm=True)


def test_client_shm_views_and_growth(server: Server, gen: torch.Generator) -> None:
    """Views of the region without a copy; a larger request replaces the region (the old
    one unregistered); bf16 inputs give bf16 o; declining final_state is honoured."""
    small, large = make_sequence(5, gen), make_sequence(3000, gen, dtype=torch.bfloat16)
    with KDAClient(server.url, transport="shm", shm_views=True) as shm, KDAClient(server.url) as binary:
        a = shm.prefill(0, [(None, *small)])
        names = [r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()]
        b = shm.prefill(0, [(None, *large)], return_final_state=False)
        after = [r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()]
        assert len(after) == len(names) and set(after) != set(names)  # replaced, not added
        assert b.o_packed.dtype == torch.bfloat16 and b.final_state is None
        ref = binary.prefill(0, [(None, *large)], return_final_state=False)
        assert torch.equal(b.o_packed, ref.o_packed)
        for slot in a.slots + b.slots + ref.slots:
            binary.free(slot)


def test_async_client_shm(server: Server, gen: torch.Generator) -> None:
    seqs = [make_sequence(33, gen), make_sequence(20, gen)]

    async def run() -> tuple:
        async with AsyncKDAClient(server.url, transport="shm") as shm, AsyncKDAClient(server.url) as binary:
            got = await asyncio.gather(shm.prefill(0, [(None, *seqs[0])]), shm.prefill(1, [(None, *seqs[1])]))
            want = [await binary.prefill(0, [(None, *seqs[0])]), await binary.prefill(1, [(None, *seqs[1])])]
            for out in [*got, *want]:
                await binary.free(out.slots[0])
            return got, want

    got, want = asyncio.run(run())
    for x, y in zip(got, want):
        assert torch.equal(x.o_packed, y.o_packed) and torch.equal(x.final_state, y.final_state)


def test_client_close_unregisters_and_leaves_nothing(server: Server, gen: torch.Generator) -> None:
    with KDAClient(server.url, transport="shm") as shm:
        out = shm.prefill(0, [(None, *make_sequence(8, gen))])
        (name,) = [r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()]
        assert not os.path.exists(f"/dev/shm/{name}")  # unlinked once registered: a crash leaks nothing
        assert name in _server_maps(server)
        shm.free(out.slots[0])
    assert httpx.get(f"{server.url}/shm/regions").json() == []
    assert name not in _server_maps(server)  # the server unmapped it


def test_client_reregisters_after_the_server_lost_its_region(server: Server, gen: torch.Generator) -> None:
    with KDAClient(server.url, transport="shm") as shm:
        seq = make_sequence(8, gen)
        a = shm.prefill(0, [(None, *seq)])
        (name,) = [r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()]
        assert httpx.delete(f"{server.url}/shm/regions/{name}").status_code == 204  # as a lease running out
        b = shm.prefill(0, [(None, *seq)])
        assert torch.equal(a.o_packed, b.o_packed)
        for slot in a.slots + b.slots:
            shm.free(slot)


def test_raw_request_and_unregister(server: Server, gen: torch.Generator) -> None:
    region = Region(1 << 20)
    try:
        reg = httpx.post(f"{server.url}/shm/regions", json=region.registration())
        assert reg.status_code == 201 and reg.json()["byte_size"] == region.size
        seqs = [make_sequence(12, gen)]
        r = _post(server, shm_request(region, [None], seqs))
        assert r.status_code == 200, r.text
        doc = r.json()
        o, final = region.get(doc["o"]), region.get(doc["final_state"])
        assert o.shape == (12, HV, V) and final.shape == (1, HV, V, K)
        want_o, want_h = reference(seqs)
        assert rel(o, want_o) < TOL and rel(final, want_h) < TOL
        assert "kernel;dur=" in r.headers["server-timing"]
        httpx.delete(f"{server.url}/slots/{doc['slots'][0]}")
        assert httpx.delete(f"{server.url}/shm/regions/{region.name}").status_code == 204
        assert httpx.delete(f"{server.url}/shm/regions/{region.name}").status_code == 204  # idempotent
        assert region.name not in _server_maps(server)
        gone = _post(server, shm_request(region, [None], seqs))
        assert gone.status_code == 400 and gone.json()["type"].endswith("unknown-shared-memory-region")
    finally:
        region.unlink()


def test_lease_expires(server: Server) -> None:
    region = Region(4096)
    try:
        assert httpx.post(f"{server.url}/shm/regions", json=region.registration(ttl_s=0.3)).status_code == 201
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and httpx.get(f"{server.url}/shm/regions").json():
            time.sleep(0.2)
        assert httpx.get(f"{server.url}/shm/regions").json() == []
        assert region.name not in _server_maps(server)
    finally:
        region.unlink()


@pytest.mark.parametrize("case", [
    "input past the end", "output past the end", "unknown region", "output room too small",
    "final_state room too small",
    "input byte_size disagrees with shape", "final_state room missing", "NaN input", "bad shape",
])
def test_refusals_change_nothing(server: Server, gen: torch.Generator, case: str) -> None:
    """Each refusal: 400 problem+json naming the field; no slot allocated or changed."""
    region = Region(1 << 20)
    try:
        assert httpx.post(f"{server.url}/shm/regions", json=region.registration()).status_code == 201
        with KDAClient(server.url) as client:
            slot = client.alloc(1)[0]
            client.prefill(0, [(slot, *make_sequence(9, gen))])
            seqs = [make_sequence(10, gen), make_sequence(6, gen)]
            doc = shm_request(region, [slot, None], seqs)
            if case == "input past the end":
                doc["k"]["shm"]["offset"] = region.size - 64
            elif case == "output past the end":
                doc["outputs"]["o"]["offset"] = region.size - 64
            elif case == "unknown region":
                doc["v"]["shm"]["region"] = "nobody"
            elif case == "output room too small":
                doc["outputs"]["o"]["byte_size"] -= 4
            elif case == "final_state room too small":
                doc["outputs"]["final_state"]["byte_size"] -= 4
            elif case == "input byte_size disagrees with shape":
                doc["beta"]["shm"]["byte_size"] += 4
            elif case == "final_state room missing":
                del doc["outputs"]["final_state"]
            elif case == "NaN input":
                q = torch.cat([seqs[0][0], seqs[1][0]])
                q[3, 0, 0] = float("nan")
                region.put(doc["q"]["shm"]["offset"], q)
            elif case == "bad shape":
                doc["g"]["shape"] = [16, HV, K + 1]
                doc["g"]["shm"]["byte_size"] = 16 * HV * (K + 1) * 4
            before = pool_image(server.url, [slot])
            r = _post(server, doc)
            assert r.status_code == 400, r.text
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["status"] == 400 and r.json()["detail"]
            assert pool_image(server.url, [slot]) == before
            client.free(slot)
    finally:
        httpx.delete(f"{server.url}/shm/regions/{region.name}")
        region.unlink()


def test_registration_refusals(server: Server) -> None:
    region = Region(4096)
    try:
        url = f"{server.url}/shm/regions"
        assert httpx.post(url, json=region.registration(byte_size=8192)).status_code == 400  # past the object
        assert httpx.post(url, json={"name": "x", "key": "/no-such-object-kda", "byte_size": 16}).status_code == 400
        assert httpx.post(url, json={"name": "x", "key": "/a/b", "byte_size": 16}).status_code == 400
        assert httpx.post(url, json={**region.registration(), "ttl_s": -1}).status_code == 422
        assert httpx.post(url, json=region.registration()).status_code == 201
        assert httpx.post(url, json=region.registration()).status_code == 400  # name taken
        assert httpx.get(f"{url}/{region.name}").json()["byte_size"] == 4096
        assert httpx.get(f"{url}/nobody").status_code == 400
    finally:
        httpx.delete(f"{server.url}/shm/regions/{region.name}")
        region.unlink()


def test_shm_rejected_client_side_errors(server: Server, gen: torch.Generator) -> None:
    """The shm client raises the same errors as the binary one (validation is shared)."""
    seq = list(make_sequence(4, gen))
    seq[0] = torch.randn(4, 2, K + 1)  # q's head dim is not K
    with KDAClient(server.url, transport="shm") as shm, KDAClient(server.url) as binary:
        with pytest.raises(BadRequest) as a:
            shm.prefill(0, [(None, *seq)])
        with pytest.raises(BadRequest) as b:
            binary.prefill(0, [(None, *seq)])
    assert a.value.problem["detail"] == b.value.problem["detail"]
    assert a.value.problem["field"] == b.value.problem["field"]


def test_large_inputs_copied_out_into_a_reused_buffer_are_each_their_own(server: Server, gen: torch.Generator) -> None:
    """Inputs of 2 MB and more are copied out into a host buffer the server reuses once the
    request before has let go of it: three prefills of one size, each its reference (none
    sees the bytes of the one before), and equal to the binary path."""
    seqs = [make_sequence(2000, gen) for _ in range(3)]
    with KDAClient(server.url, transport="shm") as shm, KDAClient(server.url) as binary:
        slots = shm.alloc(6)
        outs = [shm.prefill(0, [(slot, *seq)]) for slot, seq in zip(slots[:3], seqs)]
        again = [binary.prefill(0, [(slot, *seq)]) for slot, seq in zip(slots[3:], seqs)]
        for out, same, seq in zip(outs, again, seqs):
            o, final = reference([seq])
            assert rel(out.o_packed, o) < TOL and rel(out.final_state, final) < TOL
            assert torch.equal(out.o_packed, same.o_packed)
        for slot in slots:
            shm.free(slot)
