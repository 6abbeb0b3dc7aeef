"""The CPU-runnable parts of bench/cuda_ipc.py: case parsing, the buffer layout, and the
shared memory /prefill document it builds, sent for real through a POSIX region (the same
document names a CUDA region on the GPU) to the CPU server, with the outputs checked
against its in-process kernel call and the table rendered from the figures."""
from __future__ import annotations

import httpx
import pytest
import torch
from transport_helpers import HV, K, V, Region, Server, dumps

from bench.cuda_ipc import (
    ALIGN, INPUTS, PHASES, TOL, Case, Result, fill_inputs, free, kernel_call, make_layout, median_phases,
    parse_cases, parse_dtypes, prefill, prefill_doc, rel, table, view,
)
from service.shm.prefill import parse_shm_request


def test_parse_cases_and_dtypes() -> None:
    assert parse_cases("1x4096, 8x4096,1x16384") == [(1, 4096), (8, 4096), (1, 16384)]
    for bad in ("8", "x4096", "0x10", "2x0", "2x-1", "ax3", ""):
        with pytest.raises(ValueError, match="SEQUENCESxTOKENS"):
            parse_cases(bad)
    assert parse_dtypes("bfloat16,float32") == [torch.bfloat16, torch.float32]
    with pytest.raises(ValueError, match="float16"):
        parse_dtypes("float16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layout_places_every_tensor_apart_and_aligned(dtype: torch.dtype) -> None:
    case = Case(8, 4096, dtype)
    layout = make_layout(case)
    slots = [*layout.inputs.values(), layout.o, layout.final_state]
    assert list(layout.inputs) == list(INPUTS)
    assert all(s.offset % ALIGN == 0 for s in slots)
    spans = sorted((s.offset, s.offset + s.byte_size) for s in slots)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.total < spans[-1][1] + ALIGN
    assert layout.inputs["q"].shape == (case.tokens, 32, 128) and layout.inputs["q"].dtype == dtype
    assert layout.o.byte_size == case.tokens * 32 * 128 * dtype.itemsize
    assert layout.final_state.shape == (8, 32, 128, 128) and layout.final_state.dtype == torch.float32


def test_doc_is_a_valid_shm_request() -> None:
    case = Case(2, 100, torch.bfloat16)
    layout = make_layout(case)
    parsed = parse_shm_request(dumps(prefill_doc(case, layout, "kda-cuda", base=4096)))
    assert [s["slot"] for s in parsed.sequences] == [None, None] and [s["length"] for s in parsed.sequences] == [100, 100]
    assert parsed.lower_bound == -5.0 and parsed.use_qk_l2norm and parsed.use_beta_sigmoid
    assert parsed.q.shm.offset == 4096 + layout.inputs["q"].offset and parsed.q.dtype == "bfloat16"
    assert parsed.A_log is not None and parsed.A_log.dtype == "float32"
    assert parsed.outputs.final_state is not None
    assert parsed.outputs.final_state.byte_size == layout.final_state.byte_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doc_through_a_live_server(server: Server, dtype: torch.dtype) -> None:
    """The bench's request path on a POSIX region: its outputs equal its own in-process
    kernel call (from zero states), the slots it frees are gone, the table renders."""
    case = Case(3, 70, dtype)
    layout = make_layout(case, heads=HV, k_dim=K, v_dim=V)
    region = Region(layout.total)
    inputs = fill_inputs(region.memory, layout, torch.Generator().manual_seed(3))
    inputs["dt_bias"].mul_(0.1)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/shm/regions", json=region.registration())
        assert r.status_code == 201, r.text
        try:
            body = dumps(prefill_doc(case, layout, region.name))
            timings = []
            for _ in range(2):
                seconds, timing, slots = prefill(http, body)
                assert seconds > 0 and len(slots) == case.sequences
                free(http, slots)
                assert all(http.get(f"/slots/{s}").status_code == 404 for s in slots)
                timings.append(timing)
            o_got, final_got = view(region.memory, layout.o).clone(), view(region.memory, layout.final_state).clone()
        finally:
            http.delete(f"/shm/regions/{region.name}")
            region.unlink()
    pool = torch.zeros(layout.final_state.shape)
    o_want = kernel_call(inputs, case, pool)()[0]
    assert o_got.dtype == dtype and o_got.shape == (case.tokens, HV, V)
    assert rel(o_got, o_want) < TOL and rel(final_got, pool) < TOL
    phases = median_phases(timings)
    assert set(PHASES) <= set(phases)
    result = Result(case.name, case.sequences, case.length, str(dtype), case.tokens, 2.0, 1.5, phases,
                    rel(o_got, o_want), rel(final_got, pool), client_ms=3.0)
    assert result.ok and result.ratio == 0.75 and result.overhead_ms == 0.5
    assert result.figures()["ok"] is True
    lines = table([result]).splitlines()
    assert len(lines) == 3 and lines[2].startswith(f"| {case.name} | {case.tokens} | 2.00 | 3.00 | 1.50 | 0.75 | 0.50 |")
    assert lines[2].endswith(" ok |")
