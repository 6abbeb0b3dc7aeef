"""A bounded load test of a kda-serve on loopback, and its figures.

Clients (asyncio, one httpx connection each, safetensors bodies):

- ``clients`` sequence clients: each allocates one slot and continues its own sequence
  with /prefill requests of 1..``max_tokens`` tokens until the deadline, keeping every
  input and output; the odd ones on layer 1, the even ones on layer 0.
- ``churners``: allocate 1..4 slots, fork one, prefill a new sequence (a null slot), free
  all they made, and again.
- one filler: every ``full_every_s`` it takes every free slot for ``full_hold_s`` seconds,
  so the churners' allocations meet a full pool (503 with Retry-After) and retry.

`verify` then checks every sequence client against its own float64 reference
(`kernels.naive_recurrent_kda`): all clients at once in one call, each client's value heads
side by side (heads are independent, so this is each client's own reference), the shorter
sequences padded with tokens that leave a state unchanged (beta = 0, g = 0).

Run it by hand for the figures in docs/RELIABILITY.md::

    PYTHONPATH=. python tests/reliability/load_driver.py --clients 64 --seconds 120
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import torch
from reliability_helpers import GEOMETRY_ARGS, HV, LAYERS, TOL, make_sequence, rel, rss_bytes, start_server

import kernels
from service.wire.prefill import decode_prefill_response
from service.wire.safetensors_codec import encode_safetensors
from service.wire.state import decode_state_safetensors

ST = "application/x-safetensors"
NAMES = ("q", "k", "v", "g", "beta")


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 64
    seconds: float = 60.0
    churners: int = 4
    max_tokens: int = 4
    full_every_s: float = 5.0
    full_hold_s: float = 0.5
    warm_fraction: float = 0.25  # the server's memory is read this far into the run, and at its end


@dataclass
class Sequence:
    """One sequence client's slot, layer, inputs and outputs, in request order. (Tensors
    stay out of reprs: asyncio.run formats its main task's result when it restores the
    SIGINT handler, and printing thousands of tensors takes minutes.)"""

    slot: str
    layer: int
    inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list, repr=False)
    outputs: list[torch.Tensor] = field(default_factory=list, repr=False)
    final: Optional[torch.Tensor] = field(default=None, repr=False)


@dataclass
class LoadReport:
    """What happened: request counts by (kind, status), prefill latencies, the server's
    resident memory at the warm mark and at the end, and every unexpected answer."""

    config: LoadConfig
    elapsed_s: float = 0.0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    latencies_s: list[float] = field(default_factory=list, repr=False)
    pool_full: int = 0
    problems: list[str] = field(default_factory=list)
    rss_warm: int = 0
    rss_end: int = 0
    sequences: list[Sequence] = field(default_factory=list, repr=False)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def figures(self) -> dict[str, object]:
        lat = sorted(self.latencies_s)
        return {
            "clients": self.config.clients, "churners": self.config.churners, "seconds": round(self.elapsed_s, 1),
            "requests": self.requests, "requests_per_s": round(self.requests / self.elapsed_s, 1),
            "prefills": len(lat), "prefill_p50_ms": round(1000 * statistics.median(lat), 2),
            "prefill_p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2),
            "pool_full_503": self.pool_full, "errors": len(self.problems),
            "statuses": {f"{kind} {status}": n for (kind, status), n in sorted(self.statuses.items())},
            "rss_warm_mib": round(self.rss_warm / 2**20, 1), "rss_end_mib": round(self.rss_end / 2**20, 1),
            "tokens_per_sequence": round(statistics.mean(sum(x[0].shape[0] for x in s.inputs) for s in self.sequences)),
        }


def _body(layer: int, slot: Optional[str], seq: tuple[torch.Tensor, ...]) -> bytes:
    request = {"layer": layer, "sequences": [{"slot": slot, "length": seq[0].shape[0]}]}
    return bytes(encode_safetensors(dict(zip(NAMES, seq)), {"request": json.dumps(request)}))


class Load:
    """One run against ``url``; the server process is ``pid`` (for its memory)."""

    def __init__(self, url: str, pid: int, config: LoadConfig) -> None:
        self.url = url
        self.pid = pid
        self.config = config
        self.report = LoadReport(config)
        self.deadline = 0.0

    def _note(self, kind: str, r: httpx.Response, ok: tuple[int, ...]) -> bool:
        """Count ``r``; a 503 must be pool-full with Retry-After; anything else not in
        ``ok`` is a problem. Whether the answer was one of ``ok``."""
        self.report.statuses[(kind, r.status_code)] += 1
        if r.status_code in ok:
            return True
        if r.status_code == 503:
            self.report.pool_full += 1
            problem = r.json()
            if not r.headers.get("retry-after", "").isdigit() or not problem["type"].endswith(":pool-full"):
                self.report.problems.append(f"{kind}: 503 without Retry-After or not pool-full: {r.headers} {r.text}")
        else:
            self.report.problems.append(f"{kind}: {r.status_code} {r.text[:300]}")
        return False

    async def _alloc(self, http: httpx.AsyncClient, count: int) -> list[str]:
        """``count`` slots, retrying (after a short nap) while the pool is full."""
        while True:
            r = await http.post("/slots", json={"count": count})
            if self._note("alloc", r, (201,)):
                return r.json()["slots"]
            if time.monotonic() > self.deadline + 30:
                raise RuntimeError("no slot for 30 s past the deadline")
            await asyncio.sleep(0.05)

    async def sequence_client(self, i: int) -> None:
        rng = torch.Generator().manual_seed(10_000 + i)
        choose = random.Random(i)
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            seq = Sequence((await self._alloc(http, 1))[0], i % LAYERS)
            self.report.sequences.append(seq)
            while time.monotonic() < self.deadline:
                x = make_sequence(choose.randint(1, self.config.max_tokens), rng)
                start = time.monotonic()
                r = await http.post("/prefill", content=_body(seq.layer, seq.slot, x), headers={"content-type": ST})
                self.report.latencies_s.append(time.monotonic() - start)
                if self._note("prefill", r, (200,)):
                    _, o, _ = decode_prefill_response(bytearray(r.content), ST)
                    seq.inputs.append(x)
                    seq.outputs.append(o.clone())
            r = await http.get(f"/slots/{seq.slot}/state")
            if self._note("state", r, (200,)):
                seq.final = decode_state_safetensors(bytearray(r.content))[seq.layer].clone()

    async def churner(self, i: int) -> None:
        rng = torch.Generator().manual_seed(20_000 + i)
        choose = random.Random(1000 + i)
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            while time.monotonic() < self.deadline:
                r = await http.post("/slots", json={"count": choose.randint(1, 4)})
                if not self._note("alloc", r, (201,)):
                    await asyncio.sleep(0.05)
                    continue
                made = r.json()["slots"]
                r = await http.post(f"/slots/{made[0]}/fork")
                if self._note("fork", r, (201,)):
                    made.append(r.json()["slot"])
                r = await http.post("/prefill", content=_body(choose.randint(0, LAYERS - 1), None, make_sequence(2, rng)),
                                    headers={"content-type": ST})
                if self._note("prefill-new", r, (200,)):
                    made.extend(decode_prefill_response(bytearray(r.content), ST)[0])
                for slot in made:
                    self._note("free", await http.delete(f"/slots/{slot}"), (204,))

    async def filler(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            while time.monotonic() + self.config.full_every_s < self.deadline:
                await asyncio.sleep(self.config.full_every_s)
                free = (await http.get("/info")).json()["free_slots"]
                if free < 1:
                    continue
                r = await http.post("/slots", json={"count": free})
                if not self._note("fill", r, (201,)):
                    continue  # someone took a slot meanwhile
                await asyncio.sleep(self.config.full_hold_s)
                for slot in r.json()["slots"]:
                    self._note("free", await http.delete(f"/slots/{slot}"), (204,))

    async def memory(self) -> None:
        await asyncio.sleep(self.config.seconds * self.config.warm_fraction)
        self.report.rss_warm = rss_bytes(self.pid)

    async def run(self) -> LoadReport:
        start = time.monotonic()
        self.deadline = start + self.config.seconds
        await asyncio.gather(
            *(self.sequence_client(i) for i in range(self.config.clients)),
            *(self.churner(i) for i in range(self.config.churners)),
            self.filler(), self.memory(),
        )
        self.report.elapsed_s = time.monotonic() - start
        self.report.rss_end = rss_bytes(self.pid)
        return self.report


def run_load(url: str, pid: int, config: LoadConfig) -> LoadReport:
    return asyncio.run(Load(url, pid, config).run())


def verify(report: LoadReport) -> list[str]:
    """Each sequence client's outputs and final state against its own float64 reference;
    returns the clients that disagree (relative L2 error over TOL)."""
    seqs = report.sequences
    lengths = [sum(x[0].shape[0] for x in s.inputs) for s in seqs]
    T = max(lengths)

    def packed(s: Sequence, n: int) -> torch.Tensor:
        """Input ``n`` of client ``s``, all its tokens, padded to T with no-op tokens."""
        whole = torch.cat([x[n] for x in s.inputs])
        pad = torch.zeros(T - whole.shape[0], *whole.shape[1:])
        if NAMES[n] in ("q", "k", "v"):
            pad = pad + 1.0  # anything: with beta = 0 and g = 0 a token leaves S as it is
        return torch.cat([whole, pad])

    side_by_side = [torch.cat([packed(s, n) for s in seqs], dim=1) for n in range(len(NAMES))]
    o_ref, final_ref = kernels.naive_recurrent_kda(*side_by_side)
    bad = []
    for c, (s, n) in enumerate(zip(seqs, lengths)):
        heads = slice(c * HV, (c + 1) * HV)
        o = torch.cat(s.outputs)
        if s.final is None or rel(o, o_ref[:n, heads]) >= TOL or rel(s.final, final_ref[0, heads]) >= TOL:
            bad.append(f"{s.slot} (layer {s.layer}, {n} tokens)")
    return bad


def server_args(config: LoadConfig) -> list[str]:
    """The load server: the service tests' geometry with room for every sequence client,
    the churners' slots and a little more (so the filler has something to take)."""
    return [*GEOMETRY_ARGS, "--num-slots", str(config.clients + 5 * config.churners + 8), "--batch-window-ms", "2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--churners", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LoadConfig(clients=args.clients, seconds=args.seconds, churners=args.churners, max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(server_args(config), Path(tmp) / "kda-serve.log")
        try:
            report = run_load(server.url, server.process.pid, config)
        finally:
            status = server.stop()
    figures = report.figures()
    figures["exit_status"] = status
    figures["wrong_sequences"] = verify(report)
    figures["problems"] = report.problems[:10]
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
