"""How many Produce requests each broker has in flight from this proxy, and whose goes next.

Why (issue 27): a byte-rate capacity cannot keep a saturated broker's queue short. A throttled
Kafka client is muted and then sends its backlog at once, and a broker serves its request queue in
arrival order, so the protected tenant's small request waits behind every best-effort batch queued
at the broker (on the overload bed, even a static capacity of 0.85 x the broker's left gold's p99
at 27 x quiet). Envoy's adaptive concurrency filter and Netflix's concurrency-limits bound requests
in flight instead; so does this, per broker, with Kafka's `share` deciding who waits:

- **A broker takes at most `limit` requests** from this proxy. A request over it waits in the proxy
  (its connection stops being read, as a muted one does, so its memory is bounded by
  `queued_max_request_bytes`).
- **When one completes, the slot goes to the waiting tenant with the fewest in flight per unit of
  share once it has it** (a weighted fair queue: share 10 gets ten slots to share 1's one; ties
  first come, first served). Nobody starves, and a light high-share tenant (gold: a few requests
  at a time) waits for one completion at most. A cap that let every tenant's first request
  through was tried: three best-effort tenants then always had three batches in the broker beside
  gold's request, and gold's p99 stayed at 54 ms on the bed.
- **The limit follows the broker's latency** per window of WINDOW_MS (AIMD, as TCP's window): when
  the window's p90 of completed requests is above `tolerance` x the broker's healthy baseline (the
  adaptive controller's, learned while the load is light) + SLACK_MS, it is cut by
  DECREASE_FACTOR (from what was in flight, if fewer); when the latency is under, it grows by
  sqrt(limit) (Gradient2's queue allowance), from MIN_LIMIT up to MAX_LIMIT, where nothing waits any
  more (from 1 back there in 15 windows, under 4 s).

Produce with acks=1/all only: it is the request that queues work at a broker (compression,
appends, replication), and its response ends it. acks=0 has no response to end it, and a Fetch
waits out its max_wait_ms by design, so neither is counted.

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

#: The limit is judged once per this window of completed requests.
WINDOW_MS = 250
#: A window is judged only with this many completed requests (a p90 of two is noise).
MIN_WINDOW_SAMPLES = 3
MIN_LIMIT = 1.0
#: At this limit nothing waits: the broker is not in trouble, the proxy stays out of the way.
MAX_LIMIT = 64.0
DECREASE_FACTOR = 0.7
SLACK_MS = 5.0
DEFAULT_TOLERANCE = 2.0


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]


@dataclass(slots=True)
class _Tenant(Generic[W]):
    weight: float
    in_flight: int = 0
    waiting: deque[W] = field(default_factory=deque)
    #: arrival order of its oldest waiter (ties between equally served tenants)
    since: int = 0


@dataclass(frozen=True, slots=True)
class LimitChange:
    broker: int
    old: float
    new: float
    #: the window's p90 and the latency it was judged against, in ms
    p90_ms: float
    bound_ms: float


class BrokerSlots(Generic[W]):
    """One broker: its limit, who has requests in flight there, who waits."""

    def __init__(self, broker: int) -> None:
        self.broker = broker
        self.limit = MAX_LIMIT
        self.in_flight = 0
        self._tenants: dict[Hashable, _Tenant[W]] = {}
        self._waiting = 0
        self._order = 0
        self._window_end: float | None = None
        self._samples: list[float] = []
        #: the most in flight at once in this window (was the limit reached?)
        self._peak = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def acquire(self, tenant: Hashable, weight: float, waiter: W) -> bool:
        """A request of `tenant` may go now (True, counted in flight), or `waiter` waits its turn
        (False; `release` returns it when its slot comes, already counted)."""
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = _Tenant(weight)
        entry.weight = weight
        if self.limit >= MAX_LIMIT or (self.in_flight < self.limit and self._waiting == 0):
            self._start(entry)
            return True
        if not entry.waiting:
            self._order += 1
            entry.since = self._order
        entry.waiting.append(waiter)
        self._waiting += 1
        return False

    def start_anyway(self, tenant: Hashable, weight: float) -> bool:
        """A request of `tenant` goes now, counted in flight, whatever the limit (shadow mode:
        quotas/shadow.py); returns whether it would have gone without waiting."""
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = _Tenant(weight)
        entry.weight = weight
        within = self.limit >= MAX_LIMIT or (self.in_flight < self.limit and self._waiting == 0)
        self._start(entry)
        return within

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
        woken = self._wake()
        if entry.in_flight == 0 and not entry.waiting:
            del self._tenants[tenant]
        return woken

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
        if entry.in_flight == 0 and not entry.waiting:
            del self._tenants[tenant]

    def drain_waiters(self) -> list[W]:
        """Every waiter, forgotten (the limit is being replaced)."""
        waiters = [waiter for entry in self._tenants.values() for waiter in entry.waiting]
        for entry in self._tenants.values():
            entry.waiting.clear()
        self._waiting = 0
        return waiters

    def _wake(self) -> list[W]:
        woken: list[W] = []
        while self._waiting:
            if self.in_flight >= self.limit:
                break
            best: _Tenant[W] | None = None
            for entry in self._tenants.values():
                if entry.waiting and (best is None or _before(entry, best)):
                    best = entry
            assert best is not None
            woken.append(best.waiting.popleft())
            self._waiting -= 1
            if best.waiting:
                self._order += 1
                best.since = self._order
            self._start(best)
        return woken

    def sample(self, latency_ms: float, now_ms: float, bound_ms: float | None) -> LimitChange | None:
        """A completed request's time; at the end of a window, the limit moves (the change, if any).
        `bound_ms`: the latency above which the broker is queueing (None: not known yet)."""
        if self._window_end is None:
            self._window_end = now_ms + WINDOW_MS
        self._samples.append(latency_ms)
        if now_ms < self._window_end:
            return None
        samples, peak = self._samples, self._peak
        self._samples, self._peak, self._window_end = [], self.in_flight, now_ms + WINDOW_MS
        if bound_ms is None or len(samples) < MIN_WINDOW_SAMPLES:
            return None
        seen = p90(samples)
        old = self.limit
        if seen > bound_ms:
            new = max(MIN_LIMIT, min(old, max(peak, MIN_LIMIT)) * DECREASE_FACTOR)
        else:
            new = min(MAX_LIMIT, old + math.sqrt(old))
        if new == old:
            return None
        self.limit = new  # a raise lets waiters go: the caller asks `wake_after_raise`
        return LimitChange(self.broker, old, new, seen, bound_ms)

    def wake_after_raise(self) -> list[W]:
        """After the limit rose: the waiters that may now go."""
        return self._wake()


def _before(a: _Tenant[W], b: _Tenant[W]) -> bool:
    """Whether `a` gets the next slot before `b`: fewer in flight per unit of share once it has it
    (a weighted fair queue's finish order), then the one waiting longer."""
    left, right = (a.in_flight + 1) / a.weight, (b.in_flight + 1) / b.weight
    return left < right or (left == right and a.since < b.since)


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
                  now_ms: float) -> tuple[list[W], LimitChange | None]:
        """A request ended (latency None: its connection closed first): who goes now, and the limit's
        change if its window ended."""
        slots = self.slots(broker)
        change = None
        if latency_ms is not None:
            change = slots.sample(latency_ms, now_ms, self.bound_ms(broker))
        woken = slots.release(tenant)
        if change is not None and change.new > change.old:
            woken += slots.wake_after_raise()
        return woken, change


__all__ = ["MAX_LIMIT", "MIN_LIMIT", "WINDOW_MS", "BrokerConcurrency", "BrokerSlots", "LimitChange"]
