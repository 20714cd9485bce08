"""Prometheus metrics of the KIP-73 partition throttles (`quotas/partition_throttle.py`).

Kafka reports a replication throttle as `kafka.server:type=LeaderReplication,name=byte-rate` (the
shared rate the decision compares with `leader.replication.throttled.rate`); here each throttle
has that rate, its bound, and counters of the record bytes it let through and withheld, labelled
by the throttle's name and topic. The throttle list is bounded (`MAX_PARTITION_THROTTLES`), so are
the series.

As for the quota metrics (`metrics.py`), the figures are read only when Prometheus scrapes:
`refresh` runs on the event loop that owns the throttles (measuring a rate resets expired
samples, so it must not run on the scrape's thread) and `collect` hands out that snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from protocol.topic_names import TopicNames
from quotas.partition_throttle import PartitionThrottles

from .metrics import ENFORCED, SHADOW

_LABELS = ["throttle", "topic"]


class PartitionThrottleCollector(Collector):
    """The partition throttles' figures, from a snapshot taken on the event loop."""

    def __init__(self, throttles: PartitionThrottles, topic_names: TopicNames | None = None) -> None:
        self.throttles = throttles
        self.topic_names = topic_names
        self._families: list[GaugeMetricFamily | CounterMetricFamily] = []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._families

    def refresh(self, now_ms: int | None = None) -> None:
        """Take the snapshot `collect` serves (call on the loop, before each scrape)."""
        now = int(time.monotonic() * 1000) if now_ms is None else now_ms
        rate = GaugeMetricFamily(
            "kthrottle_partition_throttle_byte_rate_bytes_per_second",
            "Record bytes per second let through a partition throttle, the rate its decisions use "
            "(kafka.server:type=LeaderReplication,name=byte-rate)", labels=_LABELS)
        limit = GaugeMetricFamily(
            "kthrottle_partition_throttle_limit_bytes_per_second",
            "The byte rate a partition throttle holds its partitions to "
            "(leader.replication.throttled.rate)", labels=_LABELS)
        let_through = CounterMetricFamily(
            "kthrottle_partition_throttle_let_through_bytes",
            "Record bytes of a partition throttle's partitions sent on to clients", labels=_LABELS)
        withheld = CounterMetricFamily(
            "kthrottle_partition_throttle_withheld_bytes",
            "Record bytes of a partition throttle's partitions emptied from Fetch responses while it "
            "was over its rate (the client fetches them again); mode=\"shadow\": would have been, in shadow",
            labels=[*_LABELS, "mode"])
        withheld_partitions = CounterMetricFamily(
            "kthrottle_partition_throttle_withheld_partitions",
            "Partitions emptied from Fetch responses by a partition throttle", labels=[*_LABELS, "mode"])
        for stats in self.throttles.stats(now):
            values = [stats.name, stats.topic]
            rate.add_metric(values, stats.rate)
            limit.add_metric(values, stats.byte_rate)
            let_through.add_metric(values, stats.let_through_bytes)
            withheld.add_metric([*values, ENFORCED], stats.withheld_bytes)
            withheld_partitions.add_metric([*values, ENFORCED], stats.withheld_partitions)
            if stats.shadow_withheld_partitions:
                withheld.add_metric([*values, SHADOW], stats.shadow_withheld_bytes)
                withheld_partitions.add_metric([*values, SHADOW], stats.shadow_withheld_partitions)
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            rate, limit, let_through, withheld, withheld_partitions]
        if self.topic_names is not None:
            unknown = GaugeMetricFamily(
                "kthrottle_partition_throttle_topic_id_unknown",
                "1 while no Metadata response has told the proxy this throttled topic's id: its "
                "partitions go through Fetch v13+ responses unthrottled until one does", labels=["topic"])
            missing = set(self.topic_names.unknown(self.throttles.topics))
            for topic in sorted(self.throttles.topics):
                unknown.add_metric([topic], 1.0 if topic in missing else 0.0)
            families.append(unknown)
        self._families = families


def register_partition_throttle_metrics(registry: CollectorRegistry, throttles: PartitionThrottles,
                                        topic_names: TopicNames | None = None) -> PartitionThrottleCollector:
    """Create the collector on the proxy's registry (`ProxyMetrics.registry`) and return it."""
    collector = PartitionThrottleCollector(throttles, topic_names)
    registry.register(collector)
    return collector


__all__ = ["PartitionThrottleCollector", "register_partition_throttle_metrics"]
