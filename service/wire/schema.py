"""The JSON documents of the API, as pydantic models (they also make the OpenAPI schema).

Strict: unknown members are refused, numbers are not taken from strings, floats must be
finite. A document that breaks them is a schema error (HTTP 422).
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Type, TypeVar, Union

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' TypedDict before 3.12

from tensor_io.shapes import MAX_RANK, shape_problem

from ..errors import MalformedBody, SchemaError
from .tensors import tensor_from_json

SLOT_ID_MAX = 256
_STRICT = ConfigDict(extra="forbid", strict=True)
_M = TypeVar("_M", bound=BaseModel)


def parse_model(model: Type[_M], raw: Union[bytes, bytearray, str], where: str = "body") -> _M:
    """``model`` from JSON text: MalformedBody (400) when it is not JSON, SchemaError (422)
    when it does not fit the schema. Errors carry location, message and type, never the input."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = [{"loc": [where, *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in e.errors()]
        if any(err["type"] == "json_invalid" for err in errors):
            raise MalformedBody(f"{where} is not valid JSON: {errors[0]['msg']}", field=where) from None
        loc = ".".join(str(p) for p in errors[0]["loc"])
        raise SchemaError(f"{loc}: {errors[0]['msg']} ({len(errors)} error(s))", errors) from None


def _possible(shape: list[int]) -> list[int]:
    problem = shape_problem(shape)
    if problem is not None:
        raise ValueError(problem)
    return shape


Shape = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_RANK), AfterValidator(_possible)]
"""A tensor's shape in a JSON document: at most 8 non-negative ints that a tensor can have
(`tensor_io.shapes.shape_problem`, the check the safetensors parser makes too); every JSON
decoder's shapes are this type."""


class JSONTensor(BaseModel):
    """A tensor: ``data`` is the base64 of its little-endian, row-major bytes."""

    model_config = _STRICT
    dtype: Literal["float32", "bfloat16", "float16", "int64", "int32"]
    shape: Shape
    data: str = Field(description="base64 (RFC 4648, with padding) of the tensor's bytes")

    def to_tensor(self, field: str) -> torch.Tensor:
        """The decoded CPU tensor; MalformedBody naming ``field`` on bad base64 or a byte
        count that disagrees with dtype x shape."""
        return tensor_from_json(self.dtype, self.shape, self.data, field=field)


class CheckpointSpec(TypedDict):
    """One checkpoint of a sequence (a TypedDict, as `SequenceSpec`)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    offset: Annotated[int, Field(description="the slot's tokens in this layer at the checkpoint: its tokens before the "
                                             "request plus a multiple of 64 into the sequence, or the sequence's end")]
    key: Annotated[str, Field(description="the prefix cache key to store the state under (1..128 characters)")]


class SequenceSpec(TypedDict):
    """One sequence of a batch. A TypedDict, not a model: a decode step names hundreds of
    sequences, and validating them into dicts takes a third of the time model instances
    take (256 sequences: 138 against 402 us on a 2-core machine)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    slot: Annotated[Optional[Annotated[str, Field(min_length=1, max_length=SLOT_ID_MAX)]], Field(
        description="the sequence's slot id, or null to allocate a new slot for it")]
    length: Annotated[int, Field(description="tokens of this sequence in the packed tensors (>= 1)")]
    checkpoints: NotRequired[Annotated[list[CheckpointSpec], Field(
        description="states of this sequence to store in the prefix cache (docs/PREFIX_CACHE.md)")]]


class PrefillOptions(BaseModel):
    """Everything of a prefill request but its tensors. In the safetensors encoding this is
    the JSON string ``__metadata__["request"]``."""

    model_config = _STRICT
    layer: int = Field(description="the KDA layer (0 <= layer < num_layers)")
    sequences: list[SequenceSpec] = Field(min_length=1, description="the batch, in packing order")
    lower_bound: Optional[float] = Field(None, allow_inf_nan=False, description="lower-bound gate, in [-5, 0)")
    scale: Optional[float] = Field(None, allow_inf_nan=False, description="q scale (default K ** -0.5)")
    use_qk_l2norm: bool = False
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = Field(False, description="beta = 2 * sigmoid(beta) (with use_beta_sigmoid)")
    return_final_state: bool = True


class PrefillJSONRequest(PrefillOptions):
    """``POST /prefill`` as ``application/json``: tensors packed along tokens T = sum(lengths)."""

    q: JSONTensor = Field(description="[T, H, K]")
    k: JSONTensor = Field(description="[T, H, K]")
    v: JSONTensor = Field(description="[T, HV, V]")
    g: JSONTensor = Field(description="[T, HV, K]: raw with a gate (A_log, lower_bound or server), else log decay")
    beta: JSONTensor = Field(description="[T, HV]")
    A_log: Optional[JSONTensor] = Field(None, description="[HV]")
    dt_bias: Optional[JSONTensor] = Field(None, description="[HV, K] or [HV * K]")


class PrefillJSONResponse(BaseModel):
    slots: list[str] = Field(description="each sequence's slot id, in order")
    o: JSONTensor = Field(description="[T, HV, V] in v's dtype")
    final_state: Optional[JSONTensor] = Field(None, description="[N, HV, V, K]; absent when declined")


class StateJSON(BaseModel):
    model_config = _STRICT
    state: JSONTensor = Field(description="[L, HV, V, K] in the pool dtype")


class AllocRequest(BaseModel):
    model_config = _STRICT
    count: int = Field(1, ge=1, description="slots to allocate, all or none")
    prefix: Optional[list[str]] = Field(None, description="prefix cache keys in prompt order: the new slots start "
                                        "from the longest complete entry among them")


class PrefixMatchJSON(BaseModel):
    matched: int = Field(description="1-based position of the matched key among those given (0: none)")
    key: Optional[str]
    tokens: int = Field(description="tokens per layer the new slots hold")


class SlotsCreated(BaseModel):
    slots: list[str]
    prefix: Optional[PrefixMatchJSON] = Field(None, description="with a prefix in the request: what it matched")


class PublishRequest(BaseModel):
    model_config = _STRICT
    key: str = Field(description="the prefix cache key (1..128 characters)")


class PrefixEntryJSON(BaseModel):
    key: str
    tokens: int = Field(description="tokens per layer of the stored states")
    layers: int = Field(description="layers stored (complete: all of num_layers)")
    complete: bool
    bytes: int
    tier: Literal["device", "host"]
    last_used: float = Field(description="unix seconds")


# `DELETE /prefix/{key}` answers 204 whether or not an entry existed; this header of the
# answer says which ("true": one was removed, "false": there was none).
PREFIX_DROPPED_HEADER = "KDA-Prefix-Dropped"


class Forked(BaseModel):
    slot: str


class SlotMetadata(BaseModel):
    slot: str
    created: float = Field(description="unix seconds")
    last_used: float = Field(description="unix seconds")
    tokens_per_layer: list[int]
    state_lost: bool = Field(description="the state cannot be trusted: an update on it failed midway")


class SelfTestFailure(BaseModel):
    path: str = Field(description="the kernel path, e.g. decode/bfloat16/lower_bound")
    detail: str = Field(description="its errors against the float64 reference, or what it raised")


class SelfTestInfo(BaseModel):
    """The kernel self-test run after warm-up: until it passes, /health/ready is 503."""

    status: Literal["pending", "passed", "failed"]
    paths: list[str] = Field(default_factory=list, description="every path tested")
    failures: list[SelfTestFailure] = Field(default_factory=list)
    toolchain: dict[str, str] = Field(default_factory=dict, description="what compiled the kernels: backend, "
                                                                         "torch, triton, ptxas (path, version)")
    seconds: float = 0.0


class Info(BaseModel):
    version: str = Field(description="the kda-serve release (kda-serve --version)")
    num_layers: int
    num_slots: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    state_dtype: str
    device: str
    backend: str
    free_slots: int
    used_slots: int
    gate_layers: list[int] = Field(description="layers with server gate parameters (--gate-params)")
    spare_rows: Optional[int] = Field(None, description="storage rows beside the slots' that launches write new "
                                                        "states to (--spare-rows; a server, not the ingress)")
    self_test: Optional[SelfTestInfo] = Field(None, description="the kernel self-test (a server; not the ingress)")


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str
    title: str
    status: int
    detail: str
    field: Optional[str] = Field(None, description="the request field at fault")
    errors: Optional[list[dict]] = Field(None, description="schema errors (422)")
    request_id: Optional[str] = Field(None, description="the request's id, as in its X-Request-ID response header")
