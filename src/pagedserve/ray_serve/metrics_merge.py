"""One Prometheus scrape out of every replica's own: each replica's series gain a `replica`
label and the families are merged, so that a name's HELP and TYPE appear once. No Ray here."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_replica_metrics(texts: dict[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """The exposition of every replica's metrics text (replica id -> text), labelled by replica,
    followed by `extra` families (the front door's own)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            merged.samples += [
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), *extra]))
    return generate_latest(registry)
