"""The JSON documents of the Open Inference Protocol (KServe v2) this server reads, as
strict pydantic models: unknown members are refused, numbers are not taken from strings.

Parameters (request, input, output) are ``name -> string | number | boolean`` as the
protocol says; which names are allowed, and their types, is `service.kserve.options`' and
`service.kserve.codec`'s business.

A shared memory region's name (a URL segment over HTTP, a string field over gRPC) goes
through `region_name` on both front ends: 1 to `REGION_NAME_MAX` characters, as ``POST
/shm/regions`` and ``POST /prefill``'s references to regions take (`service.shm`), so a
region registered through the KServe extensions can always be named there too (the
registry refuses a "/" in any name: no per-name route could address it).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..errors import InvalidRequest
from ..wire.schema import Shape

_STRICT = ConfigDict(extra="forbid", strict=True)
ParameterValue = Union[StrictBool, StrictInt, StrictFloat, StrictStr]
Parameters = dict[str, ParameterValue]
NAME_MAX = 256
REGION_NAME_MAX = 255  # characters, as service.shm's region names (POST /shm/regions, /prefill by reference)


def region_name(name: str) -> str:
    """``name`` when it can name a shared memory region (1 to `REGION_NAME_MAX` characters);
    InvalidRequest (HTTP 400, gRPC INVALID_ARGUMENT) naming the field ``name`` otherwise."""
    if not name:
        raise InvalidRequest("a shared memory region needs a name", field="name")
    if len(name) > REGION_NAME_MAX:
        raise InvalidRequest(f"name: a shared memory region's name has at most {REGION_NAME_MAX} characters, "
                             f"got {len(name)}", field="name")
    return name


class RequestInput(BaseModel):
    """``$request_input``: one tensor; its bytes are in ``data`` (JSON numbers), in the
    binary part of the body (``parameters.binary_data_size``) or in a registered shared
    memory region (``parameters.shared_memory_region``)."""

    model_config = _STRICT
    name: Annotated[str, Field(max_length=NAME_MAX)]
    shape: Shape
    datatype: Annotated[str, Field(max_length=16)]
    parameters: Parameters = Field(default_factory=dict)
    data: Optional[list[Any]] = Field(None, description="row-major numbers, nested or flat")


class RequestOutput(BaseModel):
    """``$request_output``: an output to return, as JSON, binary data or into shared memory."""

    model_config = _STRICT
    name: Annotated[str, Field(max_length=NAME_MAX)]
    parameters: Parameters = Field(default_factory=dict)


class InferenceRequest(BaseModel):
    """``$inference_request``. ``model_name`` / ``model_version`` are tolerated in the body
    (some clients echo them); the URL decides the model, and a body naming another is
    refused (`service.kserve.http_codec.parse_request`)."""

    model_config = _STRICT
    id: Optional[Annotated[str, Field(max_length=NAME_MAX)]] = None
    model_name: Optional[str] = None
    model_version: Optional[str] = None
    parameters: Parameters = Field(default_factory=dict)
    inputs: Annotated[list[RequestInput], Field(min_length=1, max_length=16)]
    outputs: Optional[Annotated[list[RequestOutput], Field(max_length=16)]] = None


LEASE = ("kda-serve's extension: a lease, unregistered after this many seconds without a request using it "
         "(a client that died leaves no mapping behind); none: until unregistered")


class SystemShmRegister(BaseModel):
    """``$system_shared_memory_register_request``: bytes [offset, offset + byte_size) of the
    POSIX shared memory object ``key``."""

    model_config = _STRICT
    key: Annotated[str, Field(min_length=1, max_length=NAME_MAX)]
    offset: Annotated[int, Field(ge=0)] = 0
    byte_size: Annotated[int, Field(ge=1)]
    ttl_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description=LEASE)


class RawHandle(BaseModel):
    model_config = _STRICT
    b64: Annotated[str, Field(max_length=1024)]


class CudaShmRegister(BaseModel):
    """``$cuda_shared_memory_register_request``: a cudaIpcMemHandle_t (base64) of
    ``byte_size`` bytes on GPU ``device_id``."""

    model_config = _STRICT
    raw_handle: RawHandle
    device_id: Annotated[int, Field(ge=0)]
    byte_size: Annotated[int, Field(ge=1)]
    ttl_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description=LEASE)
