"""Prometheus metrics: traffic per API from the I/O layer, quota state read from the engine.

Per-entity quota figures are read from the engine only when Prometheus scrapes, so they cost
nothing per request. Each maps to the broker metric Kafka users know (see README "Metrics").
Label cardinality is bounded: per quota type at most `max_entities` (user, client-id) series;
the rest are folded into one series labelled "__other__".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.apis import api_name
from quotas.engine import QuotaEngine
from quotas.entity import client_id_label
from quotas.manager import Bucket
from quotas.types import QuotaType

OTHER = "__other__"

#: The `mode` label of the throttle counters: applied, or computed and reported only (shadow).
ENFORCED = "enforced"
SHADOW = "shadow"

#: name, help and unit conversion of the measured rate, per quota type
_RATE_FAMILIES: dict[QuotaType, tuple[str, str]] = {
    QuotaType.PRODUCE: ("kthrottle_produce_byte_rate_bytes_per_second",
                        "Produce bytes per second per quota bucket (kafka.server:type=Produce byte-rate)"),
    QuotaType.FETCH: ("kthrottle_fetch_byte_rate_bytes_per_second",
                      "Fetch bytes per second per quota bucket (kafka.server:type=Fetch byte-rate)"),
    QuotaType.REQUEST: ("kthrottle_request_time_percent",
                        "Request time as % of one thread per quota bucket (kafka.server:type=Request "
                        "request-time); a proxy-side approximation, see README"),
    QuotaType.CONTROLLER_MUTATION: ("kthrottle_controller_mutation_rate_per_second",
                                    "Partitions created, added or deleted per second per quota bucket "
                                    "(kafka.server:type=ControllerMutation mutation-rate)"),
    QuotaType.PRODUCER_IDS: ("kthrottle_producer_id_rate_per_second",
                             "New producer ids per second per user (KIP-936 draft)"),
}


def _monotonic_ms() -> int:
    return int(time.monotonic() * 1000)


#: Buckets read per slice of a scrape's snapshot; the loop serves other connections in between.
SNAPSHOT_SLICE = 2000


def _throttle_avg_max(bucket: Bucket, now_ms: int) -> tuple[float, float]:
    """Kafka's throttle-time avg and max (ms) over the window."""
    throttle = bucket.throttle
    if throttle is None:
        return 0.0, 0.0
    return throttle.average(now_ms), throttle.maximum(now_ms)


class QuotaCollector(Collector):
    """The quota buckets' figures, from a snapshot the event loop takes before each scrape.

    The loop owns the buckets; `refresh` (a coroutine on the loop) reads them in slices and
    builds finished metric families, and `collect` (called by prometheus-client's formatter, on
    any thread) only hands those out. A scrape therefore never reads a dict while it changes.
    """

    def __init__(self, engine: QuotaEngine, max_entities: int) -> None:
        self.engine = engine
        self.max_entities = max_entities
        self._families: list[GaugeMetricFamily | CounterMetricFamily] = []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._families

    async def refresh(self) -> None:
        """Take the snapshot `collect` serves (call on the event loop that owns the engine)."""
        labels = ["quota", "user", "client_id"]
        limit = GaugeMetricFamily("kthrottle_quota_limit",
                                  "The quota bound in force, in the quota's own unit", labels=labels)
        throttle_avg = GaugeMetricFamily(
            "kthrottle_throttle_time_avg_seconds",
            "Average throttle time over the quota window (kafka.server throttle-time avg)", labels=labels)
        throttle_max = GaugeMetricFamily(
            "kthrottle_throttle_time_max_seconds",
            "Largest throttle time over the quota window (kafka.server throttle-time max)", labels=labels)
        # mode: "enforced", or "shadow" for throttles computed and reported only (quotas/shadow.py)
        throttle_total = CounterMetricFamily(
            "kthrottle_throttle_time_seconds", "Throttle time decided by each quota",
            labels=[*labels, "mode"])
        throttles = CounterMetricFamily(
            "kthrottle_throttles", "Responses throttled by each quota", labels=[*labels, "mode"])
        rates = {quota_type: GaugeMetricFamily(name, text, labels=labels)
                 for quota_type, (name, text) in _RATE_FAMILIES.items()}
        tokens = GaugeMetricFamily(
            "kthrottle_controller_mutation_tokens",
            "Partitions the controller mutation token bucket holds, negative in debt "
            "(kafka.server:type=ControllerMutation tokens)", labels=["user", "client_id"])
        mutations = self.engine.controller_mutation
        fleet = self.engine.fleet  # in a fleet: the rate decided on (this bucket's + its peers') beside it
        fleet_rates: dict[QuotaType, GaugeMetricFamily] = {} if fleet is None else {
            quota_type: GaugeMetricFamily(name.replace("kthrottle_", "kthrottle_fleet_", 1),
                                          f"{text}, over the whole fleet (this member's + its peers')",
                                          labels=labels)
            for quota_type, (name, text) in _RATE_FAMILIES.items()
            if quota_type is not QuotaType.CONTROLLER_MUTATION}  # its rate is this proxy's (tokens: fleet)
        for quota_type, manager in self.engine.all_managers().items():
            folded: dict[str, float] = {}
            view = None if fleet is None or quota_type not in fleet_rates else fleet.view(quota_type)
            # Buckets that come or go while the slices are read wait for the next scrape.
            items = list(manager.buckets.items())
            for start in range(0, len(items), SNAPSHOT_SLICE):
                if start:
                    await asyncio.sleep(0)
                now = _monotonic_ms()
                for index in range(start, min(start + SNAPSHOT_SLICE, len(items))):
                    key, bucket = items[index]
                    rate = bucket.rate.measure(now)
                    fleet_rate = rate if view is None else rate + view.rate(key, now)
                    avg, peak = _throttle_avg_max(bucket, now)
                    if index >= self.max_entities:
                        folded["rate"] = folded.get("rate", 0.0) + rate
                        folded["fleet"] = folded.get("fleet", 0.0) + fleet_rate
                        folded["max"] = max(folded.get("max", 0.0), peak / 1000.0)
                        folded["total"] = folded.get("total", 0.0) + bucket.throttle_total_ms / 1000.0
                        folded["count"] = folded.get("count", 0.0) + bucket.throttle_count
                        folded["shadow_total"] = (folded.get("shadow_total", 0.0)
                                                  + bucket.shadow_throttle_total_ms / 1000.0)
                        folded["shadow_count"] = (folded.get("shadow_count", 0.0)
                                                  + bucket.shadow_throttle_count)
                        continue
                    # a client-id prefix's bucket shows as `etl-*` (entity.client_id_label)
                    values = [quota_type.value, key.user, client_id_label(key.client_id)]
                    rates[quota_type].add_metric(values, rate)
                    if view is not None:
                        fleet_rates[quota_type].add_metric(values, fleet_rate)
                    if bucket.applies:
                        limit.add_metric(values, bucket.bound)
                    throttle_avg.add_metric(values, avg / 1000.0)
                    throttle_max.add_metric(values, peak / 1000.0)
                    throttle_total.add_metric([*values, ENFORCED], bucket.throttle_total_ms / 1000.0)
                    throttles.add_metric([*values, ENFORCED], bucket.throttle_count)
                    if bucket.shadow_throttle_count:
                        throttle_total.add_metric([*values, SHADOW], bucket.shadow_throttle_total_ms / 1000.0)
                        throttles.add_metric([*values, SHADOW], bucket.shadow_throttle_count)
                    if manager is mutations and bucket.applies:
                        tokens.add_metric(values[1:], mutations.tokens(bucket, now))
            if folded:
                values = [quota_type.value, OTHER, OTHER]
                rates[quota_type].add_metric(values, folded["rate"])
                if view is not None:
                    fleet_rates[quota_type].add_metric(values, folded["fleet"])
                throttle_max.add_metric(values, folded["max"])
                throttle_total.add_metric([*values, ENFORCED], folded["total"])
                throttles.add_metric([*values, ENFORCED], folded["count"])
                if folded["shadow_count"]:
                    throttle_total.add_metric([*values, SHADOW], folded["shadow_total"])
                    throttles.add_metric([*values, SHADOW], folded["shadow_count"])
        buckets = GaugeMetricFamily("kthrottle_quota_buckets",
                                    "Live quota buckets per quota type (bounded by max_quota_buckets)",
                                    labels=["quota"])
        cap = GaugeMetricFamily("kthrottle_quota_buckets_max",
                                "max_quota_buckets: live buckets a quota type may hold", labels=["quota"])
        overflow = CounterMetricFamily(
            "kthrottle_quota_bucket_overflow",
            "Charges to the shared overflow bucket because max_quota_buckets was reached", labels=["quota"])
        dropped = CounterMetricFamily(
            "kthrottle_quota_buckets_dropped",
            "Quota buckets dropped: 'expired' once their window passed with nothing to keep, 'evicted' "
            "(dormant ones, history already gone) to make room under max_quota_buckets",
            labels=["quota", "why"])
        for quota_type, manager in self.engine.all_managers().items():
            buckets.add_metric([quota_type.value], len(manager.buckets))
            if manager.max_buckets is not None:
                cap.add_metric([quota_type.value], manager.max_buckets)
            overflow.add_metric([quota_type.value], manager.overflow_charges)
            dropped.add_metric([quota_type.value, "expired"], manager.expired_buckets)
            dropped.add_metric([quota_type.value, "evicted"], manager.evicted_buckets)
        self._families = [*rates.values(), *fleet_rates.values(), tokens, limit, throttle_avg, throttle_max,
                          throttle_total, throttles, buckets, cap, overflow, dropped]


class ProxyMetrics:
    """The proxy's own metrics, in one registry (so tests and embedding stay isolated)."""

    def __init__(self, engine: QuotaEngine, max_entities: int = 1000,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.connections = Gauge("kthrottle_connections", "Open client connections", registry=r)
        self.muted = Gauge("kthrottle_muted_connections",
                           "Client connections not being read while a throttle passes "
                           "(kafka.network queue of throttled channels)", registry=r)
        self.requests = Counter("kthrottle_requests", "Requests forwarded, per API", ["api"], registry=r)
        self.request_bytes = Counter("kthrottle_request_bytes", "Request bytes from clients, per API",
                                     ["api"], registry=r)
        self.response_bytes = Counter("kthrottle_response_bytes", "Response bytes to clients, per API",
                                      ["api"], registry=r)
        self.latency = Histogram("kthrottle_upstream_latency_seconds",
                                 "Time from forwarding a request to its broker response, per API", ["api"],
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                          1.0, 2.5, 5.0, 10.0), registry=r)
        self.throttled = Counter("kthrottle_throttled_responses", "Responses the proxy throttled, per API",
                                 ["api"], registry=r)
        self.upstream_up = Gauge("kthrottle_upstream_up",
                                 "1 while at least one upstream broker answers ApiVersions, else 0",
                                 registry=r)
        self.refused = Counter("kthrottle_connections_refused",
                               "Client connections closed at once, by the limit they were over",
                               ["reason"], registry=r)
        self.closed = Counter("kthrottle_connections_closed",
                              "Client connections the proxy closed, by why", ["reason"], registry=r)
        self.queued_request_bytes = Gauge(
            "kthrottle_queued_request_bytes",
            "Request bytes held by all connections (bounded by queued_max_request_bytes)", registry=r)
        self.memory_waiting = Gauge(
            "kthrottle_memory_waiting_connections",
            "Connections not being read until queued_max_request_bytes has room", registry=r)
        self.quotas = QuotaCollector(engine, max_entities)
        r.register(self.quotas)
        self._children: dict[int, tuple[Counter, Counter, Counter, Histogram]] = {}

    def exchange(self, api_key: int, request_bytes: int, response_bytes: int, latency_ms: float) -> None:
        """One request answered (called by the connection; label children are cached)."""
        children = self._children.get(api_key)
        if children is None:
            name = api_name(api_key)
            children = (self.requests.labels(name), self.request_bytes.labels(name),
                        self.response_bytes.labels(name), self.latency.labels(name))
            self._children[api_key] = children
        children[0].inc()
        children[1].inc(request_bytes)
        children[2].inc(response_bytes)
        children[3].observe(latency_ms / 1000.0)
