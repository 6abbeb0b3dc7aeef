"""The shared memory extensions with tritonclient's own helpers: system shared memory in
and out, offsets, bounds checks with no state change, status and unregister; the CUDA
extension's refusal on a server without CUDA (and, where CUDA exists, CUDA IPC in and out)."""
from __future__ import annotations

import importlib.util
import os
import time
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as tc
import tritonclient.utils.shared_memory as shm
from kserve_helpers import (
    HV, K, TOL, V, from_numpy, infer, make_sequence, pool_image, reference, rel, result_tensor, seq_inputs, to_numpy,
)
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

STATE_BYTES = HV * V * K * 4


class Packed:
    """Tensors laid out one after another in a region, from ``start``: each one's offset."""

    def __init__(self, tensors: dict[str, torch.Tensor], start: int) -> None:
        self.tensors = tensors
        self.offsets: dict[str, int] = {}
        at = start
        for name, t in tensors.items():
            self.offsets[name] = at
            at += t.numel() * t.element_size()
        self.end = at

    def write(self, handle: shm.SharedMemoryRegion, base: int = 0) -> None:
        for name, t in self.tensors.items():
            shm.set_shared_memory_region(handle, [to_numpy(t)], offset=base + self.offsets[name])

    def inputs(self, region: str) -> list[tc.InferInput]:
        out = []
        for name, t in self.tensors.items():
            x = tc.InferInput(name, list(t.shape), np_to_triton_dtype(to_numpy(t).dtype))
            x.set_shared_memory(region, t.numel() * t.element_size(), offset=self.offsets[name])
            out.append(x)
        return out


@pytest.fixture
def regions(client) -> Iterator[dict[str, shm.SharedMemoryRegion]]:
    """An input object of 64 KiB registered from byte 128 on (region 'kda_in'), an output
    object of 64 KiB registered whole ('kda_out'); both unregistered and destroyed after."""
    tag = f"{os.getpid()}_{id(client)}"
    handles = {"kda_in": shm.create_shared_memory_region("kda_in", f"/kda_in_{tag}", 1 << 16),
               "kda_out": shm.create_shared_memory_region("kda_out", f"/kda_out_{tag}", 1 << 16)}
    client.register_system_shared_memory("kda_in", f"/kda_in_{tag}", (1 << 16) - 128, offset=128)
    client.register_system_shared_memory("kda_out", f"/kda_out_{tag}", 1 << 16)
    yield handles
    client.unregister_system_shared_memory()
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def shm_outputs(o_bytes: int, o_offset: int = 0, state_offset: int = 32 << 10) -> list[tc.InferRequestedOutput]:
    o, state = tc.InferRequestedOutput("o"), tc.InferRequestedOutput("final_state")
    o.set_shared_memory("kda_out", o_bytes, offset=o_offset)
    state.set_shared_memory("kda_out", STATE_BYTES, offset=state_offset)
    return [o, state]


def test_status_lists_the_registered_regions(client, regions):
    status = {r["name"]: r for r in client.get_system_shared_memory_status()}
    assert set(status) >= {"kda_in", "kda_out"}
    assert status["kda_in"]["offset"] == 128 and status["kda_in"]["byte_size"] == (1 << 16) - 128
    assert client.get_system_shared_memory_status("kda_out")[0]["key"].startswith("/kda_out_")


def test_a_sequence_through_system_shared_memory_equals_binary_data(server, client, regions, gen):
    """Two requests of one sequence with every input read from 'kda_in' (at offsets past
    the registered offset) and both outputs written into 'kda_out': the same bytes as the
    binary-data path, and the float64 reference."""
    seqs = [make_sequence(n, gen) for n in (7, 5)]
    outs, finals = [], []
    for i, seq in enumerate(seqs):
        packed = Packed(seq_inputs(seq), start=256)
        packed.write(regions["kda_in"], base=128)
        o_bytes = seq[2].numel() * 4
        r = client.infer("kda", packed.inputs("kda_in"), outputs=shm_outputs(o_bytes, o_offset=64),
                         sequence_id="shm-seq", sequence_start=i == 0, sequence_end=i == 1)
        described = {o["name"]: o for o in r.get_response()["outputs"]}
        assert described["o"]["parameters"] == {"shared_memory_region": "kda_out", "shared_memory_byte_size": o_bytes,
                                                "shared_memory_offset": 64}
        assert "data" not in described["o"] and "data" not in described["final_state"]
        outs.append(from_numpy(shm.get_contents_as_numpy(regions["kda_out"], np.float32, [len(seq[0]), HV, V], 64)))
        finals.append(from_numpy(shm.get_contents_as_numpy(regions["kda_out"], np.float32, [HV, V, K], 32 << 10)))
    whole = tuple(torch.cat([s[i] for s in seqs]) for i in range(5))
    o_ref, final_ref = reference([whole])
    assert rel(torch.cat(outs), o_ref) < TOL and rel(finals[-1], final_ref[0]) < TOL
    binary = [infer(client, seq_inputs(s), sequence_id="binary-seq", start=i == 0, end=i == 1)
              for i, s in enumerate(seqs)]
    assert torch.equal(torch.cat(outs), torch.cat([result_tensor(r, "o") for r in binary]))
    assert torch.equal(finals[-1], result_tensor(binary[-1], "final_state"))


def test_bf16_inputs_from_shared_memory(client, regions, gen):
    seq = tuple(t.bfloat16() for t in make_sequence(6, gen))
    packed = Packed(seq_inputs(seq), start=0)
    packed.write(regions["kda_in"], base=128)
    r = client.infer("kda", packed.inputs("kda_in"), outputs=[tc.InferRequestedOutput("o")])
    assert r.get_output("o")["datatype"] == "BF16"
    assert torch.equal(result_tensor(r, "o"), result_tensor(infer(client, seq_inputs(seq)), "o"))


def _refused(server, client, slots, call, status: str, *words: str) -> None:
    before = pool_image(server.url, slots)
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == status, e.value.message()
    for word in words:
        assert word in e.value.message(), e.value.message()
    assert pool_image(server.url, slots) == before


def test_out_of_bounds_and_short_regions_are_refused_before_anything_runs(server, client, regions, gen):
    """Inputs or outputs past a region's end, a byte size that disagrees with the shape, and
    an output room smaller than the output: 400, and the live sequence's slot unchanged."""
    seq = make_sequence(6, gen)
    slot = infer(client, seq_inputs(seq), sequence_id="bounds", start=True).get_response()["parameters"]["slot"]
    packed = Packed(seq_inputs(make_sequence(6, gen)), start=0)
    packed.write(regions["kda_in"], base=128)
    region_size = (1 << 16) - 128

    def with_input(name: str, nbytes: int, offset: int) -> list[tc.InferInput]:
        inputs = packed.inputs("kda_in")
        for x in inputs:
            if x.name() == name:
                x.set_shared_memory("kda_in", nbytes, offset=offset)
        return inputs

    v_bytes = 6 * HV * V * 4
    cases = [
        (lambda: client.infer("kda", with_input("v", v_bytes, region_size - 8), sequence_id="bounds"),
         "400", "input 'v': bytes", f"fall outside shared memory region 'kda_in' of {region_size} bytes"),
        (lambda: client.infer("kda", with_input("v", v_bytes - 4, 0), sequence_id="bounds"),
         "400", "input 'v'", f"is {v_bytes} bytes, but its shared_memory_region says {v_bytes - 4}"),
        (lambda: client.infer("kda", packed.inputs("kda_in"), outputs=shm_outputs(v_bytes - 4), sequence_id="bounds"),
         "400", f"output 'o' needs {v_bytes} bytes, but its shared_memory_byte_size is {v_bytes - 4}"),
        (lambda: client.infer("kda", packed.inputs("kda_in"), outputs=shm_outputs(v_bytes, o_offset=(1 << 16) - 100),
                              sequence_id="bounds"),
         "400", "output 'o': bytes", "fall outside shared memory region 'kda_out'"),
        (lambda: client.infer("kda", packed.inputs("nowhere"), sequence_id="bounds"),
         "400", "unknown shared memory region 'nowhere'"),
    ]
    for call, status, *words in cases:
        _refused(server, client, [slot], call, status, *words)
    r = infer(client, seq_inputs(make_sequence(3, gen)), sequence_id="bounds", end=True)
    assert r.get_response()["outputs"][0]["shape"] == [3, HV, V]


def test_register_refusals_and_unregister(server, client, regions):
    tag = f"{os.getpid()}_{id(client)}"
    for call, words in [
        (lambda: client.register_system_shared_memory("kda_in", f"/kda_in_{tag}", 16), "already registered"),
        (lambda: client.register_system_shared_memory("x", "/kda_no_such_key", 16), "unable to open shared memory key"),
        (lambda: client.register_system_shared_memory("x", f"/kda_out_{tag}", 1 << 16, offset=1),
         f"holds {1 << 16} bytes, fewer than offset 1 + byte_size {1 << 16}"),
        (lambda: client.register_system_shared_memory("x", "/a/b", 16), "must be a name like '/my_region'"),
        (lambda: client.get_system_shared_memory_status("nope"), "unknown system shared memory region 'nope'"),
    ]:
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "400" and words in e.value.message(), e.value.message()
    client.unregister_system_shared_memory("not-registered")  # a no-op, as in Triton
    client.unregister_system_shared_memory("kda_out")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["kda_in"]
    assert os.path.exists(f"/dev/shm/kda_out_{tag}")  # the client's memory stays the client's
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for servers without CUDA")
def test_cuda_shared_memory_needs_a_cuda_device(client):
    assert "cuda_shared_memory" not in client.get_server_metadata()["extensions"]
    for call in (lambda: client.register_cuda_shared_memory("c", b"AAAA", 0, 16),
                 lambda: client.get_cuda_shared_memory_status(),
                 lambda: client.unregister_cuda_shared_memory()):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "400" and "CUDA shared memory needs a CUDA device" in e.value.message()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cuda") is None,
                    reason="needs a CUDA device and cuda-python")
def test_cuda_shared_memory_in_and_out(client, gen):
    """Inputs and outputs in CUDA IPC memory of this (client) process: the same results as
    binary data."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    seq = make_sequence(9, gen)
    tensors = seq_inputs(seq)
    sizes = {n: t.numel() * 4 for n, t in tensors.items()}
    in_handle = cudashm.create_shared_memory_region("kda_cuda_in", sum(sizes.values()), 0)
    out_handle = cudashm.create_shared_memory_region("kda_cuda_out", sizes["v"] + STATE_BYTES, 0)
    try:
        cudashm.set_shared_memory_region(in_handle, [to_numpy(t) for t in tensors.values()])
        client.register_cuda_shared_memory("kda_cuda_in", cudashm.get_raw_handle(in_handle), 0, sum(sizes.values()))
        client.register_cuda_shared_memory("kda_cuda_out", cudashm.get_raw_handle(out_handle), 0,
                                           sizes["v"] + STATE_BYTES)
        inputs, at = [], 0
        for name, t in tensors.items():
            x = tc.InferInput(name, list(t.shape), "FP32")
            x.set_shared_memory("kda_cuda_in", sizes[name], offset=at)
            inputs.append(x)
            at += sizes[name]
        o, state = tc.InferRequestedOutput("o"), tc.InferRequestedOutput("final_state")
        o.set_shared_memory("kda_cuda_out", sizes["v"])
        state.set_shared_memory("kda_cuda_out", STATE_BYTES, offset=sizes["v"])
        client.infer("kda", inputs, outputs=[o, state])
        got_o = cudashm.get_contents_as_numpy(out_handle, triton_to_np_dtype("FP32"), [9, HV, V])
        expected = infer(client, tensors)
        assert torch.equal(from_numpy(got_o), result_tensor(expected, "o"))
        assert [r["name"] for r in client.get_cuda_shared_memory_status()] == ["kda_cuda_in", "kda_cuda_out"]
    finally:
        client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(in_handle)
        cudashm.destroy_shared_memory_region(out_handle)


def test_a_registration_with_a_lease_goes_when_unused(server, client):
    """kda-serve's ``ttl_s`` on a system registration: unregistered once unused that long,
    the client's memory left as it is."""
    tag = f"{os.getpid()}_{id(client)}_lease"
    handle = shm.create_shared_memory_region("kda_lease", f"/kda_lease_{tag}", 4096)
    try:
        r = httpx.post(f"{server.url}/v2/systemsharedmemory/region/kda_lease/register",
                       json={"key": f"/kda_lease_{tag}", "byte_size": 4096, "ttl_s": 0.3})
        assert r.status_code == 200, r.text
        assert [s["name"] for s in client.get_system_shared_memory_status()] == ["kda_lease"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and client.get_system_shared_memory_status():
            time.sleep(0.2)
        assert client.get_system_shared_memory_status() == []
        assert os.path.exists(f"/dev/shm/kda_lease_{tag}")
    finally:
        shm.destroy_shared_memory_region(handle)
