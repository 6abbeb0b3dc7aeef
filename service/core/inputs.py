"""The transport-neutral form of a prefill: what every decoder produces and the core consumes.

HTTP JSON, HTTP safetensors and any later transport (shared memory, CUDA IPC, the KServe
v2 endpoint) decode into `PrefillInputs`; validation, batching and the kernels never see
the wire. `PrefillResult` is what comes back, before it is encoded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class PrefillInputs:
    """One prefill request: a batch of sequences on one layer, tensors packed along tokens
    in sequence order (T = sum(lengths)).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (the log decay, or the raw gate when a
    gate is fused: A_log or lower_bound given, or server gate parameters for the layer);
    beta: [T, HV] (logits with ``use_beta_sigmoid``) -- float32, bfloat16 or float16,
    typically CPU views over the request body (on the pool's GPU when they came from CUDA
    shared memory). A_log: [HV]; dt_bias: [HV, K] or [HV * K] (on the host).
    ``slots[n]`` is sequence n's slot id, or None to allocate a new slot for it.
    ``device_outputs``: o and final_state stay on the pool's device (results written into
    CUDA shared memory) instead of coming to the host.
    Nothing here is checked yet: see `service.core.validation`.
    """

    layer: int
    slots: list[Optional[str]]
    lengths: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    lower_bound: Optional[float] = None
    scale: Optional[float] = None
    use_qk_l2norm: bool = False
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    return_final_state: bool = True
    device_outputs: bool = False


@dataclass
class PrefillResult:
    """The outcome of one `PrefillInputs`, on the host (CPU), or on the pool's device
    with ``device_outputs``.

    slots: each sequence's slot id, in order (new ids where the request had None);
    lengths: tokens per sequence; o: [T, HV, V] in v's dtype; final_state: [N, HV, V, K] in
    the pool dtype, each slot's state after this request, or None when declined;
    allocated: the ids this request created (a transport that cannot deliver the result
    frees them); kernel_s: seconds of the launch that ran it (inputs to the device, kernel,
    outputs to the host; shared by every request merged into that launch); validate_s:
    seconds spent validating the request's inputs.
    """

    slots: list[str]
    lengths: list[int]
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    allocated: list[str]
    kernel_s: float = 0.0
    validate_s: float = 0.0
