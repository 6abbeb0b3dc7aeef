"""The shared memory extensions over gRPC with tritonclient.grpc and its shared memory
helpers: system shared memory in and out (the same bytes as raw tensors and as the same
request over HTTP), one registry for both transports, refusals with HTTP's messages and
no state change; CUDA shared memory refused without CUDA and, on a GPU server, in and out."""
from __future__ import annotations

import importlib.util
import os
from typing import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as gc
import tritonclient.http as tc
import tritonclient.utils.shared_memory as shm
from kserve_helpers import (
    HV, K, TOL, V, from_numpy, grpc_infer, make_sequence, pool_image, reference, rel, response_slot,
    result_tensor, seq_inputs, to_numpy,
)
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

STATE_BYTES = HV * V * K * 4


def place(tensors: dict[str, torch.Tensor], handle: shm.SharedMemoryRegion, start: int,
          base: int = 0) -> dict[str, tuple[int, int]]:
    """Write ``tensors`` one after another from ``start`` (``base`` more into the object);
    each one's (offset in the registered region, byte size)."""
    at, where = start, {}
    for name, t in tensors.items():
        shm.set_shared_memory_region(handle, [to_numpy(t)], offset=base + at)
        where[name] = (at, t.numel() * t.element_size())
        at += t.numel() * t.element_size()
    return where


def shm_inputs(module, tensors: dict[str, torch.Tensor], region: str, where: dict[str, tuple[int, int]]) -> list:
    """InferInputs of ``module`` (tritonclient.grpc or .http) naming ``region``."""
    inputs = []
    for name, t in tensors.items():
        x = module.InferInput(name, list(t.shape), np_to_triton_dtype(to_numpy(t).dtype))
        x.set_shared_memory(region, where[name][1], offset=where[name][0])
        inputs.append(x)
    return inputs


def shm_outputs(module, o_bytes: int, state_offset: int = 32 << 10) -> list:
    o, state = module.InferRequestedOutput("o"), module.InferRequestedOutput("final_state")
    o.set_shared_memory("grpc_out", o_bytes, offset=64)
    state.set_shared_memory("grpc_out", STATE_BYTES, offset=state_offset)
    return [o, state]


@pytest.fixture
def regions(grpc_client) -> Iterator[dict[str, shm.SharedMemoryRegion]]:
    """'grpc_in' (64 KiB, registered from byte 128 on) and 'grpc_out' (64 KiB), registered
    over gRPC; unregistered and destroyed after."""
    tag = f"{os.getpid()}_grpc"
    handles = {"grpc_in": shm.create_shared_memory_region("grpc_in", f"/grpc_in_{tag}", 1 << 16),
               "grpc_out": shm.create_shared_memory_region("grpc_out", f"/grpc_out_{tag}", 1 << 16)}
    grpc_client.register_system_shared_memory("grpc_in", f"/grpc_in_{tag}", (1 << 16) - 128, offset=128)
    grpc_client.register_system_shared_memory("grpc_out", f"/grpc_out_{tag}", 1 << 16)
    yield handles
    grpc_client.unregister_system_shared_memory()
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def test_one_registry_for_both_transports(client, grpc_client, regions):
    status = grpc_client.get_system_shared_memory_status(as_json=True)["regions"]
    assert set(status) == {"grpc_in", "grpc_out"}
    assert status["grpc_in"]["offset"] == "128" and status["grpc_in"]["byte_size"] == str((1 << 16) - 128)
    assert {r["name"] for r in client.get_system_shared_memory_status()} == {"grpc_in", "grpc_out"}
    one = grpc_client.get_system_shared_memory_status("grpc_out", as_json=True)["regions"]
    assert list(one) == ["grpc_out"] and one["grpc_out"]["key"].startswith("/grpc_out_")


def test_a_sequence_through_system_shared_memory_equals_raw_tensors_and_http(server, client, grpc_client, regions,
                                                                             gen):
    """Two requests of one sequence, inputs read from 'grpc_in', outputs written into
    'grpc_out': the same bytes as raw_input_contents over gRPC, as the same shared memory
    request over HTTP, and the float64 reference."""
    seqs = [make_sequence(n, gen) for n in (7, 5)]
    outs = {"grpc": [], "http": []}
    finals = {}
    for module, via, name in ((gc, grpc_client, "grpc"), (tc, client, "http")):
        for i, seq in enumerate(seqs):
            tensors = seq_inputs(seq)
            where = place(tensors, regions["grpc_in"], start=256, base=128)
            o_bytes = seq[2].numel() * 4
            r = via.infer("kda", shm_inputs(module, tensors, "grpc_in", where), outputs=shm_outputs(module, o_bytes),
                          sequence_id=f"shm-{name}", sequence_start=i == 0, sequence_end=i == 1)
            if name == "grpc":
                described = {o.name: o for o in r.get_response().outputs}["o"]
                assert described.parameters["shared_memory_region"].string_param == "grpc_out"
                assert described.parameters["shared_memory_offset"].int64_param == 64
                assert list(r.get_response().raw_output_contents) == [b"", b""]
            outs[name].append(from_numpy(shm.get_contents_as_numpy(regions["grpc_out"], np.float32,
                                                                   [len(seq[0]), HV, V], 64)))
            finals[name] = from_numpy(shm.get_contents_as_numpy(regions["grpc_out"], np.float32, [HV, V, K], 32 << 10))
    raw = [grpc_infer(grpc_client, seq_inputs(s), sequence_id="shm-raw", start=i == 0, end=i == 1)
           for i, s in enumerate(seqs)]
    assert torch.equal(torch.cat(outs["grpc"]), torch.cat([result_tensor(r, "o") for r in raw]))
    assert torch.equal(finals["grpc"], result_tensor(raw[-1], "final_state"))
    assert torch.equal(torch.cat(outs["grpc"]), torch.cat(outs["http"])) and torch.equal(finals["grpc"], finals["http"])
    o_ref, final_ref = reference([tuple(torch.cat([s[i] for s in seqs]) for i in range(5))])
    assert rel(torch.cat(outs["grpc"]), o_ref) < TOL and rel(finals["grpc"], final_ref[0]) < TOL


def _refusal(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


def test_refusals_match_http_and_change_nothing(server, client, grpc_client, regions, gen):
    """Out-of-bounds inputs, short output room, unknown regions and bad registrations:
    INVALID_ARGUMENT with HTTP's message, the live sequence's slot unchanged."""
    slot = response_slot(grpc_infer(grpc_client, seq_inputs(make_sequence(6, gen)), sequence_id="grpc-bounds",
                                    start=True))
    tensors = seq_inputs(make_sequence(6, gen))
    where = place(tensors, regions["grpc_in"], start=0, base=128)
    region_size = (1 << 16) - 128
    v_bytes = 6 * HV * V * 4
    tag = f"{os.getpid()}_grpc"

    def past_the_end(module) -> list:
        return shm_inputs(module, tensors, "grpc_in", {**where, "v": (region_size - 8, v_bytes)})

    pairs = [
        (lambda: grpc_client.infer("kda", past_the_end(gc), sequence_id="grpc-bounds"),
         lambda: client.infer("kda", past_the_end(tc), sequence_id="grpc-bounds"), "fall outside"),
        (lambda: grpc_client.infer("kda", shm_inputs(gc, tensors, "grpc_in", where),
                                   outputs=shm_outputs(gc, v_bytes - 4), sequence_id="grpc-bounds"),
         lambda: client.infer("kda", shm_inputs(tc, tensors, "grpc_in", where), outputs=shm_outputs(tc, v_bytes - 4),
                              sequence_id="grpc-bounds"), f"needs {v_bytes} bytes"),
        (lambda: grpc_client.infer("kda", shm_inputs(gc, tensors, "nowhere", where), sequence_id="grpc-bounds"),
         lambda: client.infer("kda", shm_inputs(tc, tensors, "nowhere", where), sequence_id="grpc-bounds"),
         "unknown shared memory region 'nowhere'"),
        (lambda: grpc_client.register_system_shared_memory("grpc_in", f"/grpc_in_{tag}", 16),
         lambda: client.register_system_shared_memory("grpc_in", f"/grpc_in_{tag}", 16), "already registered"),
        (lambda: grpc_client.register_system_shared_memory("x", "/kda_no_such_key", 16),
         lambda: client.register_system_shared_memory("x", "/kda_no_such_key", 16), "unable to open"),
        (lambda: grpc_client.get_system_shared_memory_status("nope"),
         lambda: client.get_system_shared_memory_status("nope"), "unknown system shared memory region 'nope'"),
    ]
    for grpc_call, http_call, words in pairs:
        before = pool_image(server.url, [slot])
        e, h = _refusal(grpc_call), _refusal(http_call)
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and h.status() == "400", e.message()
        assert e.message() == h.message() and words in e.message()
        assert pool_image(server.url, [slot]) == before
    e = _refusal(lambda: grpc_client.register_system_shared_memory("x", f"/grpc_in_{tag}", 0))
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "byte_size" in e.message()  # HTTP's 422
    r = grpc_infer(grpc_client, seq_inputs(make_sequence(3, gen)), sequence_id="grpc-bounds", end=True)
    assert list(r.get_response().outputs[0].shape) == [3, HV, V]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for servers without CUDA")
def test_cuda_shared_memory_needs_a_cuda_device(grpc_client):
    assert "cuda_shared_memory" not in grpc_client.get_server_metadata(as_json=True)["extensions"]
    for call in (lambda: grpc_client.register_cuda_shared_memory("c", b"AAAA", 0, 16),
                 lambda: grpc_client.get_cuda_shared_memory_status(),
                 lambda: grpc_client.unregister_cuda_shared_memory()):
        e = _refusal(call)
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and "CUDA shared memory needs a CUDA device" in e.message()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cuda") is None,
                    reason="needs a CUDA device and cuda-python")
def test_cuda_shared_memory_in_and_out(grpc_client, gen):
    """Inputs and outputs in CUDA IPC memory of this (client) process, over gRPC: the same
    results as raw tensors."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    tensors = seq_inputs(make_sequence(9, gen))
    sizes = {n: t.numel() * 4 for n, t in tensors.items()}
    in_handle = cudashm.create_shared_memory_region("grpc_cuda_in", sum(sizes.values()), 0)
    out_handle = cudashm.create_shared_memory_region("grpc_cuda_out", sizes["v"] + STATE_BYTES, 0)
    try:
        cudashm.set_shared_memory_region(in_handle, [to_numpy(t) for t in tensors.values()])
        grpc_client.register_cuda_shared_memory("grpc_cuda_in", cudashm.get_raw_handle(in_handle), 0,
                                                sum(sizes.values()))
        grpc_client.register_cuda_shared_memory("grpc_cuda_out", cudashm.get_raw_handle(out_handle), 0,
                                                sizes["v"] + STATE_BYTES)
        where, at = {}, 0
        for name in tensors:
            where[name] = (at, sizes[name])
            at += sizes[name]
        o, state = gc.InferRequestedOutput("o"), gc.InferRequestedOutput("final_state")
        o.set_shared_memory("grpc_cuda_out", sizes["v"])
        state.set_shared_memory("grpc_cuda_out", STATE_BYTES, offset=sizes["v"])
        grpc_client.infer("kda", shm_inputs(gc, tensors, "grpc_cuda_in", where), outputs=[o, state])
        # get_contents_as_numpy reads from the region's start (it takes no offset): read it all, then slice
        flat = cudashm.get_contents_as_numpy(out_handle, np.float32, [(sizes["v"] + STATE_BYTES) // 4])
        got_o = flat[:sizes["v"] // 4].reshape(9, HV, V)
        got_state = flat[sizes["v"] // 4:].reshape(HV, V, K)
        expected = grpc_infer(grpc_client, tensors)
        assert torch.equal(from_numpy(got_o), result_tensor(expected, "o"))
        assert torch.equal(from_numpy(got_state), result_tensor(expected, "final_state"))
        status = grpc_client.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert set(status) == {"grpc_cuda_in", "grpc_cuda_out"}
    finally:
        grpc_client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(in_handle)
        cudashm.destroy_shared_memory_region(out_handle)
