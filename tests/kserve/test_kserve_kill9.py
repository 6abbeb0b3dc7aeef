"""Triton-style sequences across a ``kill -9``: the sequence table is saved with every
periodic pool snapshot and its changes since are journaled, so a restart on the same
snapshot path continues exactly every sequence whose slot the last pool snapshot holds,
one STARTed after the table's last save included (a kill -9 between the pool snapshot's
rename and the table's save); one whose slot was allocated after the last pool snapshot
must START again."""
from __future__ import annotations

import json
import signal
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

from service.kserve.sequences import JOURNAL_SUFFIX, SUFFIX

KILL_9_BEFORE_THE_TABLE = """
import os, signal, sys
from service.kserve.sequences import SequenceTable
SequenceTable.save = lambda self: os.kill(os.getpid(), signal.SIGKILL)
from service.cli import main
sys.argv[0] = "kda-serve"
sys.exit(main())
"""
"""The server's entry: it kills itself (SIGKILL) where it would save the sequence table, so
right after a pool snapshot's rename: the crash window between the two files, every time."""


def saved_sequences(path: Path) -> dict:
    """The saved table's {sequence id: slot}, {} while there is none."""
    try:
        return {e["id"]: e["slot"] for e in json.loads(path.read_text())["sequences"]}
    except (OSError, ValueError):
        return {}


def journaled(path: Path) -> list:
    """The sequence ids the table's journal binds, in order ([] while there is none)."""
    try:
        records = [json.loads(line) for line in Path(str(path) + JOURNAL_SUFFIX).read_text().splitlines()]
    except OSError:
        return []
    return [r["id"] for r in records if r["op"] == "bind"]


def client_of(server: Server) -> tc.InferenceServerClient:
    return tc.InferenceServerClient(urlsplit(server.url).netloc, network_timeout=60.0)


def test_sequences_survive_kill_9_as_of_the_last_snapshot(tmp_path: Path, gen: torch.Generator) -> None:
    """A sequence bound at the last snapshot continues exactly after a kill -9; one STARTed
    after it (no periodic snapshots then) is journaled, but the restored pool lacks its slot
    (allocated after the snapshot), so it is dropped at the restart and must START again."""
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
    assert "late" not in saved_sequences(table) and "late" in journaled(table)
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


def test_a_sequence_started_after_the_last_table_save_survives_kill_9_between_the_files(
        tmp_path: Path, gen: torch.Generator) -> None:
    """A kill -9 after the periodic pool snapshot holding a new sequence's slot was written,
    before the table was saved: the table file lacks the sequence, its journal does not, so
    the restart continues it exactly."""
    snapshot = tmp_path / "pool.snapshot"
    table = Path(str(snapshot) + SUFFIX)
    periodic = [*GEOMETRY_ARGS, "--snapshot-path", str(snapshot), "--snapshot-interval-s", "0.2"]
    first, second = make_sequence(40, gen), make_sequence(7, gen)

    srv = start_server(periodic, tmp_path / "0.log", entry=("-c", KILL_9_BEFORE_THE_TABLE))
    try:
        with client_of(srv) as c:
            infer(c, seq_inputs(first), sequence_id="window", start=True)
        assert srv.process.wait(30) == -signal.SIGKILL, srv.log_text()  # at the next periodic snapshot
    finally:
        srv.stop()  # nothing to do once it is dead
    assert snapshot.exists() and "window" not in saved_sequences(table) and journaled(table) == ["window"]

    srv = start_server(periodic, tmp_path / "1.log")
    try:
        with client_of(srv) as c:
            r = infer(c, seq_inputs(second), sequence_id="window", end=True)
        o_ref, final_ref = reference([tuple(torch.cat([a, b]) for a, b in zip(first, second))])
        assert rel(result_tensor(r, "o"), o_ref[len(first[0]):]) < TOL
        assert rel(result_tensor(r, "final_state"), final_ref[0]) < TOL
    finally:
        assert srv.stop() == 0
    assert "Traceback" not in srv.log_text()
