"""The sequence table's journal stays bounded on a server whose periodic snapshots are off
(``--snapshot-interval-s 0`` with a snapshot path: the table is saved only at shutdown
otherwise): once it outgrows max(1 MiB, 4x the table's last saved size) the table is saved
and the journal emptied, as the pool's own journal is compacted. A restart still restores
exactly what the uncompacted journal would have."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from service.kserve.sequences import COMPACT_MIN_BYTES, SequenceTable


def test_the_journal_is_folded_into_the_table_once_it_outgrows_its_bound(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    table = SequenceTable(path)
    table.bind("kept", "slot-kept")
    largest = 0
    for i in range(30_000):  # ~2.5 MB of records without a bound
        table.bind(i, f"slot-{i:022d}")
        table.unbind(i)
        if i % 1000 == 0:
            largest = max(largest, os.path.getsize(table.journal_path))
    table.bind("late", "slot-late")
    largest = max(largest, os.path.getsize(table.journal_path))
    assert largest <= COMPACT_MIN_BYTES + 200, largest
    restored = SequenceTable(path)
    restored.load(lambda slot: True)  # as after a kill -9: the saved table and the journal since
    assert restored.live() == table.live() == {"kept": "slot-kept", "late": "slot-late"}


def test_a_failed_fold_keeps_the_journal_and_journaling(tmp_path: Path) -> None:
    """A save that fails when the journal outgrows its bound (the table's directory not
    writable, say) leaves the journal as it is: every change is still in it."""
    path = str(tmp_path / "t.json")
    table = SequenceTable(path)

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    table.save = full_disk  # type: ignore[method-assign]
    for i in range(30_000):
        table.bind(i, f"slot-{i:022d}")
        table.unbind(i)
    table.bind("late", "slot-late")
    restored = SequenceTable(path)
    restored.load(lambda slot: True)
    assert restored.live() == {"late": "slot-late"}
