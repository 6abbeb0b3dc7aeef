"""POSIX shared memory on a GPU server: the region is page-locked on first use, q, k, v, g
and beta go from it to the GPU in one DMA each (no host copy), o and final states come
back into it from the device. Results equal the binary path bit for bit, a NaN in the
region is refused without touching the pool, and unregistering unpins and unmaps it.
Runs where CUDA exists (the folder's server is then on the GPU); on the GPU machine
`test_transport_shm.py` runs unfiltered against the same server too."""
from __future__ import annotations

import httpx
import pytest
import torch
from transport_helpers import Server, make_sequence, pool_image, prefill_and_continue

from kda_client.client import BadRequest, KDAClient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _regions(server: Server) -> list[str]:
    return [r["name"] for r in httpx.get(f"{server.url}/shm/regions").json()]


def test_system_region_on_a_gpu_server_equals_binary_and_is_pinned(server: Server, gen: torch.Generator) -> None:
    assert httpx.get(f"{server.url}/info").json()["device"].startswith("cuda")
    first = [make_sequence(70, gen), make_sequence(1, gen), make_sequence(2100, gen)]
    second = [make_sequence(40, gen), make_sequence(65, gen), make_sequence(3, gen)]
    with KDAClient(server.url) as binary, KDAClient(server.url, transport="shm") as shm:
        outs = [prefill_and_continue(client, first, second, use_qk_l2norm=True) for client in (binary, shm)]
        (name,) = _regions(server)
        for x, y in zip(*outs):
            assert y.o_packed.device.type == "cpu"
            assert torch.equal(x.o_packed, y.o_packed) and torch.equal(x.final_state, y.final_state)
        for slot in outs[0][0].slots + outs[1][0].slots:
            binary.free(slot)
    assert _regions(server) == []
    log = server.log_text()
    assert "could not be page-locked" not in log, log
    assert "unmapping shared memory region" not in log, log  # unpinned, then unmapped without error
    assert name not in open(f"/proc/{server.process.pid}/maps").read()


def test_nan_in_a_system_region_on_a_gpu_server_changes_nothing(server: Server, gen: torch.Generator) -> None:
    with KDAClient(server.url, transport="shm") as shm:
        slot = shm.alloc(1)[0]
        shm.prefill(0, [(slot, *make_sequence(9, gen))])
        q, k, v, g, beta = make_sequence(300, gen)
        k[123, 1, 5] = float("inf")
        before = pool_image(server.url, [slot])
        with pytest.raises(BadRequest) as refused:
            shm.prefill(0, [(slot, q, k, v, g, beta)])
        assert refused.value.problem["field"] == "k"
        assert pool_image(server.url, [slot]) == before
        shm.free(slot)
