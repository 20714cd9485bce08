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

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from config.settings import Address
from protocol.topic_names import TopicNames
from quotas.partition_throttle import PartitionThrottles

from .discovery import fetch_topic_ids

log = logging.getLogger("kthrottle.partition_throttles")

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
            "was over its rate (the client fetches them again)", labels=_LABELS)
        withheld_partitions = CounterMetricFamily(
            "kthrottle_partition_throttle_withheld_partitions",
            "Partitions emptied from Fetch responses by a partition throttle", labels=_LABELS)
        for stats in self.throttles.stats(now):
            values = [stats.name, stats.topic]
            rate.add_metric(values, stats.rate)
            limit.add_metric(values, stats.byte_rate)
            let_through.add_metric(values, stats.let_through_bytes)
            withheld.add_metric(values, stats.withheld_bytes)
            withheld_partitions.add_metric(values, stats.withheld_partitions)
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


#: How often the proxy asks the cluster for the ids of throttled topics it does not know yet.
TOPIC_ID_LOOKUP_INTERVAL_S = 5.0


class TopicIdResolver:
    """Learns the ids of throttled topics from the cluster itself (Metadata v10, no topic created).

    Fetch v13+ names topics by id and the operator names them: without this, a throttle added
    while a consumer runs (or after a restart) would apply from that consumer's next metadata
    refresh only, up to `metadata.max.age.ms` (5 minutes) later. On listeners that need
    authentication the lookup fails (the proxy holds no credentials) and the ids come from the
    clients' own Metadata responses, as before; that is logged once.
    """

    def __init__(self, upstream: list[Address], tls: Callable[[], ssl.SSLContext | None],
                 throttles: PartitionThrottles, topic_names: TopicNames) -> None:
        self._upstream = upstream
        self._tls = tls
        self._throttles = throttles
        self._names = topic_names
        self._task: asyncio.Task[None] | None = None
        self._next_s = 0.0
        self._warned = False

    def poll(self, now_s: float) -> None:
        """Start a lookup when a throttled topic's id is unknown (at most one per interval)."""
        if (self._task is not None and not self._task.done()) or now_s < self._next_s:
            return
        unknown = self._names.unknown(self._throttles.topics)
        if not unknown:
            return
        self._next_s = now_s + TOPIC_ID_LOOKUP_INTERVAL_S
        self._task = asyncio.get_running_loop().create_task(self._resolve(unknown))

    async def _resolve(self, topics: list[str]) -> None:
        try:
            found = await fetch_topic_ids(self._upstream, topics, self._tls())
        except ConnectionError as exc:
            if not self._warned:
                self._warned = True
                log.info("cannot read the ids of throttled topics from the cluster (%s): they are learned "
                         "from clients' Metadata responses instead", exc)
            return
        for name, topic_id in found.items():
            self._names.learn(topic_id, name)
