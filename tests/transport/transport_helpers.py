"""Helpers for the transport tests: the service tests' server and inputs (tests/server_harness.py), and a hand-made POSIX shared memory region to build
shared memory requests with, including wrong ones."""
from __future__ import annotations

import http.server
import json
import os
import resource
import secrets
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import httpx
import torch

from kda_client.client import KDAClient, PrefillOutput
from kda_client.framed import FramedExchange
from service.wire.frames import PREPARED_ID, Op
from service.wire.tensors import JSON_DTYPES, JSON_NAMES
from server_harness import (  # noqa: F401  (re-exported for this folder's tests)
    GEOMETRY_ARGS, H, HV, K, LAYERS, SLOTS, Server, TOL, V, free_port, make_sequence, pool_image, reference, rel,
    start_server,
)

ROOT = Path(__file__).resolve().parents[2]
SHM_JSON = "application/vnd.kda.shm+json"


NAMES = ("q", "k", "v", "g", "beta")


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """A threaded stdlib HTTP server of ``handler`` on a free loopback port (yielded), shut
    down on exit: a peer for the client-side transport tests."""
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


class Region:
    """A POSIX shared memory object of ``size`` bytes made by the test (as a client would),
    sparse (ftruncate only), in ``folder`` (the /dev/shm the server sees: another process's
    is ``/proc/<pid>/root/dev/shm``), mapped here as a uint8 tensor; `unlink` removes the
    name."""

    def __init__(self, size: int, folder: str = "/dev/shm") -> None:
        self.name = f"kda-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = f"{folder}/{self.name}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.memory = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)

    def registration(self, ttl_s: Optional[float] = None, name: Optional[str] = None,
                     byte_size: Optional[int] = None) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": name or self.name, "key": "/" + self.name,
                               "byte_size": self.size if byte_size is None else byte_size}
        if ttl_s is not None:
            doc["ttl_s"] = ttl_s
        return doc

    def put(self, offset: int, t: torch.Tensor) -> dict[str, Any]:
        """Write ``t`` at ``offset``; its shared memory tensor reference."""
        n = t.numel() * t.element_size()
        self.memory[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        return {"dtype": JSON_NAMES[t.dtype], "shape": list(t.shape),
                "shm": {"region": self.name, "offset": offset, "byte_size": n}}

    def get(self, ref: dict[str, Any]) -> torch.Tensor:
        """A copy of the tensor a response places in this region."""
        shm = ref["shm"]
        raw = self.memory[shm["offset"]:shm["offset"] + shm["byte_size"]]
        return raw.view(JSON_DTYPES[ref["dtype"]]).view(ref["shape"]).clone()

    def unlink(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


@contextmanager
def registered_region(url: str, size: int = 1 << 20) -> Iterator[Region]:
    """A POSIX shared memory region of ``size`` bytes registered with the server at ``url``
    for the block; unregistered and unlinked after."""
    region = Region(size)
    assert httpx.post(f"{url}/shm/regions", json=region.registration()).status_code == 201
    try:
        yield region
    finally:
        httpx.delete(f"{url}/shm/regions/{region.name}")
        region.unlink()


def prepare_and_run(exchange: FramedExchange, doc: dict[str, Any]) -> bytes:
    """``doc`` prepared over the framed ``exchange`` (201) and run once (200): its packed
    prepared id, for more RUNs and the RELEASE."""
    answer = exchange.request(Op.PREPARE, dumps(doc))
    assert answer.status == 201, answer.body
    prepared = PREPARED_ID.pack(json.loads(answer.body)["prepared"])
    assert exchange.request(Op.RUN, prepared).status == 200
    return prepared


@contextmanager
def file_size_limit(pid: int, limit: int) -> Iterator[None]:
    """Process ``pid``'s RLIMIT_FSIZE (soft) at ``limit`` bytes while the block runs: a
    write at or past that offset of any file fails with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


def shm_request(region: Region, slots: Sequence[Optional[str]], seqs: Sequence[Sequence[torch.Tensor]],
                layer: int = 0, **options: Any) -> dict[str, Any]:
    """A /prefill shared memory request with the packed inputs written from offset 0 of
    ``region``, o and final_state after them (64-byte aligned, room exactly as needed)."""
    doc: dict[str, Any] = {"layer": layer, "sequences": [{"slot": s, "length": int(x[0].shape[0])}
                                                        for s, x in zip(slots, seqs)], **options}
    offset = 0
    for i, name in enumerate(NAMES):
        packed = torch.cat([x[i] for x in seqs])
        doc[name] = region.put(offset, packed)
        offset += -(-packed.numel() * packed.element_size() // 64) * 64
    T = sum(int(x[0].shape[0]) for x in seqs)
    o_size = T * HV * V * seqs[0][2].element_size()
    final_size = len(seqs) * HV * V * K * 4
    doc["outputs"] = {"o": {"region": region.name, "offset": offset, "byte_size": o_size},
                      "final_state": {"region": region.name, "offset": offset + -(-o_size // 64) * 64,
                                      "byte_size": final_size}}
    return doc


def prefill_and_continue(client: KDAClient, first: Sequence[Sequence[torch.Tensor]],
                         second: Sequence[Sequence[torch.Tensor]], **options: Any) -> tuple[PrefillOutput, PrefillOutput]:
    """Two prefills through ``client``: ``first`` on new slots, then ``second`` continuing
    them; both outputs."""
    a = client.prefill(0, [(None, *s) for s in first], **options)
    b = client.prefill(0, [(slot, *s) for slot, s in zip(a.slots, second)], **options)
    return a, b


def assert_continuation_matches(first: Sequence[Sequence[torch.Tensor]], second: Sequence[Sequence[torch.Tensor]],
                                outs: Sequence[tuple[PrefillOutput, PrefillOutput]], **options: Any) -> None:
    """``outs``: `prefill_and_continue` of ``first`` then ``second`` through two transports.
    Both equal bit for bit, and the second within `TOL` of the float64 reference."""
    for x, y in zip(outs[0], outs[1]):
        assert torch.equal(x.o_packed, y.o_packed)
        assert torch.equal(x.final_state, y.final_state)
    o1, h1 = reference(first, **options)
    o2, h2 = reference(second, initial=h1, **options)
    a, b = outs[1]
    assert rel(a.o_packed, o1) < TOL and rel(a.final_state, h1) < TOL
    assert rel(b.o_packed, o2) < TOL and rel(b.final_state, h2) < TOL


def dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def request_head(method: str, path: str, headers: Sequence[tuple[str, str]]) -> bytes:
    """An HTTP/1.1 request line and headers, as bytes for a raw socket."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length from ``s``: status, headers, body. Reads
    exactly its bytes (the head a byte at a time), so pipelined responses can follow."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += _recv_exactly(s, 1)
    head = head[:-4]
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, _recv_exactly(s, int(headers.get("content-length", "0")))


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data
