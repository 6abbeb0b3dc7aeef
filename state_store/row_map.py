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

import operator
from typing import Optional, Sequence


class RowMap:
    """Storage rows of ``num_layers`` x ``num_slots`` slot rows and ``num_spares`` spares;
    at first (and after `reset`) layer l's slot row s lives in storage row l * num_slots + s
    and the spares are the last ``num_spares`` rows."""

    def __init__(self, num_layers: int, num_slots: int, num_spares: int) -> None:
        if num_spares < 0:
            raise ValueError(f"num_spares must be >= 0, got {num_spares}")
        self.num_layers, self.num_slots, self.num_spares = num_layers, num_slots, num_spares
        self._where: list[list[int]] = []
        self._spares: list[int] = []
        self.reset()

    @property
    def storage_rows(self) -> int:
        """R: rows of the storage tensor, spares included."""
        return self.num_layers * self.num_slots + self.num_spares

    @property
    def spare_count(self) -> int:
        """Spare rows free now."""
        return len(self._spares)

    def reset(self) -> None:
        """Every slot row back in its first place, every spare free."""
        L, S = self.num_layers, self.num_slots
        self._where = [list(range(layer * S, (layer + 1) * S)) for layer in range(L)]
        self._spares = list(range(L * S, L * S + self.num_spares))

    def rows_of_layer(self, layer: int, rows: Sequence[int]) -> list[int]:
        """Storage rows of slot ``rows`` on ``layer``, in order."""
        return list(map(self._where[layer].__getitem__, rows))

    def rows_of_slot(self, row: int) -> list[int]:
        """Storage rows of slot ``row`` on every layer, in layer order."""
        return list(map(operator.itemgetter(row), self._where))

    def all_rows(self) -> list[int]:
        """Storage rows of every (layer, slot row), layer by layer, slot rows in order: the
        logical pool [L, S] flattened."""
        return [row for layer in self._where for row in layer]

    def take_spares(self, count: int) -> Optional[list[int]]:
        """``count`` spare rows, no longer spare, or None (nothing taken) when fewer are free."""
        if count > len(self._spares):
            return None
        taken = self._spares[len(self._spares) - count:]
        del self._spares[len(self._spares) - count:]
        return taken

    def give_back(self, spares: Sequence[int]) -> None:
        """Spare rows taken by `take_spares` and not committed."""
        self._spares.extend(spares)

    def commit(self, layer: int, rows: Sequence[int], read: Sequence[int], written: Sequence[int]) -> None:
        """Slot ``rows`` of ``layer`` (distinct: one launch updates a slot once) now live in the
        storage rows ``written`` (taken spares), and the rows ``read`` they lived in become
        spare. ValueError, having changed nothing but handed ``written`` back, when a slot
        row no longer lives in its ``read`` row (the caller must keep the slots from other
        updates between reading and committing)."""
        where = self._where[layer]
        if len(rows) != len(read) or len(rows) != len(written) or self.rows_of_layer(layer, rows) != list(read):
            self.give_back(written)
            raise ValueError(f"slot rows of layer {layer} moved since they were read: nothing committed")
        for row, new in zip(rows, written):
            where[row] = new
        self._spares.extend(read)
