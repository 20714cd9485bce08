"""Metrics of client connections before they are served: Kafka's socket-server connection metrics.

Kafka names them `connection-accept-rate` (per listener, and `broker-connection-accept-rate`),
`connection-accept-throttle-time`, `ip-connection-accept-throttle-time`; here:

- `kthrottle_connection_accept_rate{listener}`: `connection-accept-rate` per listener;
- `kthrottle_proxy_connection_accept_rate`: `broker-connection-accept-rate`;
- `kthrottle_ip_connection_creation_rate{ip}` and `..._limit{ip}`: the per-IP sensor and its quota;
- `kthrottle_connections_throttled_total{reason,listener}`: `ip_quota` (accepted, closed after the
  throttle), `listener_rate` / `proxy_rate` (the accept was delayed);
- `kthrottle_connection_accept_throttle_seconds_total{reason,listener}`: `connection-accept-throttle-time`;
- `kthrottle_connections_refused_total{reason}`: closed at once, by `max_connections`,
  `max_connections_per_ip`, `max_connections_per_ip_overrides` or `proxy_header`;
- `kthrottle_connections_peer_waits_total{listener}`: in a fleet, times a new connection waited for
  the peers' next report before its IP quota was checked again (quotas/connection_quotas.py's
  HEADROOM_SHARE; Kafka has no fleet);
- `kthrottle_throttled_connections{listener}`: `ip_quota` connections accepted and waiting to be
  closed (Kafka's Acceptor `throttledSockets`, which has no metric), and
  `kthrottle_throttled_connections_closed_early_total`: those closed at once because
  `max_connections` already waited (Kafka's queue has no bound).

The per-IP series are capped like the quota series (`metrics_max_entities`): the busiest buckets
are named, the rest fold into `ip="__other__"`. The rates are measured on the event loop that owns
the connection quotas (`refresh`, before each scrape); `collect` only hands out that snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from quotas.connection_quotas import ConnectionQuotas
from quotas.throttled_sockets import ThrottledSockets

#: Why a connection was closed at once (the first word of the refusal), all exported from the start
#: so an alert sees the first refusal as an increase.
REFUSAL_REASONS = ("max_connections", "max_connections_per_ip", "max_connections_per_ip_overrides",
                   "proxy_header")
OTHER = "__other__"


class ConnectionMetrics(Collector):
    """Counters the acceptors update, plus the connection quotas' rates read at each scrape."""

    def __init__(self, registry: CollectorRegistry, quotas: ConnectionQuotas, refused: Counter,
                 max_entities: int, *, throttled_sockets: ThrottledSockets[Any] | None = None) -> None:
        self.quotas = quotas
        self.throttled_sockets = throttled_sockets
        self.max_entities = max_entities
        self._refused = refused
        for reason in REFUSAL_REASONS:
            refused.labels(reason)
        self._throttled = Counter(
            "kthrottle_connections_throttled",
            "New connections throttled: ip_quota (accepted, never served, closed after the throttle), "
            "listener_rate / proxy_rate (the accept loop waited)", ["reason", "listener"], registry=registry)
        self._delay = Counter(
            "kthrottle_connection_accept_throttle_seconds",
            "Time accept loops waited for the connection-creation rates (Kafka's "
            "connection-accept-throttle-time)", ["reason", "listener"], registry=registry)
        self._peer_waits = Counter(
            "kthrottle_connections_peer_waits",
            "Times a new connection waited for the fleet's peers' next report before its ip quota was "
            "checked again (its member had used its part of the headroom)", ["listener"], registry=registry)
        self.accept_errors = Counter("kthrottle_accept_errors", "accept() calls that failed (out of "
                                     "descriptors, ...)", registry=registry)
        self._families: list[GaugeMetricFamily | CounterMetricFamily] = []
        registry.register(self)

    # -- what the acceptors report --------------------------------------------------------------

    def listener_started(self, listener: str) -> None:
        """Export the listener's throttle series at 0 from the start (an alert on their increase
        then sees the first throttle, and a dashboard has its series before any)."""
        for reason in ("ip_quota", "listener_rate", "proxy_rate"):
            self._throttled.labels(reason, listener)
        for reason in ("listener_rate", "proxy_rate"):
            self._delay.labels(reason, listener)
        self._peer_waits.labels(listener)

    def refused(self, reason: str) -> None:
        self._refused.labels(reason).inc()

    def throttled(self, reason: str, listener: str) -> None:
        self._throttled.labels(reason, listener).inc()

    def peer_wait(self, listener: str) -> None:
        self._peer_waits.labels(listener).inc()

    def accept_delayed(self, listener: str, reason: str | None, delay_ms: int) -> None:
        why = reason or "listener_rate"
        self._throttled.labels(why, listener).inc()
        self._delay.labels(why, listener).inc(delay_ms / 1000.0)

    # -- the scrape ----------------------------------------------------------------------------

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._families

    def refresh(self, now_ms: int | None = None) -> None:
        """Measure the rates (on the event loop that owns the connection quotas)."""
        now = int(time.monotonic() * 1000) if now_ms is None else now_ms
        quotas = self.quotas
        accept = GaugeMetricFamily("kthrottle_connection_accept_rate", "New connections per second on "
                                   "each listener (Kafka's connection-accept-rate)", labels=["listener"])
        for listener in sorted(quotas.listeners):
            accept.add_metric([listener], quotas.listener_rate(listener, now))
        proxy_rate = GaugeMetricFamily("kthrottle_proxy_connection_accept_rate",
                                       "New connections per second on all listeners together "
                                       "(Kafka's broker-connection-accept-rate)")
        proxy_rate.add_metric([], quotas.broker_rate.measure(now))
        ip_rate = GaugeMetricFamily("kthrottle_ip_connection_creation_rate",
                                    "New connections per second of each ip bucket (an address, or a CIDR "
                                    "entity's whole prefix), with peers' in a fleet", labels=["ip"])
        ip_limit = GaugeMetricFamily("kthrottle_ip_connection_creation_limit",
                                     "The connection_creation_rate in force for each ip bucket",
                                     labels=["ip"])
        measured = sorted(((usage.rate, usage.bucket) for usage in quotas.ip_usage(now)), reverse=True)
        bounds = {key: bucket.bound for key, bucket in quotas.buckets.items()}
        other = 0.0
        for index, (rate, bucket) in enumerate(measured):
            if index >= self.max_entities:
                other += rate
                continue
            ip_rate.add_metric([bucket], rate)
            bound = bounds.get(bucket)
            if bound is not None:
                ip_limit.add_metric([bucket], bound)
        if len(measured) > self.max_entities:
            ip_rate.add_metric([OTHER], other)
        buckets = GaugeMetricFamily("kthrottle_ip_connection_buckets", "Live ip buckets (bounded by "
                                    "max_quota_buckets; past it, <default> addresses share an overflow "
                                    "bucket)")
        buckets.add_metric([], quotas.live_buckets)
        overflow = CounterMetricFamily("kthrottle_ip_connection_bucket_overflow",
                                       "Connections charged to the shared overflow ip bucket")
        overflow.add_metric([], quotas.overflow_charges)
        self._families = [accept, proxy_rate, ip_rate, ip_limit, buckets, overflow]
        held = self.throttled_sockets
        if held is not None:
            waiting = GaugeMetricFamily("kthrottle_throttled_connections", "Connections over their "
                                        "address's connection_creation_rate, accepted, never read, waiting "
                                        "to be closed after their throttle", labels=["listener"])
            for listener in sorted(quotas.listeners):
                waiting.add_metric([listener], held.held(listener))
            early = CounterMetricFamily("kthrottle_throttled_connections_closed_early",
                                        "Throttled connections closed at once, max_connections of them "
                                        "already waiting to be closed")
            early.add_metric([], held.closed_early)
            self._families += [waiting, early]


__all__ = ["REFUSAL_REASONS", "ConnectionMetrics"]
