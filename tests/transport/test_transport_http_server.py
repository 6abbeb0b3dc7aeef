"""kda-serve's HTTP framing through `service.http.protocol.KDAHttpConnection`: framing the
parser refuses is an RFC 9457 problem on a closed connection, a client that leaves mid-body
changes nothing, and large prefills on one keep-alive connection (warm buffers reused)
give the reference's results every time."""
from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from transport_helpers import TOL, Server, make_sequence, pool_image, read_response, reference, rel, request_head

from kda_client.client import KDAClient
from service.wire.media import PROBLEM, SAFETENSORS
from service.wire.safetensors_codec import safetensors_pieces


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


@pytest.mark.parametrize("length, status, slug", [
    ("-1", 400, "bad-content-length"), ("12abc", 400, "bad-content-length"), ("1, 2", 400, "bad-content-length"),
    ("+5", 400, "bad-content-length"), ("9" * 25, 413, "payload-too-large"),
])
def test_a_malformed_content_length_is_a_problem(server, length, status, slug):
    with KDAClient(server.url) as kda:
        slot = kda.alloc(1)[0]
        before = pool_image(server.url, [slot])
        with _connect(server) as s:
            s.sendall(request_head("POST", "/prefill", [("Content-Type", SAFETENSORS), ("Content-Length", length)])
                      + b"\0" * 16)
            got, headers, body = read_response(s)
            assert s.recv(1) == b""  # closed
        assert got == status and headers["content-type"] == PROBLEM and headers["connection"] == "close"
        problem = json.loads(body)
        assert problem["type"] == f"urn:kda-serve:problem:{slug}" and problem["status"] == status
        assert "Content-Length" in problem["detail"]
        assert pool_image(server.url, [slot]) == before
        kda.free(slot)


def test_a_client_leaving_mid_body_changes_nothing(server, gen):
    """Half of a 6 MB prefill body, then the client goes: the slot is as it was, and the
    next prefill on it (on a new connection) is the reference's."""
    seq = make_sequence(12000, gen)
    with KDAClient(server.url) as kda:
        slot = kda.alloc(1)[0]
        before = pool_image(server.url, [slot])
        options = {"layer": 0, "sequences": [{"slot": slot, "length": 12000}]}
        pieces = safetensors_pieces(dict(zip(("q", "k", "v", "g", "beta"), ([t] for t in seq))),
                                    {"request": json.dumps(options)})
        body = b"".join(bytes(p) for p in pieces)
        with _connect(server) as s:
            s.sendall(request_head("POST", "/prefill", [("Content-Type", SAFETENSORS),
                                                        ("Content-Length", str(len(body)))]) + body[:len(body) // 2])
        time.sleep(0.5)
        assert pool_image(server.url, [slot]) == before
        out = kda.prefill(0, [(slot, *seq)])
        o, final = reference([seq])
        assert rel(out.o_packed, o) < TOL and rel(out.final_state, final) < TOL
        kda.free(slot)


def test_large_prefills_on_one_connection_are_each_their_own(server, gen):
    """Three 4 MB prefills of one size on one connection (the later ones land in a reused
    warm buffer on the server, and the client's responses in fresh ones): each result is
    that request's reference, none an echo of the one before."""
    seqs = [make_sequence(8000, gen) for _ in range(3)]
    with KDAClient(server.url) as kda:
        slots = kda.alloc(3)
        outs = [kda.prefill(0, [(slot, *seq)]) for slot, seq in zip(slots, seqs)]
        for out, seq in zip(outs, seqs):
            o, final = reference([seq])
            assert rel(out.o_packed, o) < TOL and rel(out.final_state, final) < TOL
        for slot in slots:
            kda.free(slot)
    assert not torch.equal(outs[0].o_packed, outs[1].o_packed)
