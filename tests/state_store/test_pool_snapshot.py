"""Whole-pool snapshot and restore: bit-exact, atomic, and verified before anything changes."""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from pool_helpers import FakeClock, PoolImage, assert_bit_equal, fill_random, make_pool, random_state
from safetensors import safe_open

import state_store.ids
import state_store.snapshot
from state_store import GeometryMismatch, SnapshotError, StatePool


def _restored(snapshot_path, **overrides) -> StatePool:
    pool = make_pool(**overrides)
    pool.restore(snapshot_path)
    return pool


def test_restore_into_a_new_pool_is_bit_exact(populated, clock, tmp_path):
    path = tmp_path / "pool.safetensors"
    populated.snapshot(path)
    saved_ids = populated.slot_ids()
    saved = {slot_id: populated.slot_info(slot_id) for slot_id in saved_ids}

    other_clock = FakeClock(start=50.0)
    pool = make_pool(clock=other_clock)
    stale = pool.alloc(2)  # replaced by the restore
    pool.restore(str(path))

    assert_bit_equal(pool.image(), populated.image())  # free rows' contents too
    assert sorted(pool.slot_ids()) == sorted(saved_ids)
    assert not any(pool.contains(slot_id) for slot_id in stale)
    for slot_id, info in saved.items():
        got = pool.slot_info(slot_id)
        assert (got.row, got.created, got.tokens_per_layer, got.state_lost) == (
            info.row, info.created, info.tokens_per_layer, info.state_lost,
        )
        assert_bit_equal(pool.read_state(slot_id), populated.read_state(slot_id))
    assert pool.slot_info(saved_ids[3]).state_lost  # mark_lost survives


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restored_ids_keep_working_and_free_rows_are_right(tmp_path, dtype):
    pool = make_pool(dtype=dtype)
    fill_random(pool)
    ids = pool.alloc(4)
    for seed, slot_id in enumerate(ids):
        pool.write_state(slot_id, random_state(pool, seed))
    pool.free(ids[1])
    pool.snapshot(tmp_path / "s")

    restored = _restored(tmp_path / "s", dtype=dtype)
    assert_bit_equal(restored.image(), pool.image())
    live_rows = set(restored.rows([ids[0], ids[2], ids[3]]))
    assert live_rows == {0, 2, 3}
    new = restored.alloc(3)
    assert set(restored.rows(new)) == {1, 4, 5}  # exactly the free rows
    assert restored.stats().free == 0
    restored.free(ids[2])
    restored.write_state(ids[3], random_state(restored, 99))
    assert_bit_equal(restored.read_state(ids[3]), random_state(restored, 99))
    assert_bit_equal(restored.read_state(ids[0]), random_state(restored, 0))


def test_ids_issued_after_a_restore_never_collide(populated, tmp_path, monkeypatch):
    path = tmp_path / "s"
    populated.snapshot(path)
    pool = _restored(path)  # no id_prefix here: ids are the bare random part
    restored = populated.slot_ids()
    draws = iter([restored[0], restored[2], "fresh-id"])
    monkeypatch.setattr(state_store.ids.secrets, "token_urlsafe", lambda nbytes: next(draws))
    assert pool.alloc(1) == ["fresh-id"]
    assert sorted(pool.slot_ids()) == sorted(restored + ["fresh-id"])


def test_restore_keeps_idle_time_as_of_the_snapshot(tmp_path):
    clock = FakeClock()
    pool = make_pool(clock=clock, ttl=100.0)
    a, b = pool.alloc(2)
    clock.advance(60.0)
    pool.rows([b])
    clock.advance(30.0)  # a idle 90 s, b idle 30 s
    pool.snapshot(tmp_path / "s")

    later = FakeClock(start=5.0)
    restored = _restored(tmp_path / "s", clock=later, ttl=100.0)
    assert restored.slot_info(a).last_used - restored.slot_info(b).last_used == pytest.approx(-60.0)
    later.advance(10.5)  # a idle 100.5 s: expired; b idle 40.5 s
    assert restored.sweep() == [a]
    assert restored.contains(b)


def test_snapshot_is_safetensors_with_verified_metadata(populated, tmp_path):
    path = tmp_path / "s.safetensors"
    populated.snapshot(path)
    with safe_open(str(path), framework="pt") as snapshot:
        assert_bit_equal(snapshot.get_tensor("pool"), populated.image())
        meta = snapshot.metadata()
    assert (meta["format"], meta["version"]) == ("kda-serve/pool-snapshot", "1")
    index = json.loads(meta["index"])
    assert index["geometry"] == {
        "num_slots": 6, "num_layers": 3, "num_heads": 2, "head_k_dim": 8, "head_v_dim": 4,
        "dtype": "float32",
    }
    assert sorted(s["slot_id"] for s in index["slots"]) == sorted(populated.slot_ids())
    assert len(meta["pool_sha256"]) == len(meta["index_sha256"]) == 64


def test_atomic_write_leaves_no_temporary_file(populated, tmp_path):
    path = tmp_path / "pool.safetensors"
    populated.snapshot(path)
    first = path.read_bytes()
    populated.write_state(populated.slot_ids()[0], random_state(populated, 42))
    populated.snapshot(path)  # overwrite
    assert os.listdir(tmp_path) == ["pool.safetensors"]
    assert path.read_bytes() != first


def test_failed_write_keeps_the_old_snapshot(populated, tmp_path, monkeypatch):
    path = tmp_path / "pool.safetensors"
    populated.snapshot(path)
    first = path.read_bytes()
    populated.write_state(populated.slot_ids()[0], random_state(populated, 43))

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_store.snapshot.os, "replace", refuse)
    with pytest.raises(SnapshotError) as caught:
        populated.snapshot(path)
    assert caught.value.path == path and "No space left" in str(caught.value)
    assert os.listdir(tmp_path) == ["pool.safetensors"]
    assert path.read_bytes() == first
    with pytest.raises(SnapshotError):
        populated.snapshot(tmp_path / "missing-dir" / "s")


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1 :]


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def _bare_pool_file(metadata=None) -> bytes:
    return safetensors.torch.save({"pool": make_pool().image() + 1.0}, metadata=metadata)


# Each makes a bad file from a good snapshot and a slot export of the same pool.
CORRUPTIONS = {
    "empty": lambda good, export: b"",
    "truncated to 4 bytes": lambda good, export: good[:4],
    "truncated header": lambda good, export: good[: _header_end(good) - 10],
    "truncated data": lambda good, export: good[:-1],
    "half the data": lambda good, export: good[: (_header_end(good) + len(good)) // 2],
    "trailing byte": lambda good, export: good + b"\x00",
    "flipped byte in tensor data": lambda good, export: _flip(good, len(good) - 3),
    "flipped first data byte": lambda good, export: _flip(good, _header_end(good)),
    "flipped byte in the id map": lambda good, export: _flip(good, good.index(b'slot_id') + 20),
    "flipped byte in the header length": lambda good, export: _flip(good, 1),
    "text": lambda good, export: b"name,row\nabc,1\n",
    "a slot export": lambda good, export: export,
    "safetensors without metadata": lambda good, export: _bare_pool_file(),
    "foreign metadata": lambda good, export: _bare_pool_file({"format": "pt"}),
    "other version": lambda good, export: good.replace(b'"version":"1"', b'"version":"9"'),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_restore_refuses_bad_files_and_changes_nothing(populated, tmp_path, case):
    good_path = tmp_path / "good"
    populated.snapshot(good_path)
    data = CORRUPTIONS[case](good_path.read_bytes(), populated.export(populated.slot_ids()[0]))
    assert data != good_path.read_bytes()
    bad_path = tmp_path / "bad"
    bad_path.write_bytes(data)
    for slot_id in populated.slot_ids():  # make the pool differ from the snapshot
        populated.write_state(slot_id, random_state(populated, 77))
    populated.alloc(1)
    image = PoolImage.of(populated)
    with pytest.raises(SnapshotError) as caught:
        populated.restore(bad_path)
    assert caught.value.path == bad_path and caught.value.reason in str(caught.value)
    image.assert_same(populated)


def test_restore_refuses_a_missing_file(populated, tmp_path):
    image = PoolImage.of(populated)
    with pytest.raises(SnapshotError) as caught:
        populated.restore(tmp_path / "nowhere")
    assert "cannot read" in str(caught.value)
    image.assert_same(populated)


@pytest.mark.parametrize(
    "geometry",
    [
        {"num_slots": 5},
        {"num_layers": 4},
        {"head_k_dim": 4, "head_v_dim": 8},
        {"num_heads": 1},
        {"dtype": torch.bfloat16},
    ],
)
def test_restore_refuses_another_geometry_and_changes_nothing(populated, tmp_path, geometry):
    other = make_pool(**geometry)
    fill_random(other, seed=5)
    other.alloc(2)
    other.snapshot(tmp_path / "other")
    image = PoolImage.of(populated)
    with pytest.raises(GeometryMismatch) as caught:
        populated.restore(tmp_path / "other")
    assert caught.value.expected["num_slots"] == 6 and caught.value.got != caught.value.expected
    image.assert_same(populated)
