"""Export and import of one slot's state as safetensors bytes."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from pool_helpers import PoolImage, assert_bit_equal, fill_random, make_pool, random_state

from state_store import GeometryMismatch, PoolError, PoolFull, SnapshotError, UnknownSlot
from tensor_io.safetensors_format import MAX_HEADER_BYTES, MAX_REQUEST_HEADER_BYTES


def _metadata(data: bytes) -> dict[str, str]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length])["__metadata__"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_import_round_trip_is_bit_exact(dtype):
    source = make_pool(dtype=dtype)
    fill_random(source)
    a, b = source.alloc(2)
    state = random_state(source, 7)
    source.write_state(a, state)
    source.record_tokens(a, 2, 130)
    data = source.export(a)

    target = make_pool(dtype=dtype, num_slots=3, id_prefix="other.")
    fill_random(target, seed=2)
    new = target.import_(data)
    assert new.startswith("other.")
    assert_bit_equal(target.read_state(new), state)
    assert target.slot_info(new).tokens_per_layer == [0, 0, 130]

    assert source.import_(memoryview(data), slot_id=b) == b  # over a live slot
    assert_bit_equal(source.read_state(b), state)
    assert source.slot_info(b).tokens_per_layer == [0, 0, 130]


def test_export_is_plain_safetensors_with_geometry_metadata():
    pool = make_pool()
    (a,) = pool.alloc(1)
    state = random_state(pool, 8)
    pool.write_state(a, state)
    data = pool.export(a)
    loaded = safetensors.torch.load(data)
    assert list(loaded) == ["state"]
    assert_bit_equal(loaded["state"], state)
    meta = _metadata(data)
    assert {k: meta[k] for k in ("num_layers", "num_heads", "head_k_dim", "head_v_dim", "dtype")} == {
        "num_layers": "3",
        "num_heads": "2",
        "head_k_dim": "8",
        "head_v_dim": "4",
        "dtype": "float32",
    }


def test_import_of_a_third_party_safetensors_body():
    pool = make_pool()
    state = random_state(pool, 9)
    meta = {"num_layers": "3", "num_heads": "2", "head_k_dim": "8", "head_v_dim": "4", "dtype": "float32"}
    slot_id = pool.import_(safetensors.torch.save({"state": state}, metadata=meta))
    assert_bit_equal(pool.read_state(slot_id), state)
    assert pool.slot_info(slot_id).tokens_per_layer == [0, 0, 0]


def test_import_takes_a_header_over_the_request_cap():
    """Files (exports, snapshots) get the file header cap, not the request bodies' one."""
    pool = make_pool()
    state = random_state(pool, 10)
    assert MAX_REQUEST_HEADER_BYTES < MAX_HEADER_BYTES
    meta = {"num_layers": "3", "num_heads": "2", "head_k_dim": "8", "head_v_dim": "4", "dtype": "float32",
            "note": "x" * (MAX_REQUEST_HEADER_BYTES + 1)}
    slot_id = pool.import_(safetensors.torch.save({"state": state}, metadata=meta))
    assert_bit_equal(pool.read_state(slot_id), state)


def _export_of(seed: int, **geometry) -> bytes:
    pool = make_pool(**geometry)
    (a,) = pool.alloc(1)
    pool.write_state(a, random_state(pool, seed))
    return pool.export(a)


@pytest.mark.parametrize(
    "geometry",
    [
        {"head_k_dim": 4, "head_v_dim": 8},  # transposed
        {"num_layers": 2},
        {"num_heads": 4},
        {"dtype": torch.bfloat16},
    ],
)
@pytest.mark.parametrize("into_live_slot", [False, True])
def test_import_refuses_another_geometry_and_changes_nothing(populated, geometry, into_live_slot):
    data = _export_of(3, **geometry)
    target = populated.slot_ids()[0] if into_live_slot else None
    image = PoolImage.of(populated)
    with pytest.raises(GeometryMismatch) as caught:
        populated.import_(data, target)
    assert caught.value.expected == {
        "num_layers": 3, "num_heads": 2, "head_k_dim": 8, "head_v_dim": 4, "dtype": "float32",
    }
    assert caught.value.got != caught.value.expected
    assert str(caught.value.expected) in str(caught.value) and str(caught.value.got) in str(caught.value)
    image.assert_same(populated)


def _garbage() -> dict[str, bytes]:
    good = _export_of(4)
    pool = make_pool()
    meta = {"num_layers": "3", "num_heads": "2", "head_k_dim": "8", "head_v_dim": "4", "dtype": "float32"}
    state = random_state(pool, 5)
    flipped_meta = good.replace(b'"num_layers":"3"', b'"num_layers":"x"')
    return {
        "empty": b"",
        "short": b"\x01\x02",
        "text": b"this is not a safetensors body at all, just words",
        "random": torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
        .to(torch.uint8)
        .numpy()
        .tobytes(),
        "huge header length": (2**40).to_bytes(8, "little") + b"{}",
        "truncated": good[:-5],
        "trailing bytes": good + b"\x00",
        "no metadata": safetensors.torch.save({"state": state}),
        "other tensor name": safetensors.torch.save({"pool": state}, metadata=meta),
        "two tensors": safetensors.torch.save({"state": state, "extra": state[0].clone()}, metadata=meta),
        "shape disagrees with metadata": safetensors.torch.save({"state": state[:, :1].contiguous()}, metadata=meta),
        "non-integer geometry": flipped_meta,
        "bad tokens": safetensors.torch.save(
            {"state": state}, metadata={**meta, "tokens_per_layer": "[1, -2, 3]"}
        ),
        "deeply nested tokens": safetensors.torch.save(
            {"state": state}, metadata={**meta, "tokens_per_layer": "[" * 100_000}
        ),
    }


@pytest.mark.parametrize("case", sorted(_garbage()))
@pytest.mark.parametrize("into_live_slot", [False, True])
def test_import_refuses_garbage_and_changes_nothing(populated, case, into_live_slot):
    data = _garbage()[case]
    target = populated.slot_ids()[0] if into_live_slot else None
    image = PoolImage.of(populated)
    with pytest.raises(SnapshotError) as caught:
        populated.import_(data, target)
    assert isinstance(caught.value, PoolError) and caught.value.path is None
    assert str(caught.value).startswith("slot state data: ") and caught.value.reason
    image.assert_same(populated)


def test_import_into_a_full_pool_or_an_unknown_slot_changes_nothing(populated):
    data = populated.export(populated.slot_ids()[0])
    populated.alloc(populated.stats().free)
    image = PoolImage.of(populated)
    with pytest.raises(PoolFull):
        populated.import_(data)
    with pytest.raises(UnknownSlot):
        populated.import_(data, "no-such-slot")
    with pytest.raises(UnknownSlot):
        populated.import_(b"garbage", "no-such-slot")  # the slot is resolved first
    image.assert_same(populated)


def test_export_reads_no_other_row(populated):
    ids = populated.slot_ids()
    for slot_id in ids:
        state = safetensors.torch.load(populated.export(slot_id))["state"]
        assert_bit_equal(state, populated.read_state(slot_id))
