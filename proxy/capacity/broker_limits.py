"""The per-broker concurrency limit on asyncio: quotas/broker_concurrency.py, driven.

It counts each broker's Produce requests (acks 1 or all) and the Fetch requests of consumers that
are catching up (protocol/broker_admission.py says why both).

On while the adaptive controller in force is "concurrency" (`[capacity] controller`); it may come
and go while the proxy runs (live.py), so each session gets a `SessionSlots` that asks whether it
is on at each request. A waiting session is woken with `call_soon`, never from inside another
session's callback (the slot often frees while a response is being handled). A ticket carries the
generation it was taken in: when the limit is turned off and on again, slots taken before are
given back to nobody rather than miscounted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge

from quotas.adaptive_capacity import CONCURRENCY, PRODUCE, AdaptiveCapacity
from quotas.broker_concurrency import DEFAULT_TOLERANCE, MAX_LIMIT, BrokerConcurrency, LimitChange
from quotas.capacity import CapacityManager
from quotas.shadow import ShadowPolicy

log = logging.getLogger("kthrottle.capacity")

#: The ticket of a request admitted while the limit is off: nothing to give back.
UNCOUNTED = ("uncounted",)


def _now_ms() -> float:
    return time.monotonic() * 1000.0


class BrokerLimits:
    """The process's limit, its metrics, and the controller whose baselines bound the latency."""

    def __init__(self, capacity: CapacityManager, registry: CollectorRegistry,
                 shadow: ShadowPolicy | None = None) -> None:
        """`shadow`: who is in shadow (quotas/shadow.py): their requests never wait, and those that
        would have are counted under mode="shadow"."""
        self.capacity = capacity
        self.shadow = shadow
        self.controller: AdaptiveCapacity | None = None
        self.on = False
        self._generation = 0
        self.concurrency: BrokerConcurrency[SessionSlots] = BrokerConcurrency(self._baseline)
        self.limit = Gauge("kthrottle_broker_request_limit",
                           f"Produce and catching-up Fetch requests a broker may have in flight from this "
                           f"proxy (adaptive, controller \"concurrency\"; {MAX_LIMIT:g}: nothing waits)",
                           ["broker"], registry=registry)
        self.waits = Counter("kthrottle_broker_request_waits",
                             "Produce and catching-up Fetch requests that waited in the proxy for a slot "
                             "at their broker "
                             "(mode=\"shadow\": would have waited, and went on in shadow)",
                             ["broker", "mode"], registry=registry)

    @property
    def enabled(self) -> bool:
        controller = self.controller
        return controller is not None and controller.config.controller == CONCURRENCY

    def set_controller(self, controller: AdaptiveCapacity | None) -> None:
        """A new controller is in force: a new limit (and a new generation of tickets); every
        session that waited goes on."""
        if controller is self.controller:
            return
        self.controller = controller
        #: the hot path's one test while the limit is off (set here, where the controller changes)
        self.on = self.enabled
        old = self.concurrency
        self._generation += 1
        tolerance = DEFAULT_TOLERANCE if controller is None else controller.config.latency_tolerance
        self.concurrency = BrokerConcurrency(self._baseline, tolerance)
        for slots in old.brokers.values():
            for waiter in slots.drain_waiters():
                waiter.granted(UNCOUNTED)
        self.limit.clear()

    def _baseline(self, broker: int) -> float | None:
        controller = self.controller
        return None if controller is None else controller.baselines.get((broker, PRODUCE))

    def for_session(self, broker: int, wake: Callable[[Hashable], None]) -> SessionSlots:
        return SessionSlots(self, broker, wake)

    def acquire(self, session: SessionSlots, principal: str, client_id: str) -> tuple[Hashable, bool]:
        """The ticket of `session`'s next Produce, and whether it goes now (False: it waits for that
        ticket, which `granted` hands it when its turn comes)."""
        if not self.on:
            return UNCOUNTED, True
        tenant, weight = self.capacity.tenant(principal, client_id)
        slots = self.concurrency.slots(session.broker)
        shadow = self.shadow
        if shadow is not None and shadow.active and shadow.shadowed(principal, client_id):
            if not slots.start_anyway(tenant, weight, _now_ms()):
                self.waits.labels(str(session.broker), "shadow").inc()
            return (self._generation, tenant), True
        if slots.acquire(tenant, weight, session, _now_ms()):
            return (self._generation, tenant), True
        self.waits.labels(str(session.broker), "enforced").inc()
        return (self._generation, tenant), False

    def completed(self, broker: int, ticket: Hashable, latency_ms: float | None, fetch: bool = False) -> None:
        if ticket is UNCOUNTED or not isinstance(ticket, tuple) or ticket[0] != self._generation:
            return
        woken, change = self.concurrency.completed(broker, ticket[1], latency_ms, _now_ms(), fetch)
        if change is not None:
            self._changed(change)
        for waiter in woken:
            waiter.granted(waiter.waiting)

    def cancel(self, session: SessionSlots) -> None:
        ticket, session.waiting = session.waiting, None
        if isinstance(ticket, tuple) and ticket[0] == self._generation:
            self.concurrency.slots(session.broker).cancel(ticket[1], session)

    def _changed(self, change: LimitChange) -> None:
        self.limit.labels(str(change.broker)).set(change.new)
        if change.new < change.old:
            log.info("broker %d request limit %.1f -> %.1f: tail %.0f ms > %.0f ms", change.broker,
                     change.old, change.new, change.tail_ms, change.bound_ms)
        elif change.new >= MAX_LIMIT:
            log.info("broker %d request limit %.1f -> none: tail %.0f ms <= %.0f ms", change.broker,
                     change.old, change.tail_ms, change.bound_ms)


class SessionSlots:
    """One session's side of the limit (protocol.connection.BrokerAdmission)."""

    __slots__ = ("_wake", "broker", "owner", "waiting")

    def __init__(self, owner: BrokerLimits, broker: int, wake: Callable[[Hashable], None]) -> None:
        self.owner = owner
        self.broker = broker
        self._wake = wake
        #: the ticket this session waits to get (None: not waiting)
        self.waiting: Hashable | None = None

    def admit(self, principal: str, client_id: str) -> Hashable | None:
        owner = self.owner
        if not owner.on:  # every acks 1/all Produce asks: one attribute test while the limit is off
            return UNCOUNTED
        ticket, goes = owner.acquire(self, principal, client_id)
        if goes:
            return ticket
        self.waiting = ticket
        return None

    def done(self, ticket: Hashable, latency_ms: float | None, fetch: bool = False) -> None:
        self.owner.completed(self.broker, ticket, latency_ms, fetch)

    def limited(self, principal: str, client_id: str) -> bool:
        owner = self.owner
        if not owner.on or owner.concurrency.slots(self.broker).limit >= MAX_LIMIT:
            return False
        shadow = owner.shadow  # in shadow the limit is reported, never applied: no Fetch asks for less
        return shadow is None or not shadow.active or not shadow.shadowed(principal, client_id)

    def granted(self, ticket: Hashable) -> None:
        """Its turn came (the slot is counted): the session goes on, on a later loop turn."""
        self.waiting = None
        asyncio.get_running_loop().call_soon(self._wake, ticket)

    def close(self) -> None:
        """The session ended: it waits no more."""
        if self.waiting is not None:
            self.owner.cancel(self)


__all__ = ["UNCOUNTED", "BrokerLimits", "SessionSlots"]
