"""An inference request of the Open Inference Protocol in transport-neutral form, checked,
and turned into tensors: what the HTTP body parser (`service.kserve.http_codec`) and the
gRPC message reader (`service.kserve.rpc.codec`) both produce and the request path
(`service.kserve.endpoint`) consumes.

Each input's bytes come from exactly one source: numbers (HTTP ``data``, gRPC
``contents``; not BF16), raw bytes (the HTTP binary tensor data extension's part of the
body, gRPC ``raw_input_contents``: little-endian row-major, zero-copy views when aligned)
or a shared memory region (copied out with `service.shm.tensors.copy_out`, as
``POST /prefill`` by reference does: on a GPU server q, k, v, g and beta straight into
device memory). Each output goes back as raw bytes, as numbers (HTTP only) or into a
shared memory region (from the device directly on a GPU server when every output goes
into shared memory).

Checks run in two steps so nothing is read before a request is known to be well formed:
building a `ParsedRequest` checks names, datatypes, byte counts and data sources;
`read_inputs` then materialises the tensors, and `plan_outputs` checks the outputs (their
datatype and shared memory room) before the launch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from tensor_io.views import view_tensor

from ..errors import InvalidRequest
from ..core.inputs import OPTIONAL_TENSORS, REQUIRED_TENSORS, TENSORS, PrefillInputs
from ..shm.registry import Region
from ..shm.tensors import ShmInput, ShmRef, copy_out
from ..wire.buffers import WarmBuffers
from .datatypes import ACCEPTED, BINARY_ONLY, PROTOCOL_DATATYPES, datatype_name, torch_dtype
from .model import OUTPUTS
from .options import InferOptions
from .protocol import Parameters

SHM_PARAMETERS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


@dataclass(frozen=True)
class Sources:
    """How a transport names the three sources of an input's bytes, for its messages."""

    numbers: str
    raw: str
    shm: str = "shared_memory_region"


@dataclass(frozen=True)
class Raw:
    """An input's raw bytes: ``size`` bytes at ``offset`` of ``buffer`` (an HTTP body, or
    one gRPC ``raw_input_contents`` entry)."""

    buffer: Union[bytes, bytearray]
    offset: int
    size: int


@dataclass(frozen=True)
class InputSpec:
    """One input, checked: a KDA datatype, and one data source (``numbers``, ``raw`` or
    ``shm``) whose byte count matches ``shape``."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    numbers: Optional[Sequence[Any]]
    raw: Optional[Raw]
    shm: Optional[ShmRef]


@dataclass(frozen=True)
class OutputSpec:
    """One output to return: as raw bytes (``binary``), as numbers, or into ``shm``."""

    name: str
    binary: bool
    shm: Optional[ShmRef]


@dataclass(frozen=True)
class ParsedRequest:
    """A request that passed every check that needs no tensor data. ``id``: the request's
    id, echoed in the response (None: none given)."""

    id: Optional[str]
    options: InferOptions
    inputs: list[InputSpec]
    outputs: list[OutputSpec]

    @property
    def regions(self) -> set[str]:
        """Names of the shared memory regions the request reads or writes."""
        refs = [s.shm for s in self.inputs] + [s.shm for s in self.outputs]
        return {ref.region for ref in refs if ref is not None}

    @property
    def wants_final_state(self) -> bool:
        return any(s.name == "final_state" for s in self.outputs)

    @property
    def input_bytes(self) -> int:
        """The bytes of every input's tensor, whatever its source (what `read_inputs`
        views, converts or copies out)."""
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.inputs)

    @property
    def outputs_in_shm(self) -> bool:
        """Whether every output goes into shared memory (so results may stay on the device)."""
        return all(s.shm is not None for s in self.outputs)


def bad(field: str, detail: str) -> InvalidRequest:
    return InvalidRequest(detail, field=field)


def uint_parameter(params: Parameters, name: str, where: str) -> Optional[int]:
    """Parameter ``name`` as an integer >= 0, or None when absent (400 otherwise)."""
    value = params.get(name)
    if value is not None and (type(value) is not int or value < 0):
        raise bad(f"{where}.parameters.{name}", f"{where}: {name} must be an integer >= 0, got {value!r}")
    return value


def shm_ref(params: Parameters, where: str) -> Optional[ShmRef]:
    """The shared memory parameters of an input or output, or None when it names no region."""
    region = params.get("shared_memory_region")
    size = uint_parameter(params, "shared_memory_byte_size", where)
    offset = uint_parameter(params, "shared_memory_offset", where) or 0
    if region is None:
        if size is not None or "shared_memory_offset" in params:
            raise bad(f"{where}.parameters", f"{where}: shared_memory_byte_size and shared_memory_offset need "
                                             "shared_memory_region")
        return None
    if type(region) is not str or not region:
        raise bad(f"{where}.parameters.shared_memory_region", f"{where}: shared_memory_region must be a region name")
    if size is None:
        raise bad(f"{where}.parameters", f"{where}: shared_memory_region needs shared_memory_byte_size")
    return ShmRef.model_construct(region=region, offset=offset, byte_size=size)  # checked above


def check_parameters(params: Parameters, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise bad(f"{where}.parameters", f"{where}: unknown parameter(s) {unknown}; allowed: {list(allowed)}")


def check_input_names(names: list[str]) -> None:
    """q, k, v, g, beta (optional A_log, dt_bias), each once."""
    unknown = [n for n in names if n not in TENSORS]
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = [n for n in REQUIRED_TENSORS if n not in names]
    if unknown or twice or missing:
        what = (f"unknown input(s) {unknown}" if unknown else f"input(s) {twice} given twice" if twice
                else f"missing input(s) {missing}")
        raise bad("inputs", f"{what}; the model takes {list(REQUIRED_TENSORS)} and optionally {list(OPTIONAL_TENSORS)}")


def input_dtype(name: str, datatype: str, shape: list[int], given: Mapping[str, Optional[int]],
                sources: Sources) -> torch.dtype:
    """The torch dtype of input ``name``, after checking its datatype and its sources:
    ``given`` maps each source the request used (a `Sources` name) to the bytes it
    announces (None for numbers). Exactly one source; its byte count equals ``shape``'s;
    BF16 never as numbers."""
    where = f"input {name!r}"
    dtype = torch_dtype(datatype)
    if dtype is None:
        what = "a protocol datatype KDA does not take" if datatype in PROTOCOL_DATATYPES else "not a protocol datatype"
        raise bad(name, f"{where} has datatype {datatype!r} ({what}); KDA inputs are {ACCEPTED}")
    if len(given) != 1:
        raise bad(name, f"{where} must carry its bytes in exactly one of {sources.numbers}, {sources.raw} or "
                        f"{sources.shm}, got {list(given) or 'none'}")
    (source, size), = given.items()
    nbytes = math.prod(shape) * dtype.itemsize
    if size is not None and size != nbytes:
        raise bad(name, f"{where}: shape {shape} of {datatype} is {nbytes} bytes, but its {source} says {size}")
    if size is None and dtype in BINARY_ONLY:
        raise bad(name, f"{where} is {datatype}: BF16 travels as binary data ({sources.raw}) or in shared memory, "
                        f"never as numbers ({sources.numbers})")
    return dtype


def check_output_names(names: list[str]) -> None:
    for name in names:
        if name not in OUTPUTS:
            raise bad("outputs", f"unknown output {name!r}; the model's outputs are {list(OUTPUTS)}")
    if len(set(names)) != len(names):
        raise bad("outputs", f"outputs {names} name an output twice")


def _from_numbers(spec: InputSpec) -> torch.Tensor:
    try:
        array = np.asarray(spec.numbers)
    except (ValueError, OverflowError) as e:
        raise bad(spec.name, f"input {spec.name!r}: data is not a rectangular array of numbers ({e})") from None
    if array.dtype.kind not in "iuf":
        raise bad(spec.name, f"input {spec.name!r}: data must hold numbers only, got {array.dtype.kind!r} elements")
    if array.size != math.prod(spec.shape):
        raise bad(spec.name, f"input {spec.name!r}: shape {spec.shape} needs {math.prod(spec.shape)} values, "
                             f"data holds {array.size}")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64).reshape(spec.shape)).to(spec.dtype)


def _from_raw(spec: InputSpec, raw: Raw) -> torch.Tensor:
    """A view over a writable buffer; immutable bytes (a gRPC message's) are copied once."""
    if isinstance(raw.buffer, bytearray):
        return view_tensor(raw.buffer, raw.offset, spec.dtype, spec.shape)
    return view_tensor(bytearray(memoryview(raw.buffer)[raw.offset:raw.offset + raw.size]), 0, spec.dtype, spec.shape)


def read_inputs(request: ParsedRequest, regions: Mapping[str, Region], warm: WarmBuffers,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Every input as a tensor of its shape and dtype, in input order: numbers converted,
    raw bytes viewed (zero-copy when aligned and writable), shared memory bounds-checked,
    then copied out of ``regions`` at once (`copy_out`: a buffer from ``warm`` on the
    host; q, k, v, g and beta onto ``device`` when it is a GPU)."""
    tensors: dict[str, torch.Tensor] = {}
    in_shm: dict[str, ShmInput] = {}
    for spec in request.inputs:
        if spec.raw is not None:
            tensors[spec.name] = _from_raw(spec, spec.raw)
        elif spec.shm is not None:
            regions[spec.shm.region].check(spec.shm.offset, spec.shm.byte_size, f"input {spec.name!r}")
            in_shm[spec.name] = ShmInput(spec.shm, spec.dtype, spec.shape)
        else:
            tensors[spec.name] = _from_numbers(spec)
    tensors.update(copy_out(in_shm, regions, warm, device, to_device=REQUIRED_TENSORS))
    return {spec.name: tensors[spec.name] for spec in request.inputs}


def prefill_inputs(request: ParsedRequest, tensors: Mapping[str, torch.Tensor], slot: Optional[str],
                   device_outputs: bool = False) -> PrefillInputs:
    """The prefill of one sequence on ``slot`` (None: a new slot): T = q's first dim.
    ``device_outputs``: the results stay on the pool's device (every output goes into
    shared memory on a GPU server)."""
    q = tensors["q"]
    params = dataclasses.replace(request.options.prefill, return_final_state=request.wants_final_state)
    checkpoints = [list(request.options.checkpoints)] if request.options.checkpoints else None
    return PrefillInputs.of(params, [slot], [q.shape[0] if q.dim() else 0], tensors, device_outputs, checkpoints)


def plan_outputs(request: ParsedRequest, o_dtype: torch.dtype, o_nbytes: int, state_dtype: torch.dtype,
                 state_nbytes: int, regions: Mapping[str, Region]) -> None:
    """Refuse, before the launch, outputs that cannot be delivered: BF16 as numbers, or a
    shared memory destination that is out of bounds, too small, or whose bytes cannot be
    reserved (`Region.reserve`: past the server's file size limit, or no room left in
    /dev/shm), so `write_shm_outputs` cannot fail after the launch. ``o_*`` describe o
    ([T, HV, V] in v's dtype), ``state_*`` the final state ([HV, V, K] in the pool dtype)."""
    for spec in request.outputs:
        dtype, nbytes = (o_dtype, o_nbytes) if spec.name == "o" else (state_dtype, state_nbytes)
        where = f"output {spec.name!r}"
        if spec.shm is not None:
            region = regions[spec.shm.region]
            region.check(spec.shm.offset, spec.shm.byte_size, where)
            if spec.shm.byte_size < nbytes:
                raise bad(spec.name, f"{where} needs {nbytes} bytes, but its shared_memory_byte_size is "
                                     f"{spec.shm.byte_size}")
            region.reserve(spec.shm.offset, nbytes, where)
        elif not spec.binary and dtype in BINARY_ONLY:
            raise bad(spec.name, f"{where} is {datatype_name(dtype)}, which travels as binary data only: request "
                                 "it with binary_data true (or into shared memory)")


def write_shm_outputs(request: ParsedRequest, tensors: Mapping[str, torch.Tensor],
                      regions: Mapping[str, Region]) -> None:
    """Store each output bound for shared memory in its region (planned by `plan_outputs`)."""
    for spec in request.outputs:
        if spec.shm is not None:
            regions[spec.shm.region].write(spec.shm.offset, tensors[spec.name])


def shm_description(spec: OutputSpec, t: torch.Tensor) -> dict[str, Union[str, int]]:
    """The parameters a response gives an output written into shared memory."""
    assert spec.shm is not None
    described: dict[str, Union[str, int]] = {"shared_memory_region": spec.shm.region,
                                             "shared_memory_byte_size": t.numel() * t.element_size()}
    if spec.shm.offset:
        described["shared_memory_offset"] = spec.shm.offset
    return described
