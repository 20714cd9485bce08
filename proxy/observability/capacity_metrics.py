"""Prometheus metrics of the cluster capacity: what it is, what is in force, and who gets what.

Read from the capacity manager when Prometheus scrapes (nothing per request). Per tenant and
direction: its demand as estimated, its fleet-wide rate, its fair share while the capacity binds,
its weight, and the throttles the capacity decided (counted apart from the quotas' throttles,
`kthrottle_throttles_total`). At most `max_entities` tenants per direction get their own
series; the rest are folded into "__other__", as the quota metrics are. The adaptive factor comes
with the reason of its latest change and the brokers' latency baselines it is judged against.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from quotas.adaptive_capacity import API_NAMES, REASONS, AdaptiveCapacity, FactorChange
from quotas.capacity import CapacityManager
from quotas.entity import client_id_label

from .metrics import ENFORCED, SHADOW

OTHER = "__other__"
#: the reason label of a change brought by a peer's lower factor
FLEET = "fleet"

_Family = GaugeMetricFamily | CounterMetricFamily


class CapacityMetrics(Collector):
    """The capacity's figures (a Collector), plus counters of the factor's changes."""

    def __init__(self, registry: CollectorRegistry, capacity: CapacityManager,
                 controller: AdaptiveCapacity | None, max_entities: int) -> None:
        self.capacity = capacity
        self.controller = controller
        self.max_entities = max_entities
        self.changes = Counter("kthrottle_capacity_factor_changes",
                               "Changes of the adaptive capacity factor, by the signal behind them",
                               ["reason"], registry=registry)
        for reason in (*REASONS, FLEET):
            self.changes.labels(reason)
        self._families: list[_Family] = []
        registry.register(self)

    def own_change(self, change: FactorChange) -> None:
        self.changes.labels(change.reason).inc()

    def factor_changed(self, old: float, new: float) -> None:
        """The factor in force moved; a move this member's controller did not make is a peer's."""
        if self.controller is None or self.controller.factor != new:
            self.changes.labels(FLEET).inc()

    def collect(self) -> Iterator[_Family]:
        yield from self._families

    def refresh(self, now_ms: int) -> None:
        """Take the snapshot `collect` serves (on the event loop that owns the capacity)."""
        capacity = self.capacity
        config = capacity.config
        families: list[_Family] = []
        direction_labels = ["quota"]
        static = GaugeMetricFamily("kthrottle_capacity", "The configured cluster capacity per direction "
                                   "(the [capacity] table), in the quota's unit", labels=direction_labels)
        effective = GaugeMetricFamily("kthrottle_capacity_effective",
                                      "The capacity in force: configured (or learned) x the adaptive factor",
                                      labels=direction_labels)
        total = GaugeMetricFamily("kthrottle_capacity_rate_total",
                                  "Fleet-wide rate of all tenants, per direction", labels=direction_labels)
        contended = GaugeMetricFamily("kthrottle_capacity_contended",
                                      "1 while the capacity binds (some tenant gets less than it claims)",
                                      labels=direction_labels)
        labels = ["quota", "user", "client_id"]
        demand = GaugeMetricFamily("kthrottle_capacity_demand",
                                   "Each tenant's demand as estimated (see docs/protecting-the-cluster.md)",
                                   labels=labels)
        rate = GaugeMetricFamily("kthrottle_capacity_tenant_rate",
                                 "Each tenant's fleet-wide rate (this member's + its peers')", labels=labels)
        share = GaugeMetricFamily("kthrottle_capacity_fair_share",
                                  "Each tenant's fair share of the capacity: its allocation while the "
                                  "capacity binds, else what it is guaranteed (its weight's part of it)",
                                  labels=labels)
        weight = GaugeMetricFamily("kthrottle_capacity_share", "Each tenant's weight (its `share` setting)",
                                   labels=labels)
        throttle_time = CounterMetricFamily("kthrottle_capacity_throttle_time_seconds",
                                            "Throttle time decided by the capacity (the tenant was above "
                                            "its fair share)", labels=[*labels, "mode"])
        throttles = CounterMetricFamily("kthrottle_capacity_throttles",
                                        "Responses throttled by the capacity", labels=[*labels, "mode"])
        if config is not None:
            for direction, value in config.static().items():
                static.add_metric([direction.value], value)
        for direction, state in capacity.directions.items():
            name = direction.value
            if state.effective is not None:
                effective.add_metric([name], state.effective)
            total.add_metric([name], state.total_rate)
            contended.add_metric([name], 1.0 if state.contended else 0.0)
            other = [0.0, 0.0, 0.0, 0, 0, 0, 0]
            weights = sum(flow.weight for flow in state.flows.values()) or 1.0
            for index, flow in enumerate(state.flows.values()):
                fair = flow.allocation
                if fair == float("inf"):  # not binding: the part its weight guarantees
                    fair = 0.0 if state.effective is None else state.effective * flow.weight / weights
                fleet_rate = flow.own_rate(now_ms) + flow.peer_rate
                if index >= self.max_entities:
                    other[0] += flow.demand
                    other[1] += fleet_rate
                    other[2] += fair
                    other[3] += flow.throttle_total_ms
                    other[4] += flow.throttle_count
                    other[5] += flow.shadow_throttle_total_ms
                    other[6] += flow.shadow_throttle_count
                    continue
                tenant = [name, flow.key.user, client_id_label(flow.key.client_id)]
                demand.add_metric(tenant, flow.demand)
                rate.add_metric(tenant, fleet_rate)
                weight.add_metric(tenant, flow.weight)
                if state.effective is not None:
                    share.add_metric(tenant, fair)
                throttle_time.add_metric([*tenant, ENFORCED], flow.throttle_total_ms / 1000.0)
                throttles.add_metric([*tenant, ENFORCED], flow.throttle_count)
                if flow.shadow_throttle_count:
                    throttle_time.add_metric([*tenant, SHADOW], flow.shadow_throttle_total_ms / 1000.0)
                    throttles.add_metric([*tenant, SHADOW], flow.shadow_throttle_count)
            if len(state.flows) > self.max_entities:
                tenant = [name, OTHER, OTHER]
                demand.add_metric(tenant, other[0])
                rate.add_metric(tenant, other[1])
                if state.effective is not None:
                    share.add_metric(tenant, other[2])
                throttle_time.add_metric([*tenant, ENFORCED], other[3] / 1000.0)
                throttles.add_metric([*tenant, ENFORCED], other[4])
                if other[6]:
                    throttle_time.add_metric([*tenant, SHADOW], other[5] / 1000.0)
                    throttles.add_metric([*tenant, SHADOW], other[6])
        families += [static, effective, total, contended, demand, rate, share, weight, throttle_time,
                     throttles]
        if self.controller is not None:
            controller = self.controller
            factor = GaugeMetricFamily("kthrottle_capacity_factor",
                                       "The adaptive factor in force (the fleet's lowest)")
            factor.add_metric([], capacity.factor)
            own = GaugeMetricFamily("kthrottle_capacity_factor_own",
                                    "This member's own adaptive factor, from the brokers it sees")
            own.add_metric([], controller.factor)
            reason = GaugeMetricFamily(
                "kthrottle_capacity_factor_reason", "1 for the signal behind the factor's latest change",
                labels=["reason"])
            for name in REASONS:
                reason.add_metric([name], 1.0 if controller.reason == name else 0.0)
            broker_labels = ["broker", "api"]
            baseline = GaugeMetricFamily("kthrottle_capacity_latency_baseline_seconds",
                                         "Healthy p99 response time learned per broker and API",
                                         labels=broker_labels)
            latest = GaugeMetricFamily("kthrottle_capacity_latency_p99_seconds",
                                       "p99 response time in the latest tick per broker and API",
                                       labels=broker_labels)
            for (broker, api), value in controller.baselines.items():
                baseline.add_metric([str(broker), API_NAMES.get(api, str(api))], value / 1000.0)
            for (broker, api), value in controller.latest_p99.items():
                latest.add_metric([str(broker), API_NAMES.get(api, str(api))], value / 1000.0)
            families += [factor, own, reason, baseline, latest]
        self._families = families
