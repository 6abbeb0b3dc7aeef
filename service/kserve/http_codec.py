"""Inference bodies of the Open Inference Protocol over HTTP, to and from the neutral form
(`service.kserve.codec`).

Request body: the JSON `InferenceRequest`, then (binary tensor data extension) the raw
bytes of every input that has ``parameters.binary_data_size``, in input order;
``Inference-Header-Content-Length`` gives the JSON's length. An input's bytes come from
``data`` (JSON numbers), its ``binary_data_size`` bytes of the binary part, or shared
memory. Response: JSON ``outputs`` (``data`` lists), binary sections after the JSON
(``binary_data_size``), or the description of bytes already written into shared memory.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from tensor_io.views import tensor_bytes

from ..errors import MalformedBody
from ..wire.schema import parse_model
from .codec import (
    SHM_PARAMETERS, InputSpec, OutputSpec, ParsedRequest, Raw, Sources, bad, check_input_names, check_output_names,
    check_parameters, input_dtype, shm_description, shm_ref, uint_parameter,
)
from .datatypes import datatype_name
from .model import OUTPUTS, VERSION
from .options import parse_options
from .protocol import NAME_MAX, InferenceRequest, RequestInput, RequestOutput

HEADER_LENGTH = "Inference-Header-Content-Length"
LENGTH_DIGITS_MAX = 32  # digits of a header length: far more than any body's, far fewer than int() refuses
SOURCES = Sources(numbers="data", raw="binary_data_size")
_INPUT_PARAMETERS = ("binary_data_size", *SHM_PARAMETERS)
_OUTPUT_PARAMETERS = ("binary_data", *SHM_PARAMETERS)


def header_end(body_length: int, header_length: Optional[str]) -> int:
    """Where the JSON ends: ``Inference-Header-Content-Length``, or the whole body. The
    header is ASCII digits (str.isdigit alone takes superscripts, which int() refuses) of
    at most `LENGTH_DIGITS_MAX` (int() refuses thousands of them); MalformedBody otherwise."""
    if header_length is None:
        return body_length
    digits = header_length.strip()
    if (not (digits.isascii() and digits.isdigit()) or len(digits) > LENGTH_DIGITS_MAX
            or int(digits) > body_length):
        raise MalformedBody(f"{HEADER_LENGTH} {header_length[:64]!r} is not a byte count within the body's "
                            f"{body_length} bytes", field=HEADER_LENGTH)
    return int(digits)


def _input_spec(x: RequestInput, body: bytearray, offset: int) -> InputSpec:
    """Input ``x``; its binary data (if any) starts at ``offset`` of ``body``."""
    where = f"input {x.name!r}"
    check_parameters(x.parameters, _INPUT_PARAMETERS, where)
    binary_size = uint_parameter(x.parameters, "binary_data_size", where)
    shm = shm_ref(x.parameters, where)
    given = {source: size for source, size, used in (
        (SOURCES.numbers, None, x.data is not None), (SOURCES.raw, binary_size, binary_size is not None),
        (SOURCES.shm, shm.byte_size if shm else None, shm is not None)) if used}
    dtype = input_dtype(x.name, x.datatype, list(x.shape), given, SOURCES)
    raw = Raw(body, offset, binary_size) if binary_size is not None else None
    return InputSpec(x.name, dtype, list(x.shape), x.data, raw, shm)


def _output_spec(x: RequestOutput, binary_default: bool) -> OutputSpec:
    where = f"output {x.name!r}"
    check_output_names([x.name])
    check_parameters(x.parameters, _OUTPUT_PARAMETERS, where)
    binary = x.parameters.get("binary_data", binary_default)
    if type(binary) is not bool:
        raise bad(f"{where}.parameters.binary_data", f"{where}: binary_data must be a boolean")
    shm = shm_ref(x.parameters, where)
    if shm is not None and x.parameters.get("binary_data") is True:
        raise bad(f"{where}.parameters", f"{where}: binary_data and shared_memory_region exclude each other")
    return OutputSpec(x.name, binary and shm is None, shm)


def _check_echo(doc: InferenceRequest, model: str, version: Optional[str]) -> None:
    """That the body's ``model_name`` and ``model_version`` (optional echoes; "" for the
    version: any), where given, name the model of the URL (``version`` None: `VERSION`,
    the one it serves); InvalidRequest (400) naming the member otherwise."""
    for member, said, url in (("model_name", doc.model_name, model),
                              ("model_version", doc.model_version or None, version or VERSION)):
        if said is not None and said != url:
            raise bad(member, f"the body's {member} {said[:NAME_MAX]!r} contradicts the URL, which names "
                              f"{url!r}; leave it out or give the URL's")


def parse_request(body: bytearray, json_end: int, model: Optional[str] = None,
                  version: Optional[str] = None) -> ParsedRequest:
    """Read the JSON part of ``body`` (its first ``json_end`` bytes) and check it: schema
    (422), parameters, input names, datatypes, byte counts, data sources and requested
    outputs (400); the binary part must hold exactly the bytes the inputs announce. With
    ``model`` (the URL's, and its ``version``), the body's ``model_name`` and
    ``model_version`` must agree with them (400)."""
    raw = body if json_end == len(body) else bytes(memoryview(body)[:json_end])
    doc = parse_model(InferenceRequest, raw, where="request")
    if model is not None:
        _check_echo(doc, model, version)
    options = parse_options(doc.parameters)
    check_input_names([x.name for x in doc.inputs])
    inputs, offset = [], json_end
    for x in doc.inputs:
        spec = _input_spec(x, body, offset)
        inputs.append(spec)
        offset += spec.raw.size if spec.raw is not None else 0
    if offset != len(body):
        raise MalformedBody(f"inputs announce {offset - json_end} bytes of binary data (binary_data_size), but "
                            f"{len(body) - json_end} bytes follow the {json_end}-byte JSON ({HEADER_LENGTH})",
                            field=HEADER_LENGTH)
    if doc.outputs is None:
        outputs = [OutputSpec(name, options.binary_data_output, None) for name in OUTPUTS]
    else:
        outputs = [_output_spec(x, options.binary_data_output) for x in doc.outputs]
        check_output_names([s.name for s in outputs])
    return ParsedRequest(doc.id, options, inputs, outputs)


def encode_response(request: ParsedRequest, model: str, version: str, tensors: Mapping[str, torch.Tensor],
                    parameters: Mapping[str, Union[str, int, bool]]) -> tuple[bytes, Optional[int]]:
    """The response body and, when binary sections follow the JSON, the JSON's length
    (for ``Inference-Header-Content-Length``). ``tensors`` holds each requested output
    (those bound for shared memory are already there)."""
    outputs: list[dict[str, Any]] = []
    sections: list[np.ndarray] = []
    for spec in request.outputs:
        t = tensors[spec.name]
        entry: dict[str, Any] = {"name": spec.name, "datatype": datatype_name(t.dtype), "shape": list(t.shape)}
        if spec.shm is not None:
            entry["parameters"] = shm_description(spec, t)
        elif spec.binary:
            sections.append(tensor_bytes(t))
            entry["parameters"] = {"binary_data_size": t.numel() * t.element_size()}
        else:
            entry["data"] = t.double().reshape(-1).tolist()
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": outputs}
    if request.id is not None:
        doc["id"] = request.id
    if parameters:
        doc["parameters"] = dict(parameters)
    header = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()  # outputs are finite (transactions)
    if not sections:
        return header, None
    return b"".join([header, *sections]), len(header)
