"""Helpers of the KServe tests: the service tests' harness (a real kda-serve process, random
inputs, the float64 reference, pool images), and tritonclient plumbing (HTTP and gRPC).

The harness is ``tests/server_harness.py`` (tests/ is on pytest's pythonpath).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np
import torch
import tritonclient.grpc as gc
import tritonclient.http as tc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import np_to_triton_dtype
from server_harness import (  # noqa: F401  (re-exported for this folder's tests)
    GEOMETRY_ARGS, H, HV, K, LAYERS, SLOTS, Server, TOL, V, make_sequence, metric, pool_image, random_state, reference, rel, start_server, wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_BODY_MB = 1  # the test servers' body limit: small, so the 413 test sends little
NAMES = ("q", "k", "v", "g", "beta")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as the numpy array tritonclient wants (ml_dtypes.bfloat16 for BF16)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """The inverse of `to_numpy`."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def triton_inputs(tensors: dict[str, torch.Tensor], binary: bool = True) -> list[tc.InferInput]:
    """One InferInput per tensor, as binary data or JSON numbers."""
    inputs = []
    for name, t in tensors.items():
        array = to_numpy(t)
        x = tc.InferInput(name, list(t.shape), np_to_triton_dtype(array.dtype))
        x.set_data_from_numpy(array, binary_data=binary)
        inputs.append(x)
    return inputs


def seq_inputs(seq: Sequence[torch.Tensor], **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """{q, k, v, g, beta} of a `make_sequence` tuple, plus ``extra`` (A_log, dt_bias)."""
    return {**dict(zip(NAMES, seq)), **extra}


def infer(client: tc.InferenceServerClient, tensors: dict[str, torch.Tensor], *, binary: bool = True,
          outputs: Optional[list[tc.InferRequestedOutput]] = None, sequence_id: Any = 0, start: bool = False,
          end: bool = False, params: Optional[dict[str, Any]] = None) -> tc.InferResult:
    """One infer call of model kda; ``params`` are the request parameters (layer, slot, ...)."""
    return client.infer("kda", triton_inputs(tensors, binary), outputs=outputs, sequence_id=sequence_id,
                        sequence_start=start, sequence_end=end, parameters=params)


def result_tensor(result: tc.InferResult, name: str) -> torch.Tensor:
    return from_numpy(result.as_numpy(name))


def grpc_inputs(tensors: dict[str, torch.Tensor]) -> list[gc.InferInput]:
    """One gRPC InferInput per tensor (raw_input_contents)."""
    inputs = []
    for name, t in tensors.items():
        array = to_numpy(t)
        x = gc.InferInput(name, list(t.shape), np_to_triton_dtype(array.dtype))
        x.set_data_from_numpy(array)
        inputs.append(x)
    return inputs


def grpc_infer(client: gc.InferenceServerClient, tensors: dict[str, torch.Tensor], *,
               outputs: Optional[list[gc.InferRequestedOutput]] = None, sequence_id: Any = 0, start: bool = False,
               end: bool = False, params: Optional[dict[str, Any]] = None) -> gc.InferResult:
    """`infer` over gRPC."""
    return client.infer("kda", grpc_inputs(tensors), outputs=outputs, sequence_id=sequence_id,
                        sequence_start=start, sequence_end=end, parameters=params)


def response_slot(result: Any) -> Optional[str]:
    """The ``slot`` response parameter of an HTTP or gRPC result (None when absent)."""
    response = result.get_response()
    if isinstance(response, dict):
        return response.get("parameters", {}).get("slot")
    return response.parameters["slot"].string_param if "slot" in response.parameters else None


def raw_request(tensors: dict[str, torch.Tensor], request_id: str = "", **parameters: pb.InferParameter
                ) -> pb.ModelInferRequest:
    """A ModelInferRequest by hand, its FP32 inputs as raw_input_contents (what tritonclient
    cannot send: a uint64 sequence id, bytes that are no message, ...)."""
    request = pb.ModelInferRequest(model_name="kda", id=request_id)
    for name, t in tensors.items():
        request.inputs.add(name=name, datatype="FP32", shape=list(t.shape))
        request.raw_input_contents.append(t.numpy().tobytes())
    for name, value in parameters.items():
        request.parameters[name].CopyFrom(value)
    return request
