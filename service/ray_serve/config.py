"""Settings of a sharded deployment: the single server's `Settings` (pool geometry per
shard, batching, gates, API key, HTTP address of Serve's proxy) plus `ScaleOut`.

Flags and ``KDA_*`` variables work as for ``kda-serve`` (a flag beats the variable, the
variable beats the default): ``--shards`` is ``KDA_SHARDS`` and so on.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from service.config import Settings, add_env_flags, build_parser

from .ids import check_shard_name


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ScaleOut:
    """How the service spreads over a Ray cluster."""

    shards: int = _opt(1, "shard deployments: one per GPU, each a single replica with its own pool")
    shard_prefix: str = _opt("shard", "shard names are <prefix>-0 .. <prefix>-(N-1); they appear in slot ids")
    gpus_per_shard: float = _opt(1.0, "GPUs each shard replica reserves (0: a CPU shard)")
    cpus_per_shard: float = _opt(1.0, "CPUs each shard replica reserves")
    ingress_replicas: int = _opt(1, "replicas of the HTTP ingress (they share the slot directory)")
    cpus_per_ingress: float = _opt(1.0, "CPUs each ingress replica reserves")
    state_dir: Optional[str] = _opt(None, "per-shard snapshots and incarnation records, and the slot directory "
                                          "(shared storage on a multi-node cluster; none: nothing survives a restart)")
    app_name: str = _opt("kda-serve", "the Serve application name (also names the slot directory actor)")
    ray_address: str = _opt("auto", "the Ray cluster to join (auto: the one this node belongs to)")
    health_check_period_s: float = _opt(2.0, "how often Serve probes each replica (a dead shard restarts after)")
    move_wait_s: float = _opt(10.0, "how long a request for a slot in mid-move waits before answering 503")

    def __post_init__(self) -> None:
        problems = []
        if self.shards < 1:
            problems.append(f"shards must be >= 1, got {self.shards}")
        if self.ingress_replicas < 1:
            problems.append(f"ingress_replicas must be >= 1, got {self.ingress_replicas}")
        for name in ("gpus_per_shard", "cpus_per_shard", "cpus_per_ingress"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.health_check_period_s > 0 or not self.move_wait_s >= 0:
            problems.append("health_check_period_s must be > 0 and move_wait_s >= 0")
        try:
            check_shard_name(f"{self.shard_prefix}-{self.shards - 1}")
        except ValueError as e:
            problems.append(f"shard_prefix: {e}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def shard_names(self) -> list[str]:
        return [f"{self.shard_prefix}-{i}" for i in range(self.shards)]

    @property
    def directory_path(self) -> Optional[str]:
        """Where the slot directory persists its table."""
        return None if self.state_dir is None else os.path.join(self.state_dir, f"{self.app_name}.directory.json")


def build_scale_out_parser(environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """``kda-serve``'s flags plus one per `ScaleOut` field (``KDA_<FLAG>`` as default)."""
    parser = build_parser(environ)
    parser.prog = "kda-serve-ray"
    parser.description = ("Deploy kda-serve on a Ray cluster with Ray Serve: one shard (pool, batcher, kernels) per "
                          "GPU behind an HTTP ingress serving the single server's API. --host/--port are the "
                          "address of Serve's HTTP proxy. Every flag can also be set as KDA_<FLAG>.")
    add_env_flags(parser, ScaleOut, environ)
    return parser


def parse_scale_out(argv: Optional[Sequence[str]] = None,
                    environ: Mapping[str, str] = os.environ) -> tuple[Settings, ScaleOut]:
    """(Settings, ScaleOut) from flags over ``environ`` over defaults; exits with a usage
    message when a value is malformed or out of range, or --snapshot-path is given (each
    shard keeps its own snapshot under --state-dir)."""
    parser = build_scale_out_parser(environ)
    values = vars(parser.parse_args(argv))
    scale_names = {f.name for f in dataclasses.fields(ScaleOut)}
    try:
        settings = Settings(**{k: v for k, v in values.items() if k not in scale_names})
        scale_out = ScaleOut(**{k: v for k, v in values.items() if k in scale_names})
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
    if settings.snapshot_path is not None:
        parser.error("--snapshot-path is per process; with Ray each shard keeps <state-dir>/<shard>.snapshot "
                     "(use --state-dir)")
    if settings.metrics_port:
        parser.error("--metrics-port is the single server's; with Ray scrape the ingress's /metrics (every shard's "
                     "figures, labelled by shard) with the API key")
    return settings, scale_out
