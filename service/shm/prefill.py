"""``POST /prefill`` through shared memory: co-located clients name their tensors by
region, offset and byte size instead of sending them, and name where the outputs go.

Request, ``Content-Type: application/vnd.kda.shm+json`` (`PrefillShmRequest`): the
options of every prefill (`PrefillOptions`), each tensor as
``{"dtype", "shape", "shm": {"region", "offset", "byte_size"}}``, and ``outputs``:
``{"o": {"region", "offset", "byte_size"}, "final_state": {...}}`` (final_state needed
unless ``return_final_state`` is false). Regions are registered first (``POST
/shm/regions``, or the KServe v2 system shared memory extension: one registry).

Every reference is checked before anything runs: the region is registered, the bytes lie
inside it, ``byte_size`` equals dtype x shape for inputs and holds the result for outputs
(o: T x HV x V in v's dtype; final_state: N x HV x V x K in the pool dtype), and the
outputs' bytes can be written (`Region.reserve`: within the server's file size limit, pages
allocated on a full /dev/shm). A failure is a 400 problem naming the field and changes no
slot. Inputs are copied out of the regions once
(`service.shm.tensors.copy_out`: q, k, v, g and beta straight into device memory on a GPU
server, everything else into one reused host buffer), decoded into `PrefillInputs` and go
through the same validation, per-slot ordering and batching as every transport. Outputs are
written into the named bytes before the response (`PrefillShmResponse`, JSON) says where
they are; on a GPU server from the device directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Iterable, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from tensor_io.views import nbytes

from ..core.server import ServerCore
from ..errors import InvalidRequest
from ..core.inputs import REQUIRED_TENSORS, TENSORS, PrefillInputs, PrefillResult
from .registry import CudaRegion, Region
from .tensors import ShmInput, ShmRef, copy_out
from ..wire.prefill import prefill_inputs_of
from ..wire.schema import PrefillOptions, Shape, parse_model
from ..wire.tensors import JSON_DTYPES, JSON_NAMES
from ..wire.buffers import WarmBuffers

SHM_JSON = "application/vnd.kda.shm+json"
_STRICT = ConfigDict(extra="forbid", strict=True)
_NAME = Annotated[str, Field(min_length=1, max_length=255)]


class ShmTensor(BaseModel):
    """A tensor in shared memory: little-endian, row-major, contiguous bytes."""

    model_config = _STRICT
    dtype: Literal["float32", "bfloat16", "float16"]
    shape: Shape
    shm: ShmRef


class ShmOutputs(BaseModel):
    """Where the outputs go."""

    model_config = _STRICT
    o: ShmRef = Field(description="room for o [T, HV, V] in v's dtype")
    final_state: Optional[ShmRef] = Field(None, description="room for [N, HV, V, K] in the pool dtype; "
                                                            "required unless return_final_state is false")


class PrefillShmRequest(PrefillOptions):
    """``POST /prefill`` as ``application/vnd.kda.shm+json``: tensors packed along tokens
    T = sum(lengths), each in a registered shared memory region."""

    q: ShmTensor = Field(description="[T, H, K]")
    k: ShmTensor = Field(description="[T, H, K]")
    v: ShmTensor = Field(description="[T, HV, V]")
    g: ShmTensor = Field(description="[T, HV, K]: raw with a gate (A_log, lower_bound or server), else log decay")
    beta: ShmTensor = Field(description="[T, HV]")
    A_log: Optional[ShmTensor] = Field(None, description="[HV]")
    dt_bias: Optional[ShmTensor] = Field(None, description="[HV, K] or [HV * K]")
    outputs: ShmOutputs


class PrefillShmResponse(BaseModel):
    """Where each output was written (the bytes are in place when this arrives)."""

    slots: list[str] = Field(description="each sequence's slot id, in order")
    o: ShmTensor = Field(description="[T, HV, V] in v's dtype")
    final_state: Optional[ShmTensor] = Field(None, description="[N, HV, V, K]; absent when declined")


class RegionRegister(BaseModel):
    """``POST /shm/regions``: map ``byte_size`` bytes at ``offset`` of POSIX shared memory
    object ``key`` (as shm_open names it, e.g. ``/kda-1234``) as region ``name``."""

    model_config = _STRICT
    name: _NAME
    key: _NAME
    offset: int = Field(0, ge=0)
    byte_size: int = Field(ge=1)
    ttl_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description=(
        "lease: unregistered after this many seconds without a request using it (none: until unregistered)"))


class RegionStatus(BaseModel):
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class ShmPlan:
    """A checked request: its inputs copied out of shared memory, and where outputs go."""

    inputs: PrefillInputs
    o: ShmRef
    o_dtype: torch.dtype
    final_state: Optional[ShmRef]


def parse_shm_request(body: Union[bytes, bytearray]) -> PrefillShmRequest:
    """The request document (MalformedBody 400 / SchemaError 422 when it is not one)."""
    return parse_model(PrefillShmRequest, body)


def region_names(request: PrefillShmRequest) -> set[str]:
    """Every region the request reads or writes."""
    refs = [t.shm for t in _tensors(request).values()] + [request.outputs.o]
    if request.outputs.final_state is not None:
        refs.append(request.outputs.final_state)
    return {ref.region for ref in refs}


def host_bytes(refs: Iterable[Optional[ShmRef]], regions: dict[str, Region]) -> int:
    """Bytes of ``refs`` in system regions: what reading or writing them costs the host (and
    so whether that work should leave the event loop, `service.core.worker.off_loop`); bytes in
    CUDA regions move device to device and cost it nothing."""
    return sum(ref.byte_size for ref in refs if ref is not None and not isinstance(regions[ref.region], CudaRegion))


def input_refs(request: PrefillShmRequest) -> list[ShmRef]:
    """Where q, k, v, g and beta lie."""
    return [getattr(request, name).shm for name in REQUIRED_TENSORS]


def _tensors(request: PrefillShmRequest) -> dict[str, ShmTensor]:
    return {name: getattr(request, name) for name in TENSORS if getattr(request, name) is not None}


def _room(regions: dict[str, Region], ref: ShmRef, need: int, field: str) -> None:
    """That ``ref`` lies in its region and holds ``need`` bytes, and those bytes are
    reserved (`SystemRegion.reserve`): writing the result after the launch cannot fail."""
    region = regions[ref.region]
    region.check(ref.offset, ref.byte_size, field)
    if ref.byte_size < need:
        raise InvalidRequest(f"{field}: the result needs {need} bytes, shared memory byte_size is {ref.byte_size}",
                             field=field)
    region.reserve(ref.offset, need, field)


def read_request(request: PrefillShmRequest, regions: dict[str, Region], core: ServerCore,
                 warm: WarmBuffers) -> ShmPlan:
    """Check every reference against ``regions`` (leased by the caller) and the output room
    against ``core``'s geometry, then copy the inputs out (into a buffer from ``warm``): a
    `ShmPlan`. InvalidRequest (400) naming the field on any violation, before anything is
    copied."""
    sources, o_dtype, final = checked_request(request, regions, core)
    device = core.geometry.device
    loaded = copy_out(sources, regions, warm, device, to_device=REQUIRED_TENSORS)
    device_outputs = device.type == "cuda"  # written from the device into any region (`write_result`)
    return ShmPlan(prefill_inputs_of(request, loaded, device_outputs), request.outputs.o, o_dtype, final)


def checked_request(request: PrefillShmRequest, regions: dict[str, Region], core: ServerCore
                    ) -> tuple[dict[str, ShmInput], torch.dtype, Optional[ShmRef]]:
    """`read_request`'s checks: every input's bytes, where they lie, and the outputs' room
    (InvalidRequest, 400, naming the field). Returns the inputs by name, o's dtype and where
    the final states go (None when declined)."""
    tensors = _tensors(request)
    for name, t in tensors.items():
        want = nbytes(t.shape, JSON_DTYPES[t.dtype])
        if t.shm.byte_size != want:
            raise InvalidRequest(f"{name}: shape {t.shape} of {t.dtype} needs {want} bytes, shm.byte_size is "
                                 f"{t.shm.byte_size}", field=f"{name}.shm.byte_size")
        regions[t.shm.region].check(t.shm.offset, want, f"{name}.shm")
    g = core.geometry
    o_dtype = JSON_DTYPES[request.v.dtype]
    T, N = sum(s["length"] for s in request.sequences), len(request.sequences)
    _room(regions, request.outputs.o, max(T, 0) * g.num_heads * g.head_v_dim * o_dtype.itemsize, "outputs.o")
    final = request.outputs.final_state if request.return_final_state else None
    if request.return_final_state:
        if final is None:
            raise InvalidRequest("outputs.final_state is required unless return_final_state is false",
                                 field="outputs.final_state")
        _room(regions, final, N * g.num_heads * g.head_v_dim * g.head_k_dim * g.dtype.itemsize,
              "outputs.final_state")
    return {name: ShmInput(t.shm, JSON_DTYPES[t.dtype], t.shape) for name, t in tensors.items()}, o_dtype, final


def _placed(t: torch.Tensor, ref: ShmRef) -> dict[str, Any]:
    return {"dtype": JSON_NAMES[t.dtype], "shape": list(t.shape),
            "shm": {"region": ref.region, "offset": ref.offset, "byte_size": t.numel() * t.element_size()}}


def write_result(plan: ShmPlan, result: PrefillResult, regions: dict[str, Region]) -> dict[str, Any]:
    """Write o and final_state where the plan says; the `PrefillShmResponse` document."""
    regions[plan.o.region].write(plan.o.offset, result.o)
    doc: dict[str, Any] = {"slots": result.slots, "o": _placed(result.o, plan.o)}
    if plan.final_state is not None and result.final_state is not None:
        regions[plan.final_state.region].write(plan.final_state.offset, result.final_state)
        doc["final_state"] = _placed(result.final_state, plan.final_state)
    return doc
