"""Every check a prefill passes before anything changes: nothing is allocated, queued or
launched for a request that fails here, and no kernel error can stand in for a 400.

One check may be left to the launch (`validate_prefill`'s ``defer``): the values of the
packed inputs (q, k, v, g, beta), which the kernels check as they read them
(`kernels.problem.PrefillProblem.input_checks`, no pass of its own); the launch rolls a
request whose values fail back and refuses it with the same 400 (`failed_input_problem`).

Errors name the field and show what was seen (`InvalidRequest`, HTTP 400).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch

from kernels.problem import FLOAT_INPUTS, lower_bound_error
from state_store import PoolGeometry

from .staging import copy_stream, on_stream
from ..errors import InvalidRequest
from .gate_params import Gate, gate_key
from .inputs import OPTIONAL_TENSORS, REQUIRED_TENSORS, TENSORS, PrefillInputs
from ..wire.tensors import describe


@dataclass(frozen=True)
class DeferredCheck:
    """The value checks of a request's tensors on a GPU, computed there and read after the
    launch instead of before it (no synchronization of their own): ``ends`` [n, 3] float32,
    each tensor's (-min, max, bad) (`kernels.triton_kernels.extremes.value_extremes`: one
    launch, on the copy stream), complete once ``ready`` (an event on it) is;
    ``names``/``described`` name the tensors; ``log_decay``: g is the log decay, so its
    largest value must be <= 0. The launch queues `read` on its stream before its one
    synchronization and calls `problem` after it; a request it refuses is rolled back."""

    names: tuple[str, ...]
    described: tuple[str, ...]
    ends: torch.Tensor
    ready: Optional["torch.cuda.Event"]
    log_decay: bool

    def read(self) -> torch.Tensor:
        """``ends`` copied to the host behind the current stream's work ([n, 3], float32;
        valid once that stream is synchronized), the stream first waiting for ``ready``."""
        if not self.ends.is_cuda:
            return self.ends
        stream = torch.cuda.current_stream(self.ends.device)
        if self.ready is not None:
            stream.wait_event(self.ready)
        host = torch.empty(self.ends.shape, dtype=self.ends.dtype, pin_memory=True)
        host.copy_(self.ends, non_blocking=True)
        self.ends.record_stream(stream)
        return host

    def problem(self, host: torch.Tensor) -> Optional[InvalidRequest]:
        """The 400 `read`'s values call for (the first failing tensor), or None."""
        return packed_value_problem(self.names, self.described, host.tolist(), self.log_decay)


@dataclass(frozen=True)
class ValidPrefill:
    """A prefill that passed validation: its inputs, q/k heads H, the gate that applies
    (dt_bias reshaped to [HV, K]) and the key of the launches it may share; ``deferred``:
    the value checks of its GPU gate tensors, still to read after the launch
    (`DeferredCheck`), or None; ``kernel_checked``: the values of q, k, v, g and beta are
    left to the launch's kernels (`kernels.problem.PrefillProblem.input_checks`)."""

    inputs: PrefillInputs
    heads: int
    gate: Gate
    batch_key: Hashable
    deferred: Optional[DeferredCheck] = None
    kernel_checked: bool = False

    @property
    def packed(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of q, k, v, g and beta, the inputs packed along tokens."""
        return [(name, getattr(self.inputs, name)) for name in REQUIRED_TENSORS]

    def values_problem(self) -> InvalidRequest:
        """The 400 of these inputs after a launch's input check failed (`failed_input_problem`)."""
        return failed_input_problem(self.packed, not self.gate.fused)

    @property
    def tokens(self) -> int:
        return self.inputs.q.shape[0]


def _fail(field: str, detail: str) -> InvalidRequest:
    return InvalidRequest(detail, field=field)


def _check_sequences(x: PrefillInputs, geometry: PoolGeometry) -> None:
    layer = x.params.layer
    if not 0 <= layer < geometry.num_layers:
        raise _fail("layer", f"layer {layer} out of range: the pool has {geometry.num_layers} layers "
                             f"(0..{geometry.num_layers - 1})")
    n = len(x.slots)
    if n != len(x.lengths):
        raise _fail("sequences", f"{n} slots but {len(x.lengths)} lengths")
    if not 1 <= n <= geometry.num_slots:
        raise _fail("sequences", f"a request holds 1..{geometry.num_slots} sequences (the pool's slots), got {n}")
    for i, length in enumerate(x.lengths):
        if length < 1:
            raise _fail(f"sequences[{i}].length", f"sequence {i} has length {length}; lengths must be >= 1")
    seen: dict[str, int] = {}
    for i, slot in enumerate(x.slots):
        if slot is None:
            continue
        if slot in seen:
            raise _fail(f"sequences[{i}].slot", f"slot {slot!r} appears twice, in sequences[{seen[slot]}] and "
                                                f"sequences[{i}]; a request may name a slot once")
        seen[slot] = i


def _check_tensors(x: PrefillInputs, geometry: PoolGeometry) -> int:
    """Shapes and dtypes of q, k, v, g, beta against each other and the pool; returns H."""
    HV, K, V = geometry.num_heads, geometry.head_k_dim, geometry.head_v_dim
    for name in REQUIRED_TENSORS:
        t = getattr(x, name)
        if t.dtype not in FLOAT_INPUTS:
            raise _fail(name, f"{name} must be float32, bfloat16 or float16, got {describe(t)}")
        if t.dim() != (2 if name == "beta" else 3):
            raise _fail(name, f"{name} must have {2 if name == 'beta' else 3} dimensions, got {describe(t)}")
    T, H, qk = x.q.shape
    if qk != K or H < 1 or HV % H:
        raise _fail("q", f"q must be [T, H, K] with K={K} and H dividing the pool's {HV} heads, got {describe(x.q)}")
    want = {"k": (T, H, K), "v": (T, HV, V), "g": (T, HV, K), "beta": (T, HV)}
    for name, shape in want.items():
        t = getattr(x, name)
        if tuple(t.shape) != shape:
            raise _fail(name, f"{name} must be {list(shape)} (T={T}, H={H} from q; HV={HV}, K={K}, V={V} "
                              f"from the pool), got {describe(t)}")
    if sum(x.lengths) != T:
        raise _fail("sequences", f"sequence lengths {x.lengths} sum to {sum(x.lengths)}, but q has T={T} tokens")
    return H


def _resolve_gate(x: PrefillInputs, geometry: PoolGeometry, server: Optional[Gate]) -> Gate:
    """The gate that applies: the server's for the layer, else the request's (checked)."""
    HV, K = geometry.num_heads, geometry.head_k_dim
    lower_bound = x.params.lower_bound
    given = [n for n in OPTIONAL_TENSORS if getattr(x, n) is not None]  # the request's gate parameters
    if lower_bound is not None:
        given.append("lower_bound")
    if server is not None:
        if given:
            raise _fail(given[0], f"layer {x.params.layer} uses the server's gate parameters (--gate-params); "
                                  f"the request must not send {', '.join(given)}")
        return server
    if lower_bound is not None and (why := lower_bound_error(lower_bound)):
        raise _fail("lower_bound", why)
    if x.A_log is not None:
        if x.A_log.dtype not in FLOAT_INPUTS or tuple(x.A_log.shape) != (HV,):
            raise _fail("A_log", f"A_log must be a float tensor of shape [{HV}], got {describe(x.A_log)}")
    dt_bias = x.dt_bias
    if dt_bias is not None:
        if x.A_log is None and lower_bound is None:
            raise _fail("dt_bias", "dt_bias needs A_log or lower_bound (without either, g is taken as the log decay)")
        if dt_bias.dtype not in FLOAT_INPUTS or tuple(dt_bias.shape) not in ((HV, K), (HV * K,)):
            raise _fail("dt_bias", f"dt_bias must be a float tensor of shape [{HV}, {K}] or [{HV * K}], "
                                   f"got {describe(dt_bias)}")
        dt_bias = dt_bias.reshape(HV, K)
    return Gate(x.A_log, dt_bias, lower_bound, key=gate_key(x.A_log, dt_bias, lower_bound))


def extremes(tensors: Sequence[torch.Tensor]) -> list[Optional[tuple[float, float]]]:
    """(min, max) of each float tensor of ``tensors`` (None when empty), in one pass over
    it that allocates nothing of its size; min and max propagate NaN and are infinite when
    any value is. (``torch.isfinite(t).all()`` writes a bool tensor of t's size and reads it
    again: ~10x slower.) Tensors on a GPU (inputs copied out of shared memory) are scanned on
    the stream that copied them, so the answer never waits for a launch in flight, and are
    read back with one synchronization per device for all of them."""
    out: list[Optional[tuple[float, float]]] = [None] * len(tensors)
    on_gpu: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        if t.is_cuda:
            on_gpu.setdefault(t.device, []).append(i)
        else:
            lo, hi = torch.aminmax(t)
            out[i] = (lo.item(), hi.item())  # host scalars: no synchronization, fewer ops than a stacked read
    for device, indices in on_gpu.items():
        with on_stream(copy_stream(device)):
            ends = torch.stack([torch.stack(torch.aminmax(tensors[i])).float() for i in indices]).tolist()  # [n, 2]
        for i, (lo, hi) in zip(indices, ends):
            out[i] = (lo, hi)
    return out


def finite_flags(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each float tensor of ``tensors``, whether every value is finite (`extremes`)."""
    return [e is None or (math.isfinite(e[0]) and math.isfinite(e[1])) for e in extremes(tensors)]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of the float tensor ``t`` is finite (`extremes`)."""
    return finite_flags([t])[0]


def _value_problem(name: str, described: Union[str, torch.Tensor], lo: float, hi: float, log_decay: bool
                   ) -> Optional[InvalidRequest]:
    """The 400 for tensor ``name`` (``described``: the tensor, or its description) with
    smallest ``lo`` and largest ``hi``, or None."""
    if math.isfinite(lo) and math.isfinite(hi) and not (name == "g" and log_decay and hi > 0):
        return None
    if isinstance(described, torch.Tensor):
        described = describe(described)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return _fail(name, f"{name} {described} holds non-finite values (NaN or Inf)")
    if name == "g" and log_decay and hi > 0:
        return _fail("g", f"g {described} is the log decay (no gate: no A_log, lower_bound or server gate "
                          f"parameters), so every value must be <= 0; its largest is {hi:g}")
    return None


def first_value_problem(named: Sequence[tuple[str, torch.Tensor]], log_decay: bool) -> Optional[InvalidRequest]:
    """The 400 for the first of the ``named`` tensors whose values fail (a NaN or Inf; with
    ``log_decay``, g > 0), scanned here (`extremes`), or None."""
    for (name, t), ends in zip(named, extremes([t for _, t in named])):
        if ends is not None and (why := _value_problem(name, t, *ends, log_decay)):
            return why
    return None


def _check_values(x: PrefillInputs, gate: Gate, defer: bool) -> Optional[DeferredCheck]:
    """Every value finite, ``scale`` > 0, and a given log decay (g without a gate) <= 0:
    a positive one grows the state by exp(g) per token, so a finite request would leave
    Inf or NaN in its slot. With ``defer`` q, k, v, g and beta are left to the launch's
    kernels, and the gate tensors on a GPU are scanned there and the answer returned as a
    `DeferredCheck` instead of read back here."""
    scale = x.params.scale
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise _fail("scale", f"scale must be a finite number > 0, got {scale}")
    names = OPTIONAL_TENSORS if defer else TENSORS
    named = [(name, t) for name in names if (t := getattr(x, name)) is not None and t.numel()]
    later = [(name, t) for name, t in named if defer and t.is_cuda]
    now = [(name, t) for name, t in named if not (defer and t.is_cuda)]
    if (why := first_value_problem(now, not gate.fused)) is not None:
        raise why
    if not later:
        return None
    from kernels.triton_kernels.extremes import value_extremes  # Triton: imported once a GPU tensor needs it

    device = later[0][1].device
    stream = copy_stream(device)
    with on_stream(stream):
        for _, t in later:
            t.record_stream(stream)
        ends_t = value_extremes([t for _, t in later])  # [n, 3]: one launch, where ~3n small ops were
        ready = torch.cuda.Event()
        ready.record(stream)
    return DeferredCheck(tuple(n for n, _ in later), tuple(describe(t) for _, t in later), ends_t, ready,
                         not gate.fused)


def validate_prefill(x: PrefillInputs, geometry: PoolGeometry, server_gates: Mapping[int, Gate],
                     defer: bool = False) -> ValidPrefill:
    """Check ``x`` against the pool's ``geometry`` and the server's gates, cheapest checks
    first: layer, sequences and lengths, slots named once, shapes and dtypes, the gate,
    then the values (finite; a given log decay <= 0). Raises InvalidRequest (400) on the
    first failure. With ``defer`` (the launch checks and rolls back what is deferred) the
    values of q, k, v, g and beta are left to the launch's kernels
    (``ValidPrefill.kernel_checked``), and those of the gate tensors on a GPU are scanned
    there without waiting (``ValidPrefill.deferred``, read at the launch's one
    synchronization)."""
    _check_sequences(x, geometry)
    heads = _check_tensors(x, geometry)
    gate = _resolve_gate(x, geometry, server_gates.get(x.params.layer))
    deferred = _check_values(x, gate, defer)
    return ValidPrefill(inputs=x, heads=heads, gate=gate, batch_key=_batch_key(x, heads, gate), deferred=deferred,
                        kernel_checked=defer)


def validate_form(x: PrefillInputs, geometry: PoolGeometry, server_gates: Mapping[int, Gate]) -> ValidPrefill:
    """`validate_prefill` but for the values of the packed tensors (q, k, v, g, beta): the
    checks of a prepared prefill, whose packed inputs get new values at every run and are
    checked then (by the kernels: `failed_input_problem`); the scale and the request's gate
    tensors (A_log, dt_bias), which stay as they are, are checked here."""
    _check_sequences(x, geometry)
    heads = _check_tensors(x, geometry)
    gate = _resolve_gate(x, geometry, server_gates.get(x.params.layer))
    scale = x.params.scale
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise _fail("scale", f"scale must be a finite number > 0, got {scale}")
    named = [(name, t) for name in OPTIONAL_TENSORS if (t := getattr(x, name)) is not None and t.numel()]
    if (why := first_value_problem(named, not gate.fused)) is not None:
        raise why
    return ValidPrefill(inputs=x, heads=heads, gate=gate, batch_key=_batch_key(x, heads, gate), kernel_checked=True)


def packed_value_problem(names: Sequence[str], tensors: Sequence[Union[str, torch.Tensor]],
                         ends: Sequence[Sequence[float]], log_decay: bool) -> Optional[InvalidRequest]:
    """The 400 for the first of ``tensors`` (named ``names``; each the tensor or its
    description) whose values fail: ``ends``
    holds each one's (-min, max, bad) as `value_extremes` computes them (bad > 0: a NaN or
    an Inf); ``log_decay``: g is the log decay (no gate), so its values must be <= 0."""
    for name, t, (neg_lo, hi, bad) in zip(names, tensors, ends):
        lo, hi = (math.nan, math.nan) if bad > 0 else (-neg_lo, hi)
        if (why := _value_problem(name, t, lo, hi, log_decay)) is not None:
            return why
    return None


def failed_input_problem(named: Sequence[tuple[str, torch.Tensor]], log_decay: bool) -> InvalidRequest:
    """The 400 for inputs a launch's input check failed (`PrefillProblem.input_checks`):
    their values scanned here (that launch's path alone) for the first of ``named`` that
    fails; when none does now, its values changed since the launch read them (a client
    writing into inputs read in place)."""
    return first_value_problem(named, log_decay) or changed_inputs_problem()


def changed_inputs_problem() -> InvalidRequest:
    """The 400 for inputs a launch's input check failed that a scan finds no fault in now:
    their values changed during the run (inputs read in place, written meanwhile)."""
    return _fail("inputs", "an input held a non-finite value (NaN or Inf) or a log decay > 0 when the launch "
                           "read it, but holds none now: its values changed during the run")


def _batch_key(x: PrefillInputs, heads: int, gate: Gate) -> Hashable:
    """What requests must share to run in one launch (`ValidPrefill.batch_key`)."""
    return (x.params.launch_key, heads, tuple(getattr(x, n).dtype for n in REQUIRED_TENSORS), gate.key)


def validate_state(state: torch.Tensor, geometry: PoolGeometry, field: str = "state") -> None:
    """A slot state to write: [L, HV, V, K] in the pool dtype, every value finite."""
    if tuple(state.shape) != geometry.slot_shape or state.dtype != geometry.dtype:
        raise _fail(field, f"state must be {geometry.dtype_name}{list(geometry.slot_shape)} "
                           f"([L, HV, V, K] of the pool), got {describe(state)}")
    if not all_finite(state):
        raise _fail(field, f"state {describe(state)} holds non-finite values (NaN or Inf)")
