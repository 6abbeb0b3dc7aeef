"""`RowMap`: where each (layer, slot row) of a pool lives among its storage rows, and which
storage rows are spare.

A pool keeps its states in one tensor of storage rows [R, HV, V, K]: ``num_layers *
num_slots`` rows that hold the slots' states and ``num_spares`` more. A launch on one layer
may read each slot's state from its row and write the new state to a spare row; committing
it swaps the two in the map (the row read becomes spare), so the launch never overwrites a
state it may still have to keep (a refused launch hands its spare rows back and nothing
changed). Plain host bookkeeping, no tensors: the pool holds the lock around it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

Rows = Union[Sequence[int], np.ndarray]
"""Row numbers: a sequence of ints, or an int64 array (a launch's hundreds: no Python loop)."""


class RowMap:
    """Storage rows of ``num_layers`` x ``num_slots`` slot rows and ``num_spares`` spares;
    at first (and after `reset`) layer l's slot row s lives in storage row l * num_slots + s
    and the spares are the last ``num_spares`` rows. Held in numpy arrays: a decode step
    moves hundreds of rows, each pass one vectorized operation."""

    def __init__(self, num_layers: int, num_slots: int, num_spares: int) -> None:
        if num_spares < 0:
            raise ValueError(f"num_spares must be >= 0, got {num_spares}")
        self.num_layers, self.num_slots, self.num_spares = num_layers, num_slots, num_spares
        self._where = np.empty((num_layers, num_slots), dtype=np.int64)  # [layer, slot row] -> storage row
        self._spares = np.empty(num_spares, dtype=np.int64)  # a stack: the first ``_free`` are spare
        self._free = 0
        self.reset()

    @property
    def storage_rows(self) -> int:
        """R: rows of the storage tensor, spares included."""
        return self.num_layers * self.num_slots + self.num_spares

    @property
    def spare_count(self) -> int:
        """Spare rows free now."""
        return self._free

    def reset(self) -> None:
        """Every slot row back in its first place, every spare free."""
        L, S = self.num_layers, self.num_slots
        self._where[:] = np.arange(L * S, dtype=np.int64).reshape(L, S)
        self._spares[:] = np.arange(L * S, L * S + self.num_spares, dtype=np.int64)
        self._free = self.num_spares

    def rows_of_layer(self, layer: int, rows: Rows) -> np.ndarray:
        """Storage rows of slot ``rows`` on ``layer``, in order: a new int64 array."""
        return self._where[layer].take(rows)

    def rows_of_slot(self, row: int) -> list[int]:
        """Storage rows of slot ``row`` on every layer, in layer order."""
        return self._where[:, row].tolist()

    def all_rows(self) -> list[int]:
        """Storage rows of every (layer, slot row), layer by layer, slot rows in order: the
        logical pool [L, S] flattened."""
        return self._where.ravel().tolist()

    def take_spares(self, count: int) -> Optional[np.ndarray]:
        """``count`` spare rows (a new int64 array), no longer spare, or None (nothing taken)
        when fewer are free."""
        if count > self._free:
            return None
        self._free -= count
        return self._spares[self._free:self._free + count].copy()

    def give_back(self, spares: Rows) -> None:
        """Spare rows taken by `take_spares` and not committed (ValueError, nothing changed,
        for more than were taken: a row would be spare twice)."""
        n = len(spares)
        if self._free + n > self.num_spares:
            raise ValueError(f"{n} rows given back, but only {self.num_spares - self._free} spare rows are taken")
        self._spares[self._free:self._free + n] = spares
        self._free += n

    def commit(self, layer: int, rows: Rows, read: Rows, written: Rows) -> None:
        """Slot ``rows`` of ``layer`` (distinct: one launch updates a slot once) now live in the
        storage rows ``written`` (taken spares), and the rows ``read`` they lived in become
        spare. ValueError, having changed nothing but handed ``written`` back, when a slot
        row no longer lives in its ``read`` row (the caller must keep the slots from other
        updates between reading and committing)."""
        where = self._where[layer]
        # compared as bytes: no ufunc and reduction set up (a lone sequence's commit is all overhead)
        if (len(rows) != len(read) or len(rows) != len(written)
                or where.take(rows).tobytes() != np.asarray(read, dtype=np.int64).tobytes()):
            self.give_back(written)
            raise ValueError(f"slot rows of layer {layer} moved since they were read: nothing committed")
        where.put(rows, written)  # (take and put read a list of rows as it is: no array made for it)
        self.give_back(read)
