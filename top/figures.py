"""`kthrottle top`'s figures: metrics text in, one row per tenant and per proxy out (pure).

Where the figures come from (README "Metrics"): per (user, client-id) and quota type, the proxy's
own windowed rate gauges (the numbers its throttling decisions use, like a broker's `byte-rate`),
the quota in force (`kthrottle_quota_limit`) and the throttle counters, which are differentiated
between two scrapes; per proxy, the connection gauges and the request counters. Sorting and
filtering the rows is here too; top_view.py lays them out on a screen.

With a `[capacity]` table (docs/protecting-the-cluster.md) the proxy also exports each capacity
tenant's weight, estimated demand, fleet-wide rate and the throttles the capacity decided, labelled
like a quota bucket (a tenant is found through the same eight entity levels, on the entities that
set `share`). They join the row with the same (user, client_id) labels, or make a row of their
own: a tenant that no quota covers has no quota bucket, so its rates come from the capacity's rate
gauge (see `build_view`), and the capacity's throttles count in its throttle time like a quota's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

from quotas.types import QuotaType

#: The rate gauge of each quota type, as proxy/observability/metrics.py exports them (`quota` label =
#: QuotaType.value).
RATE_FAMILIES: dict[str, str] = {
    QuotaType.PRODUCE.value: "kthrottle_produce_byte_rate_bytes_per_second",
    QuotaType.FETCH.value: "kthrottle_fetch_byte_rate_bytes_per_second",
    QuotaType.REQUEST.value: "kthrottle_request_time_percent",
    QuotaType.CONTROLLER_MUTATION.value: "kthrottle_controller_mutation_rate_per_second",
    QuotaType.PRODUCER_IDS.value: "kthrottle_producer_id_rate_per_second",
}
_RATE_SAMPLES = {name: quota for quota, name in RATE_FAMILIES.items()}
LIMIT = "kthrottle_quota_limit"
THROTTLE_TIME = "kthrottle_throttle_time_seconds_total"
THROTTLES = "kthrottle_throttles_total"
#: the `mode` label value of the throttle counters' series in shadow (quotas/shadow.py)
SHADOW = "shadow"
MUTED = "kthrottle_muted_connections"
CONNECTIONS = "kthrottle_connections"
UPSTREAM_UP = "kthrottle_upstream_up"
#: A proxy that exports this is a fleet member: its quotas bound the whole fleet, not itself alone.
FLEET_MEMBERS = "kthrottle_fleet_members"
#: The per-proxy counters shown as rates (summed over their `api` label).
REQUESTS = "kthrottle_requests_total"
REQUEST_BYTES = "kthrottle_request_bytes_total"
RESPONSE_BYTES = "kthrottle_response_bytes_total"
THROTTLED_RESPONSES = "kthrottle_throttled_responses_total"
_PROXY_COUNTERS = (REQUESTS, REQUEST_BYTES, RESPONSE_BYTES, THROTTLED_RESPONSES)
#: The capacity's per-tenant families (proxy/observability/capacity_metrics.py), labelled
#: {quota, user, client_id} with `quota` the direction (QuotaType.value).
CAPACITY_SHARE = "kthrottle_capacity_share"
CAPACITY_DEMAND = "kthrottle_capacity_demand"
CAPACITY_RATE = "kthrottle_capacity_tenant_rate"
CAPACITY_THROTTLE_TIME = "kthrottle_capacity_throttle_time_seconds_total"
CAPACITY_THROTTLES = "kthrottle_capacity_throttles_total"
_TENANT_SAMPLES = {LIMIT, THROTTLE_TIME, THROTTLES, CAPACITY_SHARE, CAPACITY_DEMAND, CAPACITY_RATE,
                   CAPACITY_THROTTLE_TIME, CAPACITY_THROTTLES}

#: The label proxy/observability/metrics.py gives to entities folded beyond `metrics_max_entities`.
OTHER = "__other__"

#: (user, client_id) as the proxy labels a quota bucket; "" where the bucket spans that dimension.
Tenant = tuple[str, str]


# -- one scrape --------------------------------------------------------------------------------


@dataclass
class TenantFigures:
    """One tenant's samples in one proxy's scrape."""

    rates: dict[str, float] = field(default_factory=dict)  # quota type -> rate gauge
    limits: dict[str, float] = field(default_factory=dict)  # quota type -> quota in force
    throttle_seconds: float = 0.0  # counter, summed over quota types (and the capacity's directions)
    throttles: float = 0.0  # counter, summed over quota types (and the capacity's directions)
    #: the same two for throttles computed and not applied (`mode="shadow"`); None: no such series
    shadow_seconds: float | None = None
    shadow_throttles: float | None = None
    #: the capacity tenant's weight (`share`; the same in every direction), None: no capacity tenant
    weight: float | None = None
    demands: dict[str, float] = field(default_factory=dict)  # direction -> demand as estimated
    capacity_rates: dict[str, float] = field(default_factory=dict)  # direction -> fleet-wide rate


@dataclass
class ProxyFigures:
    """Everything `top` uses from one proxy's metrics text."""

    tenants: dict[Tenant, TenantFigures] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # _PROXY_COUNTERS, summed over labels
    muted: float = 0.0
    connections: float = 0.0
    upstream_up: float | None = None
    in_fleet: bool = False


@dataclass(frozen=True)
class Scrape:
    """One fetch of one endpoint: its figures, or why there are none. `at` is monotonic seconds."""

    url: str
    at: float
    figures: ProxyFigures | None = None
    error: str | None = None


def parse_metrics(text: str) -> ProxyFigures:
    """The figures in a Prometheus text exposition; ValueError when it is not one."""
    figures = ProxyFigures()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if math.isnan(value):
                continue
            if name in _RATE_SAMPLES or name in _TENANT_SAMPLES:
                tenant = (labels.get("user", ""), labels.get("client_id", ""))
                entry = figures.tenants.setdefault(tenant, TenantFigures())
                quota = labels.get("quota", "")
                if name in _RATE_SAMPLES:
                    entry.rates[_RATE_SAMPLES[name]] = value
                elif name == LIMIT:
                    entry.limits[quota] = value
                elif name in (THROTTLE_TIME, CAPACITY_THROTTLE_TIME):
                    if labels.get("mode") == SHADOW:
                        entry.shadow_seconds = (entry.shadow_seconds or 0.0) + value
                    else:
                        entry.throttle_seconds += value
                elif name in (THROTTLES, CAPACITY_THROTTLES):
                    if labels.get("mode") == SHADOW:
                        entry.shadow_throttles = (entry.shadow_throttles or 0.0) + value
                    else:
                        entry.throttles += value
                elif name == CAPACITY_SHARE:
                    entry.weight = value if entry.weight is None else max(entry.weight, value)
                elif name == CAPACITY_DEMAND:
                    entry.demands[quota] = value
                else:
                    entry.capacity_rates[quota] = value
            elif name in _PROXY_COUNTERS:
                figures.counters[name] = figures.counters.get(name, 0.0) + value
            elif name == MUTED:
                figures.muted = value
            elif name == CONNECTIONS:
                figures.connections = value
            elif name == UPSTREAM_UP:
                figures.upstream_up = value
            elif name == FLEET_MEMBERS:
                figures.in_fleet = True
    return figures


def scrape_from_text(url: str, at: float, text: str) -> Scrape:
    """A Scrape of fetched text: text that is not Prometheus's is an error shown, not raised."""
    try:
        return Scrape(url, at, parse_metrics(text))
    except ValueError as exc:
        return Scrape(url, at, error=f"not Prometheus metrics text: {exc}")


def metrics_url(text: str) -> str:
    """`host:port`, `http://host:port` or a full URL; the path defaults to /metrics."""
    text = text.strip()
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if not parts.hostname:
        raise ValueError(f"not a metrics endpoint: {text!r} (expected host:port or http://host:port/metrics)")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


# -- from scrapes to rows --------------------------------------------------------------------


def _counter_rate(current: float, previous: float | None, seconds: float) -> float | None:
    """Per second between two readings; a counter that went down was reset (a restart) and counts
    from zero, as Prometheus's rate() does."""
    if previous is None or seconds <= 0:
        return None
    delta = current - previous if current >= previous else current
    return delta / seconds


@dataclass
class TenantRow:
    """One tenant over every proxy that answered."""

    user: str
    client_id: str
    rates: dict[str, float] = field(default_factory=dict)  # summed over proxies
    limits: dict[str, float] = field(default_factory=dict)  # the quota in force over those proxies
    throttle_rate: float | None = None  # throttle seconds decided per second, over the last refresh
    throttles_rate: float | None = None  # throttles per second, over the last refresh
    #: throttle seconds computed in shadow per second (reported, not applied); None: no shadow figures
    shadow_rate: float | None = None
    proxies: int = 0  # proxies that have a bucket for this tenant
    #: its weight as a capacity tenant (`share`), None where no proxy has a capacity tenant for it
    weight: float | None = None
    #: its demand per direction as the capacity estimates it (kthrottle_capacity_demand)
    demands: dict[str, float] = field(default_factory=dict)

    @property
    def produce(self) -> float:
        return self.rates.get(QuotaType.PRODUCE.value, 0.0)

    @property
    def fetch(self) -> float:
        return self.rates.get(QuotaType.FETCH.value, 0.0)

    @property
    def request(self) -> float:
        return self.rates.get(QuotaType.REQUEST.value, 0.0)

    def used(self, quota: str) -> float | None:
        """Rate / quota for one quota type (not its `share`, the capacity weight); None without a quota."""
        limit = self.limits.get(quota)
        if limit is None or limit <= 0:
            return None
        return self.rates.get(quota, 0.0) / limit

    @property
    def usage(self) -> float | None:
        """How much of its most used quota it uses: the one that throttles it first."""
        used = [u for u in (self.used(q) for q in self.limits) if u is not None]
        return max(used) if used else None

    @property
    def demand(self) -> float | None:
        """Bytes per second it asks of the cluster: its produce and fetch demands added (None: no
        capacity figures in either direction).

        Chosen over one direction's demand so that a consumer shows its demand as a producer
        does, and over a per-direction pair of columns to keep the screen narrow; both are bytes
        per second, while the request-time direction is a percentage and is left out. The demand is
        the tenant's claim on the capacity: 1.2 x its rate, or, while it is greedy (held at its
        allocation), all it may have (the capacity, or its own quota), so a large DEMAND beside a
        smaller rate reads "held back" (docs/protecting-the-cluster.md).
        """
        byte_demands = [self.demands[q] for q in (QuotaType.PRODUCE.value, QuotaType.FETCH.value)
                        if q in self.demands]
        return sum(byte_demands) if byte_demands else None

    @property
    def throttled(self) -> bool:
        return bool(self.throttle_rate) or bool(self.throttles_rate)


@dataclass
class ProxyRow:
    """One endpoint's own totals (or the sum of all), or why it could not be read."""

    url: str
    error: str | None = None
    connections: float = 0.0
    muted: float = 0.0
    upstream_up: float | None = None
    in_fleet: bool = False
    rates: dict[str, float | None] = field(default_factory=dict)  # _PROXY_COUNTERS per second


@dataclass
class View:
    tenants: list[TenantRow]
    proxies: list[ProxyRow]
    total: ProxyRow


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def build_view(current: Sequence[Scrape], previous: Mapping[str, Scrape]) -> View:
    """Rows for the screen from this refresh's scrapes and the last good scrape of each endpoint.

    Rates of a fleet are summed over its proxies. A quota is summed too, since each lone proxy
    grants it in full, except among fleet members, which enforce one quota between them (their
    largest is taken).

    The capacity's figures follow the same rule: a fleet member reports each tenant's fleet-wide
    rate and demand (its own plus its peers'), so among fleet members the largest is taken, while
    lone proxies each hold a capacity of their own and are summed; the weight is the largest
    reported. A row with no quota bucket's rate for a direction (no quota covers the tenant there)
    shows the capacity's rate for it.
    """
    proxies: list[ProxyRow] = []
    tenants: dict[Tenant, TenantRow] = {}
    fleet_limits: dict[Tenant, dict[str, float]] = {}
    throttle_rates: dict[Tenant, list[float | None]] = {}
    throttles_rates: dict[Tenant, list[float | None]] = {}
    shadow_rates: dict[Tenant, list[float | None]] = {}
    #: capacity demands and rates per tenant and direction: fleet members' (largest), lone proxies' (summed)
    fleet_capacity: dict[Tenant, tuple[dict[str, float], dict[str, float]]] = {}
    lone_capacity: dict[Tenant, tuple[dict[str, float], dict[str, float]]] = {}
    for scrape in current:
        figures = scrape.figures
        if figures is None:
            proxies.append(ProxyRow(scrape.url, error=scrape.error or "no answer"))
            continue
        before = previous.get(scrape.url)
        old = before.figures if before is not None else None
        seconds = scrape.at - before.at if before is not None else 0.0
        proxies.append(ProxyRow(
            scrape.url, connections=figures.connections, muted=figures.muted,
            upstream_up=figures.upstream_up, in_fleet=figures.in_fleet,
            rates={name: _counter_rate(figures.counters.get(name, 0.0),
                                       None if old is None else old.counters.get(name, 0.0), seconds)
                   for name in _PROXY_COUNTERS}))
        for tenant, entry in figures.tenants.items():
            row = tenants.setdefault(tenant, TenantRow(*tenant))
            row.proxies += 1
            for quota, rate in entry.rates.items():
                row.rates[quota] = row.rates.get(quota, 0.0) + rate
            for quota, limit in entry.limits.items():
                if figures.in_fleet:
                    merged = fleet_limits.setdefault(tenant, {})
                    merged[quota] = max(merged.get(quota, 0.0), limit)
                else:
                    row.limits[quota] = row.limits.get(quota, 0.0) + limit
            if entry.weight is not None:
                row.weight = entry.weight if row.weight is None else max(row.weight, entry.weight)
            if entry.demands or entry.capacity_rates:
                into = (fleet_capacity if figures.in_fleet else lone_capacity).setdefault(tenant, ({}, {}))
                for found, sums in ((entry.demands, into[0]), (entry.capacity_rates, into[1])):
                    for quota, value in found.items():
                        known = sums.get(quota)
                        sums[quota] = (value if known is None else max(known, value) if figures.in_fleet
                                       else known + value)
            # a bucket the last scrape did not have started from zero since
            prior = None if old is None else old.tenants.get(tenant, TenantFigures())
            throttle_rates.setdefault(tenant, []).append(_counter_rate(
                entry.throttle_seconds, None if prior is None else prior.throttle_seconds, seconds))
            throttles_rates.setdefault(tenant, []).append(_counter_rate(
                entry.throttles, None if prior is None else prior.throttles, seconds))
            if entry.shadow_seconds is not None:
                shadow_rates.setdefault(tenant, []).append(_counter_rate(
                    entry.shadow_seconds, None if prior is None else prior.shadow_seconds or 0.0, seconds))
    for tenant, row in tenants.items():
        for quota, limit in fleet_limits.get(tenant, {}).items():
            row.limits[quota] = row.limits.get(quota, 0.0) + limit
        capacity_rates: dict[str, float] = {}
        for demands, rates in (fleet_capacity.get(tenant, ({}, {})), lone_capacity.get(tenant, ({}, {}))):
            for quota, value in demands.items():
                row.demands[quota] = row.demands.get(quota, 0.0) + value
            for quota, value in rates.items():
                capacity_rates[quota] = capacity_rates.get(quota, 0.0) + value
        for quota, value in capacity_rates.items():
            row.rates.setdefault(quota, value)  # only where no quota bucket measured it
        row.throttle_rate = _sum_known(throttle_rates.get(tenant, ()))
        row.throttles_rate = _sum_known(throttles_rates.get(tenant, ()))
        row.shadow_rate = _sum_known(shadow_rates.get(tenant, ()))
    answered = [p for p in proxies if p.error is None]
    total = ProxyRow(
        "total", connections=sum(p.connections for p in answered), muted=sum(p.muted for p in answered),
        rates={name: _sum_known(p.rates.get(name) for p in answered) for name in _PROXY_COUNTERS})
    return View(list(tenants.values()), proxies, total)


# -- sorting and filtering -------------------------------------------------------------------


@dataclass(frozen=True)
class SortKey:
    title: str
    value: Callable[[TenantRow], float | None]  # larger first; None last


#: Keys that sort the table: pressing one sorts by it, pressing it again reverses the order.
SORT_KEYS: dict[str, SortKey] = {
    "b": SortKey("bytes", lambda r: r.produce + r.fetch),
    "p": SortKey("produce", lambda r: r.produce),
    "f": SortKey("fetch", lambda r: r.fetch),
    "r": SortKey("request time", lambda r: r.request),
    "u": SortKey("quota use", lambda r: r.usage),
    "t": SortKey("throttle time", lambda r: r.throttle_rate),
    "n": SortKey("name", lambda r: None),
}
DEFAULT_SORT = "b"
NAME_SORT = "n"


def sort_rows(rows: Iterable[TenantRow], key: str, reverse: bool = False) -> list[TenantRow]:
    """Largest first (names: alphabetical), ties and unknowns after, by name; `reverse` flips."""
    by_name = sorted(rows, key=lambda r: (r.user, r.client_id))
    if key == NAME_SORT:
        return by_name[::-1] if reverse else by_name
    value = SORT_KEYS[key].value
    known = [r for r in by_name if value(r) is not None]
    unknown = [r for r in by_name if value(r) is None]
    ordered = sorted(known, key=lambda r: value(r) or 0.0, reverse=not reverse)  # stable: ties by name
    return ordered + unknown


def filter_rows(rows: Iterable[TenantRow], text: str) -> list[TenantRow]:
    """Tenants whose user or client-id contains `text` (case-insensitive)."""
    needle = text.lower()
    return [r for r in rows if needle in r.user.lower() or needle in r.client_id.lower()]
