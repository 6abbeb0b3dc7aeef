"""The transport-neutral form of a prefill: what every decoder produces and the core consumes.

HTTP JSON, HTTP safetensors, shared memory, the KServe v2 endpoint and the Ray shards'
payload all build `PrefillInputs` with `PrefillInputs.of` from a `PrefillParams` and the
tensors by name (`REQUIRED_TENSORS`, `OPTIONAL_TENSORS`); validation, batching and the
kernels never see the wire. `PrefillResult` is what comes back, before it is encoded.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence

import torch

REQUIRED_TENSORS = ("q", "k", "v", "g", "beta")  # packed along tokens
OPTIONAL_TENSORS = ("A_log", "dt_bias")  # the request's gate parameters, per head
TENSORS = REQUIRED_TENSORS + OPTIONAL_TENSORS


@dataclass(frozen=True)
class PrefillParams:
    """Everything of a prefill but its sequences and tensors: the layer, the lower-bound
    gate L (in [-5, 0), or None), the q scale (None: K ** -0.5), the fused transforms
    (q/k L2 norm, beta sigmoid, beta doubled for negative eigenvalues) and whether final
    states come back. Front ends name these fields through `PARAM_NAMES`."""

    layer: int = 0
    lower_bound: Optional[float] = None
    scale: Optional[float] = None
    use_qk_l2norm: bool = False
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    return_final_state: bool = True

    @property
    def launch_key(self) -> Hashable:
        """What requests must share to run in one launch: every field but return_final_state
        (a tuple of their values: no second instance made per request)."""
        return _launch_fields(self)


PARAM_NAMES = tuple(f.name for f in dataclasses.fields(PrefillParams))
_launch_fields = operator.attrgetter(*(name for name in PARAM_NAMES if name != "return_final_state"))


@dataclass(frozen=True)
class Checkpoint:
    """Store the state of a sequence's slot at ``offset`` (its tokens in the request's layer:
    those before the request plus those into the sequence) in the prefix cache under ``key``."""

    offset: int
    key: str


@dataclass
class PrefillInputs:
    """One prefill request: a batch of sequences on one layer, tensors packed along tokens
    in sequence order (T = sum(lengths)).

    q, k: [T, H, K]; v: [T, HV, V]; g: [T, HV, K] (the log decay, or the raw gate when a
    gate is fused: A_log or lower_bound given, or server gate parameters for the layer);
    beta: [T, HV] (logits with ``use_beta_sigmoid``) -- float32, bfloat16 or float16,
    typically CPU views over the request body (on the pool's GPU when they came from
    shared memory). A_log: [HV]; dt_bias: [HV, K] or [HV * K] (on the host).
    ``slots[n]`` is sequence n's slot id, or None to allocate a new slot for it.
    ``device_outputs``: o and final_state stay on the pool's device (results written into
    shared memory from there) instead of coming to the host. ``checkpoints[n]``: sequence
    n's `Checkpoint`s (empty lists, or an empty list for none at all).
    Nothing here is checked yet: see `service.core.validation`. Build one with `of`.
    """

    params: PrefillParams
    slots: list[Optional[str]]
    lengths: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    device_outputs: bool = False
    checkpoints: list[list[Checkpoint]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, params: PrefillParams, slots: Sequence[Optional[str]], lengths: Sequence[int],
           tensors: Mapping[str, torch.Tensor], device_outputs: bool = False,
           checkpoints: Optional[Sequence[Sequence[Checkpoint]]] = None) -> "PrefillInputs":
        """The prefill of ``tensors`` by name: every one of `REQUIRED_TENSORS`, and those of
        `OPTIONAL_TENSORS` the request gives (a missing one is None); ``checkpoints`` per
        sequence, or None for none."""
        return cls(params=params, slots=list(slots), lengths=list(lengths),
                   **{name: tensors[name] for name in REQUIRED_TENSORS},
                   **{name: tensors.get(name) for name in OPTIONAL_TENSORS}, device_outputs=device_outputs,
                   checkpoints=[list(c) for c in checkpoints] if checkpoints else [])

    def checkpoint_list(self) -> list[list[Checkpoint]]:
        """``checkpoints`` with one (possibly empty) list per sequence."""
        return self.checkpoints if self.checkpoints else [[] for _ in self.lengths]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors given, by name, in `TENSORS` order (absent optional ones left out)."""
        return {name: t for name in TENSORS if (t := getattr(self, name)) is not None}


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
