"""Triton-style sequences across a ``kill -9``: the sequence table is saved with every
periodic pool snapshot, so a restart on the same snapshot path continues the sequences
bound at the last snapshot exactly; one started after it must START again."""
from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
import tritonclient.http as tc
from kserve_helpers import (
    GEOMETRY_ARGS, TOL, Server, infer, make_sequence, reference, rel, result_tensor, seq_inputs, start_server,
)
from server_harness import kill_9, wait_for
from tritonclient.utils import InferenceServerException

from service.kserve.sequences import SUFFIX


def saved_sequences(path: Path) -> dict:
    """The saved table's {sequence id: slot}, {} while there is none."""
    try:
        return {e["id"]: e["slot"] for e in json.loads(path.read_text())["sequences"]}
    except (OSError, ValueError):
        return {}


def client_of(server: Server) -> tc.InferenceServerClient:
    return tc.InferenceServerClient(urlsplit(server.url).netloc, network_timeout=60.0)


def test_sequences_survive_kill_9_as_of_the_last_snapshot(tmp_path: Path, gen: torch.Generator) -> None:
    snapshot = tmp_path / "pool.snapshot"
    table = Path(str(snapshot) + SUFFIX)
    periodic = [*GEOMETRY_ARGS, "--snapshot-path", str(snapshot), "--snapshot-interval-s", "0.2"]
    first, second = make_sequence(70, gen), make_sequence(9, gen)

    srv = start_server(periodic, tmp_path / "0.log")
    with client_of(srv) as c:
        slot = infer(c, seq_inputs(first), sequence_id="kept", start=True).get_response()["parameters"]["slot"]
    assert wait_for(lambda: saved_sequences(table).get("kept") == slot, timeout=30), srv.log_text()
    kill_9(srv)

    # no periodic snapshots now: a START here is after the last snapshot
    srv = start_server([*GEOMETRY_ARGS, "--snapshot-path", str(snapshot), "--snapshot-interval-s", "0"],
                       tmp_path / "1.log")
    with client_of(srv) as c:
        infer(c, seq_inputs(make_sequence(5, gen)), sequence_id="late", start=True)
    assert "late" not in saved_sequences(table)
    kill_9(srv)

    srv = start_server(periodic, tmp_path / "2.log")
    try:
        with client_of(srv) as c:
            r = infer(c, seq_inputs(second), sequence_id="kept", end=True)
            o_ref, final_ref = reference([tuple(torch.cat([a, b]) for a, b in zip(first, second))])
            assert rel(result_tensor(r, "o"), o_ref[len(first[0]):]) < TOL
            assert rel(result_tensor(r, "final_state"), final_ref[0]) < TOL
            with pytest.raises(InferenceServerException) as e:
                infer(c, seq_inputs(make_sequence(3, gen)), sequence_id="late")
            assert e.value.status() == "400" and "must specify the START flag" in e.value.message()
    finally:
        assert srv.stop() == 0
    assert "Traceback" not in srv.log_text()
