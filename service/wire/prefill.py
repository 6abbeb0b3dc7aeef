"""Prefill requests and responses in both encodings, to and from `PrefillInputs` /
`PrefillResult`.

- ``application/json``: `PrefillJSONRequest` with base64 tensors; response
  `PrefillJSONResponse`.
- ``application/x-safetensors``: tensors q, k, v, g, beta (A_log, dt_bias) in one body and
  `PrefillOptions` as the JSON string ``__metadata__["request"]``; response tensors ``o``
  and ``final_state`` with ``__metadata__["response"] = {"slots": [...]}``. Request tensors
  are zero-copy views over the body.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

import torch

from ..errors import MalformedBody, SchemaError
from ..core.inputs import (
    OPTIONAL_TENSORS, PARAM_NAMES, REQUIRED_TENSORS, TENSORS, Checkpoint, PrefillInputs, PrefillParams,
    PrefillResult,
)
from .media import JSON
from .safetensors_codec import parse_safetensors, safetensors_pieces
from .schema import PrefillJSONRequest, PrefillJSONResponse, PrefillOptions, parse_model
from .tensors import tensor_to_json


def prefill_inputs_of(options: PrefillOptions, tensors: Mapping[str, torch.Tensor],
                      device_outputs: bool = False) -> PrefillInputs:
    """The prefill a request document (JSON, safetensors metadata, shared memory) asks for,
    over ``tensors`` by name (`PrefillInputs.of`)."""
    params = PrefillParams(**{name: getattr(options, name) for name in PARAM_NAMES})
    checkpoints = [[Checkpoint(c["offset"], c["key"]) for c in s.get("checkpoints", ())] for s in options.sequences]
    return PrefillInputs.of(params, [s["slot"] for s in options.sequences], [s["length"] for s in options.sequences],
                            tensors, device_outputs, checkpoints if any(checkpoints) else None)


def decode_prefill_json(body: bytes | bytearray) -> PrefillInputs:
    request = parse_model(PrefillJSONRequest, body)
    tensors = {
        name: getattr(request, name).to_tensor(name)
        for name in TENSORS
        if getattr(request, name) is not None
    }
    return prefill_inputs_of(request, tensors)


def decode_prefill_safetensors(body: bytearray) -> PrefillInputs:
    tensors, metadata = parse_safetensors(body)
    missing = [n for n in REQUIRED_TENSORS if n not in tensors]
    unknown = [n for n in tensors if n not in TENSORS]
    if missing or unknown:
        errors = [{"loc": ["body", n], "msg": "Field required", "type": "missing"} for n in missing]
        errors += [{"loc": ["body", n], "msg": "Extra inputs are not permitted", "type": "extra_forbidden"}
                   for n in unknown]
        what = f"missing tensor(s) {missing}" if missing else f"unknown tensor(s) {unknown}"
        raise SchemaError(f"{what}; a prefill body holds {list(REQUIRED_TENSORS)} and optionally "
                          f"{list(OPTIONAL_TENSORS)}", errors)
    if "request" not in metadata:
        raise MalformedBody('safetensors body lacks __metadata__["request"] (the request options as JSON)',
                            field="__metadata__.request")
    options = parse_model(PrefillOptions, metadata["request"], where="__metadata__.request")
    return prefill_inputs_of(options, tensors)


def encode_prefill_json(result: PrefillResult) -> bytes:
    doc: dict[str, Any] = {"slots": result.slots, "o": tensor_to_json(result.o)}
    if result.final_state is not None:
        doc["final_state"] = tensor_to_json(result.final_state)
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


def prefill_safetensors_pieces(result: PrefillResult) -> list[memoryview]:
    """A safetensors /prefill response (o, final_state when given, ``__metadata__.response``
    = ``{"slots": [...]}``) as pieces to send one after another: the header, then views of
    o's and final_state's own bytes (no copy of the outputs)."""
    tensors = {"o": result.o}
    if result.final_state is not None:
        tensors["final_state"] = result.final_state
    return safetensors_pieces(tensors, {"response": json.dumps({"slots": result.slots})})


def decode_prefill_response(body: bytearray, media: str) -> tuple[list[str], torch.Tensor, Optional[torch.Tensor]]:
    """(slots, o, final_state or None) from a /prefill response body of ``media`` type."""
    if media == JSON:
        doc = parse_model(PrefillJSONResponse, body)
        final = None if doc.final_state is None else doc.final_state.to_tensor("final_state")
        return doc.slots, doc.o.to_tensor("o"), final
    tensors, metadata = parse_safetensors(body)
    try:
        slots = json.loads(metadata["response"])["slots"]
        return slots, tensors["o"], tensors.get("final_state")
    except (KeyError, TypeError, ValueError) as e:
        raise MalformedBody(f"not a prefill response: {e!r}") from None
