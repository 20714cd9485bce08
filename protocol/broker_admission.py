"""One connection's side of the per-broker concurrency limit (quotas/broker_concurrency.py).

Kept apart from the connection, as charging and SASL tracking are: the connection only asks the
gate whether a request that makes its broker work may go now, and tells it when one is answered.
The gate holds the two facts that belong to this concern: whether the head request waits for its
slot, and the slot granted to it, which it takes when it goes on.

The requests counted are a Produce with acks 1 or all (it queues work at the broker, and its
response ends it) and the Fetch of a consumer that is catching up (its last Fetch brought at least
CATCHING_UP_BYTES): over TLS a broker encrypts every byte it sends, and on the fetch overload bed
three consumers reading a backlog took gold's p99 from 10.9 to 47.0 ms through the proxy. A Fetch
of a consumer that is caught up waits out its max_wait_ms at the broker, which costs the broker
nothing, so it holds no slot; and no Fetch's time judges the limit, since a long poll's is its
wait. While the limit is below its maximum, a counted Fetch asks for at most
FETCH_BYTES_WHILE_LIMITED (as a broker lowers a throttled consumer's max_bytes), so one slot holds
one bounded piece of the broker's work: uncapped, one Fetch of up to six 1 MB partitions kept the
broker as busy as three (gold's p99 21-27 ms at 491-534 MB/s, a 512 MB heap).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

#: A Fetch response at least this long brought records: its consumer is catching up, and its next
#: Fetch will make the broker work.
CATCHING_UP_BYTES = 64 * 1024
#: A counted Fetch's max_bytes while the limit is below its maximum (a broker still returns a first
#: batch that is larger whole). On the fetch bed, in one run of each (gold's p99, consumers' MB/s):
#: 1 MB 14.7 ms, 449; 512 KB 8.5 ms, 418; 256 KB 8.7 ms, 356; 64 KB (a smaller heap) about 0.4x
#: direct's goodput. Smaller asks mean more requests for the same bytes, and more broker work each.
FETCH_BYTES_WHILE_LIMITED = 512 * 1024


class BrokerAdmission(Protocol):
    """Whether a counted request (the module's docstring) may go to the broker now: the per-broker
    concurrency limit (quotas/broker_concurrency.py), which the I/O layer keeps."""

    def admit(self, principal: str, client_id: str) -> Hashable | None:
        """A ticket: the request holds a slot (given back with `done`); None: it waits, and the
        I/O layer calls `ProxyConnection.slot_granted` with its ticket when its turn comes."""

    def done(self, ticket: Hashable, latency_ms: float | None, fetch: bool = False) -> None:
        """The request holding `ticket` ended: a Produce answered after `latency_ms`, which judges the
        limit; a Fetch answered (`fetch`: its time must not judge it, but a Fetch held the slot); or
        one never answered (neither)."""

    def limited(self, principal: str, client_id: str) -> bool:
        """The broker's limit is below its maximum and applies to this client (not in shadow): its
        counted Fetch asks for less."""


class AdmissionGate:
    """A connection's counted requests through the admission: take, wait, be granted, give back."""

    __slots__ = ("_granted", "admission", "awaiting", "catching_up")

    def __init__(self, admission: BrokerAdmission) -> None:
        self.admission = admission
        #: the request at the head of the connection's deferred requests waits for its slot
        self.awaiting = False
        self._granted: Hashable | None = None
        #: the connection's last Fetch answer brought CATCHING_UP_BYTES or more: its next Fetch
        #: is counted
        self.catching_up = False

    def fetch_answered(self, size: int) -> None:
        """A Fetch answer of `size` bytes: whether the next Fetch will make the broker work."""
        self.catching_up = size >= CATCHING_UP_BYTES

    def fetch_max_bytes(self, principal: str, client_id: str) -> int | None:
        """What a counted Fetch may ask for now (None: its own max_bytes)."""
        return FETCH_BYTES_WHILE_LIMITED if self.admission.limited(principal, client_id) else None

    def take(self, principal: str, client_id: str) -> Hashable | None:
        """The slot for the next counted request: the one granted to it after a wait, or a new one;
        None: it waits (`awaiting`) until `granted`."""
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
        """Its turn came: True when a request waits for it; False: nobody does, given back."""
        if not self.awaiting:
            self.give_back(ticket)
            return False
        self.awaiting = False
        self._granted = ticket
        return True

    def answered(self, ticket: Hashable, latency_ms: float | None) -> None:
        """The request holding `ticket` was answered after `latency_ms` (None: a Fetch, whose time
        must not judge the limit, though the limit learns that a Fetch held the slot)."""
        self.admission.done(ticket, latency_ms, fetch=latency_ms is None)

    def release(self) -> list[Hashable]:
        """The connection closes: the slot granted and not yet taken, for the I/O layer to give back
        (with those its in-flight requests hold)."""
        held = [] if self._granted is None else [self._granted]
        self._granted = None
        self.awaiting = False
        return held


__all__ = ["CATCHING_UP_BYTES", "FETCH_BYTES_WHILE_LIMITED", "AdmissionGate", "BrokerAdmission"]
