"""The KServe pieces in process (no server process): the error form on every layer, the
sequence table across a restart with a snapshot, the shared memory registry's leases and
cleanup, and the request parameters."""
from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import httpx
import pytest
import torch
from kserve_helpers import HV, K, LAYERS, TOL, V, make_sequence, reference, rel, seq_inputs

from service.http.app import create_app
from service.config import Settings
from service.errors import InvalidRequest
from service.kserve.codec import read_inputs
from service.kserve.http_codec import parse_request
from service.kserve.options import UINT64_MAX, parse_options
from service.kserve.sequences import SUFFIX, SequenceTable
from service.shm.registry import ShmRegistry
from service.wire.buffers import WarmBuffers

SETTINGS = dict(num_layers=LAYERS, num_slots=8, num_heads=HV, head_dim=K, head_v_dim=V)


def json_request(seq: tuple[torch.Tensor, ...], **parameters: Any) -> bytes:
    inputs = [{"name": n, "shape": list(t.shape), "datatype": "FP32", "data": t.reshape(-1).tolist()}
              for n, t in seq_inputs(seq).items()]
    return json.dumps({"inputs": inputs, "parameters": parameters}).encode()


def final_state(response: httpx.Response) -> torch.Tensor:
    out = {o["name"]: o for o in response.json()["outputs"]}["final_state"]
    return torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])


@asynccontextmanager
async def serve(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process app with its lifespan (start, restore; shutdown, snapshot) around the
    block, once its kernels are warm."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kda") as http:
            while (await http.get("/v2/health/ready")).status_code != 200:  # infer waits for warm kernels
                await asyncio.sleep(0.05)
            yield http


def test_errors_under_v2_take_the_protocol_form_on_every_layer():
    """Routing (404, 405) and middleware (401 without the API key) errors under /v2 are
    {"error": ...} with their status and headers; elsewhere they stay problem+json. The
    health probes need no key."""

    async def main() -> None:
        async with serve(Settings(**SETTINGS, api_key="k")) as http:
            assert (await http.get("/v2/health/live")).status_code == 200
            r = await http.get("/v2/models/kda")
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            assert r.headers["content-type"] == "application/json" and "Bearer" in r.json()["error"]
            assert (await http.get("/info")).headers["content-type"] == "application/problem+json"
            auth = {"authorization": "Bearer k"}
            r = await http.get("/v2/nowhere", headers=auth)
            assert r.status_code == 404 and r.json() == {"error": "Not Found"}
            r = await http.post("/v2/health/live", headers=auth)
            assert r.status_code == 405 and set(r.json()) == {"error"}
            r = await http.get("/v2/models/kda/versions/2", headers=auth)
            assert r.status_code == 404 and "unknown version '2'" in r.json()["error"]

    asyncio.run(main())


def test_sequences_survive_a_restart_with_a_snapshot(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """START on one server; shut down (pool snapshot and sequence table saved); a new server
    continues the sequence from the restored slot, equal to the reference of all tokens.
    Without the table file the id is unknown; a corrupt file is logged and ignored."""
    snapshot = tmp_path / "pool.snapshot"
    settings = Settings(**SETTINGS, snapshot_path=str(snapshot))
    gen = torch.Generator().manual_seed(1)
    first, second = make_sequence(5, gen), make_sequence(4, gen)

    async def run(body: bytes) -> httpx.Response:
        async with serve(settings) as http:
            return await http.post("/v2/models/kda/infer", content=body)

    assert asyncio.run(run(json_request(first, sequence_id=9, sequence_start=True))).status_code == 200
    assert Path(str(snapshot) + SUFFIX).exists()
    r = asyncio.run(run(json_request(second, sequence_id=9)))
    assert r.status_code == 200, r.text
    whole = tuple(torch.cat([a, b]) for a, b in zip(first, second))
    assert rel(final_state(r), reference([whole])[1][0]) < TOL
    Path(str(snapshot) + SUFFIX).write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="kda_serve.kserve.sequences"):
        r = asyncio.run(run(json_request(second, sequence_id=9, sequence_end=True)))
    assert r.status_code == 400 and "must specify the START flag" in r.json()["error"]
    assert "ignoring the sequence table" in caplog.text


def test_sequence_table_keeps_only_entries_whose_slot_exists(tmp_path: Path):
    table = SequenceTable(str(tmp_path / "t.json"))
    for sequence, slot in ((1, "a"), ("1", "b"), ((1 << 64) - 1, "c")):
        table.bind(sequence, slot)
    table.save()
    restored = SequenceTable(str(tmp_path / "t.json"))
    restored.load(lambda slot: slot != "b")
    assert restored.live() == {1: "a", (1 << 64) - 1: "c"}


def restored_table(path: str, slot_exists: Callable[[str], bool] = lambda slot: True) -> dict:
    """What a fresh table on ``path`` loads (as a restart does)."""
    table = SequenceTable(path)
    table.load(slot_exists)
    return table.live()


def test_changes_after_the_last_save_come_back_from_the_journal(tmp_path: Path):
    """Binds and unbinds after the last save (a kill -9 before the next snapshot's table
    save) are replayed over the saved table; the slot filter applies to them too."""
    path = str(tmp_path / "t.json")
    table = SequenceTable(path)
    table.bind(1, "a")
    table.bind(2, "b")
    table.save()
    table.bind("late", "c")
    table.unbind(1)
    table.bind(2, "d")  # a START for a live id: the new slot wins
    assert restored_table(path) == {2: "d", "late": "c"}
    assert restored_table(path, lambda slot: slot != "c") == {2: "d"}


def test_a_torn_journal_tail_is_dropped_and_appending_goes_on(tmp_path: Path):
    """A last line cut short (no newline) or unreadable is dropped, the records before it
    kept; records appended after the restart are read back at the next one."""
    for tail in (b'{"op": "bind", "id": 3, "sl', b'{"op": "bind", "id"\n'):
        path = str(tmp_path / f"t{len(tail)}.json")
        table = SequenceTable(path)
        table.bind(1, "a")
        table.save()
        table.bind(2, "b")
        with open(table.journal_path, "ab") as journal:
            journal.write(tail)
        restored = SequenceTable(path)
        restored.load(lambda slot: True)
        assert restored.live() == {1: "a", 2: "b"}
        restored.bind(4, "e")
        assert restored_table(path) == {1: "a", 2: "b", 4: "e"}


def test_an_unreadable_journal_line_ends_the_replay(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A bad line before the last: the records before it are kept, those after it ignored,
    and the log says so."""
    path = str(tmp_path / "t.json")
    table = SequenceTable(path)
    table.bind(1, "a")
    with open(table.journal_path, "ab") as journal:
        journal.write(b'{"op": "rebind", "id": 1}\n')
    table.bind(2, "b")
    with caplog.at_level(logging.ERROR, logger="kda_serve.kserve.sequences"):
        assert restored_table(path) == {1: "a"}
    assert "sequence journal" in caplog.text


def test_replaying_the_journal_over_a_newer_table_is_harmless(tmp_path: Path):
    """A crash between a save's rename and the journal's truncation leaves records the
    table already holds: replayed in order over it, they change nothing (last writer wins
    per id)."""
    path = str(tmp_path / "t.json")
    table = SequenceTable(path)
    table.bind(1, "a")
    table.bind(2, "b")
    table.save()
    for step in (lambda: table.bind(3, "c"), lambda: table.unbind(1), lambda: table.bind(2, "d"),
                 lambda: table.bind(1, "e"), lambda: table.unbind(3)):
        step()
    stale = Path(table.journal_path).read_bytes()
    table.save()
    Path(table.journal_path).write_bytes(stale)
    assert restored_table(path) == table.live() == {1: "e", 2: "d"}


def test_a_failing_journal_write_is_logged_once_and_the_request_goes_on(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture):
    """A full disk (the journal is /dev/full): bind and unbind work in memory, one warning
    is logged; the next save holds them, and the journal works again once writable."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    path = str(tmp_path / "t.json")
    table = SequenceTable(path)
    os.symlink("/dev/full", table.journal_path)
    with caplog.at_level(logging.WARNING, logger="kda_serve.kserve.sequences"):
        table.bind(1, "a")
        table.bind(2, "b")
        table.unbind(2)
    assert table.live() == {1: "a"}
    assert [r.levelno for r in caplog.records if "journal" in r.getMessage()] == [logging.WARNING]
    table.save()
    os.unlink(table.journal_path)  # space again
    table.save()
    table.bind(3, "c")
    assert restored_table(path) == {1: "a", 3: "c"}


def test_load_removes_the_temporaries_of_a_save_a_crash_interrupted(tmp_path: Path):
    """The temporary files of `SequenceTable.save` (and of older versions, named
    ``.kserve-sequences-*``) go at load; other files stay."""
    stale = [".t.json.k2j3l4x0.tmp", ".kserve-sequences-q8z1m0v_"]
    kept = [".other.json.k2j3l4x0.tmp", ".pool.snapshot.k2j3l4x0.tmp", "t.json.k2j3l4x0.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_text("{")
    SequenceTable(str(tmp_path / "t.json")).load(lambda slot: True)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


@pytest.fixture
def shm_object() -> Iterator[str]:
    """A 4 KiB POSIX shared memory object of this test, removed afterwards; yields its key."""
    key = f"/kda_unit_{os.getpid()}"
    path = f"/dev/shm{key}"
    with open(path, "wb") as f:
        f.truncate(mmap.PAGESIZE)
    yield key
    os.unlink(path)


def test_registry_leases_defer_unmapping_and_close_unmaps_everything(shm_object: str):
    registry = ShmRegistry()
    registry.register_system("a", shm_object, 16, 64)
    registry.register_system("b", shm_object, 0, 32)
    with registry.lease(["a"]) as regions:
        region = regions["a"]
        region.write(8, torch.arange(4, dtype=torch.float32))
        registry.unregister("system", "a")
        assert registry.status("system") == [{"name": "b", "key": shm_object, "offset": 0, "byte_size": 32}]
        back = bytearray(16)
        region.read_into(8, memoryview(back))
        assert back == torch.arange(4, dtype=torch.float32).numpy().tobytes()  # still mapped
    with pytest.raises(ValueError):
        region.read_into(8, memoryview(bytearray(16)))  # unmapped once the last lease ended
    with open(f"/dev/shm{shm_object}", "rb") as f:
        assert f.read()[24:40] == torch.arange(4, dtype=torch.float32).numpy().tobytes()  # offset 16 + 8
    with registry.lease(["b"]) as regions, pytest.raises(InvalidRequest, match="outside shared memory region 'b' of 32"):
        regions["b"].check(30, 4, "input 'q'")
    registry.close()
    assert registry.status("system") == []


def test_request_parameters_are_strict():
    assert parse_options({"sequence_id": UINT64_MAX, "sequence_start": True}).sequence == UINT64_MAX
    assert parse_options({"sequence_id": 0}).sequence is None and parse_options({"sequence_id": ""}).sequence is None
    assert parse_options({"scale": 1}).prefill.scale == 1.0
    for params, words in [
        ({"sequence_id": UINT64_MAX + 1}, "uint64"),
        ({"sequence_id": True}, "got a boolean"),
        ({"sequence_id": 1.5}, "got a number"),
        ({"sequence_start": True}, "needs a non-zero"),
        ({"sequence_id": 0, "sequence_end": True}, "needs a non-zero"),
        ({"layer": True}, "layer must be an integer"),
        ({"use_qk_l2norm": 1}, "use_qk_l2norm must be a boolean, got an integer"),
        ({"lower_bound": "-4"}, "must be a number"),
        ({"slot": ""}, "non-empty string"),
        ({"priority": 1}, "unknown request parameter(s) ['priority']"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            parse_options(params)
        assert words in e.value.detail, (params, e.value.detail)


def test_shared_memory_inputs_are_copied_out_once_into_one_buffer(shm_object: str):
    """KServe reads shared memory inputs with the shared memory prefill's reader: one copy
    of each into one host buffer (their storage shared), beside an input given as JSON,
    each equal to what was written and unchanged when the region changes afterwards."""
    gen = torch.Generator().manual_seed(11)
    tensors = seq_inputs(make_sequence(2, gen))  # q, k, v, g: 2 KiB, inside the one page
    registry = ShmRegistry()
    registry.register_system("r", shm_object, 0, mmap.PAGESIZE)
    inputs, offset = [], 0
    with registry.lease(["r"]) as regions:
        for name, t in tensors.items():
            if name == "beta":
                inputs.append({"name": name, "shape": list(t.shape), "datatype": "FP32", "data": t.reshape(-1).tolist()})
                continue
            size = t.numel() * t.element_size()
            assert offset + size <= mmap.PAGESIZE
            regions["r"].write(offset, t)
            inputs.append({"name": name, "shape": list(t.shape), "datatype": "FP32", "parameters": {
                "shared_memory_region": "r", "shared_memory_offset": offset, "shared_memory_byte_size": size}})
            offset += size
        body = bytearray(json.dumps({"inputs": inputs}).encode())
        got = read_inputs(parse_request(body, len(body)), regions, WarmBuffers(), torch.device("cpu"))
        regions["r"].write(0, torch.full((offset // 4,), 7.0))
    registry.close()
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name
    packed, start = [n for n in tensors if n != "beta"], got["q"].data_ptr()
    where = [got[n].data_ptr() - start for n in packed]
    sizes = [-(-got[n].numel() * 4 // 64) * 64 for n in packed]  # 64-byte aligned, back to back
    assert where == [sum(sizes[:i]) for i in range(len(packed))]
