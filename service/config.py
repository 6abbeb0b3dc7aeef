"""Server settings: one frozen dataclass, filled from CLI flags or ``KDA_<FLAG>`` variables.

Every field is a flag (``num_slots`` -> ``--num-slots``) and an environment variable
(``KDA_NUM_SLOTS``); a flag beats the variable, the variable beats the default. With
nothing set the server listens on 127.0.0.1:8000 with a small pool: 2 layers x 64 slots,
4 heads, K = V = 64, fp32 (2 MiB of state), on the GPU when there is one, else the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from kernels.backends import triton_available
from kernels.problem import head_dims_error

from .version import __version__

ENV_PREFIX = "KDA_"
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKEND_CHOICES = ("auto", "torch", "triton")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# A lone launch of at most this many tokens runs on the event loop when the device is idle:
# on a GPU that is a few milliseconds of kernel at most, on the CPU about one.
INLINE_LAUNCH_TOKENS_GPU = 16384
INLINE_LAUNCH_TOKENS_CPU = 256
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class Settings:
    """Everything `kda-serve` can be told. Sizes of the pool are its geometry:
    [num_layers, num_slots, num_heads, head_v_dim, head_dim] in ``state_dtype``."""

    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "TCP port to listen on")
    grpc_port: int = _opt(0, "TCP port of the KServe v2 gRPC endpoint on --host (0: off; conventionally 8001); "
                             "needs the grpc extra")
    metrics_port: int = _opt(0, "TCP port on --host serving the Prometheus page without the API key (0: off; "
                                "conventionally 8002)")
    framed_socket: Optional[str] = _opt(None, "path of a Unix socket serving shared memory and CUDA IPC prefills "
                                              "in length-prefixed frames, outside HTTP (co-located clients; mode "
                                              "0600; docs/FRAMED.md)")
    device: str = _opt("auto", "auto | cpu | cuda | cuda:N (auto: the GPU when present)")
    backend: str = _opt("auto", "kernel backend: auto | torch | triton (auto: triton on CUDA)")
    num_layers: int = _opt(2, "KDA layers held per slot")
    num_slots: int = _opt(64, "slots in the pool (concurrent sequences)")
    num_heads: int = _opt(4, "value heads HV of the state (q/k heads H must divide it)")
    head_dim: int = _opt(64, "key head dim K (and V unless --head-v-dim)")
    head_v_dim: Optional[int] = _opt(None, "value head dim V (default: --head-dim)")
    state_dtype: str = _opt("float32", "pool dtype: float32 | bfloat16")
    spare_rows: Optional[int] = _opt(
        None, "pool rows beside the slots' (one layer's state each) that launches write new states to, committing "
              "by moving the slots' rows: nothing copied for a refusal to restore (default: --num-slots, 1/num_layers "
              "more memory; 0: launches update rows in place and copy them first)")
    gate_params: Optional[str] = _opt(
        None, "safetensors with layers.{i}.A_log, layers.{i}.dt_bias[, layers.{i}.lower_bound]"
    )
    max_body_mb: float = _opt(256.0, "largest request body accepted, in MiB (413 beyond)")
    batch_window_ms: float = _opt(
        0.0, "how long a /prefill arriving at an idle device waits for others to share its launch (0: launch at once; what arrives during a launch still merges into the next)")
    max_batch_tokens: int = _opt(65536, "most tokens merged into one launch")
    inline_launch_tokens: Optional[int] = _opt(
        None, "a lone prefill of at most this many tokens reaching an idle device launches on the event loop, "
              "without the hop to the device thread (0: never; default 256 on the CPU, 16384 on a GPU)")
    slot_ttl_s: Optional[float] = _opt(None, "free slots idle longer than this (default: never)")
    api_key: Optional[str] = _opt(None, "require 'Authorization: Bearer <key>' on all but /health", repr=False)
    snapshot_path: Optional[str] = _opt(
        None, "restore the pool from this file at start (slots changed after it, per its journal "
              "PATH.journal, come back flagged state_lost); save it every --snapshot-interval-s and at shutdown"
    )
    snapshot_interval_s: float = _opt(
        60.0, "with --snapshot-path: snapshot this often when anything changed (0: only at shutdown)"
    )
    body_timeout_s: float = _opt(30.0, "longest wait for the next bytes of a request body (408 after)")
    log_level: str = _opt("info", "log level (the server's and uvicorn's): debug | info | warning | error")
    log_format: str = _opt("text", "log lines: text | json (one JSON object per line, with the request id when there is one)")
    # -- reliability limits (docs/RELIABILITY.md) -------------------------------------
    body_deadline_s: float = _opt(120.0, "longest time a whole request body may take to arrive (408 after)")
    header_timeout_s: float = _opt(10.0, "longest time a request's headers may take, from their first byte "
                                         "(408 after)")
    max_header_kb: float = _opt(64.0, "largest request line and headers accepted, in KiB (431 beyond)")
    first_request_timeout_s: float = _opt(10.0, "how long a new connection may stay silent before its first "
                                                "request (closed after)")
    max_shm_regions: int = _opt(256, "most shared memory regions registered at a time (system and CUDA)")
    max_shm_mb: float = _opt(32768.0, "most bytes of system shared memory regions mapped at a time, in MiB")
    cuda_ipc_zero_copy: bool = _opt(
        False, "for trusted co-located clients only: the kernels read a request's inputs in its CUDA IPC regions in "
               "place, without the copy that keeps a client writing them during the launch from reaching the pool "
               "(the client must leave them alone until the reply; docs/RELIABILITY.md)")
    self_test_fault: Optional[str] = _opt(None, "testing only: corrupt o of the self-test path of this name (as "
                                                "check:PATH, fail its input check), to prove a mismatch keeps the "
                                                "server unready")
    # -- prefix cache (docs/PREFIX_CACHE.md) ------------------------------------------
    prefix_cache_mb: float = _opt(1024.0, "device memory for prefix cache entries, in MiB, allocated as entries "
                                          "arrive (0: the cache is off)")
    prefix_cache_host_mb: float = _opt(0.0, "pinned host memory that device entries are moved to instead of "
                                            "dropped, in MiB (0: none)")

    def __post_init__(self) -> None:
        problems = []
        if not self.host:
            problems.append("host must not be empty (0.0.0.0 listens on every interface)")
        for name in _float_fields():  # -inf and nan fail the range checks below
            if getattr(self, name) == math.inf:
                problems.append(f"{name} must be finite, got inf")
        for name in ("num_layers", "num_slots", "num_heads", "head_dim", "max_batch_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_v_dim is not None and self.head_v_dim < 1:
            problems.append(f"head_v_dim must be >= 1, got {self.head_v_dim}")
        elif self.head_dim >= 1 and (why := head_dims_error(self.head_dim, self.v_dim)):
            problems.append(why)  # the kernels' limit: checked here, not at every launch
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in 0..65535, got {self.port}")
        for name in ("grpc_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                problems.append(f"{name} must be in 0..65535, got {getattr(self, name)}")
        problems.extend(_port_clashes(self))
        if self.framed_socket is not None and not 0 < len(os.fsencode(self.framed_socket)) < 108:
            problems.append(f"framed_socket must be a path of 1..107 bytes (a Unix socket's limit), "
                            f"got {self.framed_socket!r}")
        if not _DEVICE_RE.match(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.log_level.lower() not in LOG_LEVELS:
            problems.append(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            problems.append(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.backend not in BACKEND_CHOICES:
            problems.append(f"backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        if self.state_dtype not in STATE_DTYPES:
            problems.append(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {self.state_dtype!r}")
        if not self.max_body_mb > 0:
            problems.append(f"max_body_mb must be > 0, got {self.max_body_mb}")
        if not self.batch_window_ms >= 0:
            problems.append(f"batch_window_ms must be >= 0, got {self.batch_window_ms}")
        if self.inline_launch_tokens is not None and self.inline_launch_tokens < 0:
            problems.append(f"inline_launch_tokens must be >= 0, got {self.inline_launch_tokens}")
        if not self.snapshot_interval_s >= 0:
            problems.append(f"snapshot_interval_s must be >= 0, got {self.snapshot_interval_s}")
        if not self.body_timeout_s > 0:
            problems.append(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        for name in ("body_deadline_s", "header_timeout_s", "max_header_kb", "first_request_timeout_s", "max_shm_mb"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefix_cache_mb", "prefix_cache_host_mb"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.spare_rows is not None and self.spare_rows < 0:
            problems.append(f"spare_rows must be >= 0, got {self.spare_rows}")
        if self.max_shm_regions < 0:
            problems.append(f"max_shm_regions must be >= 0, got {self.max_shm_regions}")
        if self.slot_ttl_s is not None and not self.slot_ttl_s > 0:
            problems.append(f"slot_ttl_s must be > 0, got {self.slot_ttl_s}")
        if self.api_key is not None and not self.api_key:
            problems.append("api_key must not be empty")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def v_dim(self) -> int:
        """V: ``head_v_dim``, else ``head_dim``."""
        return self.head_dim if self.head_v_dim is None else self.head_v_dim

    def inline_tokens(self, device: torch.device) -> int:
        """`inline_launch_tokens`, its default for ``device`` when unset."""
        if self.inline_launch_tokens is not None:
            return self.inline_launch_tokens
        return INLINE_LAUNCH_TOKENS_GPU if device.type == "cuda" else INLINE_LAUNCH_TOKENS_CPU

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def max_header_bytes(self) -> int:
        return int(self.max_header_kb * 1024)

    @property
    def max_shm_bytes(self) -> int:
        return int(self.max_shm_mb * (1 << 20))

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mb * (1 << 20))

    @property
    def prefix_cache_host_bytes(self) -> int:
        return int(self.prefix_cache_host_mb * (1 << 20))

    @property
    def torch_state_dtype(self) -> torch.dtype:
        return STATE_DTYPES[self.state_dtype]

    def torch_device(self) -> torch.device:
        """The serving device; ``auto`` is ``cuda`` when a GPU is visible, else ``cpu``."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def device_problem(self) -> Optional[str]:
        """Why this machine cannot serve on ``device`` with ``backend`` (a CUDA device it does
        not have, ``triton`` where Triton cannot run), or None when it can."""
        device = self.torch_device()
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                return f"--device {self.device}: no CUDA device is visible"
            if (device.index or 0) >= count:
                return f"--device {self.device}: only {count} CUDA device(s) are visible"
        if self.backend == "triton" and not triton_available(device):
            return (f"--backend triton cannot run on {device}: it needs triton and a CUDA device (or, on the CPU, "
                    "TRITON_INTERPRET=1)")
        return None


@functools.cache
def _float_fields() -> tuple[str, ...]:
    """The names of Settings' float fields (Optional or not)."""
    return tuple(name for name, kind in _field_types(Settings).items() if kind is float)


def _port_clashes(settings: Settings) -> list[str]:
    """Why two of the TCP endpoints (``port``, ``grpc_port``, ``metrics_port``) cannot both
    listen: each pair set to the same non-zero port (0 is ephemeral, or off)."""
    names = ("port", "grpc_port", "metrics_port")
    return [f"{a} and {b} must differ, both are {getattr(settings, a)}"
            for i, a in enumerate(names) for b in names[i + 1:]
            if getattr(settings, a) and getattr(settings, a) == getattr(settings, b)]


def env_name(name: str) -> str:
    """``num_slots`` -> ``KDA_NUM_SLOTS``."""
    return ENV_PREFIX + name.upper()


def _field_types(cls: type) -> dict[str, type]:
    """Each field's scalar type (int, float, str or bool), Optional[...] unwrapped."""
    types = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        types[name] = args[0] if args else hint
    return types


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case); ValueError otherwise."""
    word = raw.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"{raw!r} is not one of {', '.join(_TRUE + _FALSE)}")
    return word in _TRUE


def add_env_flags(parser: argparse.ArgumentParser, cls: type, environ: Mapping[str, str]) -> None:
    """One ``--flag`` per field of the dataclass ``cls`` (help from the field's metadata), its
    default taken from ``KDA_<FLAG>`` when set; a malformed variable is a usage error. A
    bool field's flag alone means true (``--flag false`` and the variable take the words
    of `parse_bool`)."""
    types = _field_types(cls)
    for f in dataclasses.fields(cls):
        kind = types[f.name]
        convert = parse_bool if kind is bool else kind
        raw = environ.get(env_name(f.name))
        default = f.default
        if raw not in (None, ""):
            try:
                default = convert(raw)
            except ValueError:
                parser.error(f"{env_name(f.name)}={raw!r} is not a valid {kind.__name__}")
        extra = {"nargs": "?", "const": True} if kind is bool else {}
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=convert, default=default,
            help=f"{f.metadata['help']} [env {env_name(f.name)}; default {f.default}]", **extra,
        )


def build_parser(environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """One ``--flag`` per Settings field, its default taken from ``KDA_<FLAG>`` when set."""
    parser = argparse.ArgumentParser(
        prog="kda-serve",
        description="KDA chunked prefill over HTTP: a state pool, a batcher and the kernels behind FastAPI. "
        "Every flag can also be set as KDA_<FLAG> (e.g. KDA_NUM_SLOTS=256).",
    )
    parser.add_argument("--version", action="version", version=f"kda-serve {__version__}")
    add_env_flags(parser, Settings, environ)
    return parser


def parse_settings(argv: Optional[Sequence[str]] = None, environ: Mapping[str, str] = os.environ) -> Settings:
    """Settings from flags (``argv``, default sys.argv[1:]) over ``environ`` over defaults.
    Exits with a usage message (argparse) when a value is malformed or out of range."""
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    try:
        return Settings(**vars(args))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
