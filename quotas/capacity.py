"""Cluster capacity shared by weight: each tenant's demand, its fair share, the capacity throttle.

Kafka's quotas are static caps per entity. A capacity (the `[capacity]` table) says what the whole
fleet may send the cluster per direction: produce bytes/s, fetch bytes/s, request percentage.
While the active tenants' demand fits in it, it throttles nobody. Above it, the capacity is shared
by water-filling (fair_share.py): each tenant gets its weighted max-min fair share, never more
than its own Kafka quota, and what one leaves unused goes to the others.

Tenants. A tenant is found like a quota bucket, through Kafka's eight entity levels, on the
entities that set a `share` (its weight): `share` at `user = "alice"` makes all of alice's client
ids one tenant. A (user, client-id) no `share` entity matches is a tenant of its own with weight 1.

Demand, and how it is estimated while a tenant is throttled (the hard part: a throttled client
sends what it is allowed, so its true demand is hidden). Each tenant's rate is Kafka's windowed
rate (11 x 1 s) of what it was charged, summed over the fleet. Following how max-min allocators
that cannot ask their clients estimate demand (a flow held at its allocation is "bottlenecked",
as in max-min flow control and DRF's progressive filling; Strimzi's plugin has no demand notion),
a tenant is taken as *greedy* when the capacity throttled it since the previous refresh (the
direct evidence of hidden demand), or when its rate reaches GREEDY_RATIO of its allocation: it is
using what it was given, so it may want more. A greedy tenant claims the whole capacity (bounded
by its own quota). Any other tenant claims HEADROOM times its rate: room to grow before the next
refresh, and stable (its rate is 1/HEADROOM of its claim, below GREEDY_RATIO, so it stays
non-greedy until it really grows). A tenant younger than the padded window is measured over the time it has
existed, not over Kafka's padded window (which shows a new client's rate low: that is its burst
allowance, and its throttle still uses it). The price of the headroom: up to HEADROOM - 1 of the
non-greedy tenants' rates stays reserved for their growth, never more than that.

Allocations are recomputed every `refresh` (the I/O layer calls it every REFRESH_INTERVAL_MS);
a charge only records into its tenant's rate and, while the capacity binds, its token bucket.

The capacity throttle is a token bucket per tenant refilled at its weight times the water level
(the allocation a greedy tenant of its weight gets), with a burst of one second of it (the
"smooth" shape's bucket, token_bucket.py), used only while the capacity binds. Not Kafka's
windowed formula: with an 11 s padded window, greedy tenants move in an 11 s sawtooth, all
bursting at once when their windows expire, so the cluster would see several times the capacity
for seconds at a time, which is what a capacity exists to prevent (in simulation the shares also
came out 0.70 / 0.18 / 0.18 instead of 0.60 / 0.20 / 0.20). The throttle is bounded by
MAX_CAPACITY_THROTTLE_WINDOWS windows. The engine returns the larger of it and the quotas'
throttle; Kafka's quotas keep their exact semantics. Refilling every tenant at its weighted level,
not at its claim, means a tenant is never throttled below its fair share: one that grows past
its claim is served up to its share at once and becomes greedy at the next refresh (its rate
rises, or the level throttles it); until then the total may pass the capacity by that growth.

In a fleet, each member lists its tenants' own rates in the usage exchange (CapacityStream
entries) and adds its peers' to them at every refresh, so every member computes the same
allocation from the same fleet-wide demand. A member's bucket for a tenant refills at the
allocation minus what its peers report for that tenant (at least FLEET_MIN_SLICE of it, so a
tenant moving to this member can grow here). How large the capacity is while the brokers are
strained (the adaptive factor, its fleet merge, the capacity learned without a static one) is
capacity_factor.py's job; this module asks it (`factor_state`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .adaptive_capacity import CONTROLLERS, AdaptiveConfig
from .capacity_factor import CapacityFactor
from .entity import BucketKey, PrefixIndex, QuotaEntity, prefix_bucket_entities, resolve
from .fair_share import Claim, water_fill
from .fleet import PeerUsage, UsageEntry
from .rate import DEFAULT_WINDOW, WindowConfig, WindowedRate
from .token_bucket import BURST_MS, TokenBucket
from .types import CAPACITY_STREAMS, CapacityStream, QuotaType

#: The directions a capacity can be given for, and their `[capacity]` keys (the quota keys' names).
DIRECTIONS: tuple[QuotaType, ...] = (QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST)

#: A non-greedy tenant claims this many times its rate.
HEADROOM = 1.2

#: A tenant whose rate reached this share of its allocation is greedy (claims all it may have).
GREEDY_RATIO = 0.9

#: How often the I/O layer recomputes the allocations (`refresh`).
REFRESH_INTERVAL_MS = 200


#: A capacity throttle lasts at most this many quota windows (10 s by default): allocations move as
#: tenants come and go, so one delay should not outlast the share it was computed from, yet a
#: client sending large requests must still be held to its share on average.
MAX_CAPACITY_THROTTLE_WINDOWS = 10

#: In a fleet, a member's part of a tenant's allocation is at least this share of it.
FLEET_MIN_SLICE = 0.1

#: Tenants tracked per direction; past it, new ones share one overflow tenant (like the buckets).
DEFAULT_MAX_TENANTS = 50_000
OVERFLOW_TENANT = BucketKey("__overflow__", "__overflow__")

_UNLIMITED = math.inf
#: the slowest a bucket refills (units/s): a capacity of 0 would otherwise never refill it
_MIN_REFILL = 1e-3


class CapacityError(ValueError):
    """An invalid `[capacity]` setting; the message names the key and the value."""


#: The adaptive tuning's `[capacity]` keys and what each must be (AdaptiveConfig's fields).
_TUNING_RULES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("min_fraction", lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ("latency_tolerance", lambda v: v > 1, "must be > 1"),
    ("decrease_factor", lambda v: 0 < v < 1, "must be in (0, 1)"),
    ("increase_step", lambda v: 0 < v <= 1, "must be in (0, 1]"),
)


def check_tuning(tuning: AdaptiveConfig) -> AdaptiveConfig:
    """Adaptive tuning as a `[capacity]` table gives it; the error names the key and the value."""
    for name, valid, rule in _TUNING_RULES:
        value = getattr(tuning, name)
        if not valid(value):
            raise CapacityError(f"capacity.{name} = {value!r} {rule}")
    if tuning.controller not in CONTROLLERS:
        names = [f'"{name}"' for name in CONTROLLERS]
        raise CapacityError(f"capacity.controller = {tuning.controller!r} must be "
                            f"{', '.join(names[:-1])} or {names[-1]}")
    return tuning


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    """The `[capacity]` table: what the fleet may send the cluster, per direction (None: no limit)."""

    produce_byte_rate: float | None = None
    fetch_byte_rate: float | None = None
    request_percentage: float | None = None
    #: scale the capacity with the brokers' health with this tuning (adaptive_capacity.py);
    #: None: adaptive mode is off. One table says it all, so the tuning is held, not copied.
    adaptive: AdaptiveConfig | None = None

    def __post_init__(self) -> None:
        for name in ("produce_byte_rate", "fetch_byte_rate", "request_percentage"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise CapacityError(f"capacity.{name} = {value!r} must be a number > 0")
        if self.adaptive is not None:
            check_tuning(self.adaptive)
        elif self.static() == {}:
            raise CapacityError("[capacity] gives no produce_byte_rate, fetch_byte_rate or "
                                "request_percentage, and adaptive is off: it would limit nothing")

    def static(self) -> dict[QuotaType, float]:
        """The directions given a static capacity."""
        values = {QuotaType.PRODUCE: self.produce_byte_rate, QuotaType.FETCH: self.fetch_byte_rate,
                  QuotaType.REQUEST: self.request_percentage}
        return {direction: value for direction, value in values.items() if value is not None}

    def tracked(self) -> tuple[QuotaType, ...]:
        """The directions whose demand is measured: the static ones, or all three when adaptive
        (adaptive mode without a static capacity learns one from the healthy throughput)."""
        if self.adaptive is not None:
            return DIRECTIONS
        static = self.static()
        return tuple(direction for direction in DIRECTIONS if direction in static)


class CapacityCharge(NamedTuple):
    """What one charge to the capacity decided (`CapacityManager.record`)."""

    #: the capacity throttle it causes (0: within its share)
    throttle_ms: int
    #: whether the tenant's bucket was in debt before it: a fetch that finds it out of debt is
    #: delivered and paid back by its throttle (as the smooth shape does), else a response larger
    #: than the burst would be emptied every time
    in_debt: bool


#: A charge that nothing binds (the usual case: no allocation made).
UNMETERED = CapacityCharge(0, False)


class Flow:
    """One tenant's traffic in one direction."""

    __slots__ = ("allocation", "cap", "demand", "first_ms", "greedy", "key", "local_allocation", "peer_rate",
                 "pending", "rate", "reported", "shadow_throttle_count", "shadow_throttle_total_ms",
                 "throttle_count", "throttle_total_ms", "throttled_until_ms",
                 "tokens", "weight")

    def __init__(self, key: BucketKey, weight: float, window: WindowConfig, now_ms: int) -> None:
        self.key = key
        self.weight = weight
        self.rate = WindowedRate(window)
        #: charged since the rate was last brought up to date (`own_rate`, `roll`): the hot path
        #: adds here, and a refresh (every 200 ms) records it, so a charge costs one addition
        self.pending = 0.0
        self.first_ms = now_ms
        #: its fair allocation (inf: the capacity does not bind now), and this member's part of it
        self.allocation = _UNLIMITED
        self.local_allocation = _UNLIMITED
        #: the bucket that throttles it while the capacity binds (None: full, or not binding)
        self.tokens: TokenBucket | None = None
        #: its own Kafka quota in this direction, as last charged (None: no quota)
        self.cap: float | None = None
        #: its demand as estimated at the last refresh: what it claimed in the water-filling
        #: (HEADROOM x its rate, or all it may have when greedy), or its rate when nothing binds
        self.demand = 0.0
        self.greedy = True
        #: peers' rate for this tenant at the last refresh (added to its own when deciding)
        self.peer_rate = 0.0
        #: its own rate when last listed for the fleet
        self.reported = 0.0
        self.throttled_until_ms = 0
        self.throttle_total_ms = 0
        self.throttle_count = 0
        self.shadow_throttle_total_ms = 0
        self.shadow_throttle_count = 0

    def roll(self, now_ms: int) -> None:
        """Record what is pending into the windowed rate (at most a refresh interval late: its
        windows are a second long, and the rate spans eleven)."""
        if self.pending:
            self.rate.record(self.pending, now_ms)
            self.pending = 0.0

    def own_rate(self, now_ms: int) -> float:
        """This member's windowed rate for the tenant (Kafka's), up to date."""
        self.roll(now_ms)
        return self.rate.measure(now_ms)


@dataclass(slots=True)
class DirectionState:
    """One direction's tenants and what the last refresh decided."""

    direction: QuotaType
    flows: dict[BucketKey, Flow] = field(default_factory=dict)
    #: (user, client-id) -> its tenant's flow: one lookup on the hot path (cleared when tenants or
    #: shares change, or a flow goes)
    clients: dict[tuple[str, str], Flow] = field(default_factory=dict)
    #: whether the capacity binds: some allocation is below its claim
    contended: bool = False
    #: the capacity shared at the last refresh (None: no limit now)
    effective: float | None = None
    #: the water level: a greedy tenant of weight w is allocated w x level (0: not binding)
    level: float = 0.0
    #: fleet-wide rate (own + peers') summed over tenants at the last refresh
    total_rate: float = 0.0
    #: when the last refresh ran
    refreshed_ms: int = 0
    #: what was sent since the last refresh unmetered (nothing bound, or by a tenant new since
    #: then, which has no allocation yet): past one refresh
    #: interval's worth of the capacity, `record` refreshes at once. Without it, consumers starting
    #: together fetched 14x a fetch capacity for the seconds before the first refreshes saw them
    #: (each fetch response is megabytes, answered in milliseconds while nothing binds). A refresh
    #: costs O(tenants), but how many run early is bounded by bytes, not time: each needs another
    #: interval's worth, and the demands reach the capacity within a window's worth of it.
    unmetered: float = 0.0
    #: `unmetered` past this refreshes early: one refresh interval's worth of `effective` (inf: none)
    early_after: float = math.inf
    #: the highest `total_rate` a refresh saw (what "light" is judged against without a capacity)
    peak_rate: float = 0.0
    #: tenants only peers report, with their rate, at the last refresh
    peer_only: dict[BucketKey, float] = field(default_factory=dict)
    #: allocations of tenants only peers report, for their greediness at the next refresh
    peer_allocations: dict[BucketKey, float] = field(default_factory=dict)


class CapacityManager:
    """The capacity per direction, its tenants and their fair allocations."""

    def __init__(self, window: WindowConfig = DEFAULT_WINDOW, *,
                 max_tenants: int = DEFAULT_MAX_TENANTS, max_throttle_ms: int | None = None) -> None:
        """`max_throttle_ms`: the proxy's `max_throttle_time_ms`, below the capacity's own bound."""
        self.window = window
        self.max_tenants = max_tenants
        self.config: CapacityConfig | None = None
        #: each tracked direction's state, by the direction's config name (`QuotaType.value`: the
        #: hot path's lookup, as an enum's own hash is a Python call); `directions` lists them
        self._states: dict[str, DirectionState] = {}
        #: `share` entities in force (Kafka's precedence resolves them)
        self.shares: dict[QuotaEntity, float] = {}
        self._share_prefixes = PrefixIndex(())
        self._tenants: dict[tuple[str, str], tuple[BucketKey, float]] = {}
        #: the adaptive factor in force and what it scales without a static capacity (its
        #: `controller` is set by the I/O layer, proxy/capacity/live.py)
        self.factor_state = CapacityFactor()
        self.max_throttle_ms = MAX_CAPACITY_THROTTLE_WINDOWS * window.window_ms
        if max_throttle_ms is not None:
            self.max_throttle_ms = min(self.max_throttle_ms, max_throttle_ms)
        #: the latest end of any capacity throttle (a quick test for `remaining_throttle_ms`)
        self.throttled_until_ms = 0
        #: the fleet's merged peer usage (None: a lone proxy)
        self.peers: PeerUsage | None = None
        self._charged: dict[QuotaType, set[BucketKey]] = {}

    # -- configuration ------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.config is not None

    @property
    def active(self) -> bool:
        """Whether some direction is tracked (what the engine tests before charging)."""
        return bool(self._states)

    @property
    def directions(self) -> dict[QuotaType, DirectionState]:
        """Each tracked direction's state (a view made on each call: not for the hot path)."""
        return {state.direction: state for state in self._states.values()}

    @property
    def factor(self) -> float:
        """The adaptive factor in force (1.0: the whole capacity; see capacity_factor.py)."""
        return self.factor_state.factor

    def configure(self, config: CapacityConfig | None) -> None:
        """Apply a `[capacity]` table (None: none); tenants' histories stay where they apply."""
        self.config = config
        tracked = config.tracked() if config is not None else ()
        states = self._states
        self._states = {direction._value_: states.get(direction._value_) or DirectionState(direction)
                        for direction in tracked}
        self._charged = {direction: self._charged.get(direction, set()) for direction in tracked}

    def set_shares(self, shares: Mapping[QuotaEntity, float]) -> None:
        """The `share` entities in force; every live tenant takes its new weight at once."""
        self.shares = dict(shares)
        self._share_prefixes = PrefixIndex(self.shares)
        self._tenants = {}
        for state in self._states.values():
            state.clients = {}
            for flow in state.flows.values():
                flow.weight = self._weight(flow.key)

    def tenant(self, user: str, client_id: str) -> tuple[BucketKey, float]:
        """The tenant (user, client-id) belongs to and its weight (cached until shares change)."""
        found = self._tenants.get((user, client_id))
        if found is None:
            resolved = resolve(self.shares, user, client_id, self._share_prefixes) if self.shares else None
            found = resolved if resolved is not None else (BucketKey(user, client_id), 1.0)
            if len(self._tenants) >= 4 * self.max_tenants:
                self._tenants = {}
            self._tenants[(user, client_id)] = found
        return found

    def _weight(self, key: BucketKey) -> float:
        """The weight of a tenant known by its key (a peer's, or one whose shares changed)."""
        if key == OVERFLOW_TENANT:
            return 1.0
        for entity in prefix_bucket_entities(key):  # a client-id prefix's tenant names no client id
            share = self.shares.get(entity)
            if share is not None:
                return share
        return self.tenant(key.user, key.client_id)[1]

    def capacity(self, direction: QuotaType) -> float | None:
        """The capacity in force for `direction` now: the static one, or the learned one while
        the factor is below 1, scaled by the factor (None: no limit)."""
        config = self.config
        if config is None:
            return None
        return self.factor_state.scale(direction, config.static().get(direction))

    # -- the hot path ------------------------------------------------------------------------

    def record(self, direction: QuotaType, user: str, client_id: str, value: float,
               cap: float | None, now_ms: int) -> CapacityCharge:
        """Count one charge to its tenant: the capacity throttle it causes, and whether its bucket
        was in debt before it (see CapacityCharge)."""
        state = self._states.get(direction._value_)  # an enum's own hash is a Python call
        if state is None:
            return UNMETERED
        flow = state.clients.get((user, client_id))
        if flow is None:
            flow = self._flow(state, user, client_id, now_ms)
        flow.cap = cap
        flow.pending += value
        if self.peers is not None:
            self._charged[direction].add(flow.key)
        allocation = flow.local_allocation
        if not state.contended or allocation == _UNLIMITED:
            state.unmetered += value  # nothing binds, or a tenant new since the refresh
            if state.unmetered > state.early_after:
                self._refresh_direction(state, now_ms)
            return UNMETERED
        tokens = flow.tokens
        if tokens is None:
            tokens = flow.tokens = TokenBucket()
        burst = allocation * BURST_MS / 1000.0
        level = tokens.refill(allocation, burst, now_ms)  # one refill for the test and the take
        in_debt = level < 0.0
        if in_debt and direction is QuotaType.FETCH:
            # answered empty (see QuotaEngine): not charged, held until the bucket is back at zero
            tokens.tokens = level
            throttle = math.ceil(-level / allocation * 1000.0)
        else:
            level -= value
            tokens.tokens = level if level < burst else burst
            throttle = 0 if level >= 0.0 else math.ceil(-level / allocation * 1000.0)
        if throttle > 0:
            if throttle > self.max_throttle_ms:
                throttle = self.max_throttle_ms
            until = now_ms + throttle
            if until > flow.throttled_until_ms:
                flow.throttled_until_ms = until
                if until > self.throttled_until_ms:
                    self.throttled_until_ms = until
        return CapacityCharge(throttle, in_debt)

    def _flow(self, state: DirectionState, user: str, client_id: str, now_ms: int) -> Flow:
        """The flow of (user, client-id)'s tenant, made if new (past `max_tenants`, the overflow
        tenant's), and remembered for the next lookup."""
        key, weight = self.tenant(user, client_id)
        flows = state.flows
        flow = flows.get(key)
        if flow is None:
            if len(flows) >= self.max_tenants:
                key, weight = OVERFLOW_TENANT, 1.0
                flow = flows.get(key)
            if flow is None:
                flow = flows[key] = Flow(key, weight, self.window, now_ms)
        if len(state.clients) >= 4 * self.max_tenants:
            state.clients = {}
        state.clients[(user, client_id)] = flow
        return flow

    def _known(self, direction: QuotaType, user: str, client_id: str) -> Flow | None:
        """The flow (user, client-id) was last charged to, if any (no new one is made)."""
        state = self._states.get(direction._value_)
        if state is None:
            return None
        flow = state.clients.get((user, client_id))
        if flow is None:
            flow = state.flows.get(self.tenant(user, client_id)[0]) or state.flows.get(OVERFLOW_TENANT)
        return flow

    def unrecord(self, direction: QuotaType, user: str, client_id: str, value: float, now_ms: int,
                 tokens: bool = True) -> None:
        """Take a charge back (a throttled fetch's records are not delivered); `tokens`: its
        bucket was charged too (a fetch that found it in debt was not)."""
        flow = self._known(direction, user, client_id)
        if flow is not None:
            flow.pending -= value
            if tokens and flow.tokens is not None and flow.local_allocation != _UNLIMITED:
                flow.tokens.unrecord(value, flow.local_allocation, now_ms)

    def record_throttle(self, direction: QuotaType, user: str, client_id: str, throttle_ms: int, *,
                        shadow: bool = False) -> None:
        """Count a throttle the capacity decided (the larger one of its request); `shadow`: computed
        and reported, not applied (shadow.py), counted apart."""
        flow = self._known(direction, user, client_id)
        if flow is None:
            return
        if shadow:
            flow.shadow_throttle_total_ms += throttle_ms
            flow.shadow_throttle_count += 1
        else:
            flow.throttle_total_ms += throttle_ms
            flow.throttle_count += 1

    def unthrottle(self, user: str, client_id: str) -> None:
        """Hold nothing for the tenant in any direction: its throttles were reported only (shadow.py)."""
        for direction in self.directions:
            flow = self._known(direction, user, client_id)
            if flow is not None:
                flow.throttled_until_ms = 0

    def remaining_throttle_ms(self, direction: QuotaType, user: str, client_id: str, now_ms: int) -> int:
        """How long the tenant stays throttled by the capacity in `direction` (0: not)."""
        if now_ms >= self.throttled_until_ms:
            return 0
        flow = self._known(direction, user, client_id)
        # exactly the throttle's end (a quota's hold ends 1 ms early): a held fetch that arrived
        # before the bucket is back at zero would be answered empty
        return 0 if flow is None else max(flow.throttled_until_ms - now_ms, 0)

    # -- the periodic refresh ------------------------------------------------------------------

    def refresh(self, now_ms: int) -> None:
        """Measure every tenant (own rate plus peers'), estimate demands, share the capacity.

        Also drops tenants whose rate holds no history and whose throttle is over (as bucket
        expiry does): a new flow for the same tenant measures exactly as the old one would.
        """
        for state in self._states.values():
            self._refresh_direction(state, now_ms)

    def _refresh_direction(self, state: DirectionState, now_ms: int) -> None:
        """`refresh` for one direction (also run early from `record`: see DirectionState.unmetered)."""
        direction = state.direction
        view = self.peers.view(CAPACITY_STREAMS[direction]) if self.peers is not None else None
        capacity = self.capacity(direction)
        state.effective = capacity
        state.early_after = math.inf if capacity is None else capacity * REFRESH_INTERVAL_MS / 1000.0
        claims: list[Claim[BucketKey]] = []
        #: claims of everything there is: the capacity binds them even when the claims fit
        unbounded: set[BucketKey] = set()
        total = 0.0
        ceiling = capacity if capacity is not None else 0.0
        flows = state.flows
        for key in list(flows):
            flow = flows[key]
            own = self._demand_rate(flow, now_ms)  # rolls what is pending
            peer = view.rate(key, now_ms) if view is not None else 0.0
            flow.peer_rate = peer
            if own == 0.0 and peer == 0.0 and flow.rate.expired(now_ms) \
                    and flow.throttled_until_ms <= now_ms:
                del flows[key]
                state.clients = {}
                continue
            rate = own + peer
            total += rate
            bound = flow.allocation
            flow.greedy = bound != _UNLIMITED and (flow.throttled_until_ms > state.refreshed_ms
                                                   or rate >= GREEDY_RATIO * bound)
            claim = ceiling if flow.greedy else rate * HEADROOM
            if flow.cap is not None and claim > flow.cap:
                claim = flow.cap
            flow.demand = claim if capacity is not None else rate
            if capacity is not None:
                claims.append(Claim(key, claim, flow.weight, flow.cap))
                if flow.greedy and claim >= ceiling:
                    unbounded.add(key)
        peer_only: dict[BucketKey, float] = {}
        if view is not None:
            for wire_key, rate in view.rates(now_ms).items():
                key = BucketKey(*wire_key)
                if key in flows or rate <= 0.0:
                    continue
                peer_only[key] = rate
                total += rate
                if capacity is not None:
                    before = state.peer_allocations.get(key, _UNLIMITED)
                    greedy = before != _UNLIMITED and rate >= GREEDY_RATIO * before
                    claims.append(Claim(key, ceiling if greedy else rate * HEADROOM, self._weight(key)))
                    if greedy:
                        unbounded.add(key)
        state.peer_only = peer_only
        state.total_rate = total
        if total > state.peak_rate:
            state.peak_rate = total
        state.refreshed_ms = now_ms
        state.unmetered = 0.0
        if capacity is None:
            state.contended = False
            for flow in flows.values():
                flow.allocation = flow.local_allocation = _UNLIMITED
                flow.tokens = None
            state.peer_allocations = {}
            return
        allocation = water_fill(capacity, claims)
        # A greedy tenant's claim (the whole capacity) is never satisfied, even when the claims
        # fit (a lone greedy tenant): the capacity binds it, or it would burst every other refresh.
        unsatisfied = [allocation[c.key] / c.weight for c in claims
                       if allocation[c.key] < c.bound or c.key in unbounded]
        state.contended = bool(unsatisfied)
        level = state.level = max(unsatisfied, default=0.0)
        for flow in flows.values():
            if not state.contended:
                flow.allocation = flow.local_allocation = _UNLIMITED
                flow.tokens = None
                continue
            flow.allocation = allocation.get(flow.key, _UNLIMITED)
            share = flow.weight * level
            flow.local_allocation = max(share - flow.peer_rate, FLEET_MIN_SLICE * share, _MIN_REFILL)
        state.peer_allocations = {key: allocation[key] for key in peer_only} if state.contended else {}

    def _demand_rate(self, flow: Flow, now_ms: int) -> float:
        """A tenant's own rate as its demand: Kafka's windowed rate, except that a tenant younger
        than the padded window is measured over the time it has existed. Kafka pads a new
        client's window to (samples - 1) windows, which shows its rate low (that is its burst
        allowance, and the throttle keeps it); as a demand estimate that would read a new tenant
        sending at its full rate as a tenant wanting a tenth of it."""
        flow.roll(now_ms)
        rate = flow.rate
        window = self.window
        age = now_ms - flow.first_ms
        if age >= (window.samples - 1) * window.window_ms:
            return rate.measure(now_ms)
        return rate.total(now_ms) * 1000.0 / max(age, window.window_ms)

    # -- the fleet ----------------------------------------------------------------------------

    def attach_fleet(self, peers: PeerUsage | None) -> None:
        """Add peers' rates per direction from now on (None: alone again)."""
        self.peers = self.factor_state.peers = peers
        self._charged = {state.direction: set() for state in self._states.values()}

    def local_usage(self, now_ms: int, changed_only: bool) -> list[UsageEntry]:
        """Each tenant's own rate for the fleet's report; `changed_only`: tenants charged since the
        last delta listing whose rate moved by more than 1 % of it (or of their allocation)."""
        out: list[UsageEntry] = []
        for state in self._states.values():
            direction = state.direction
            stream = CAPACITY_STREAMS[direction]
            charged = self._charged.get(direction, set())
            self._charged[direction] = set()
            keys = charged if changed_only else list(state.flows)
            for key in keys:
                flow = state.flows.get(key)
                if flow is None:
                    continue
                rate = self._demand_rate(flow, now_ms)
                if changed_only and abs(rate - flow.reported) <= 0.01 * max(rate, flow.reported):
                    continue
                flow.reported = rate
                out.append(UsageEntry(stream, key.user, key.client_id, rate))
        return out

    def list_flows(self, stream: CapacityStream, keys: Iterable[BucketKey], now_ms: int) -> list[UsageEntry]:
        """Measure and list these tenants of one stream (gone ones skipped), for a full report."""
        for state in self._states.values():
            if CAPACITY_STREAMS[state.direction] is stream:
                out = []
                for key in keys:
                    flow = state.flows.get(key)
                    if flow is not None:
                        flow.reported = rate = self._demand_rate(flow, now_ms)
                        out.append(UsageEntry(stream, key.user, key.client_id, rate))
                return out
        return []

    def factor_usage(self) -> list[UsageEntry]:
        """This member's own adaptive factor, for every report (adaptive mode only)."""
        config = self.config
        if config is None or config.adaptive is None:
            return []
        return self.factor_state.usage()

    def update_factor(self, now_ms: int) -> float:
        """Bring the factor in force up to date from this refresh's fleet-wide rates."""
        totals = {state.direction: state.total_rate for state in self._states.values()}
        return self.factor_state.update(totals, now_ms)

    def light(self) -> bool:
        """Whether the load is light now (CapacityFactor.light); False without a capacity."""
        config = self.config
        if config is None:
            return False
        states = self.directions
        return self.factor_state.light(config.static(),
                                       {direction: state.total_rate for direction, state in states.items()},
                                       {direction: state.peak_rate for direction, state in states.items()})


__all__ = [
    "DEFAULT_MAX_TENANTS", "DIRECTIONS", "GREEDY_RATIO", "HEADROOM", "MAX_CAPACITY_THROTTLE_WINDOWS",
    "OVERFLOW_TENANT", "REFRESH_INTERVAL_MS", "UNMETERED", "CapacityCharge", "CapacityConfig",
    "CapacityError", "CapacityManager", "DirectionState", "Flow", "check_tuning",
]
