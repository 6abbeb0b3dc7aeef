"""One Prometheus page for a sharded deployment: the ingress's HTTP families (``kda_http_*``,
from the single server's `MetricsMiddleware`) and every shard's pool, batch and kernel
families with a ``shard`` label added."""
from __future__ import annotations

from typing import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

HTTP_PREFIX = "kda_http"


class _Families:
    """A collector that yields fixed metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_metrics(ingress: bytes, shards: Mapping[str, bytes]) -> bytes:
    """The exposition of ``ingress``'s HTTP families and each shard's other families,
    their samples labelled ``shard="<name>"``."""
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(ingress.decode("utf-8")):
        if family.name.startswith(HTTP_PREFIX):
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
