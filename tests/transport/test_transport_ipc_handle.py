"""CUDA IPC bookkeeping that runs on CPU: the handle the client sends, taken from the one
torch shares (the bytes' layout), and the server's one mapping per handle (with a
stand-in for the CUDA open)."""
from __future__ import annotations

import pytest

from service.shm.cuda_ipc import IpcMappings
from kda_client.shm import raw_ipc_handle

HANDLE = bytes(range(64))


def test_torch_before_2_5_shares_the_bare_handle() -> None:
    assert raw_ipc_handle(HANDLE) == HANDLE


def test_torch_from_2_5_prefixes_version_and_kind() -> None:
    assert raw_ipc_handle(b"\x01c" + HANDLE) == HANDLE


@pytest.mark.parametrize("shared, says", [(b"\x01e" + HANDLE, "expandable segments"),
                                          (b"\x01x" + HANDLE, "unknown kind"),
                                          (HANDLE[:40], "unknown kind")])
def test_other_handles_are_refused_with_the_reason(shared: bytes, says: str) -> None:
    with pytest.raises(RuntimeError, match=says):
        raw_ipc_handle(shared)


class _Opened:
    """What the server's IPC registry needs of an opened handle: its key and close()."""

    def __init__(self, raw_handle: bytes, device_id: int) -> None:
        self.key = (device_id, bytes(raw_handle))
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_one_mapping_per_handle_and_device_closed_with_its_last_region() -> None:
    """CUDA opens a handle once per context, and torch shares whole allocator blocks, so two
    regions can name one allocation: the registry opens it once and closes it last."""
    opened: list[_Opened] = []

    def opener(raw_handle: bytes, device_id: int) -> _Opened:
        opened.append(_Opened(raw_handle, device_id))
        return opened[-1]

    mappings = IpcMappings(opener)  # type: ignore[arg-type]
    a, b = mappings.acquire(HANDLE, 0), mappings.acquire(HANDLE, 0)
    other_handle, other_device = mappings.acquire(HANDLE[::-1], 0), mappings.acquire(HANDLE, 1)
    assert a is b and len(opened) == 3 and len(mappings) == 3
    assert len({id(a), id(other_handle), id(other_device)}) == 3
    mappings.release(a)
    assert a.closes == 0 and len(mappings) == 3
    mappings.release(b)
    assert a.closes == 1 and len(mappings) == 2
    again = mappings.acquire(HANDLE, 0)  # registered anew after both went: opened anew
    assert again is not a and len(opened) == 4
    for memory in (other_handle, other_device, again):
        mappings.release(memory)
    assert len(mappings) == 0 and all(m.closes == 1 for m in opened)
