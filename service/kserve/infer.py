"""One inference request of the KServe endpoint, on the server core: which slot it runs on
(sequence, REST slot, or a scratch slot), the prefill itself (`ServerCore.prefill`: the
same validation, ordering and batching as ``/prefill``), and the slot's fate afterwards.

- ``sequence_id`` with ``sequence_start``: a new slot, bound to the id once the prefill
  succeeded; with ``prefix``, the slot starts from the longest complete prefix cache entry
  among its keys (`ServerCore.alloc_prefix`) and is freed again if the prefill fails. A START for a live id runs on a new slot too; the old one is freed after that
  succeeded, and the log says so (a warning).
- ``sequence_id`` alone: the bound slot; an id that is unknown, ended, or whose slot
  expired or was freed is refused (400) with Triton's "must specify the START flag".
- ``sequence_end``: the slot is freed and the id forgotten after the request.
- ``slot``: that slot, managed through the REST API (never freed here).
- none of these: zero initial state on a scratch slot, freed after the request.

A refused request changes nothing: not the pool (`ServerCore.prefill` guarantees it), not
the table (it changes only after a prefill succeeded).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from state_store import PrefixMatch, UnknownSlot

from ..core.server import ServerCore
from ..errors import InvalidRequest
from ..core.inputs import PrefillInputs, PrefillResult
from .options import InferOptions, SequenceId
from .sequences import SequenceTable

log = logging.getLogger("kda_serve.kserve")


@dataclass(frozen=True)
class Outcome:
    """The prefill's result, the slot that holds the sequence's state afterwards (None
    when it was freed: an ended sequence or a request outside any sequence), and what a
    ``prefix`` matched (None without one)."""

    result: PrefillResult
    slot: Optional[str]
    match: Optional[PrefixMatch] = None


def must_start(sequence: SequenceId, model: str, why: str = "") -> InvalidRequest:
    """Triton's refusal of a continuation for a sequence it does not know."""
    return InvalidRequest(f"inference request for sequence {sequence!r} to model {model!r} must specify the START "
                          f"flag on the first request of the sequence{why}", field="parameters.sequence_start")


async def _free(core: ServerCore, slot: str) -> None:
    try:
        await core.free(slot)
    except UnknownSlot:  # freed through the REST API or expired meanwhile: nothing left to do
        pass


async def run(core: ServerCore, table: SequenceTable, model: str, options: InferOptions,
              inputs: Callable[[Optional[str]], PrefillInputs]) -> Outcome:
    """Prefill ``inputs(slot)`` on the slot ``options`` select (see the module docstring)."""
    if options.sequence is None:
        if options.slot is not None:
            return Outcome(await core.prefill(inputs(options.slot)), options.slot)
        result = await core.prefill(inputs(None))
        await _free(core, result.slots[0])
        return Outcome(result, None)
    sequence = options.sequence
    async with table.hold(sequence):
        bound = table.slot(sequence)
        gone = bound is not None and not core.has_slot(bound)
        if gone:
            table.unbind(sequence)
            log.info("sequence %r: its slot %s expired or was freed; forgotten", sequence, bound)
            bound = None
        match = None
        if options.start and options.prefix is not None:
            (slot,), match = await core.alloc_prefix(options.prefix)
            try:
                result = await core.prefill(inputs(slot))
            except BaseException:
                await _free(core, slot)
                raise
            if bound is not None:
                log.warning("sequence %r: sequence_start for a live sequence; its slot %s is replaced by %s "
                            "(the old state is dropped)", sequence, bound, slot)
                await _free(core, bound)
            table.bind(sequence, slot)
        elif options.start:
            result = await core.prefill(inputs(None))
            slot = result.slots[0]
            if bound is not None:
                log.warning("sequence %r: sequence_start for a live sequence; its slot %s is replaced by %s "
                            "(the old state is dropped)", sequence, bound, slot)
                await _free(core, bound)
            table.bind(sequence, slot)
        elif bound is None:
            raise must_start(sequence, model, " (its slot expired or was freed)" if gone else "")
        else:
            try:
                result = await core.prefill(inputs(bound))
            except UnknownSlot:  # freed or expired between the check above and the launch
                table.unbind(sequence)
                raise must_start(sequence, model, " (its slot expired or was freed)") from None
            slot = bound
        if not options.end:
            return Outcome(result, slot, match)
        table.unbind(sequence)
        await _free(core, slot)
        return Outcome(result, None, match)
