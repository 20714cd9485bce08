"""KIP-612 connection quotas, the pure half: Kafka's `kafka.network.ConnectionQuotas`, time passed in.

Behind the proxy every broker sees one client address, so what Kafka keys on it is enforced here
(DESIGN.md, "Client addresses"). For each new client connection, in Kafka's order (`inc`):

1. `accept_delay_ms(listener, now_ms)`: the connection is recorded in the proxy-wide rate
   (`max.connection.creation.rate`) and the listener's (`listener.name.L.max.connection.creation.rate`);
   the delay is the larger of the two throttles, each `QuotaUtils.boundedThrottleTime`: Kafka's
   `(O - T) / T x W`, rounded, capped at one window (`quota.window.size.seconds`). Nothing is
   refused: the acceptor waits. Contract: calls for one listener are serial; the next is made no
   earlier than the previous delay's end (Kafka's acceptor thread blocks, and later connections
   wait in the backlog; delaying each connection on its own would record them all at once and
   cap nothing). The protected listener (Kafka's inter-broker listener, once there are two or more
   listeners) is charged to its listener rate only.
2. `check_ip(listener, address, now_ms)`: the per-IP `connection_creation_rate` (ip_entities.py).
   Only when a quota applies is anything recorded (Kafka skips the sensor at Int.MaxValue). Over
   it, the connection is UN-recorded from its IP bucket, the listener and the proxy-wide rate
   (`sensor.record(-1.0, timeMs, false)`, so a client that backs off is not charged twice) and
   the decision throttles: the socket is kept, never served, and closed after `throttle_ms`
   (Kafka's DelayedCloseSocket), bounded by one window like the listener throttle.
3. `inc(address)`: `max.connections.per.ip` and its overrides; over it the connection closes at
   once. Kafka counts first and its acceptor's close decrements again; here a refused connection
   is simply not counted (same net count). `dec(address)` when a counted connection closes. A
   connection refused here stays recorded in the rates, as in Kafka (the rate checks came first).

IP buckets: an exact entity and `<default>` charge one bucket per address (Kafka's sensor per
IP); a CIDR entity charges one bucket shared by its whole prefix. A quota change re-applies to
every live bucket at once (`updateIpConnectionRateQuota`); a bucket no entity leads to any more
keeps its history (the key may come back, as a Kafka sensor does) but is not charged. At most
`max_buckets` (the proxy's `max_quota_buckets`) live: past it, an address under `<default>` is
charged to one shared overflow bucket at the default's rate (a storm from many addresses
throttles itself as a group); exact and CIDR entities, bounded by the configuration, always get
their own. A bucket whose rate holds no history (11 s idle) is dropped by `expire_idle` or to
make room: a new one measures the same.

Fleet: `ip_usage` lists each bucket's absolute windowed count (`connections`) and rate;
`attach_peers` takes a function giving the peers' summed rate for a bucket key, added to the
local rate before Kafka's formula, as `ClientQuotaManager` does with its `PeerView`. While peers
admit to a bucket, a member takes HEADROOM_SHARE of the headroom it saw when it last heard from
them; a connection past that is to be checked again after PEER_WAIT_MS (the I/O layer holds it).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .entity import DEFAULT
from .fleet import URGENT_CHANGE_RATIO, URGENT_MIN_INTERVAL_MS
from .ip_entities import (
    IPAddress,
    IpEntityError,
    IpQuotas,
    PrefixTable,
    normalize_address,
    parse_max_connections_per_ip_overrides,
)
from .manager import DEFAULT_MAX_BUCKETS, EXPIRY_BUDGET
from .rate import DEFAULT_WINDOW, WindowConfig, WindowedRate
from .throttle import bounded_throttle_time_ms

#: An IP bucket asks for an urgent fleet report once this many connections were added to its
#: window since peers were told, when that is less than URGENT_CHANGE_RATIO of its bound: bounds are
#: tens of connections per second, so 5 % of one is a dozen connections of a window, which every
#: member of a storm would admit on its own before its peers hear of it.
URGENT_IP_CONNECTIONS = 2

#: In a fleet, while peers admit to the same IP bucket, a member takes at most this part of the
#: headroom it saw when it last heard from them (half: right for two, fewer than each taking all for
#: more). Every member of a storm sees the same headroom open at once, and without a part each
#: admitted all of it before the others' reports arrived: over `--workers 2` a window's burst came to
#: 275-283 connections against 220.
HEADROOM_SHARE = 0.5
#: Past its part, a connection waits this long for the peers' next report (urgent ones come at most
#: every URGENT_MIN_INTERVAL_MS), at most PEER_WAITS times; then Kafka's formula alone decides, so
#: a peer that has gone quiet holds a connection PEER_WAITS x PEER_WAIT_MS at most, never starves it.
PEER_WAIT_MS = 2 * URGENT_MIN_INTERVAL_MS
PEER_WAITS = 3

#: Bucket key of the shared overflow bucket (never an address nor a prefix).
OVERFLOW_KEY = "__overflow__"

#: Largest value of Kafka's INT rate configs (Int.MaxValue, which also means "no limit").
_INT_MAX = 2**31 - 1

#: Peers' summed rate for an IP bucket key at a time (the fleet's `PeerView.rate`, adapted).
PeerRate = Callable[[str, int], float]


class ConnectionCountError(ValueError):
    """`dec` for an address with no counted connection (Kafka's IllegalArgumentException)."""


class ConnectionDecision(NamedTuple):
    """The per-IP rate check of one connection: accepted, throttled (throttle_ms), or to be checked
    again after wait_ms, once the fleet's peers have reported (nothing recorded meanwhile)."""

    throttle_ms: int
    #: the IP bucket charged; None when no IP quota applies (nothing recorded)
    bucket: str | None
    bound: float
    #: the rate decided on: the bucket's own, plus its peers' in a fleet
    observed: float
    wait_ms: int = 0

    @property
    def accepted(self) -> bool:
        return self.throttle_ms == 0 and self.wait_ms == 0


ACCEPTED = ConnectionDecision(0, None, math.inf, 0.0)


class IpBucketUsage(NamedTuple):
    """One IP bucket's absolute usage for the fleet exchange."""

    bucket: str
    #: connections in the retained samples (Kafka's windowed sum)
    connections: float
    #: the rate Kafka's formula uses: count / the padded window, per second
    rate: float


@dataclass(slots=True)
class _IpBucket:
    rate: WindowedRate
    #: the bound in force; None: no entity leads here any more (history kept, not charged)
    bound: int | None
    #: the address of a per-address bucket (re-resolved when the quotas change); None for a
    #: prefix bucket and the overflow bucket
    address: IPAddress | None
    #: in a fleet: the rate peers were last told, and the local rate above which it asks for an
    #: urgent report (a storm bursts a window's worth at once on every member)
    reported: float = 0.0
    urgent_above: float = 0.0
    #: in a fleet: the peers' rate when this member last heard from them, the connections it has
    #: admitted since, and how many it may (HEADROOM_SHARE of the headroom it saw then)
    heard: float = -1.0
    since_heard: int = 0
    part: float = 0.0


@dataclass(slots=True)
class ListenerQuota:
    """One listener's connection-rate sensor and the throttles it saw (Kafka's listener metrics)."""

    rate: WindowedRate
    #: `listener.name.L.max.connection.creation.rate`; None: unlimited
    bound: int | None = None
    #: when the acceptor may take the next connection (the end of the latest accept delay)
    blocked_until_ms: int = 0
    #: accept delays (`connection-accept-throttle-time`): how many, and their sum
    throttle_count: int = 0
    throttle_total_ms: int = 0
    #: IP throttles on this listener (`ip-connection-accept-throttle-time`)
    ip_throttle_count: int = 0
    ip_throttle_total_ms: int = 0


def _check_rate(value: int | None, what: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _INT_MAX:
        raise ValueError(f"{what} must be an integer in {minimum}..{_INT_MAX}, got {value!r}")
    return value


class ConnectionQuotas:
    """Connection-creation rates (proxy-wide, per listener, per IP) and open connections per IP."""

    def __init__(self, window: WindowConfig = DEFAULT_WINDOW, *, ip_quotas: IpQuotas | None = None,
                 max_connection_creation_rate: int | None = None,
                 listener_rates: Mapping[str, int] | None = None, protected_listener: str | None = None,
                 max_connections_per_ip: int | None = None,
                 max_connections_per_ip_overrides: Mapping[str, int] | str | None = None,
                 max_buckets: int | None = DEFAULT_MAX_BUCKETS) -> None:
        if max_buckets is not None and max_buckets < 1:
            raise ValueError(f"max_buckets must be at least 1, got {max_buckets}")
        self.window = window
        #: Kafka's maxThrottleTimeMs: one quota window
        self.max_throttle_ms = window.window_ms
        self.max_buckets = max_buckets
        #: Kafka's inter-broker listener: exempt from the proxy-wide rate
        self.protected_listener = protected_listener
        self.broker_rate = WindowedRate(window)
        self.broker_bound: int | None = None
        self.set_broker_rate(max_connection_creation_rate)
        self.listeners: dict[str, ListenerQuota] = {}
        for name, rate in (listener_rates or {}).items():
            self.set_listener_rate(name, rate)
        self.ip_quotas = IpQuotas()
        self._ip_enabled = False
        #: live IP buckets, least recently charged first
        self.buckets: OrderedDict[str, _IpBucket] = OrderedDict()
        self.overflow_charges = 0
        self.evicted_buckets = 0
        self.expired_buckets = 0
        self.peers: PeerRate | None = None
        self._on_urgent: Callable[[], None] | None = None
        self._urgent_keys: set[str] = set()
        #: buckets charged since the last delta listing (`take_charged`)
        self._charged: set[str] = set()
        self._counts: dict[IPAddress, int] = {}
        self.max_connections_per_ip: int | None = None
        self._max_overrides: PrefixTable[int] = PrefixTable()
        self.set_max_connections_per_ip(max_connections_per_ip, max_connections_per_ip_overrides)
        if ip_quotas is not None:
            self.set_ip_quotas(ip_quotas)

    # -- configuration ------------------------------------------------------------------------

    def set_broker_rate(self, rate: int | None) -> None:
        """`max.connection.creation.rate` (INT, at least 0 in Kafka); history is kept."""
        self.broker_bound = _check_rate(rate, "max.connection.creation.rate", 0)

    def set_listener_rate(self, listener: str, rate: int | None) -> None:
        """`listener.name.<listener>.max.connection.creation.rate`: Kafka refuses <= 0."""
        self._listener(listener).bound = _check_rate(
            rate, f"listener.name.{listener}.max.connection.creation.rate", 1)

    def set_ip_quotas(self, quotas: IpQuotas | Mapping[str, object]) -> None:
        """Replace every `ip` entity; live buckets take their new bound at once."""
        self.ip_quotas = quotas if isinstance(quotas, IpQuotas) else IpQuotas(quotas)
        self._ip_enabled = len(self.ip_quotas) > 0
        entities = self.ip_quotas.entities()
        default = self.ip_quotas.resolve_default()
        for key, bucket in self.buckets.items():
            if bucket.address is not None:
                found = self.ip_quotas.resolve(bucket.address)
                bucket.bound = found.bound if found is not None and found.bucket == key else None
            elif key == OVERFLOW_KEY:
                bucket.bound = default
            else:
                rate = entities.get(key)
                bucket.bound = None if rate is None or rate == _INT_MAX else rate

    def update_ip_quota(self, entity: str, rate: object | None) -> None:
        """Kafka's `updateIpConnectionRateQuota`: set one entity (None removes it), `<default>` included."""
        self.set_ip_quotas(self.ip_quotas.updated(entity, rate))

    def set_max_connections_per_ip(self, default: int | None,
                                   overrides: Mapping[str, int] | str | None = None) -> None:
        """`max.connections.per.ip` (None: unlimited) and `max.connections.per.ip.overrides`."""
        table = (parse_max_connections_per_ip_overrides(overrides) if isinstance(overrides, str)
                 else dict(overrides or {}))
        for name, count in table.items():
            if name.strip() == DEFAULT:
                raise IpEntityError("max.connections.per.ip.overrides cannot name <default>: "
                                    "use max.connections.per.ip")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise IpEntityError(f"max.connections.per.ip.overrides for {name} must be an integer >= 0, "
                                    f"got {count!r}")
        if default is not None and (isinstance(default, bool) or not isinstance(default, int) or default < 0):
            raise ValueError(f"max.connections.per.ip must be an integer >= 0, got {default!r}")
        if default == 0 and not table:
            raise ValueError("max.connections.per.ip can be set to zero only if "
                             "max.connections.per.ip.overrides is set")
        self._max_overrides = PrefixTable(table)
        self.max_connections_per_ip = default

    def _listener(self, name: str) -> ListenerQuota:
        found = self.listeners.get(name)
        if found is None:
            found = self.listeners[name] = ListenerQuota(WindowedRate(self.window))
        return found

    def _protected(self, listener: str) -> bool:
        return listener == self.protected_listener and len(self.listeners) > 1

    # -- 1. proxy-wide and listener rates: a delayed accept -----------------------------------

    def _record_and_throttle(self, rate: WindowedRate, bound: int | None, now_ms: int) -> int:
        rate.record(1.0, now_ms)
        if bound is None:
            return 0
        observed, window_ms = rate.measure_with_window(now_ms)
        if bound == 0:  # Kafka: (O - 0) / 0 is infinite, Math.round gives Long.MAX_VALUE, then the cap
            return self.max_throttle_ms if observed > 0 else 0
        return bounded_throttle_time_ms(observed, bound, window_ms, self.max_throttle_ms)

    def accept_delay_ms(self, listener: str, now_ms: int) -> int:
        """Record a new connection on `listener` and the proxy; how long the acceptor waits first."""
        return self.accept_delay(listener, now_ms)[0]

    def accept_delay(self, listener: str, now_ms: int) -> tuple[int, str | None]:
        """`accept_delay_ms` and which rate decided it: "proxy_rate", "listener_rate" or None (no wait)."""
        quota = self._listener(listener)
        broker_ms = 0 if self._protected(listener) else self._record_and_throttle(
            self.broker_rate, self.broker_bound, now_ms)
        listener_ms = self._record_and_throttle(quota.rate, quota.bound, now_ms)
        delay = max(broker_ms, listener_ms)
        quota.blocked_until_ms = now_ms + delay
        if delay <= 0:
            return 0, None
        quota.throttle_count += 1
        quota.throttle_total_ms += delay
        return delay, "proxy_rate" if broker_ms >= listener_ms else "listener_rate"

    # -- 2. the per-IP rate: a throttled connection is closed after the throttle ---------------

    def check_ip(self, listener: str, address: str | IPAddress, now_ms: int, *,
                 waits: int = 0) -> ConnectionDecision:
        """Record the connection in its IP bucket; over the quota, un-record it everywhere and throttle.

        Must follow this connection's `accept_delay_ms` on the same listener (it un-records there).
        In a fleet, past this member's part of the headroom the connection is un-recorded from its
        IP bucket only and checked again after `wait_ms`, `waits` counting the times it waited.
        """
        if not self._ip_enabled:
            return ACCEPTED
        ip = normalize_address(address)
        found = self.ip_quotas.resolve(ip)
        if found is None:
            return ACCEPTED
        key, bucket = self._bucket_for(found.bucket, found.bound, found.level != "default", ip, now_ms)
        bound = found.bound
        rate = bucket.rate
        rate.record(1.0, now_ms)
        observed, window_ms = rate.measure_with_window(now_ms)
        peers = 0.0
        if self.peers is not None:
            self._charged.add(key)
            if self._on_urgent is not None and observed > bucket.urgent_above:
                self._ask_urgent(key, bucket)
            peers = self.peers(key, now_ms)
            observed += peers
        throttle = bounded_throttle_time_ms(observed, bound, window_ms, self.max_throttle_ms)
        if throttle <= 0:
            if peers > 0.0:
                self._hear_peers(bucket, peers, observed, bound, window_ms)
                if waits < PEER_WAITS and bucket.since_heard + 1 > bucket.part:
                    rate.unrecord(1.0, now_ms)
                    return ConnectionDecision(0, key, bound, observed, PEER_WAIT_MS)
                bucket.since_heard += 1
            return ConnectionDecision(0, key, bound, observed)
        rate.unrecord(1.0, now_ms)
        quota = self._listener(listener)
        quota.rate.unrecord(1.0, now_ms)
        if not self._protected(listener):
            self.broker_rate.unrecord(1.0, now_ms)
        quota.ip_throttle_count += 1
        quota.ip_throttle_total_ms += throttle
        return ConnectionDecision(throttle, key, bound, observed)

    @staticmethod
    def _hear_peers(bucket: _IpBucket, peers: float, observed: float, bound: int, window_ms: int) -> None:
        """On news from the peers (their rate changed; a fading one, from quiet peers, changes on
        every look), start this member's part again: HEADROOM_SHARE of the headroom it sees now."""
        if peers != bucket.heard:
            bucket.heard = peers
            bucket.since_heard = 0
            headroom = (bound - observed) * window_ms / 1000.0 + 1.0  # this connection included
            bucket.part = max(1.0, HEADROOM_SHARE * headroom)

    def _bucket_for(self, key: str, bound: int, configured: bool, ip: IPAddress,
                    now_ms: int) -> tuple[str, _IpBucket]:
        buckets = self.buckets
        bucket = buckets.get(key)
        if bucket is not None:
            buckets.move_to_end(key)
        elif (configured or self.max_buckets is None or len(buckets) < self.max_buckets
              or self._make_room(now_ms)):
            bucket = buckets[key] = _IpBucket(WindowedRate(self.window), bound,
                                              ip if key == str(ip) else None,
                                              urgent_above=self._urgent_rise(bound))
        else:
            self.overflow_charges += 1
            key = OVERFLOW_KEY
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = _IpBucket(WindowedRate(self.window), bound, None,
                                                  urgent_above=self._urgent_rise(bound))
            else:
                buckets.move_to_end(key)
        bucket.bound = bound
        return key, bucket

    def _make_room(self, now_ms: int) -> bool:
        """Drop the least recently charged bucket if it holds no history or no entity leads to it."""
        key = next(iter(self.buckets), None)
        if key is None:
            return False
        bucket = self.buckets[key]
        if bucket.bound is not None and not bucket.rate.expired(now_ms):
            return False
        del self.buckets[key]
        self.evicted_buckets += 1
        return True

    def expire_idle(self, now_ms: int, budget: int = EXPIRY_BUDGET) -> int:
        """Drop buckets whose rate holds no history (least recently charged first); how many went."""
        dropped = 0
        buckets = self.buckets
        while buckets and dropped < budget:
            key = next(iter(buckets))
            if not buckets[key].rate.expired(now_ms):
                break
            del buckets[key]
            dropped += 1
        self.expired_buckets += dropped
        return dropped

    # -- 3. open connections per IP ------------------------------------------------------------

    def inc(self, address: str | IPAddress) -> str | None:
        """Count a connection from `address`; returns why it is refused (then nothing is counted)."""
        ip = normalize_address(address)
        count = self._counts.get(ip, 0)
        match = self._max_overrides.lookup(ip)
        if match is not None:
            if count >= match.value:
                return f"max_connections_per_ip_overrides {match.entity} = {match.value} reached for {ip}"
        elif self.max_connections_per_ip is not None and count >= self.max_connections_per_ip:
            return f"max_connections_per_ip = {self.max_connections_per_ip} reached for {ip}"
        self._counts[ip] = count + 1
        return None

    def dec(self, address: str | IPAddress) -> None:
        """A connection `inc` counted has closed."""
        ip = normalize_address(address)
        count = self._counts.get(ip)
        if count is None:
            raise ConnectionCountError(f"connection count decreased for {ip}, which has no connections")
        if count == 1:
            del self._counts[ip]
        else:
            self._counts[ip] = count - 1

    def open_connections(self, address: str | IPAddress) -> int:
        """Kafka's `ConnectionQuotas.get`: connections counted for `address`."""
        return self._counts.get(normalize_address(address), 0)

    # -- measurements and the fleet ------------------------------------------------------------

    def listener_rate(self, listener: str, now_ms: int) -> float:
        """`connection-accept-rate{listener}`: connections per second on a listener."""
        quota = self.listeners.get(listener)
        return 0.0 if quota is None else quota.rate.measure(now_ms)

    def ip_rate(self, address: str | IPAddress, now_ms: int) -> float:
        """The rate of the bucket `address` resolves to (0.0 when none applies or none is live;
        an address sent to the overflow bucket reads 0.0 too)."""
        found = self.ip_quotas.resolve(normalize_address(address))
        bucket = None if found is None else self.buckets.get(found.bucket)
        return 0.0 if bucket is None else bucket.rate.measure(now_ms)

    def attach_peers(self, peer_rate: PeerRate | None, on_urgent: Callable[[], None] | None = None) -> None:
        """Decide on local + peers' rates from now on (None: alone again). `on_urgent` (no I/O) is
        called once a bucket's own rate rose by URGENT_CHANGE_RATIO of its bound since peers were
        told: the fleet then sends `urgent_ip_usage` at once, as for the client quotas' buckets."""
        self.peers = peer_rate
        self._on_urgent = on_urgent if peer_rate is not None else None
        self._urgent_keys = set()

    def _urgent_rise(self, bound: int) -> float:
        """How far a bucket's rate may rise before it asks for an urgent report (URGENT_IP_CONNECTIONS)."""
        window = self.window
        # half a connection short of the count, over the longest window: the count'th connection asks
        # whatever the window's padded length (Kafka's rate is count / a window that grows to it)
        connections = (URGENT_IP_CONNECTIONS - 0.5) * 1000.0 / (window.samples * window.window_ms)
        return min(URGENT_CHANGE_RATIO * bound, connections)

    def _ask_urgent(self, key: str, bucket: _IpBucket) -> None:
        bucket.urgent_above = math.inf  # listed soon: that resets it
        first = not self._urgent_keys
        self._urgent_keys.add(key)
        if first and self._on_urgent is not None:
            self._on_urgent()

    def ip_usage(self, now_ms: int, keys: Iterable[str] | None = None) -> list[IpBucketUsage]:
        """Every charged IP bucket's absolute windowed count and rate, or those of `keys`, in their
        order (a key whose bucket has gone is skipped). Buckets no entity leads to are left out:
        peers drop them as they age. What is listed counts as told to peers.

        `keys` are looked up one by one, so measuring a slice of a full report's listing costs the
        slice, not every live bucket (up to `max_buckets`) for each slice."""
        buckets = self.buckets
        listed: Iterable[tuple[str, _IpBucket]]
        if keys is None:
            listed = buckets.items()
        else:
            listed = ((key, bucket) for key in keys if (bucket := buckets.get(key)) is not None)
        out: list[IpBucketUsage] = []
        for key, bucket in listed:
            if bucket.bound is None:
                continue
            rate = bucket.rate.measure(now_ms)
            bucket.reported = rate
            bucket.urgent_above = rate + self._urgent_rise(bucket.bound)
            out.append(IpBucketUsage(key, bucket.rate.total(now_ms), rate))
        if keys is None:
            self._urgent_keys = set()
        return out

    def take_charged(self) -> set[str]:
        """The buckets charged since the previous call (in a fleet): what a delta report lists."""
        charged, self._charged = self._charged, set()
        return charged

    def urgent_ip_usage(self, now_ms: int) -> list[IpBucketUsage]:
        """The buckets that asked for an urgent report since they were last listed."""
        keys, self._urgent_keys = self._urgent_keys, set()
        return self.ip_usage(now_ms, keys) if keys else []

    @property
    def live_buckets(self) -> int:
        return len(self.buckets)


__all__ = [
    "ACCEPTED", "OVERFLOW_KEY", "ConnectionCountError", "ConnectionDecision", "ConnectionQuotas",
    "IpBucketUsage", "ListenerQuota", "PeerRate",
]
