"""KServe v2 gRPC messages to and from the neutral request form (`service.kserve.codec`):
the same checks and the same messages as over HTTP, with gRPC's names for the sources.

An input's bytes come from one of: ``contents`` (numbers: FP32 in ``fp32_contents``),
the next entry of ``raw_input_contents`` (entries are taken in input order by the inputs
that use neither contents nor shared memory: Triton's rule), or a shared memory region
(``shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``
parameters). Outputs come back in ``raw_output_contents``, one entry per output in
request order (empty for one written into shared memory, whose ``parameters`` say where).
Parameters are ``InferParameter`` oneofs: bool, int64, uint64, double or string.
`model_infer` is one request end to end: decode, the endpoint, encode.
"""
from __future__ import annotations

from typing import Mapping, Union

import torch

from tensor_io.shapes import shape_problem
from tensor_io.views import tensor_bytes

from ...core.worker import off_loop
from ..codec import (
    SHM_PARAMETERS, InputSpec, OutputSpec, ParsedRequest, Raw, Sources, bad, check_input_names, check_output_names,
    check_parameters, input_dtype, shm_description, shm_ref,
)
from ..datatypes import datatype_name
from ..endpoint import KServeEndpoint, Reply
from ..model import MODEL, OUTPUTS, VERSION
from ..options import parse_options
from ..protocol import NAME_MAX, Parameters
from .messages import pb

SOURCES = Sources(numbers="contents", raw="raw_input_contents")
MAX_TENSORS = 16  # inputs or outputs per request, as over HTTP
ParameterValue = Union[bool, int, float, str]


def parameters(entries: Mapping[str, pb.InferParameter], where: str) -> Parameters:
    """A message's ``parameters`` map as plain values (each oneof's value)."""
    values: Parameters = {}
    for name, entry in entries.items():
        choice = entry.WhichOneof("parameter_choice")
        if choice is None:
            raise bad(f"{where}.parameters.{name}", f"{where}: parameter {name!r} has no value")
        values[name] = getattr(entry, choice)
    return values


def set_parameter(entry: pb.InferParameter, value: ParameterValue) -> None:
    if isinstance(value, bool):
        entry.bool_param = value
    elif isinstance(value, int):
        entry.int64_param = value
    elif isinstance(value, float):
        entry.double_param = value
    else:
        entry.string_param = value


def _check_sizes(request: pb.ModelInferRequest) -> None:
    """The bounds the HTTP schema sets: 1..16 inputs, <= 16 outputs, names and ids of at most
    256 characters, shapes a tensor can have (`tensor_io.shapes`)."""
    if not 1 <= len(request.inputs) <= MAX_TENSORS or len(request.outputs) > MAX_TENSORS:
        raise bad("inputs", f"a request has 1..{MAX_TENSORS} inputs and at most {MAX_TENSORS} outputs, got "
                            f"{len(request.inputs)} and {len(request.outputs)}")
    if len(request.id) > NAME_MAX:
        raise bad("id", f"id has at most {NAME_MAX} characters, got {len(request.id)}")
    for x in [*request.inputs, *request.outputs]:
        if len(x.name) > NAME_MAX:
            raise bad("inputs", f"tensor names have at most {NAME_MAX} characters, got {len(x.name)}")
    for x in request.inputs:
        if (problem := shape_problem(list(x.shape))) is not None:  # the check every decoder makes
            raise bad(x.name, f"input {x.name!r}: {problem}")


def _contents(x: pb.ModelInferRequest.InferInputTensor) -> list[float]:
    """An input's numbers: FP32 only, in ``fp32_contents`` (FP16 and BF16 travel raw)."""
    used = [field.name for field, _ in x.contents.ListFields()]
    if x.datatype != "FP32" or used not in ([], ["fp32_contents"]):
        raise bad(x.name, f"input {x.name!r} is {x.datatype} with contents in {used}: numbers travel as FP32 in "
                          "fp32_contents; FP16 and BF16 as raw_input_contents (or in shared memory)")
    return list(x.contents.fp32_contents)


def _inputs(request: pb.ModelInferRequest) -> list[InputSpec]:
    raw, taken, specs = request.raw_input_contents, 0, []
    for x in request.inputs:
        where = f"input {x.name!r}"
        params = parameters(x.parameters, where)
        check_parameters(params, SHM_PARAMETERS, where)
        shm = shm_ref(params, where)
        has_contents = x.HasField("contents")
        takes_raw = shm is None and not has_contents and taken < len(raw)
        given = {source: size for source, size, used in (
            (SOURCES.numbers, None, has_contents), (SOURCES.raw, len(raw[taken]) if takes_raw else None, takes_raw),
            (SOURCES.shm, shm.byte_size if shm else None, shm is not None)) if used}
        dtype = input_dtype(x.name, x.datatype, list(x.shape), given, SOURCES)
        if has_contents and len(raw):
            raise bad(x.name, f"{where}: contents must not be given when the request uses raw_input_contents")
        numbers = _contents(x) if has_contents else None
        specs.append(InputSpec(x.name, dtype, list(x.shape), numbers,
                               Raw(raw[taken], 0, len(raw[taken])) if takes_raw else None, shm))
        taken += takes_raw
    if taken != len(raw):
        raise bad("raw_input_contents", f"the request has {len(raw)} raw_input_contents entries, but only {taken} "
                                        "input(s) take their bytes from there")
    return specs


def _outputs(request: pb.ModelInferRequest) -> list[OutputSpec]:
    if not request.outputs:
        return [OutputSpec(name, True, None) for name in OUTPUTS]
    check_output_names([x.name for x in request.outputs])
    outputs = []
    for x in request.outputs:
        where = f"output {x.name!r}"
        params = parameters(x.parameters, where)
        check_parameters(params, SHM_PARAMETERS, where)
        shm = shm_ref(params, where)
        outputs.append(OutputSpec(x.name, shm is None, shm))
    return outputs


def parse_infer_request(request: pb.ModelInferRequest) -> ParsedRequest:
    """A ``ModelInferRequest`` checked as an HTTP body is: parameters, input names,
    datatypes, byte counts, data sources and requested outputs (InvalidRequest, 400)."""
    _check_sizes(request)
    params = parameters(request.parameters, "request")
    options = parse_options(params)
    if params.get("binary_data_output") is False:
        raise bad("parameters.binary_data_output", "binary_data_output false asks for outputs as JSON numbers, which "
                                                   "gRPC does not have: outputs travel as raw_output_contents")
    check_input_names([x.name for x in request.inputs])
    return ParsedRequest(request.id or None, options, _inputs(request), _outputs(request))


def infer_response(request: ParsedRequest, reply: Reply) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of ``reply``: each output's raw bytes (little-endian,
    row-major), the request's id, and the ``slot`` parameter while the sequence lives."""
    response = pb.ModelInferResponse(model_name=MODEL, model_version=VERSION, id=request.id or "")
    for name, value in reply.parameters.items():
        set_parameter(response.parameters[name], value)
    for spec in request.outputs:
        t: torch.Tensor = reply.tensors[spec.name]
        out = response.outputs.add(name=spec.name, datatype=datatype_name(t.dtype), shape=list(t.shape))
        if spec.shm is not None:
            for name, value in shm_description(spec, t).items():
                set_parameter(out.parameters[name], value)
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(tensor_bytes(t).tobytes())
    return response


async def model_infer(endpoint: KServeEndpoint, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    """``request`` decoded, run on ``endpoint`` and its response encoded; large messages are
    decoded and encoded off the event loop."""
    parsed = await off_loop(parse_infer_request, request, nbytes=request.ByteSize())
    reply = await endpoint.infer(request.model_name, request.model_version, parsed)
    return await off_loop(infer_response, parsed, reply, nbytes=reply.nbytes)
