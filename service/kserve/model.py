"""The one model the KServe endpoint serves, as both front ends (HTTP and gRPC) describe it.

``kda`` version ``1``: inputs q, k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV]
(optional A_log [HV], dt_bias [HV, K]: the names are `service.core.inputs`'
`REQUIRED_TENSORS` and `OPTIONAL_TENSORS`); outputs o [T, HV, V] in v's datatype and
final_state [HV, V, K] in the pool's. -1 marks the token dimension (and q/k's heads H, any
divisor of HV).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from state_store import PoolGeometry

from ..core.inputs import OPTIONAL_TENSORS
from .datatypes import ACCEPTED, datatype_name
from .errors import UnknownModel

MODEL, VERSION, PLATFORM = "kda", "1", "kda-serve"
OUTPUTS = ("o", "final_state")
EXTENSIONS = ("binary_tensor_data", "sequence", "sequence(string_id)", "system_shared_memory", "parameters")
"""The protocol extensions served; ``cuda_shared_memory`` joins them where CUDA IPC works."""


@dataclass(frozen=True)
class TensorInfo:
    """One input or output of the model: its ``shape`` (-1: any size), the ``datatype`` the
    protocol's metadata names, and what else it takes (``datatypes``)."""

    name: str
    datatype: str
    shape: list[int]
    datatypes: str
    optional: bool = False


def check_model(model: str, version: Optional[str]) -> None:
    """UnknownModel (404) unless ``model`` is kda and ``version`` (None or "": any) is 1."""
    if model != MODEL:
        raise UnknownModel(f"unknown model {model!r}: this server serves {MODEL!r}", field="model")
    if version and version != VERSION:
        raise UnknownModel(f"unknown version {version!r} of model {MODEL!r}: it has version {VERSION!r}",
                           field="version")


def model_inputs(geometry: PoolGeometry) -> list[TensorInfo]:
    HV, K, V = geometry.num_heads, geometry.head_k_dim, geometry.head_v_dim
    shapes = {"q": [-1, -1, K], "k": [-1, -1, K], "v": [-1, HV, V], "g": [-1, HV, K], "beta": [-1, HV],
              "A_log": [HV], "dt_bias": [HV, K]}
    return [TensorInfo(name, "FP32", shape, ACCEPTED, name in OPTIONAL_TENSORS) for name, shape in shapes.items()]


def model_outputs(geometry: PoolGeometry) -> list[TensorInfo]:
    HV, K, V = geometry.num_heads, geometry.head_k_dim, geometry.head_v_dim
    state = datatype_name(geometry.dtype)
    return [TensorInfo("o", "FP32", [-1, HV, V], "v's datatype"), TensorInfo("final_state", state, [HV, V, K], state)]
