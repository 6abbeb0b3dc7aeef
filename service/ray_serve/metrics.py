"""One Prometheus page for a sharded deployment: the families the ingress counts itself (HTTP
``kda_http_*`` from the single server's `MetricsMiddleware`, responses abandoned by their
clients, prefix misses no shard saw, prefix hits and hit tokens of restores whose bytes moved
between shards) and every shard's pool, batch, kernel and prefix
families with a ``shard`` label added (a family both count has both sets of samples: the
ingress's without the label)."""
from __future__ import annotations

from typing import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

HTTP_PREFIX = "kda_http"
INGRESS_FAMILIES = (HTTP_PREFIX, "kda_responses_abandoned", "kda_prefix_misses", "kda_prefix_hit")
"""Families (by name prefix) the ingress's own `service.core.metrics.Metrics` counts."""


class _Families:
    """A collector that yields fixed metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_metrics(ingress: bytes, shards: Mapping[str, bytes]) -> bytes:
    """The exposition of ``ingress``'s own families (`INGRESS_FAMILIES`) and each shard's
    families but the HTTP ones, their samples labelled ``shard="<name>"``."""
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(ingress.decode("utf-8")):
        if family.name.startswith(INGRESS_FAMILIES):
            families[family.name] = family
    for shard, text in shards.items():
        for family in text_string_to_metric_families(text.decode("utf-8")):
            if family.name.startswith(HTTP_PREFIX):
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "shard": shard}, sample.value, sample.timestamp,
                                  sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry)
