"""Many clients at once: no lost or interleaved update, and requests really share launches."""
from __future__ import annotations

import asyncio
import itertools

import httpx
import torch
from server_harness import TOL, make_sequence, metric, reference, rel

from kda_client.client import AsyncKDAClient

CLIENTS, REQUESTS = 20, 10


def test_twenty_clients_ten_requests_each_end_at_their_reference(server):
    """20 clients, each continuing its own slot over 10 requests of 1..12 tokens (odd
    clients on layer 1): every output and every final state equals the reference of that
    client's tokens alone, and concurrent requests were merged into shared launches."""

    def scrape() -> str:
        return httpx.get(f"{server.url}/metrics").text

    before = scrape()

    async def one_client(i: int) -> None:
        gen = torch.Generator().manual_seed(1000 + i)
        layer = i % 2
        seqs = [make_sequence(int(torch.randint(1, 13, (), generator=gen)), gen) for _ in range(REQUESTS)]
        async with AsyncKDAClient(server.url, encoding="json" if i % 5 == 0 else "safetensors") as c:
            slot = None
            outs = []
            for seq in seqs:
                out = await c.prefill(layer, [(slot, *seq)])
                slot = out.slots[0]
                outs.append(out)
            state = await c.get_state(slot)
            info = await c.slot_info(slot)
            await c.free(slot)
        whole = tuple(torch.cat([s[n] for s in seqs]) for n in range(5))
        o_ref, final_ref = reference([whole])
        assert rel(torch.cat([o.o_packed for o in outs]), o_ref) < TOL, i
        assert rel(outs[-1].final_state[0], final_ref[0]) < TOL, i
        assert torch.equal(state[layer], outs[-1].final_state[0]), i
        assert torch.count_nonzero(state[1 - layer]) == 0, i  # the other layer never touched
        assert info["tokens_per_layer"][layer] == whole[0].shape[0], i

    async def main() -> None:
        await asyncio.gather(*(one_client(i) for i in range(CLIENTS)))

    asyncio.run(main())
    after = scrape()
    launches = metric(after, "kda_batch_requests_count") - metric(before, "kda_batch_requests_count")
    single = (metric(after, "kda_batch_requests_bucket", le="1.0")
              - metric(before, "kda_batch_requests_bucket", le="1.0"))
    requests = metric(after, "kda_batch_requests_sum") - metric(before, "kda_batch_requests_sum")
    assert requests == CLIENTS * REQUESTS
    assert launches - single > 0, "no launch merged two or more requests"
    assert launches < requests


def test_concurrent_requests_on_one_slot_apply_one_at_a_time(server, gen):
    """Four requests fired at once on one slot are applied one after another (in arrival
    order, never merged, never lost): the responses chain from zero state through each
    request's tokens in some order, and the slot ends at the last link."""
    seqs = [make_sequence(n, gen) for n in (7, 3, 12, 5)]

    async def fire():
        async with AsyncKDAClient(server.url) as c:
            slot = (await c.alloc())[0]
            outs = await asyncio.gather(*(c.prefill(0, [(slot, *s)]) for s in seqs))
            return outs, await c.get_state(slot)

    outs, state = asyncio.run(fire())
    finals = [o.final_state[0] for o in outs]

    def serial(order: tuple[int, ...]) -> bool:
        """Whether response order[n] is the state after requests order[0..n], for every n."""
        for n in range(1, len(order) + 1):
            whole = tuple(torch.cat([seqs[j][t] for j in order[:n]]) for t in range(5))
            if rel(finals[order[n - 1]], reference([whole])[1][0]) >= TOL:
                return False
        return True

    order = next((o for o in itertools.permutations(range(len(seqs))) if serial(o)), None)
    assert order is not None, "the responses are not one serial application of the requests"
    assert torch.equal(state[0], finals[order[-1]])
