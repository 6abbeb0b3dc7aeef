"""The gate parameters of a launch (`Gate`: A_log, dt_bias, lower_bound, and the key that
tells launches apart) and where they come from: the request, or the server's per-layer
``--gate-params`` file (`load_gate_params`). The math is the kernels' (`kernels.transforms`).

Formulas: with ``lower_bound`` L,
``g = L * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h]))``; with only ``A_log``,
``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])``; with neither, g is the log decay.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional

import torch

from kernels.problem import lower_bound_error
from state_store import PoolGeometry
from tensor_io.safetensors_format import ContainerError, load
from tensor_io.views import tensor_bytes

_GATE_KEY = re.compile(r"^layers\.(\d+)\.(A_log|dt_bias|lower_bound)$")


@dataclass(frozen=True)
class Gate:
    """Gate parameters for one launch: A_log [HV], dt_bias [HV, K], lower_bound in [-5, 0);
    each may be absent. ``key`` identifies them for batching: requests merge into one
    launch only when their gates are identical."""

    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    lower_bound: Optional[float] = None
    key: Hashable = None

    @property
    def fused(self) -> bool:
        """Whether g is raw (the kernel applies a gate), as opposed to the log decay."""
        return self.A_log is not None or self.lower_bound is not None


class DeviceGates:
    """Request gates' tensors on ``device``, by gate key: a request's A_log and dt_bias arrive
    on the host (their bytes are the key), and a launch needs them on the device; the copy
    is made once per distinct gate (the layers of one model repeat theirs every step), not
    once per launch, where a blocking host-to-device copy would also wait for the inputs'
    copies queued before it. Holds the ``capacity`` most recently used gates."""

    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self._device = device
        self._capacity = capacity
        self._held: OrderedDict[Hashable, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = OrderedDict()

    def tensors(self, gate: Gate) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(A_log, dt_bias) of ``gate`` on the device (None where the gate has none); a gate
        without a key is copied every time."""
        held = self._held.get(gate.key)
        if held is None:
            held = (None if gate.A_log is None else gate.A_log.to(self._device),
                    None if gate.dt_bias is None else gate.dt_bias.to(self._device))
            if gate.key is None:
                return held
            self._held[gate.key] = held
            if len(self._held) > self._capacity:
                self._held.popitem(last=False)
        else:
            self._held.move_to_end(gate.key)
        return held


def gate_key(A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], lower_bound: Optional[float]) -> Hashable:
    """A hashable identity of gate values (bytes, dtype and shape of each tensor)."""

    def one(t: Optional[torch.Tensor]) -> Hashable:
        return None if t is None else (str(t.dtype), tuple(t.shape), tensor_bytes(t).tobytes())

    return (one(A_log), one(dt_bias), lower_bound)


def load_gate_params(path: str, geometry: PoolGeometry) -> dict[int, Gate]:
    """Per-layer gates from a safetensors file of ``layers.{i}.A_log`` [HV],
    ``layers.{i}.dt_bias`` [HV, K] or [HV * K] and ``layers.{i}.lower_bound`` (one value).

    Returns {layer: Gate} with fp32 tensors on the pool's device. Raises ValueError naming
    the entry when a name, shape or value is wrong, or a layer has dt_bias alone.
    """
    HV, K = geometry.num_heads, geometry.head_k_dim
    entries: dict[int, dict[str, torch.Tensor]] = {}
    try:
        tensors, _ = load(path)
    except ContainerError as e:
        raise ValueError(f"{path}: not a safetensors file: {e}") from None
    for name, t in tensors.items():
        m = _GATE_KEY.match(name)
        if m is None or int(m.group(1)) >= geometry.num_layers:
            raise ValueError(
                f"{path}: unexpected entry {name!r} (want layers.{{0..{geometry.num_layers - 1}}}."
                "{A_log,dt_bias,lower_bound})"
            )
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{path}: {name} must hold finite floating-point values")
        entries.setdefault(int(m.group(1)), {})[m.group(2)] = t
    gates = {}
    for layer, e in sorted(entries.items()):
        A_log, dt_bias, lb = e.get("A_log"), e.get("dt_bias"), e.get("lower_bound")
        if A_log is not None and tuple(A_log.shape) != (HV,):
            raise ValueError(f"{path}: layers.{layer}.A_log must be [{HV}], got {list(A_log.shape)}")
        if dt_bias is not None and tuple(dt_bias.shape) not in ((HV, K), (HV * K,)):  # not its size alone: a
            # [K, HV] entry holds as many values, each paired with the wrong head and key once reshaped
            raise ValueError(f"{path}: layers.{layer}.dt_bias must be [{HV}, {K}] or [{HV * K}], "
                             f"got {list(dt_bias.shape)}")
        if lb is not None and lb.numel() != 1:
            raise ValueError(f"{path}: layers.{layer}.lower_bound must hold one value, got {list(lb.shape)}")
        lower_bound = None if lb is None else float(lb.reshape(()))
        if lower_bound is not None and (why := lower_bound_error(lower_bound)):
            raise ValueError(f"{path}: layers.{layer}: {why}")
        if A_log is None and lower_bound is None:
            raise ValueError(f"{path}: layers.{layer} has dt_bias but neither A_log nor lower_bound")
        device = geometry.device
        gates[layer] = Gate(
            A_log=None if A_log is None else A_log.float().to(device),
            dt_bias=None if dt_bias is None else dt_bias.float().reshape(HV, K).to(device),
            lower_bound=lower_bound,
            key=("server", layer),
        )
    return gates
