"""CUDA IPC through POST /prefill: a region of this (client) process's device memory,
shared with torch's own IPC handle (the one torch.multiprocessing sends between processes),
registered through the KServe v2 CUDA shared memory extension (one registry for both
endpoints), and named by a shared memory prefill. Runs only where CUDA and cuda-python exist."""
from __future__ import annotations

import base64
import importlib.util

import httpx
import pytest
import torch
from transport_helpers import HV, K, NAMES, SHM_JSON, V, Server, dumps, make_sequence

from service.client import KDAClient
from service.wire.tensors import JSON_NAMES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cuda") is None,
                       reason="needs a CUDA device and cuda-python"),
]


def test_cuda_ipc_prefill_equals_binary(server: Server, gen: torch.Generator) -> None:
    seq = make_sequence(21, gen)
    sizes = [t.numel() * t.element_size() for t in seq]
    o_size, final_size = 21 * HV * V * 4, HV * V * K * 4
    memory = torch.zeros(sum(sizes) + o_size + final_size, dtype=torch.uint8, device="cuda:0")
    storage = memory.untyped_storage()
    # torch's IPC handle opens the caching allocator's block; the storage starts `base` bytes into it
    _, handle, nbytes, base, *_ = storage._share_cuda_()
    doc: dict = {"layer": 0, "sequences": [{"slot": None, "length": 21}]}
    at = 0
    for name, t, size in zip(NAMES, seq, sizes):
        memory[at:at + size].copy_(t.contiguous().view(-1).view(torch.uint8).cuda())
        doc[name] = {"dtype": JSON_NAMES[t.dtype], "shape": list(t.shape),
                     "shm": {"region": "kda-cuda", "offset": base + at, "byte_size": size}}
        at += size
    doc["outputs"] = {"o": {"region": "kda-cuda", "offset": base + at, "byte_size": o_size},
                      "final_state": {"region": "kda-cuda", "offset": base + at + o_size, "byte_size": final_size}}
    torch.cuda.synchronize()
    register = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0, "byte_size": base + nbytes}
    r = httpx.post(f"{server.url}/v2/cudasharedmemory/region/kda-cuda/register", json=register)
    assert r.status_code == 200, r.text
    try:
        r = httpx.post(f"{server.url}/prefill", content=dumps(doc), headers={"content-type": SHM_JSON}, timeout=60)
        assert r.status_code == 200, r.text
        o = memory[at:at + o_size].view(torch.float32).view(21, HV, V).cpu()
        final = memory[at + o_size:].view(torch.float32).view(1, HV, V, K).cpu()
        with KDAClient(server.url) as binary:
            want = binary.prefill(0, [(None, *seq)])
            assert torch.equal(o, want.o_packed) and torch.equal(final, want.final_state)
            binary.free(want.slots[0])
            binary.free(r.json()["slots"][0])
    finally:
        httpx.post(f"{server.url}/v2/cudasharedmemory/region/kda-cuda/unregister")
