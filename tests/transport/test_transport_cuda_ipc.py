"""CUDA IPC through POST /prefill: a region of this (client) process's device memory,
shared with torch's own IPC handle (the one torch.multiprocessing sends between processes),
registered through the KServe v2 CUDA shared memory extension (one registry for both
endpoints), and named by a shared memory prefill. Runs only where CUDA and cuda-python exist."""
from __future__ import annotations

import base64
import importlib.util
import json
import math
import pathlib

import httpx
import pytest
import torch
from transport_helpers import (
    GEOMETRY_ARGS, H, HV, K, NAMES, SHM_JSON, TOL, V, Server, dumps, make_sequence, reference, rel, start_server,
)

from kda_client.client import KDAClient
from kda_client.framed import FramedExchange
from kda_client.shm import cuda_ipc_handle
from service.wire.frames import PREPARED_ID, Op
from service.wire.tensors import JSON_NAMES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cuda") is None,
                       reason="needs a CUDA device and cuda-python"),
]


def _ipc_prefill(url: str, seq: tuple[torch.Tensor, ...], skew: int = 0) -> tuple[torch.Tensor, torch.Tensor, str]:
    """One shared memory prefill of ``seq`` on a new slot, its tensors in one CUDA region of
    this process (``skew`` bytes after an aligned start: an odd skew misaligns every input
    for its dtype); the o [T, HV, V] and final state [1, HV, V, K] it wrote, and the slot."""
    T = seq[0].shape[0]
    sizes = [t.numel() * t.element_size() for t in seq]
    o_size, final_size = T * HV * V * 4, HV * V * K * 4
    memory = torch.zeros(skew + sum(sizes) + o_size + final_size, dtype=torch.uint8, device="cuda:0")
    # torch's IPC handle opens the caching allocator's block; the storage starts `base` bytes into it
    handle, base = cuda_ipc_handle(memory)
    doc: dict = {"layer": 0, "sequences": [{"slot": None, "length": T}]}
    at = skew
    for name, t, size in zip(NAMES, seq, sizes):
        memory[at:at + size].copy_(t.contiguous().view(-1).view(torch.uint8).cuda())
        doc[name] = {"dtype": JSON_NAMES[t.dtype], "shape": list(t.shape),
                     "shm": {"region": "kda-cuda", "offset": base + at, "byte_size": size}}
        at += size
    doc["outputs"] = {"o": {"region": "kda-cuda", "offset": base + at, "byte_size": o_size},
                      "final_state": {"region": "kda-cuda", "offset": base + at + o_size, "byte_size": final_size}}
    torch.cuda.synchronize()
    register = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0,
                "byte_size": base + memory.numel()}
    r = httpx.post(f"{url}/v2/cudasharedmemory/region/kda-cuda/register", json=register)
    assert r.status_code == 200, r.text
    try:
        r = httpx.post(f"{url}/prefill", content=dumps(doc), headers={"content-type": SHM_JSON}, timeout=60)
        assert r.status_code == 200, r.text
        o = memory[at:at + o_size].clone().view(torch.float32).view(T, HV, V).cpu()
        final = memory[at + o_size:].clone().view(torch.float32).view(1, HV, V, K).cpu()
        return o, final, r.json()["slots"][0]
    finally:
        httpx.post(f"{url}/v2/cudasharedmemory/region/kda-cuda/unregister")


def test_cuda_ipc_prefill_equals_binary(server: Server, gen: torch.Generator) -> None:
    seq = make_sequence(21, gen)
    o, final, slot = _ipc_prefill(server.url, seq)
    with KDAClient(server.url) as binary:
        want = binary.prefill(0, [(None, *seq)])
        assert torch.equal(o, want.o_packed) and torch.equal(final, want.final_state)
        binary.free(want.slots[0])
        binary.free(slot)


def test_zero_copy_prefill_equals_the_copying_server(server: Server, gen: torch.Generator,
                                                     tmp_path: pathlib.Path) -> None:
    """``--cuda-ipc-zero-copy``: inputs read in place (aligned) or, misaligned for their
    dtype, still copied give the numbers the default server gives from its copies; the
    reference agrees with both."""
    seq = make_sequence(150, gen)
    zero_copy = start_server([*GEOMETRY_ARGS, "--cuda-ipc-zero-copy"], tmp_path / "kda-zero-copy.log")
    try:
        for skew in (0, 1):
            o, final, _ = _ipc_prefill(zero_copy.url, seq, skew)
            o_copy, final_copy, slot = _ipc_prefill(server.url, seq, skew)
            assert rel(o, o_copy) < 1e-6 and rel(final, final_copy) < 1e-6
            with KDAClient(server.url) as client:
                client.free(slot)
        ref_o, ref_final = reference([seq])
        assert rel(o, ref_o) < TOL and rel(final, ref_final[0:1]) < TOL
    finally:
        assert zero_copy.stop() == 0, zero_copy.log_text()
    assert "--cuda-ipc-zero-copy" in zero_copy.log_text()


def _cuda_regions(server: Server) -> list[dict]:
    return httpx.get(f"{server.url}/v2/cudasharedmemory/status").json()


@pytest.mark.parametrize("over", ["http", "framed socket"])
def test_client_cuda_transport_equals_binary(server: Server, framed_socket: str, gen: torch.Generator,
                                             over: str) -> None:
    """KDAClient(transport="cuda"), its prefills over HTTP or the framed socket: device
    inputs, device results, the same numbers as the binary path; a continuation on the same
    slots; one region while open, none after."""
    first = [make_sequence(70, gen), make_sequence(1, gen), make_sequence(130, gen)]
    second = [make_sequence(40, gen), make_sequence(65, gen), make_sequence(3, gen)]
    before = {r["name"] for r in _cuda_regions(server)}
    framed = framed_socket if over == "framed socket" else None
    with KDAClient(server.url) as binary, KDAClient(server.url, transport="cuda", framed_socket=framed) as cuda:
        outs = []
        for client, dev in ((binary, "cpu"), (cuda, "cuda")):
            a = client.prefill(0, [(None, *(t.to(dev) for t in s)) for s in first], use_qk_l2norm=True)
            b = client.prefill(0, [(slot, *(t.to(dev) for t in s)) for slot, s in zip(a.slots, second)],
                               use_qk_l2norm=True)
            outs.append((a, b))
        assert len({r["name"] for r in _cuda_regions(server)} - before) == 1
        for x, y in zip(outs[0], outs[1]):
            assert y.o_packed.device.type == "cuda" and y.final_state.device.type == "cuda"
            assert torch.equal(x.o_packed, y.o_packed.cpu()) and torch.equal(x.final_state, y.final_state.cpu())
        for slot in outs[0][0].slots + outs[1][0].slots:
            binary.free(slot)
    assert {r["name"] for r in _cuda_regions(server)} == before


def test_client_cuda_transport_grows_and_keeps_host_inputs_working(server: Server, gen: torch.Generator) -> None:
    """Host tensors through transport="cuda" (copied in by the client); a larger request
    replaces the region (the old one unregistered, not added to)."""
    small, large = make_sequence(5, gen), make_sequence(3000, gen, dtype=torch.bfloat16)
    with KDAClient(server.url, transport="cuda") as cuda, KDAClient(server.url) as binary:
        a = cuda.prefill(0, [(None, *small)])
        names = {r["name"] for r in _cuda_regions(server)}
        b = cuda.prefill(0, [(None, *large)], return_final_state=False)
        after = {r["name"] for r in _cuda_regions(server)}
        assert len(after) == len(names) and after != names
        assert b.o_packed.dtype == torch.bfloat16 and b.final_state is None
        want = binary.prefill(0, [(None, *small)])
        assert torch.equal(a.o_packed.cpu(), want.o_packed)
        for slot in a.slots + b.slots + want.slots:
            binary.free(slot)


def test_client_cuda_transport_registers_the_same_memory_after_the_server_lost_it(
        server: Server, gen: torch.Generator) -> None:
    """The server forgets the region (as when its lease runs out): the next prefill
    registers the same GPU memory again under the same name (a new allocation would leak),
    and the result is unchanged."""
    seq = make_sequence(30, gen)
    before = {r["name"] for r in _cuda_regions(server)}
    with KDAClient(server.url, transport="cuda") as cuda, KDAClient(server.url) as binary:
        a = cuda.prefill(0, [(None, *seq)])
        (name,) = {r["name"] for r in _cuda_regions(server)} - before
        assert httpx.post(f"{server.url}/v2/cudasharedmemory/region/{name}/unregister").status_code == 200
        b = cuda.prefill(0, [(None, *seq)])
        assert {r["name"] for r in _cuda_regions(server)} - before == {name}
        assert torch.equal(a.o_packed, b.o_packed)
        for slot in a.slots + b.slots:
            binary.free(slot)


def test_a_size_past_the_allocation_is_refused(server: Server) -> None:
    """A registered byte_size larger than the CUDA allocation the handle names is a 400
    naming byte_size (a kernel reading past the allocation would fault the server), and
    registers nothing."""
    memory = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    handle, base = cuda_ipc_handle(memory)
    before = _cuda_regions(server)
    register = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0,
                "byte_size": base + (1 << 30)}
    r = httpx.post(f"{server.url}/v2/cudasharedmemory/region/kda-too-big/register", json=register)
    assert r.status_code == 400 and "byte_size" in r.text, r.text
    assert _cuda_regions(server) == before


def test_two_clients_whose_regions_share_an_allocator_block(server: Server, gen: torch.Generator) -> None:
    """Two transport="cuda" clients of one process: their small regions (1 MiB) come from
    one 2 MiB block of torch's allocator, so both register the same IPC handle. The server
    opens it once, serves both, and keeps it open until the second region goes."""
    seq = make_sequence(9, gen)
    with KDAClient(server.url) as binary:
        want = binary.prefill(0, [(None, *seq)])
        with KDAClient(server.url, transport="cuda") as first, KDAClient(server.url, transport="cuda") as second:
            a = first.prefill(0, [(None, *seq)])
            b = second.prefill(0, [(None, *seq)])
            first.close()  # one region gone: the other's mapping must stay
            c = second.prefill(0, [(None, *seq)])
        for out in (a, b, c):
            assert torch.equal(out.o_packed.cpu(), want.o_packed)
        for slot in want.slots + a.slots + b.slots + c.slots:
            binary.free(slot)


def test_prepared_cuda_ipc_runs_equal_binary_prefills(server: Server, framed_socket: str,
                                                      gen: torch.Generator) -> None:
    """A prepared prefill over CUDA IPC (PREPARE, then RUN frames: a CUDA graph replayed on
    the server) run three times on new inputs equals binary prefills of the same inputs on
    twin slots bit for bit, and the float64 reference, each run going on from the last."""
    _prepared_runs_equal_binary_prefills(server, framed_socket, server, gen, o_over_v=False)


def test_zero_copy_prepared_runs_with_o_over_v_equal_binary_prefills(server: Server, gen: torch.Generator,
                                                                     tmp_path: pathlib.Path) -> None:
    """``--cuda-ipc-zero-copy`` with o named over v's own bytes (an engine writing o where v
    was): the kernels read v in place, so they must not write o there while they run (o is
    copied after them, `service.core.prepared.share_bytes`); the runs still equal binary
    prefills on the copying server and the reference."""
    framed = str(tmp_path / "kda-zero-copy.sock")
    zero_copy = start_server([*GEOMETRY_ARGS, "--cuda-ipc-zero-copy", "--framed-socket", framed],
                             tmp_path / "kda-zero-copy.log")
    try:
        _prepared_runs_equal_binary_prefills(zero_copy, framed, server, gen, o_over_v=True)
    finally:
        assert zero_copy.stop() == 0, zero_copy.log_text()


def _prepared_runs_equal_binary_prefills(ipc: Server, framed_socket: str, binary_server: Server,
                                         gen: torch.Generator, o_over_v: bool) -> None:
    """Three RUNs of a prepared 70 + 1 + 130-token prefill on ``ipc`` (its inputs and
    outputs in one CUDA region of this process; o over v's bytes when ``o_over_v``), each
    equal to a binary prefill of its inputs on twin slots of ``binary_server`` (bit for bit
    when both are one server, else within 1e-6) and to the float64 reference."""
    lengths = (70, 1, 130)
    T, N = sum(lengths), len(lengths)
    shapes = {"q": (T, H, K), "k": (T, H, K), "v": (T, HV, V), "g": (T, HV, K), "beta": (T, HV)}
    offsets, at = {}, 0
    for name, shape in shapes.items():
        offsets[name], at = at, at + 4 * math.prod(shape)
    o_at, final_at = (offsets["v"] if o_over_v else at), at + (0 if o_over_v else T * HV * V * 4)
    o_end = o_at + T * HV * V * 4
    memory = torch.zeros(final_at + N * HV * V * K * 4, dtype=torch.uint8, device="cuda:0")
    handle, base = cuda_ipc_handle(memory)
    with KDAClient(ipc.url) as client, KDAClient(binary_server.url) as binary:
        slots, twins = client.alloc(N), binary.alloc(N)
    doc: dict = {"layer": 0, "sequences": [{"slot": s, "length": n} for s, n in zip(slots, lengths)],
                 "outputs": {"o": {"region": "kda-prepared", "offset": base + o_at, "byte_size": o_end - o_at},
                             "final_state": {"region": "kda-prepared", "offset": base + final_at,
                                             "byte_size": memory.numel() - final_at}}}
    for name, shape in shapes.items():
        doc[name] = {"dtype": "float32", "shape": list(shape),
                     "shm": {"region": "kda-prepared", "offset": base + offsets[name], "byte_size": 4 * math.prod(shape)}}
    register = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0,
                "byte_size": base + memory.numel()}
    assert httpx.post(f"{ipc.url}/v2/cudasharedmemory/region/kda-prepared/register", json=register).status_code == 200
    frames = FramedExchange(framed_socket, None, 120)
    try:
        answer = frames.request(Op.PREPARE, dumps(doc))
        assert answer.status == 201 and json.loads(answer.body)["graphed"], answer.body
        prepared = PREPARED_ID.pack(json.loads(answer.body)["prepared"])
        state = None
        with KDAClient(binary_server.url) as binary:
            for _ in range(3):
                seqs = [make_sequence(n, gen) for n in lengths]
                for i, name in enumerate(shapes):
                    packed = torch.cat([s[i] for s in seqs]).contiguous().view(-1).view(torch.uint8)
                    memory[offsets[name]:offsets[name] + packed.numel()].copy_(packed.cuda())
                if not o_over_v:
                    memory[o_at:].fill_(0xFF)  # poisoned: an output the run leaves unwritten shows as NaN
                memory[final_at:].fill_(0xFF)
                torch.cuda.synchronize()
                answer = frames.request(Op.RUN, prepared)
                assert answer.status == 200, answer.body
                o = memory[o_at:o_end].view(torch.float32).view(T, HV, V).cpu()
                final = memory[final_at:].view(torch.float32).view(N, HV, V, K).cpu()
                want = binary.prefill(0, [(t, *s) for t, s in zip(twins, seqs)])
                if ipc is binary_server:
                    assert torch.equal(o, want.o_packed) and torch.equal(final, want.final_state)
                else:
                    assert rel(o, want.o_packed) < 1e-6 and rel(final, want.final_state) < 1e-6
                o_ref, state = reference(seqs, initial=state)
                assert rel(o, o_ref) < TOL and rel(final, state) < TOL
            assert frames.request(Op.RELEASE, prepared).status == 204
            for slot in twins:
                binary.free(slot)
        with KDAClient(ipc.url) as client:
            for slot in slots:
                client.free(slot)
    finally:
        frames.close()
        httpx.post(f"{ipc.url}/v2/cudasharedmemory/region/kda-prepared/unregister")
