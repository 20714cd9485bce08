"""How many requests each broker has in flight from this proxy, and whose goes next.

Why (issue 27): a byte-rate capacity cannot keep a saturated broker's queue short. A throttled
Kafka client is muted and then sends its backlog at once, and a broker serves its request queue in
arrival order, so the protected tenant's small request waits behind every best-effort batch queued
at the broker (on the overload bed, even a static capacity of 0.85 x the broker's left gold's p99
at 27 x quiet). Envoy's adaptive concurrency filter and Netflix's concurrency-limits bound requests
in flight instead; so does this, per broker, with Kafka's `share` deciding who waits:

- **A broker takes at most `limit` requests** from this proxy. A request over it waits in the proxy
  (its connection stops being read, as a muted one does, so its memory is bounded by
  `queued_max_request_bytes`).
- **A tenant whose share of the limit is a whole slot or more owns one** (Netflix
  concurrency-limits' partitioned limiter, reduced to the one slot that decides latency): a tenant
  that asked within the last ACTIVE_MS, with limit x share / the active tenants' shares >= 1, may
  always have one request at the broker. Others' requests go only while the limit has room beside
  the owned slots nobody is using. Gold (share 10 of 13) owns its slot from a limit of 1.3 on, so
  its next request never waits for a best-effort one to finish. Without it, gold waited for a
  completion first (p99 16-31 ms on the bed). Owning a whole share (floor(limit x share / shares)
  slots) kept the best-effort tenants to one request in flight between them at most limits, and
  goodput fell to 0.86-0.90 x direct, against 1.02-1.10 x with one slot. A cap that let every
  tenant's first request through was also tried: three best-effort tenants then always had three
  batches at the broker beside gold's request, and gold's p99 stayed at 54 ms.
- **When one completes, the slot goes to the waiting tenant with the fewest in flight per unit of
  share once it has it** (a weighted fair queue: share 10 gets ten slots to share 1's one; ties
  first come, first served). Nobody starves: with nothing in flight, any request goes.
- **The limit follows the broker's latency** per window of WINDOW_MS (AIMD, as TCP's window): when
  the window's p99 of completed requests (its p90 below TAIL_SAMPLES) is above `tolerance` x the
  broker's healthy baseline (the adaptive controller's, learned while the load is light) + SLACK_MS,
  it is cut by DECREASE_FACTOR (from what was in flight, if fewer); when the latency is under, it
  grows by sqrt(limit) (Gradient2's queue allowance), from MIN_LIMIT up to MAX_LIMIT, where nothing waits any
  more (from 1 back there in 15 windows, under 4 s).
- **After a cut in a window where counted Fetches were answered, it grows by AVOIDANCE_STEP** for
  AVOIDANCE_WINDOWS windows, then by sqrt(limit) again (TCP's congestion avoidance after a loss).
  What one more slot costs the broker depends on what fills it: a produce batch is ~16 KB of its
  work, a catching-up consumer's Fetch up to FETCH_BYTES_WHILE_LIMITED (512 KB), and a second
  Fetch beside gold's request is only a queue. On the fetch bed, sqrt growth took the limit from 2
  to 5.3 in half a second after each cut; in alternating phases, growing by half a slot met gold's
  (then looser) p99 target in 10 phases of 12 against sqrt's 6, and in one bed read 6.0-6.8 ms
  where sqrt read 6.7-14.7 and one consumer paced evenly, one Fetch at a time, directly (the floor),
  6.2-13.8. Without Fetches the growth stays sqrt: half a slot on the produce bed cost goodput
  (0.92-1.03 x direct against 1.04-1.08 x; docs/protecting-the-cluster.md).

Counted: Produce with acks=1/all, the request that queues work at a broker (compression, appends,
replication), whose response ends it; and the Fetch of a consumer catching up, which makes a
broker read and (over TLS) encrypt what it sends (protocol/broker_admission.py). acks=0 has no
response to end it, and a caught-up consumer's Fetch waits out its max_wait_ms by design, so
neither is counted. Only Produce times are sampled: a Fetch's includes its long poll.

Per proxy process: a fleet of N holds each broker to N x the limit (each member learns its own).
Pure: time is passed in, the waiter is whatever the I/O layer wants woken.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

W = TypeVar("W")

#: A window's p99 is judged from this many completed requests on; below, its p90.
TAIL_SAMPLES = 100
#: The limit is judged once per this window of completed requests.
WINDOW_MS = 250
#: A window is judged only with this many completed requests (a tail of two is noise).
MIN_WINDOW_SAMPLES = 3
MIN_LIMIT = 1.0
#: At this limit nothing waits: the broker is not in trouble, the proxy stays out of the way.
MAX_LIMIT = 64.0
DECREASE_FACTOR = 0.7
#: After a cut in a window where counted Fetches were answered, the limit grows by this much per
#: window for AVOIDANCE_WINDOWS windows (the module's docstring says why).
AVOIDANCE_STEP = 0.5
AVOIDANCE_WINDOWS = 4
#: Added to tolerance x baseline. A broker's queue shows in the tail within a millisecond or two:
#: on the bed, 3 ms let gold's p99 reach 6.8-8.8 ms (targets 6.2-6.6 ms) where 1 ms held it at
#: 5.4-6.1 ms; the adaptive factor's 5 ms (adaptive_capacity.py) would let ~5 ms queue.
SLACK_MS = 1.0
DEFAULT_TOLERANCE = 2.0
#: A tenant that asked within this long counts as active: its slot stays its own between its
#: requests (gold sends one every 5 ms; a slower tenant loses its slot after a quiet second).
ACTIVE_MS = 1000.0
#: The active tenants' shares are summed again at most this often (and whenever one arrives), so a
#: request costs a look at the few tenants that own slots, never at every tenant.
REFRESH_MS = 50.0


def tail(samples: list[float]) -> float:
    """The window's p99, or its p90 when it has fewer than TAIL_SAMPLES (a p99 of fewer is its
    maximum, and one slow answer in a light window is noise, not a queue)."""
    ordered = sorted(samples)
    share = 0.99 if len(ordered) >= TAIL_SAMPLES else 0.9
    return ordered[max(math.ceil(share * len(ordered)) - 1, 0)]


@dataclass(slots=True)
class _Tenant(Generic[W]):
    weight: float
    in_flight: int = 0
    waiting: deque[W] = field(default_factory=deque)
    #: arrival order of its oldest waiter (ties between equally served tenants)
    since: int = 0
    #: when it last asked for a slot (ms): active until ACTIVE_MS after
    seen_ms: float = 0.0
    #: slots of the limit it owns (one, if its share of the limit is one or more), as of the last refresh
    owned: int = 0


@dataclass(frozen=True, slots=True)
class LimitChange:
    broker: int
    old: float
    new: float
    #: the window's tail (tail()) and the latency it was judged against, in ms
    tail_ms: float
    bound_ms: float


class BrokerSlots(Generic[W]):
    """One broker: its limit, who has requests in flight there, who waits."""

    def __init__(self, broker: int) -> None:
        self.broker = broker
        self._limit = MAX_LIMIT
        self.in_flight = 0
        self._tenants: dict[Hashable, _Tenant[W]] = {}
        self._waiting = 0
        self._order = 0
        self._window_end: float | None = None
        self._samples: list[float] = []
        #: the most in flight at once in this window (was the limit reached?)
        self._peak = 0
        #: a counted Fetch was answered in this window (its slot held a large piece of the broker's work)
        self._fetched = False
        #: windows left of growing by AVOIDANCE_STEP (after a cut while Fetches held slots)
        self._avoiding = 0
        #: the active tenants' summed shares, and those owning a slot or more (as of `_refreshed_ms`;
        #: -inf: stale, looked at again on the next request)
        self._active_weight = 0.0
        self._owners: list[_Tenant[W]] = []
        self._refreshed_ms = -math.inf

    @property
    def limit(self) -> float:
        """Requests this broker may have in flight from this proxy (MAX_LIMIT: nothing waits)."""
        return self._limit

    @limit.setter
    def limit(self, value: float) -> None:
        """A new limit changes the slots each tenant owns: they are looked at again on the next request."""
        self._limit = value
        self._refreshed_ms = -math.inf

    @property
    def waiting(self) -> int:
        return self._waiting

    def owned(self, tenant: Hashable) -> int:
        """The slots `tenant` owns now: 1 if its share of the limit is a whole slot, else 0."""
        entry = self._tenants.get(tenant)
        return 0 if entry is None else entry.owned

    def acquire(self, tenant: Hashable, weight: float, waiter: W, now_ms: float) -> bool:
        """A request of `tenant` may go now (True, counted in flight), or `waiter` waits its turn
        (False; `release` returns it when its turn comes, already counted)."""
        entry = self._tenant(tenant, weight, now_ms)
        if self._may_start(entry, queue_empty=self._waiting == 0):
            self._start(entry)
            return True
        if not entry.waiting:
            self._order += 1
            entry.since = self._order
        entry.waiting.append(waiter)
        self._waiting += 1
        return False

    def start_anyway(self, tenant: Hashable, weight: float, now_ms: float) -> bool:
        """A request of `tenant` goes now, counted in flight, whatever the limit (shadow mode:
        quotas/shadow.py); returns whether it would have gone without waiting."""
        entry = self._tenant(tenant, weight, now_ms)
        within = self._may_start(entry, queue_empty=self._waiting == 0)
        self._start(entry)
        return within

    def _tenant(self, tenant: Hashable, weight: float, now_ms: float) -> _Tenant[W]:
        entry = self._tenants.get(tenant)
        if entry is None:  # the others' shares shrink: only the few owners need a new look
            entry = self._tenants[tenant] = _Tenant(weight, seen_ms=now_ms)
            self._active_weight += weight
            self._owners.append(entry)
            self._owners = [owner for owner in self._owners if self._own(owner)]
        else:
            if entry.weight != weight or now_ms - entry.seen_ms >= ACTIVE_MS:
                self._refreshed_ms = -math.inf  # its share changed, or it is active again
            entry.weight = weight
            entry.seen_ms = now_ms
        if self._limit < MAX_LIMIT:  # unlimited, nobody owns anything: no tenant is looked at
            self._refresh(now_ms)
        return entry

    def _refresh(self, now_ms: float) -> None:
        """Sum the active tenants' shares, forget the long idle, and find who owns slots."""
        if now_ms - self._refreshed_ms < REFRESH_MS:
            return
        self._refreshed_ms = now_ms
        idle = [key for key, entry in self._tenants.items()
                if not entry.in_flight and not entry.waiting and now_ms - entry.seen_ms >= ACTIVE_MS]
        for key in idle:
            del self._tenants[key]
        self._active_weight = sum(entry.weight for entry in self._tenants.values())
        self._owners = [entry for entry in self._tenants.values() if self._own(entry)]

    def _own(self, entry: _Tenant[W]) -> bool:
        """Set the slots `entry` owns (one if its share of the limit is a whole slot); whether it owns one."""
        total = self._active_weight
        entry.owned = min(int(self._limit * entry.weight / total), 1) if total > 0 else 0
        return entry.owned > 0

    def _may_start(self, entry: _Tenant[W], queue_empty: bool) -> bool:
        """Within the tenant's own slots; or with nothing in flight; or, with nobody queued ahead,
        within the limit beside the slots other tenants own and do not use."""
        if self._limit >= MAX_LIMIT or entry.in_flight < entry.owned or self.in_flight == 0:
            return True
        if not queue_empty:
            return False
        unused = sum(max(owner.owned - owner.in_flight, 0) for owner in self._owners if owner is not entry)
        return self.in_flight + unused + 1 <= self._limit

    def _start(self, entry: _Tenant[W]) -> None:
        entry.in_flight += 1
        self.in_flight += 1
        self._peak = max(self._peak, self.in_flight)

    def release(self, tenant: Hashable) -> list[W]:
        """A request of `tenant` ended (answered, or its connection closed): the waiters whose turn
        it now is, each already counted in flight."""
        entry = self._tenants.get(tenant)
        if entry is None or entry.in_flight == 0:
            return []
        entry.in_flight -= 1
        self.in_flight -= 1
        if self._limit >= MAX_LIMIT and not entry.in_flight and not entry.waiting:
            self._forget(tenant, entry)  # unlimited: an idle tenant is not kept
        return self._wake()

    def _forget(self, tenant: Hashable, entry: _Tenant[W]) -> None:
        del self._tenants[tenant]
        self._active_weight -= entry.weight
        if entry.owned:  # at most one owner per slot of the limit: a short list
            self._owners = [owner for owner in self._owners if owner is not entry]
            entry.owned = 0

    def cancel(self, tenant: Hashable, waiter: W) -> None:
        """`waiter` no longer waits (its connection closed)."""
        entry = self._tenants.get(tenant)
        if entry is None:
            return
        try:
            entry.waiting.remove(waiter)
        except ValueError:
            return
        self._waiting -= 1

    def drain_waiters(self) -> list[W]:
        """Every waiter, forgotten (the limit is being replaced)."""
        waiters = [waiter for entry in self._tenants.values() for waiter in entry.waiting]
        for entry in self._tenants.values():
            entry.waiting.clear()
        self._waiting = 0
        return waiters

    def _wake(self) -> list[W]:
        """The waiters that may go now, in the weighted fair queue's order; the queue ahead of a
        waiter is the waiters before it that may not go (they wait for slots they do not own)."""
        woken: list[W] = []
        while self._waiting:
            queue = sorted((entry for entry in self._tenants.values() if entry.waiting), key=_order)
            for position, entry in enumerate(queue):
                if self._may_start(entry, queue_empty=position == 0):
                    break
            else:
                break
            woken.append(entry.waiting.popleft())
            self._waiting -= 1
            if entry.waiting:
                self._order += 1
                entry.since = self._order
            self._start(entry)
        return woken

    def fetched(self) -> None:
        """A counted Fetch was answered: a cut in this window makes the limit grow back slowly."""
        self._fetched = True

    def sample(self, latency_ms: float, now_ms: float, bound_ms: float | None) -> LimitChange | None:
        """A completed request's time; at the end of a window, the limit moves (the change, if any).
        `bound_ms`: the latency above which the broker is queueing (None: not known yet)."""
        if self._window_end is None:
            self._window_end = now_ms + WINDOW_MS
        self._samples.append(latency_ms)
        if now_ms < self._window_end:
            return None
        samples, peak, fetched = self._samples, self._peak, self._fetched
        self._samples, self._peak, self._window_end = [], self.in_flight, now_ms + WINDOW_MS
        self._fetched = False
        if bound_ms is None or len(samples) < MIN_WINDOW_SAMPLES:
            return None
        seen = tail(samples)
        old = self._limit
        if seen > bound_ms:
            new = max(MIN_LIMIT, min(old, max(peak, MIN_LIMIT)) * DECREASE_FACTOR)
            self._avoiding = AVOIDANCE_WINDOWS if fetched else 0
        elif self._avoiding:
            self._avoiding -= 1
            new = min(MAX_LIMIT, old + AVOIDANCE_STEP)
        else:
            new = min(MAX_LIMIT, old + math.sqrt(old))
        if new == old:
            return None
        self.limit = new  # a raise lets waiters go: the caller asks `wake_after_raise`
        self._refresh(now_ms)  # the slots each tenant owns follow the limit (the setter made them stale)
        return LimitChange(self.broker, old, new, seen, bound_ms)

    def wake_after_raise(self) -> list[W]:
        """After the limit rose: the waiters that may now go."""
        return self._wake()


def _order(entry: _Tenant[W]) -> tuple[float, int]:
    """Who gets the next slot first: fewer in flight per unit of share once it has it (a weighted
    fair queue's finish order), then the one waiting longer."""
    return (entry.in_flight + 1) / entry.weight, entry.since


class BrokerConcurrency(Generic[W]):
    """Every broker's slots; the latency bound of a broker comes from `baseline(broker)`."""

    def __init__(self, baseline: Callable[[int], float | None],
                 tolerance: float = DEFAULT_TOLERANCE) -> None:
        self._baseline = baseline
        self.tolerance = tolerance
        self.brokers: dict[int, BrokerSlots[W]] = {}

    def slots(self, broker: int) -> BrokerSlots[W]:
        found = self.brokers.get(broker)
        if found is None:
            found = self.brokers[broker] = BrokerSlots(broker)
        return found

    def bound_ms(self, broker: int) -> float | None:
        base = self._baseline(broker)
        return None if base is None else self.tolerance * base + SLACK_MS

    def completed(self, broker: int, tenant: Hashable, latency_ms: float | None,
                  now_ms: float, fetch: bool = False) -> tuple[list[W], LimitChange | None]:
        """A request ended: a Produce answered after `latency_ms`, a Fetch answered (`fetch`, untimed),
        or neither (its connection closed first). Who goes now, and the limit's change if its window
        ended."""
        slots = self.slots(broker)
        change = None
        if fetch:
            slots.fetched()
        elif latency_ms is not None:
            change = slots.sample(latency_ms, now_ms, self.bound_ms(broker))
        woken = slots.release(tenant)
        if change is not None and change.new > change.old:
            woken += slots.wake_after_raise()
        return woken, change


__all__ = [
    "ACTIVE_MS",
    "AVOIDANCE_STEP",
    "AVOIDANCE_WINDOWS",
    "MAX_LIMIT",
    "MIN_LIMIT",
    "WINDOW_MS",
    "BrokerConcurrency",
    "BrokerSlots",
    "LimitChange",
    "tail",
]
