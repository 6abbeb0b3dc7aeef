"""Safetensors request and response bodies: `tensor_io.safetensors_format` with the request
header cap and the wire's dtypes, its errors as `MalformedBody` (400) naming the tensor.

Request tensors are zero-copy views over the body; responses are written by
`tensor_io.safetensors_format.encode` / ``pieces`` (re-exported here for the client).
"""
from __future__ import annotations

from typing import Union

import torch

from tensor_io.safetensors_format import MAX_REQUEST_HEADER_BYTES, ContainerError, parse
from tensor_io.safetensors_format import encode as encode_safetensors  # noqa: F401  (the body writers)
from tensor_io.safetensors_format import pieces as safetensors_pieces  # noqa: F401

from ..errors import MalformedBody
from .tensors import SAFETENSORS_DTYPES


def parse_safetensors(body: Union[bytearray, memoryview]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors body, the tensors views over it in header order.

    ``body`` must be writable (a bytearray) so the tensors are too; they keep it alive.
    Raises MalformedBody (400) with the reason, and the tensor's name as ``field``.
    """
    try:
        return parse(body, max_header_bytes=MAX_REQUEST_HEADER_BYTES, dtypes=SAFETENSORS_DTYPES)
    except ContainerError as e:
        raise MalformedBody(f"bad safetensors body: {e}", field=e.field) from None
