"""Kafka's queued.max.request.bytes for the proxy: one budget for request bytes all connections hold.

A broker reads a request's size, then allocates that much from its memory pool; when the pool is
empty it stops reading from that connection until memory comes back. The proxy does the same
with what its connections hold (a request being read, requests waiting behind a throttle, a
request still queued for its broker): a connection that wants more than the pool has left stops
being read, holding only the bytes it has already read, and waits its turn. Waiters are served
first come, first served, so a large request is not starved by a stream of small ones; a
connection that is the only holder may always go on, so the largest legal request always fits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class RequestMemoryPool:
    """Reservations per holder (a connection), with a FIFO of holders waiting for room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        #: the most held at once since the caller last reset it (to give memory back after a spike)
        self.peak = 0
        self._held: dict[object, int] = {}
        #: holder -> (bytes it wants in all, called when granted)
        self._waiting: OrderedDict[object, tuple[int, Callable[[], None]]] = OrderedDict()

    def held(self, holder: object) -> int:
        return self._held.get(holder, 0)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _set(self, holder: object, amount: int) -> None:
        self.used += amount - self._held.get(holder, 0)
        if self.used > self.peak:
            self.peak = self.used
        if amount:
            self._held[holder] = amount
        else:
            self._held.pop(holder, None)

    def _fits(self, holder: object, want: int) -> bool:
        others = self.used - self._held.get(holder, 0)
        return others == 0 or others + want <= self.limit

    def request(self, holder: object, want: int, holding: int, on_grant: Callable[[], None]) -> bool:
        """`holder` wants to hold `want` bytes in all; it holds `holding` bytes already read.

        True: granted, reading may go on. False: it now holds `holding` only, must stop reading,
        and `on_grant` is called once `want` fits (with earlier waiters served first).
        """
        if holder in self._waiting:
            self._waiting[holder] = (want, on_grant)
            self._set(holder, holding)
            self._serve()
            return holder not in self._waiting
        if want <= self._held.get(holder, 0) or (not self._waiting and self._fits(holder, want)):
            self._set(holder, want)
            self._serve()
            return True
        self._set(holder, holding)
        self._waiting[holder] = (want, on_grant)
        self._serve()
        return holder not in self._waiting

    def release(self, holder: object) -> None:
        """The holder is gone: its bytes go back and it stops waiting."""
        self._waiting.pop(holder, None)
        self._set(holder, 0)
        self._serve()

    def _serve(self) -> None:
        while self._waiting:
            holder, (want, on_grant) = next(iter(self._waiting.items()))
            if not self._fits(holder, want):
                return
            del self._waiting[holder]
            self._set(holder, want)
            on_grant()
