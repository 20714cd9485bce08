"""The adaptive factor in force across the fleet, and the capacity it scales when none is set.

Kept apart from the sharing (capacity.py) because it is another job: the sharing divides a
capacity among tenants; this decides how large the capacity is while the brokers are strained.
Each member's own factor comes from its controller (adaptive_capacity.py), which judges the
brokers it sees; members tell each other theirs in the usage exchange (the CAPACITY_FACTOR
stream, a level: counted while fresh, never faded), and the factor in force is the lowest of this
member's own and its fresh peers'. A member sends its own factor, not the fleet's lowest: members
echoing the minimum would hold each other down forever.

Adaptive mode without a static capacity learns one: when the factor first drops below 1, the
capacity to scale is the fleet-wide throughput of the last refresh (the one observed while the
brokers were last healthy), forgotten once the factor is back at 1. Whether the load is light
(when the controller may learn its latency baselines) is judged here too, against the capacity,
the learned one, or the highest rate seen.
"""

from __future__ import annotations

from collections.abc import Mapping

from .adaptive_capacity import AdaptiveCapacity
from .fleet import PeerUsage, UsageEntry
from .types import CapacityStream, QuotaType

#: The load is light (adaptive baselines may learn) while every direction's fleet-wide rate is at
#: most this share of its capacity (static, learned, or the highest rate seen).
LIGHT_FRACTION = 0.5

#: The one key the factor travels under in the exchange (a member reports one factor).
FACTOR_KEY = ("", "")


class CapacityFactor:
    """The factor in force (`factor`), what it scales without a static capacity (`learned`)."""

    def __init__(self) -> None:
        #: the adaptive controller whose factor is this member's own (None: adaptive mode is off,
        #: or the I/O layer has none yet); set by the I/O layer (proxy/capacity/live.py)
        self.controller: AdaptiveCapacity | None = None
        #: the factor in force (1.0: the whole capacity): the lowest of this member's own and
        #: its fresh peers'
        self.factor = 1.0
        #: adaptive mode without a static capacity: the capacity learned from healthy throughput,
        #: applied while the factor is below 1 (empty: nothing learned)
        self.learned: dict[QuotaType, float] = {}
        #: the fleet's merged peer usage (None: a lone proxy)
        self.peers: PeerUsage | None = None

    @property
    def own(self) -> float:
        """This member's own factor: its controller's (1.0 without one)."""
        return 1.0 if self.controller is None else self.controller.factor

    def usage(self) -> list[UsageEntry]:
        """This member's own factor as the exchange's entry (see the module docstring)."""
        return [UsageEntry(CapacityStream.CAPACITY_FACTOR, *FACTOR_KEY, self.own)]

    def peer_factor(self, now_ms: int) -> float | None:
        """The lowest factor a fresh peer reported (None: none reported)."""
        if self.peers is None:
            return None
        values = self.peers.view(CapacityStream.CAPACITY_FACTOR).levels(FACTOR_KEY, now_ms)
        return min(values) if values else None

    def update(self, totals: Mapping[QuotaType, float], now_ms: int) -> float:
        """Bring the factor in force up to date; `totals` is each direction's fleet-wide rate at
        the last refresh (what is learned when the factor first drops below 1)."""
        own = self.own
        peer = self.peer_factor(now_ms)
        factor = own if peer is None else min(own, peer)
        if factor < 1.0 <= self.factor:
            self.learned = {direction: total for direction, total in totals.items() if total > 0.0}
        elif factor >= 1.0:
            self.learned = {}
        self.factor = factor
        return factor

    def scale(self, direction: QuotaType, static: float | None) -> float | None:
        """The capacity in force for `direction`: its static one, or the learned one while the
        factor is below 1, scaled by the factor (None: no limit)."""
        if static is None:
            if self.factor >= 1.0:
                return None
            static = self.learned.get(direction)
            if static is None:
                return None
        return static * self.factor

    def light(self, static: Mapping[QuotaType, float], totals: Mapping[QuotaType, float],
              peaks: Mapping[QuotaType, float]) -> bool:
        """Whether the load is light now: every direction with a capacity (static, or learned
        while the factor is below 1) at most LIGHT_FRACTION of it. Directions without one do
        not count, unless none has one (adaptive mode alone): then every direction is judged
        against the highest rate it was seen at (`peaks`), so a cluster busy from the start is never
        light and never learns busy as healthy. `totals` and `peaks` list the tracked directions."""
        bases = {direction: static.get(direction) or self.learned.get(direction) for direction in totals}
        judged = {direction: base for direction, base in bases.items() if base}
        if not judged:
            judged = {direction: peaks[direction] for direction in totals}
        return all(totals[direction] <= LIGHT_FRACTION * base for direction, base in judged.items())


__all__ = ["FACTOR_KEY", "LIGHT_FRACTION", "CapacityFactor"]
