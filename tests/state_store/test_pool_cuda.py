"""The same pool code on a CUDA device (skipped where there is none)."""
from __future__ import annotations

import pytest
import torch
from pool_helpers import assert_bit_equal, fill_random, make_pool, random_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pool_round_trips_through_host_formats(tmp_path, dtype):
    pool = make_pool(device="cuda", dtype=dtype)
    assert pool.storage.is_cuda and pool.geometry.device == pool.storage.device
    fill_random(pool)
    a, b = pool.alloc(2)
    assert torch.count_nonzero(pool.read_state(a)) == 0
    state = random_state(pool, 1)
    pool.write_state(a, state)  # from the host
    fork = pool.fork(a)
    pool.write_state(b, random_state(pool, 2).cuda())
    assert_bit_equal(pool.read_state(fork), state)

    cpu_pool = make_pool(dtype=dtype)  # exports and snapshots are device-neutral
    assert_bit_equal(cpu_pool.read_state(cpu_pool.import_(pool.export(a))), state)
    pool.snapshot(tmp_path / "s")
    cpu_pool.restore(tmp_path / "s")
    assert_bit_equal(cpu_pool.image(), pool.image())
    cuda_again = make_pool(device="cuda", dtype=dtype)
    cuda_again.restore(tmp_path / "s")
    assert_bit_equal(cuda_again.read_state(b), random_state(pool, 2))


def test_cuda_slot_copies_follow_moved_rows():
    """After a commit moved a slot's rows (as a launch does), the host's and the device's
    copies into it (write_state, alloc_copies: one copy per layer from the host, one scatter
    on the device) land in the rows it now lives in, and read back bit for bit."""
    pool = make_pool(device="cuda")
    a, b = pool.alloc(2)
    rows = pool.rows([a, b])
    read = pool.layer_rows(1, rows)
    spares = pool.take_spares(2)
    assert spares is not None
    pool.storage[spares] = 1.0
    pool.commit_rows(1, rows, read, spares)
    assert pool.layer_rows(1, rows).tolist() == spares.tolist()
    host, device = random_state(pool, 3), random_state(pool, 4).cuda()
    pool.write_state(a, host)
    pool.write_state(b, device)
    assert_bit_equal(pool.read_state(a), host)
    assert_bit_equal(pool.read_state(b), device)
    pool.free(a)
    (c,) = pool.alloc_copies(host, 1, [1, 1, 1])  # a's slot row again, its layer-1 row moved
    assert_bit_equal(pool.read_state(c), host)
