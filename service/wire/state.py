"""A slot's state on the wire: safetensors with tensor ``state`` [L, HV, V, K] (the pool's
export format; metadata optional on the way in), or JSON ``{"state": <tensor>}``."""
from __future__ import annotations

import json

import torch

from ..errors import SchemaError
from .safetensors_codec import encode_safetensors, parse_safetensors
from .schema import StateJSON, parse_model
from .tensors import tensor_to_json

STATE = "state"


def decode_state_json(body: bytes | bytearray) -> torch.Tensor:
    return parse_model(StateJSON, body).state.to_tensor(STATE)


def decode_state_safetensors(body: bytearray) -> torch.Tensor:
    tensors, _ = parse_safetensors(body)
    if list(tensors) != [STATE]:
        errors = [{"loc": ["body", n], "msg": "Extra inputs are not permitted", "type": "extra_forbidden"}
                  for n in tensors if n != STATE]
        if STATE not in tensors:
            errors.insert(0, {"loc": ["body", STATE], "msg": "Field required", "type": "missing"})
        raise SchemaError(f"a state body holds exactly one tensor, {STATE!r}; got {list(tensors)}", errors)
    return tensors[STATE]


def encode_state_json(state: torch.Tensor) -> bytes:
    return json.dumps({STATE: tensor_to_json(state)}, separators=(",", ":")).encode("ascii")


def encode_state_safetensors(state: torch.Tensor) -> bytearray:
    """A body for PUT: the tensor alone (the server checks it against its pool)."""
    return encode_safetensors({STATE: state})
