"""ModelStreamInfer with tritonclient.grpc's stream: sequences keep their order on one
stream, refusals come back on the stream without ending it, a dropped stream leaves every
request applied whole or not at all, and SIGTERM drains streams (every request answered
was applied; the stream ends UNAVAILABLE) before the snapshot."""
from __future__ import annotations

import queue
import time
from typing import Any, Optional

import httpx
import pytest
import torch
import tritonclient.grpc as gc
from kserve_helpers import (
    GEOMETRY_ARGS, TOL, grpc_infer, grpc_inputs, make_sequence, random_state, reference, rel, response_slot,
    result_tensor, seq_inputs, start_server, wait_for,
)
from tritonclient.utils import InferenceServerException

from kda_client.client import KDAClient


def cat(seqs: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([s[i] for s in seqs]) for i in range(5))


class Stream:
    """A tritonclient stream whose callback files results by request id and errors in order."""

    def __init__(self, client: gc.InferenceServerClient) -> None:
        self.client = client
        self.results: dict[str, gc.InferResult] = {}
        self.errors: "queue.Queue[Any]" = queue.Queue()
        client.start_stream(callback=self._callback)

    def _callback(self, result: Optional[gc.InferResult], error: Any) -> None:
        if error is not None:
            self.errors.put(error)
        else:
            self.results[result.get_response().id] = result

    def send(self, request_id: str, tensors: dict[str, torch.Tensor], **kw: Any) -> None:
        self.client.async_stream_infer("kda", grpc_inputs(tensors), request_id=request_id, **kw)


def settled(read, period: float = 1.0, times: int = 3, timeout: float = 90.0) -> Any:
    """``read()`` once it returned the same value ``times`` times in a row, ``period`` apart
    (the requests a dropped stream left running are done by then)."""
    deadline, seen = time.monotonic() + timeout, [read()]
    while time.monotonic() < deadline:
        time.sleep(period)
        seen = [*seen[-(times - 1):], read()]
        if len(seen) == times and all(v == seen[0] for v in seen):
            return seen[0]
    raise AssertionError(f"{read} did not settle: {seen}")


def test_a_streamed_sequence_keeps_its_order_and_refusals_do_not_end_the_stream(server, grpc_client, gen):
    """Two sequences of three requests (different lengths, so any reordering shows) sent
    interleaved at once on one stream, with a refused request among them: each sequence
    equals its reference, the refusal comes back with the unary call's message, and the
    stream goes on."""
    seqs = {"A": [make_sequence(n, gen) for n in (8, 70, 3)], "B": [make_sequence(n, gen) for n in (5, 2, 40)]}
    with gc.InferenceServerClient(server.grpc) as c:
        stream = Stream(c)
        for step in range(3):
            for name, chunks in seqs.items():
                stream.send(f"{name}{step}", seq_inputs(chunks[step]), sequence_id=f"stream-{name}",
                            sequence_start=step == 0, sequence_end=step == 2)
            if step == 1:
                stream.send("bad", seq_inputs(seqs["A"][0]), sequence_id="stream-never-started")
        assert wait_for(lambda: len(stream.results) == 6 and not stream.errors.empty(), timeout=60)
        stream.send("after", seq_inputs(seqs["A"][0]))
        assert wait_for(lambda: "after" in stream.results, timeout=30)
        c.stop_stream()
    for name, chunks in seqs.items():
        o = torch.cat([result_tensor(stream.results[f"{name}{step}"], "o") for step in range(3)])
        o_ref, final_ref = reference([cat(chunks)])
        assert rel(o, o_ref) < TOL, name
        assert rel(result_tensor(stream.results[f"{name}2"], "final_state"), final_ref[0]) < TOL, name
    error = stream.errors.get_nowait()
    with pytest.raises(InferenceServerException) as unary:
        grpc_infer(grpc_client, seq_inputs(seqs["A"][0]), sequence_id="stream-never-started")
    assert error.message() == unary.value.message() and "must specify the START flag" in error.message()
    assert stream.errors.empty()


def test_a_sequence_and_slot_requests_naming_its_slot_keep_their_order(tmp_path, gen):
    """Requests of a sequence and ``slot`` requests naming the slot it holds, interleaved on
    one stream, run in the order sent: the slot's state and each output equal the reference
    of the chunks in that order. The sequence's chunks are long enough to be read off the
    event loop (over 1 MiB, so this server takes 8 MiB bodies) and the slot's short: any
    reordering shows."""
    server = start_server([*GEOMETRY_ARGS, "--max-body-mb", "8"], tmp_path / "kda.log", grpc=True)
    try:
        with gc.InferenceServerClient(server.grpc) as c:
            first = make_sequence(4, gen)
            slot = response_slot(grpc_infer(c, seq_inputs(first), sequence_id="mixed", start=True))
            chunks = [make_sequence(n, gen) for n in (3000, 1, 2500, 2, 2200, 3)]
            stream = Stream(c)
            for i, chunk in enumerate(chunks):
                if i % 2 == 0:
                    stream.send(f"m{i}", seq_inputs(chunk), sequence_id="mixed")
                else:
                    stream.send(f"m{i}", seq_inputs(chunk), parameters={"slot": slot})
            assert wait_for(lambda: len(stream.results) == len(chunks) or not stream.errors.empty(), timeout=60)
            c.stop_stream()
            assert stream.errors.empty(), stream.errors.get_nowait().message()
            o_ref, final_ref = reference([cat([first, *chunks])])
            o = torch.cat([result_tensor(stream.results[f"m{i}"], "o") for i in range(len(chunks))])
            assert rel(o, o_ref[first[0].shape[0]:]) < TOL
            with KDAClient(server.url) as rest:
                assert rel(rest.get_state(slot)[0], final_ref[0]) < TOL
    finally:
        assert server.stop() == 0, server.log_text()
    assert "Traceback" not in server.log_text(), server.log_text()


def test_a_dropped_stream_leaves_nothing_half_applied(server, grpc_client, gen):
    """A stream cancelled right after sending six requests on a REST slot, and one cancelled
    right after sending two continuations of a started sequence: the slot advanced by
    exactly a prefix of the requests (its state equals the reference of that prefix), the
    sequence continues from a prefix of its requests, and no slot leaked."""
    lengths = [64, 64, 64, 64, 64, 64]
    chunks = [make_sequence(n, gen) for n in lengths]
    initial = random_state(gen)[0]
    with KDAClient(server.url) as rest:
        free = rest.info()["free_slots"]
        slot = rest.alloc()[0]
        rest.put_state(slot, initial)
        with gc.InferenceServerClient(server.grpc) as c:
            stream = Stream(c)
            for i, chunk in enumerate(chunks):
                stream.send(f"s{i}", seq_inputs(chunk), parameters={"slot": slot})
            c.stop_stream(cancel_requests=True)
        tokens = settled(lambda: rest.slot_info(slot)["tokens_per_layer"][0])
        assert tokens in [sum(lengths[:k]) for k in range(len(lengths) + 1)], tokens
        k = [sum(lengths[:k]) for k in range(len(lengths) + 1)].index(tokens)
        state = rest.get_state(slot)[0]
        assert rest.slot_info(slot)["tokens_per_layer"][0] == tokens  # nothing ran meanwhile
        if k:
            assert rel(state, reference([cat(chunks[:k])], initial=initial[0:1])[1][0]) < TOL
        else:
            assert torch.equal(state, initial[0])
        rest.free(slot)

        seq_chunks = [make_sequence(n, gen) for n in (40, 30, 20)]
        with gc.InferenceServerClient(server.grpc) as c:
            stream = Stream(c)
            stream.send("q0", seq_inputs(seq_chunks[0]), sequence_id="dropped", sequence_start=True)
            assert wait_for(lambda: "q0" in stream.results, timeout=30)
            for i, chunk in enumerate(seq_chunks[1:], 1):
                stream.send(f"q{i}", seq_inputs(chunk), sequence_id="dropped")
            c.stop_stream(cancel_requests=True)
        assert settled(lambda: free - rest.info()["free_slots"]) == 1  # the sequence's slot, no other
        last = make_sequence(5, gen)
        r = grpc_infer(grpc_client, seq_inputs(last), sequence_id="dropped")
        applied = rest.slot_info(response_slot(r))["tokens_per_layer"][0] - 5
        k = [40, 70, 90].index(applied) + 1
        assert rel(result_tensor(r, "final_state"), reference([cat([*seq_chunks[:k], last])])[1][0]) < TOL
        grpc_infer(grpc_client, seq_inputs(make_sequence(1, gen)), sequence_id="dropped", end=True)
        assert rest.info()["free_slots"] == free


def test_sigterm_drains_grpc_streams_then_snapshots(tmp_path, gen):
    """SIGTERM with a stream open and a request just sent: the server exits 0 well within
    the grace period; the stream ends UNAVAILABLE; the request was applied exactly when its
    response arrived; the restarted server continues the sequence from the snapshot."""
    snapshot = str(tmp_path / "pool.snapshot")
    args = [*GEOMETRY_ARGS, "--snapshot-path", snapshot]
    server = start_server(args, tmp_path / "first.log", grpc=True)
    chunks = [make_sequence(n, gen) for n in (6, 50, 4)]
    with gc.InferenceServerClient(server.grpc) as c:
        stream = Stream(c)
        stream.send("start", seq_inputs(chunks[0]), sequence_id="drained", sequence_start=True)
        assert wait_for(lambda: "start" in stream.results, timeout=30)
        stream.send("more", seq_inputs(chunks[1]), sequence_id="drained")
        began = time.monotonic()
        assert server.stop() == 0, server.log_text()
        assert time.monotonic() - began < 20
        assert wait_for(lambda: not stream.errors.empty(), timeout=10)
        error = stream.errors.get_nowait()
        assert "UNAVAILABLE" in str(error.status()) and "shutting down" in error.message(), error
        c.stop_stream()
    assert "Traceback" not in server.log_text(), server.log_text()
    applied = chunks[:2] if "more" in stream.results else chunks[:1]
    again = start_server(args, tmp_path / "second.log", grpc=True)
    try:
        with gc.InferenceServerClient(again.grpc) as c:
            r = grpc_infer(c, seq_inputs(chunks[2]), sequence_id="drained", end=True)
        assert rel(result_tensor(r, "final_state"), reference([cat([*applied, chunks[2]])])[1][0]) < TOL
        assert httpx.get(f"{again.url}/info").json()["used_slots"] == 0
    finally:
        assert again.stop() == 0, again.log_text()
