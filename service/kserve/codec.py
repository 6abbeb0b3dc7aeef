"""Inference requests and responses of the Open Inference Protocol, to and from tensors.

Request body: the JSON `InferenceRequest`, then (binary tensor data extension) the raw
bytes of every input that has ``parameters.binary_data_size``, in input order;
``Inference-Header-Content-Length`` gives the JSON's length. Each input's bytes come
from exactly one of: ``data`` (JSON numbers; not BF16), the binary part (zero-copy views
over the body, little-endian row-major) or a shared memory region (copied out with
`service.shm.tensors.copy_out`, as ``POST /prefill`` by reference does: on a GPU server
q, k, v, g and beta straight into device memory).

Response: JSON ``outputs`` (``data`` lists), binary sections after the JSON
(``binary_data_size``), or bytes written into a shared memory region, per output (from the
device directly on a GPU server when every output goes into shared memory).

Decoding is split in two so nothing runs before a request is known to be well formed:
`parse_request` reads the JSON and checks names, datatypes, byte counts and data sources;
`read_inputs` then materialises the tensors. `plan_outputs` checks the outputs (their
datatype and shared memory room) before the launch.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from tensor_io.views import tensor_bytes, view_tensor

from ..errors import InvalidRequest, MalformedBody
from ..core.inputs import OPTIONAL_TENSORS, REQUIRED_TENSORS, TENSORS, PrefillInputs
from ..shm.tensors import ShmInput, ShmRef, copy_out
from ..wire.buffers import WarmBuffers
from ..wire.schema import parse_model
from .datatypes import ACCEPTED, BINARY_ONLY, PROTOCOL_DATATYPES, datatype_name, torch_dtype
from .options import InferOptions, parse_options
from .protocol import InferenceRequest, Parameters, RequestInput, RequestOutput
from ..shm.registry import Region

OUTPUTS = ("o", "final_state")
HEADER_LENGTH = "Inference-Header-Content-Length"
_INPUT_PARAMETERS = ("binary_data_size", "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
_OUTPUT_PARAMETERS = ("binary_data", "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


@dataclass(frozen=True)
class InputSpec:
    """One input as the JSON describes it, checked: a KDA datatype, and one data source
    (``data``, ``binary_size`` or ``shm``) whose byte count matches ``shape``."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    data: Optional[list[Any]]
    binary_size: Optional[int]
    shm: Optional[ShmRef]


@dataclass(frozen=True)
class OutputSpec:
    """One output to return: as binary data, as JSON numbers, or into ``shm``."""

    name: str
    binary: bool
    shm: Optional[ShmRef]


@dataclass(frozen=True)
class ParsedRequest:
    """A request whose JSON passed every check that needs no tensor data.

    ``binary_start`` is where the binary part begins in the body (its length when none).
    """

    id: Optional[str]
    options: InferOptions
    inputs: list[InputSpec]
    outputs: list[OutputSpec]
    binary_start: int

    @property
    def regions(self) -> set[str]:
        """Names of the shared memory regions the request reads or writes."""
        refs = [s.shm for s in self.inputs] + [s.shm for s in self.outputs]
        return {ref.region for ref in refs if ref is not None}

    @property
    def wants_final_state(self) -> bool:
        return any(s.name == "final_state" for s in self.outputs)

    @property
    def outputs_in_shm(self) -> bool:
        """Whether every output goes into shared memory (so results may stay on the device)."""
        return all(s.shm is not None for s in self.outputs)


def _bad(field: str, detail: str) -> InvalidRequest:
    return InvalidRequest(detail, field=field)


def _uint(params: Parameters, name: str, where: str) -> Optional[int]:
    value = params.get(name)
    if value is not None and (type(value) is not int or value < 0):
        raise _bad(f"{where}.parameters.{name}", f"{where}: {name} must be an integer >= 0, got {value!r}")
    return value


def _shm_ref(params: Parameters, where: str) -> Optional[ShmRef]:
    """The shared memory parameters of an input or output, or None when it names no region."""
    region = params.get("shared_memory_region")
    size = _uint(params, "shared_memory_byte_size", where)
    offset = _uint(params, "shared_memory_offset", where) or 0
    if region is None:
        if size is not None or "shared_memory_offset" in params:
            raise _bad(f"{where}.parameters", f"{where}: shared_memory_byte_size and shared_memory_offset need "
                                              "shared_memory_region")
        return None
    if type(region) is not str or not region:
        raise _bad(f"{where}.parameters.shared_memory_region", f"{where}: shared_memory_region must be a region name")
    if size is None:
        raise _bad(f"{where}.parameters", f"{where}: shared_memory_region needs shared_memory_byte_size")
    return ShmRef.model_construct(region=region, offset=offset, byte_size=size)  # checked above


def _check_parameters(params: Parameters, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise _bad(f"{where}.parameters", f"{where}: unknown parameter(s) {unknown}; allowed: {list(allowed)}")


def _input_spec(x: RequestInput) -> InputSpec:
    where = f"input {x.name!r}"
    _check_parameters(x.parameters, _INPUT_PARAMETERS, where)
    dtype = torch_dtype(x.datatype)
    if dtype is None:
        what = "a protocol datatype KDA does not take" if x.datatype in PROTOCOL_DATATYPES else "not a protocol datatype"
        raise _bad(x.name, f"{where} has datatype {x.datatype!r} ({what}); KDA inputs are {ACCEPTED}")
    nbytes = math.prod(x.shape) * dtype.itemsize
    binary_size = _uint(x.parameters, "binary_data_size", where)
    shm = _shm_ref(x.parameters, where)
    sources = [s for s, given in (("data", x.data is not None), ("binary_data_size", binary_size is not None),
                                  ("shared_memory_region", shm is not None)) if given]
    if len(sources) != 1:
        raise _bad(x.name, f"{where} must carry its bytes in exactly one of data, binary_data_size or "
                           f"shared_memory_region, got {sources or 'none'}")
    size = binary_size if binary_size is not None else shm.byte_size if shm is not None else None
    if size is not None and size != nbytes:
        raise _bad(x.name, f"{where}: shape {x.shape} of {x.datatype} is {nbytes} bytes, but its "
                           f"{sources[0]} says {size}")
    if x.data is not None and dtype in BINARY_ONLY:
        raise _bad(x.name, f"{where} is {x.datatype}: BF16 travels as binary data (binary_data_size) or in shared "
                           "memory, never as JSON numbers")
    return InputSpec(x.name, dtype, list(x.shape), x.data, binary_size, shm)


def _output_spec(x: RequestOutput, binary_default: bool) -> OutputSpec:
    where = f"output {x.name!r}"
    if x.name not in OUTPUTS:
        raise _bad("outputs", f"unknown output {x.name!r}; the model's outputs are {list(OUTPUTS)}")
    _check_parameters(x.parameters, _OUTPUT_PARAMETERS, where)
    binary = x.parameters.get("binary_data", binary_default)
    if type(binary) is not bool:
        raise _bad(f"{where}.parameters.binary_data", f"{where}: binary_data must be a boolean")
    shm = _shm_ref(x.parameters, where)
    if shm is not None and x.parameters.get("binary_data") is True:
        raise _bad(f"{where}.parameters", f"{where}: binary_data and shared_memory_region exclude each other")
    return OutputSpec(x.name, binary and shm is None, shm)


def header_end(body_length: int, header_length: Optional[str]) -> int:
    """Where the JSON ends: ``Inference-Header-Content-Length``, or the whole body."""
    if header_length is None:
        return body_length
    if not header_length.strip().isdigit() or int(header_length) > body_length:
        raise MalformedBody(f"{HEADER_LENGTH} {header_length!r} is not a byte count within the body's "
                            f"{body_length} bytes", field=HEADER_LENGTH)
    return int(header_length)


def parse_request(body: bytearray, json_end: int) -> ParsedRequest:
    """Read the JSON part of ``body`` (its first ``json_end`` bytes) and check it: schema
    (422), parameters, input names (q, k, v, g, beta; optional A_log, dt_bias; each once),
    datatypes, byte counts, data sources and requested outputs (400)."""
    raw = body if json_end == len(body) else bytes(memoryview(body)[:json_end])
    doc = parse_model(InferenceRequest, raw, where="request")
    options = parse_options(doc.parameters)
    names = [x.name for x in doc.inputs]
    unknown = [n for n in names if n not in TENSORS]
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = [n for n in REQUIRED_TENSORS if n not in names]
    if unknown or twice or missing:
        what = (f"unknown input(s) {unknown}" if unknown else f"input(s) {twice} given twice" if twice
                else f"missing input(s) {missing}")
        raise _bad("inputs", f"{what}; the model takes {list(REQUIRED_TENSORS)} and optionally {list(OPTIONAL_TENSORS)}")
    inputs = [_input_spec(x) for x in doc.inputs]
    binary = sum(s.binary_size for s in inputs if s.binary_size is not None)
    if binary != len(body) - json_end:
        raise MalformedBody(f"inputs announce {binary} bytes of binary data (binary_data_size), but "
                            f"{len(body) - json_end} bytes follow the {json_end}-byte JSON ({HEADER_LENGTH})",
                            field=HEADER_LENGTH)
    if doc.outputs is None:
        outputs = [OutputSpec(name, options.binary_data_output, None) for name in OUTPUTS]
    else:
        outputs = [_output_spec(x, options.binary_data_output) for x in doc.outputs]
        out_names = [s.name for s in outputs]
        if len(set(out_names)) != len(out_names):
            raise _bad("outputs", f"outputs {out_names} name an output twice")
    return ParsedRequest(doc.id, options, inputs, outputs, json_end)


def _from_json(spec: InputSpec) -> torch.Tensor:
    try:
        array = np.asarray(spec.data)
    except (ValueError, OverflowError) as e:
        raise _bad(spec.name, f"input {spec.name!r}: data is not a rectangular array of numbers ({e})") from None
    if array.dtype.kind not in "iuf":
        raise _bad(spec.name, f"input {spec.name!r}: data must hold numbers only, got {array.dtype.kind!r} elements")
    if array.size != math.prod(spec.shape):
        raise _bad(spec.name, f"input {spec.name!r}: shape {spec.shape} needs {math.prod(spec.shape)} values, "
                              f"data holds {array.size}")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64).reshape(spec.shape)).to(spec.dtype)


def read_inputs(request: ParsedRequest, body: bytearray, regions: Mapping[str, Region], warm: WarmBuffers,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Every input as a tensor of its shape and dtype, in input order: JSON numbers
    converted, binary data viewed over ``body`` (zero-copy when aligned), shared memory
    bounds-checked, then copied out of ``regions`` at once (`copy_out`: a buffer from
    ``warm`` on the host; q, k, v, g and beta onto ``device`` when it is a GPU)."""
    tensors: dict[str, torch.Tensor] = {}
    in_shm: dict[str, ShmInput] = {}
    offset = request.binary_start
    for spec in request.inputs:
        if spec.binary_size is not None:
            tensors[spec.name] = view_tensor(body, offset, spec.dtype, spec.shape)
            offset += spec.binary_size
        elif spec.shm is not None:
            regions[spec.shm.region].check(spec.shm.offset, spec.shm.byte_size, f"input {spec.name!r}")
            in_shm[spec.name] = ShmInput(spec.shm, spec.dtype, spec.shape)
        else:
            tensors[spec.name] = _from_json(spec)
    tensors.update(copy_out(in_shm, regions, warm, device, to_device=REQUIRED_TENSORS))
    return {spec.name: tensors[spec.name] for spec in request.inputs}


def prefill_inputs(request: ParsedRequest, tensors: Mapping[str, torch.Tensor], slot: Optional[str],
                   device_outputs: bool = False) -> PrefillInputs:
    """The prefill of one sequence on ``slot`` (None: a new slot): T = q's first dim.
    ``device_outputs``: the results stay on the pool's device (every output goes into
    shared memory on a GPU server)."""
    q = tensors["q"]
    params = dataclasses.replace(request.options.prefill, return_final_state=request.wants_final_state)
    return PrefillInputs.of(params, [slot], [q.shape[0] if q.dim() else 0], tensors, device_outputs)


def plan_outputs(request: ParsedRequest, o_dtype: torch.dtype, o_nbytes: int, state_dtype: torch.dtype,
                 state_nbytes: int, regions: Mapping[str, Region]) -> None:
    """Refuse, before the launch, outputs that cannot be delivered: BF16 as JSON numbers,
    or a shared memory destination that is out of bounds or too small. ``o_*`` describe o
    ([T, HV, V] in v's dtype), ``state_*`` the final state ([HV, V, K] in the pool dtype)."""
    for spec in request.outputs:
        dtype, nbytes = (o_dtype, o_nbytes) if spec.name == "o" else (state_dtype, state_nbytes)
        where = f"output {spec.name!r}"
        if spec.shm is not None:
            region = regions[spec.shm.region]
            region.check(spec.shm.offset, spec.shm.byte_size, where)
            if spec.shm.byte_size < nbytes:
                raise _bad(spec.name, f"{where} needs {nbytes} bytes, but its shared_memory_byte_size is "
                                      f"{spec.shm.byte_size}")
        elif not spec.binary and dtype in BINARY_ONLY:
            raise _bad(spec.name, f"{where} is {datatype_name(dtype)}, which travels as binary data only: request "
                                  "it with binary_data true (or into shared memory)")


def encode_response(request: ParsedRequest, model: str, version: str, tensors: Mapping[str, torch.Tensor],
                    parameters: Mapping[str, Union[str, int, bool]],
                    regions: Mapping[str, Region]) -> tuple[bytes, Optional[int]]:
    """The response body and, when binary sections follow the JSON, the JSON's length
    (for ``Inference-Header-Content-Length``). ``tensors`` holds each requested output."""
    outputs: list[dict[str, Any]] = []
    sections: list[np.ndarray] = []
    for spec in request.outputs:
        t = tensors[spec.name]
        entry: dict[str, Any] = {"name": spec.name, "datatype": datatype_name(t.dtype), "shape": list(t.shape)}
        nbytes = t.numel() * t.element_size()
        if spec.shm is not None:
            regions[spec.shm.region].write(spec.shm.offset, t)
            entry["parameters"] = {"shared_memory_region": spec.shm.region, "shared_memory_byte_size": nbytes}
            if spec.shm.offset:
                entry["parameters"]["shared_memory_offset"] = spec.shm.offset
        elif spec.binary:
            sections.append(tensor_bytes(t))
            entry["parameters"] = {"binary_data_size": nbytes}
        else:
            entry["data"] = t.double().reshape(-1).tolist()
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": outputs}
    if request.id is not None:
        doc["id"] = request.id
    if parameters:
        doc["parameters"] = dict(parameters)
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not sections:
        return header, None
    return b"".join([header, *sections]), len(header)
