"""Prometheus metrics of one server, on its own registry (no global state: several apps,
e.g. in tests, never share or clash), with the process's own figures (CPU, memory, open
files, garbage collection, Python version) in the same registry."""
from __future__ import annotations

from importlib import metadata
from typing import Callable, Iterator, Mapping

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, GCCollector, Histogram, Info,
    PlatformCollector, ProcessCollector, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from state_store import Persistence, PoolStats, TierStats

from ..version import __version__

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)

CONTENT_TYPE = CONTENT_TYPE_LATEST

UNMATCHED_ROUTE = "unmatched"
"""The route label of an HTTP request no route matched, or that none saw (`Metrics.refused_request`)."""


def build_info(backend: str, device: torch.device) -> dict[str, str]:
    """The labels of ``kda_build_info``: kda-serve's version, the triton version installed
    ("none" when not), the kernel backend and the serving device."""
    return {"version": __version__, "backend": backend, "device": str(device), "triton": _version("triton", "none")}


def _version(distribution: str, missing: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return missing


class _PoolGauges(Collector):
    """The pool's capacity, used and state_lost slots, read through one ``stats()`` call
    per scrape."""

    def __init__(self, stats: Callable[[], PoolStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.stats()
        yield GaugeMetricFamily("kda_pool_slots", "Slots in the pool (its capacity)", value=stats.capacity)
        yield GaugeMetricFamily("kda_used_slots", "Live slots", value=stats.used)
        yield GaugeMetricFamily("kda_state_lost_slots", "Live slots flagged state_lost (their state was not "
                                "recovered after a crash)", value=stats.state_lost)


class _JournalFigures(Collector):
    """The pool journal's size and compactions, read from its `Persistence` per scrape."""

    def __init__(self, persistence: Persistence) -> None:
        self.persistence = persistence

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("kda_journal_bytes", "Bytes in the pool's journal (the changes since the latest "
                                "snapshot; compacted to their net effect past a bound)",
                                value=self.persistence.journal_size)
        yield CounterMetricFamily("kda_journal_compactions", "Times the pool's journal was rewritten as its net "
                                  "effect", value=self.persistence.compactions)


class Metrics:
    """The server's metrics: HTTP requests and errors by route and status (those the HTTP
    protocol refused before any route included), requests in flight, gRPC requests by
    method and status, framed socket requests by op and status, prefill tokens, launch
    sizes, time queued before a launch and time in the kernel, free slots, expired slots,
    abandoned responses, snapshots (and, with `watch_journal`, the journal's size and
    compactions), the prefix cache's hits, misses, hit tokens, evictions,
    entries and bytes per tier, and the process's collectors. A core with a pool adds its
    gauges and build information (`add_pool`)."""

    def __init__(self, free_slots: Callable[[], float]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kda_http_requests", "HTTP requests by route, method and status (route "
                                "unmatched: none matched, or the HTTP protocol refused the request before routing)",
                                ["route", "method", "status"], registry=r)
        self.errors = Counter("kda_http_errors", "HTTP responses with status >= 400, by route and status",
                              ["route", "method", "status"], registry=r)
        self.latency = Histogram("kda_http_request_seconds", "HTTP request latency by route",
                                 ["route", "method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.grpc_requests = Counter("kda_grpc_requests", "gRPC requests by method and status code (each request "
                                     "of a ModelStreamInfer stream counts once)", ["method", "status"], registry=r)
        self.grpc_latency = Histogram("kda_grpc_request_seconds", "gRPC request latency by method",
                                      ["method"], buckets=_LATENCY_BUCKETS, registry=r)
        self.framed_requests = Counter("kda_framed_requests", "Framed socket requests by op and status",
                                       ["op", "status"], registry=r)
        self.framed_latency = Histogram("kda_framed_request_seconds", "Framed socket request latency by op",
                                        ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prepared = Gauge("kda_prepared_prefills", "Prepared prefills held (framed socket PREPARE, not yet "
                              "released)", registry=r)
        self.tokens = Counter("kda_prefill_tokens", "Tokens prefilled", registry=r)
        self.sequences = Counter("kda_prefill_sequences", "Sequences prefilled", registry=r)
        self.batch_requests = Histogram("kda_batch_requests", "Requests merged into one kernel launch (a prepared "
                                        "run: 1)", buckets=_COUNT_BUCKETS, registry=r)
        self.batch_sequences = Histogram("kda_batch_sequences", "Sequences in one kernel launch",
                                         buckets=_COUNT_BUCKETS, registry=r)
        self.batch_tokens = Histogram("kda_batch_tokens", "Tokens in one kernel launch",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.queue_seconds = Histogram("kda_queue_seconds", "Time a prefill waited in the batcher before its launch",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.kernel_seconds = Histogram("kda_kernel_seconds", "Time of one kernel launch (of the batcher, or a "
                                        "prepared run): inputs to the device, kernel, outputs to the host",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.expired = Counter("kda_slots_expired", "Slots freed for idling past --slot-ttl-s", registry=r)
        self.abandoned = Counter("kda_responses_abandoned", "Responses whose client left before receiving them; "
                                 "the slots they created were freed", registry=r)
        self.snapshots = Counter("kda_snapshots", "Pool snapshots written (periodic and at shutdown)", registry=r)
        self.snapshot_failures = Counter("kda_snapshot_failures", "Pool snapshots that could not be written",
                                         registry=r)
        self.snapshot_generation = Gauge("kda_snapshot_generation", "Generation of the latest snapshot written "
                                         "or restored (0: none); also one whose file was renamed in before "
                                         "the snapshot failed (it may be the file on disk)", registry=r)
        self.free_slots = Gauge("kda_free_slots", "Free slots in the pool", registry=r)
        self.free_slots.set_function(free_slots)
        self.in_flight = Gauge("kda_http_requests_in_flight", "HTTP requests received and not yet answered in full",
                               registry=r)
        self.prefix_hits = Counter("kda_prefix_hits", "Slot allocations with a prefix that matched an entry", registry=r)
        self.prefix_misses = Counter("kda_prefix_misses", "Slot allocations with a prefix that matched none",
                                     registry=r)
        self.prefix_hit_tokens = Counter("kda_prefix_hit_tokens", "Tokens per layer restored from prefix entries, "
                                         "summed over the slots restored", registry=r)
        self.prefix_evictions = Counter("kda_prefix_evictions", "Prefix entries that left a tier for lack of room "
                                        "(device: moved to the host tier or dropped; host: dropped)", ["tier"],
                                        registry=r)
        self.prefix_entries = Gauge("kda_prefix_entries", "Prefix cache entries held, by tier", ["tier"], registry=r)
        self.prefix_bytes = Gauge("kda_prefix_bytes", "Bytes of prefix cache entries, by tier", ["tier"], registry=r)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def add_pool(self, stats: Callable[[], PoolStats], build: Mapping[str, str]) -> None:
        """Serve the gauges of the pool whose `PoolStats` ``stats`` reads (``kda_pool_slots``,
        ``kda_used_slots``, ``kda_state_lost_slots``) and ``kda_build_info{build}`` (1)."""
        self.registry.register(_PoolGauges(stats))
        Info("kda_build", "kda-serve version, kernel backend, device and triton version", registry=self.registry
             ).info(dict(build))

    def watch_prefix_cache(self, stats: Callable[[], Mapping[str, TierStats]]) -> None:
        """Read the prefix cache's entries and bytes per tier from ``stats`` at each scrape."""
        for tier in ("device", "host"):
            self.prefix_entries.labels(tier).set_function(lambda tier=tier: stats()[tier].entries)
            self.prefix_bytes.labels(tier).set_function(lambda tier=tier: stats()[tier].bytes)
            self.prefix_evictions.labels(tier)  # present at 0 before the first eviction

    def watch_journal(self, persistence: Persistence) -> None:
        """Serve ``kda_journal_bytes`` and ``kda_journal_compactions_total`` of ``persistence``."""
        self.registry.register(_JournalFigures(persistence))

    def prepared_launch(self, sequences: int, tokens: int, seconds: float) -> None:
        """One launch of a prepared run of ``sequences`` sequences and ``tokens`` tokens that
        took ``seconds``: a launch of one request in ``kda_batch_requests``,
        ``kda_batch_sequences``, ``kda_batch_tokens`` and ``kda_kernel_seconds``, as the
        batcher counts its launches (refused or not)."""
        self.batch_requests.observe(1)
        self.batch_sequences.observe(sequences)
        self.batch_tokens.observe(tokens)
        self.kernel_seconds.observe(seconds)

    def refused_request(self, status: int, method: str) -> None:
        """An HTTP request the protocol answered ``status`` before any route saw it (it could
        not be parsed, or went past a connection limit), counted in ``kda_http_requests`` and
        ``kda_http_errors`` under the route `UNMATCHED_ROUTE`; ``method``: its request
        line's, ``unknown`` when the protocol did not read that far."""
        self.requests.labels(UNMATCHED_ROUTE, method, str(status)).inc()
        self.errors.labels(UNMATCHED_ROUTE, method, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
