"""A full disk under a pool journal, for the persistence tests: a write of the journal that
stores half its bytes, then fails, and a cut-back that fails too."""
from __future__ import annotations

import errno
import os
from typing import Union

import pytest

from state_store import Persistence

Data = Union[bytes, bytearray, memoryview]


class HalfWrites:
    """Patches `os.write` and `os.ftruncate` for the journal's fd of ``persistence`` (other
    fds pass through). Once `arm`ed, the journal's next write stores half its bytes and
    raises ENOSPC; with ``cut_back_fails`` its next ftruncate raises EIO (each once)."""

    def __init__(self, persistence: Persistence, monkeypatch: pytest.MonkeyPatch) -> None:
        self._persistence = persistence
        self._real_write, self._real_ftruncate = os.write, os.ftruncate
        self._write_fails = self._ftruncate_fails = False
        monkeypatch.setattr(os, "write", self._write)
        monkeypatch.setattr(os, "ftruncate", self._ftruncate)

    def arm(self, cut_back_fails: bool) -> None:
        self._write_fails, self._ftruncate_fails = True, cut_back_fails

    def _journal(self, fd: int) -> bool:
        return fd == self._persistence._fd

    def _write(self, fd: int, data: Data) -> int:
        if not (self._journal(fd) and self._write_fails):
            return self._real_write(fd, data)
        self._write_fails = False
        self._real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def _ftruncate(self, fd: int, length: int) -> None:
        if self._journal(fd) and self._ftruncate_fails:
            self._ftruncate_fails = False
            raise OSError(errno.EIO, "injected")
        self._real_ftruncate(fd, length)
