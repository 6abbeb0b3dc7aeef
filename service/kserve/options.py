"""Request parameters of ``/v2/models/kda/infer``, read strictly into `InferOptions`.

Sequence (Triton's sequence batcher): ``sequence_id`` (uint64 or string; 0 and "" mean no
sequence), ``sequence_start``, ``sequence_end``. Slots managed through the REST API
instead: ``slot``. Prefill options as on ``/prefill``: each field of
`service.core.inputs.PrefillParams` (``layer``, default 0, ``lower_bound``, ``scale``,
``use_qk_l2norm``, ``use_beta_sigmoid``, ``allow_neg_eigval``) but ``return_final_state``,
which the outputs requested decide. Binary tensor data: ``binary_data_output`` (over gRPC
outputs are always raw bytes, so only true is taken there). The prefix cache
(docs/PREFIX_CACHE.md): ``checkpoints``, a JSON string ``[{"offset": n, "key": "..."}, ...]``
for the request's sequence, as on ``/prefill``; ``prefix``, a JSON string of keys in prompt
order, with ``sequence_start`` only: the new slot starts from the longest complete entry
among them. Any other name is refused, so a typo never runs with a default.
"""
from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..core.inputs import PARAM_NAMES, Checkpoint, PrefillParams
from ..errors import InvalidRequest
from .protocol import Parameters, ParameterValue

SequenceId = Union[int, str]
"""A sequence id as sent: ``42`` and ``"42"`` are different sequences."""

UINT64_MAX = (1 << 64) - 1
SEQUENCE_ID_MAX_CHARS = 256
PREFILL_PARAMETERS = tuple(name for name in PARAM_NAMES if name != "return_final_state")  # outputs decide it
KNOWN = ("sequence_id", "sequence_start", "sequence_end", "slot", *PREFILL_PARAMETERS, "binary_data_output",
         "checkpoints", "prefix")


@dataclass(frozen=True)
class InferOptions:
    """What a request's parameters ask for. ``sequence`` is None outside a sequence;
    ``prefill`` has the default ``return_final_state`` (the outputs requested decide it)."""

    sequence: Optional[SequenceId] = None
    start: bool = False
    end: bool = False
    slot: Optional[str] = None
    prefill: PrefillParams = field(default_factory=PrefillParams)
    binary_data_output: bool = False
    checkpoints: tuple[Checkpoint, ...] = ()
    prefix: Optional[tuple[str, ...]] = None


def _fail(name: str, detail: str) -> InvalidRequest:
    return InvalidRequest(detail, field=f"parameters.{name}")


def _type_name(value: ParameterValue) -> str:
    """The JSON type of a parameter's value with its article: "a string", "an integer"."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[type(value)]


def _sequence_id(value: ParameterValue) -> Optional[SequenceId]:
    if type(value) is int:
        if not 0 <= value <= UINT64_MAX:
            raise _fail("sequence_id", f"sequence_id must be a uint64 (0..{UINT64_MAX}) or a string, got {value}")
        return value or None
    if type(value) is str:
        if len(value) > SEQUENCE_ID_MAX_CHARS:
            raise _fail("sequence_id", f"a string sequence_id has at most {SEQUENCE_ID_MAX_CHARS} characters, "
                                       f"got {len(value)}")
        return value or None
    raise _fail("sequence_id", f"sequence_id must be a uint64 or a string, got {_type_name(value)}")


def _bool(params: Parameters, name: str) -> bool:
    value = params.get(name, False)
    if type(value) is not bool:
        raise _fail(name, f"{name} must be a boolean, got {_type_name(value)}")
    return value


def _number(params: Parameters, name: str) -> Optional[float]:
    value = params.get(name)
    if value is not None and type(value) not in (int, float):
        raise _fail(name, f"{name} must be a number, got {_type_name(value)}")
    return None if value is None else float(value)


def _int(params: Parameters, name: str) -> int:
    value = params[name]
    if type(value) is not int:
        raise _fail(name, f"{name} must be an integer, got {_type_name(value)}")
    return value


_READERS: dict[object, Callable[[Parameters, str], object]] = {int: _int, Optional[float]: _number, bool: _bool}
_PREFILL_TYPES = typing.get_type_hints(PrefillParams)


def _prefill(params: Parameters) -> PrefillParams:
    """The prefill options among ``params``, each read by its field's type (the rest default)."""
    return PrefillParams(**{name: _READERS[_PREFILL_TYPES[name]](params, name)
                            for name in PREFILL_PARAMETERS if name in params})


def _slot(params: Parameters) -> Optional[str]:
    value = params.get("slot")
    if value is not None and (type(value) is not str or not value):
        raise _fail("slot", "slot must be a non-empty string (a slot id from POST /slots)")
    return value


def _json_param(params: Parameters, name: str) -> object:
    value = params[name]
    if type(value) is not str:
        raise _fail(name, f"{name} must be a JSON string, got {_type_name(value)}")
    try:
        return json.loads(value)
    except ValueError as e:
        raise _fail(name, f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise _fail(name, f"{name} is nested too deeply to parse") from None


def _checkpoints(params: Parameters) -> tuple[Checkpoint, ...]:
    if "checkpoints" not in params:
        return ()
    doc = _json_param(params, "checkpoints")
    shape = 'checkpoints must be a JSON list of {"offset": integer, "key": string}'
    if not isinstance(doc, list):
        raise _fail("checkpoints", shape)
    marks = []
    for item in doc:
        if (not isinstance(item, dict) or set(item) != {"offset", "key"} or type(item["offset"]) is not int
                or type(item["key"]) is not str):
            raise _fail("checkpoints", f"{shape}, got {json.dumps(item)[:200]}")
        marks.append(Checkpoint(item["offset"], item["key"]))
    return tuple(marks)


def _prefix(params: Parameters) -> Optional[tuple[str, ...]]:
    if "prefix" not in params:
        return None
    doc = _json_param(params, "prefix")
    if not isinstance(doc, list) or not all(type(k) is str for k in doc):
        raise _fail("prefix", "prefix must be a JSON list of key strings")
    return tuple(doc)


def parse_options(params: Parameters) -> InferOptions:
    """`InferOptions` from a request's ``parameters``; InvalidRequest (400) naming the
    parameter for an unknown name, a wrong type, START/END without a sequence id, or both
    a sequence id and a slot."""
    unknown = sorted(set(params) - set(KNOWN))
    if unknown:
        raise _fail(unknown[0], f"unknown request parameter(s) {unknown}; this model takes {list(KNOWN)}")
    options = InferOptions(
        sequence=_sequence_id(params["sequence_id"]) if "sequence_id" in params else None,
        start=_bool(params, "sequence_start"),
        end=_bool(params, "sequence_end"),
        slot=_slot(params),
        prefill=_prefill(params),
        binary_data_output=_bool(params, "binary_data_output"),
        checkpoints=_checkpoints(params),
        prefix=_prefix(params),
    )
    if options.prefix is not None and not options.start:
        raise _fail("prefix", "prefix needs sequence_start: only a new sequence's slot starts from a cached prefix")
    if options.sequence is None and (options.start or options.end):
        flag = "sequence_start" if options.start else "sequence_end"
        raise _fail(flag, f"{flag} needs a non-zero (or non-empty) sequence_id")
    if options.sequence is not None and options.slot is not None:
        raise _fail("slot", "give sequence_id or slot, not both: a sequence's slot is chosen by the server")
    return options
