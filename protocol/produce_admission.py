"""One connection's side of the per-broker Produce concurrency limit (quotas/broker_concurrency.py).

Kept apart from the connection, as charging and SASL tracking are: the connection only asks the
gate whether a Produce (acks 1 or all) may go now, and tells it when one is answered. The gate
holds the two facts that belong to this concern: whether the head request waits for its slot, and
the slot granted to it, which it takes when it goes on.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol


class ProduceAdmission(Protocol):
    """Whether a Produce (acks 1 or all) may go to the broker now: the per-broker concurrency limit
    (quotas/broker_concurrency.py), which the I/O layer keeps."""

    def admit(self, principal: str, client_id: str) -> Hashable | None:
        """A ticket: the request holds a slot (given back with `done`); None: it waits, and the
        I/O layer calls `ProxyConnection.slot_granted` with its ticket when its turn comes."""

    def done(self, ticket: Hashable, latency_ms: float | None) -> None:
        """The request holding `ticket` was answered after `latency_ms` (None: never answered)."""


class ProduceGate:
    """A connection's Produce requests through the admission: take, wait, be granted, give back."""

    __slots__ = ("_granted", "admission", "awaiting")

    def __init__(self, admission: ProduceAdmission) -> None:
        self.admission = admission
        #: the Produce at the head of the connection's deferred requests waits for its slot
        self.awaiting = False
        self._granted: Hashable | None = None

    def take(self, principal: str, client_id: str) -> Hashable | None:
        """The slot for the next Produce: the one granted to it after a wait, or a new one; None:
        it waits (`awaiting`) until `granted`."""
        ticket, self._granted = self._granted, None
        if ticket is None:
            ticket = self.admission.admit(principal, client_id)
            if ticket is None:
                self.awaiting = True
        return ticket

    def give_back(self, ticket: Hashable) -> None:
        """A slot nobody will use (its connection closed)."""
        self.admission.done(ticket, None)

    def granted(self, ticket: Hashable) -> bool:
        """Its turn came: True when a Produce waits for it; False: nobody does, given back."""
        if not self.awaiting:
            self.give_back(ticket)
            return False
        self.awaiting = False
        self._granted = ticket
        return True

    def answered(self, ticket: Hashable, latency_ms: float) -> None:
        """The Produce holding `ticket` was answered after `latency_ms`."""
        self.admission.done(ticket, latency_ms)

    def release(self) -> list[Hashable]:
        """The connection closes: the slot granted and not yet taken, for the I/O layer to give back
        (with those its in-flight requests hold)."""
        held = [] if self._granted is None else [self._granted]
        self._granted = None
        self.awaiting = False
        return held


__all__ = ["ProduceAdmission", "ProduceGate"]
