"""What the fleet exchange carries: each stream's wire code and its kind, declared once.

The exchange carries three kinds of value through one path, and both ends must read each the same
way; so a stream's kind is declared here, beside its code, and the sender (`UsageTracker`) and the
receiver (`PeerUsage`) both read it, rather than keying special cases on one stream:

- a RATE (a bucket's windowed usage, a capacity tenant's demand) is state: a peer's latest value
  replaces its previous one; it counts at full weight while fresh, then fades to 0 over one quota
  window (a dead member's usage never vanishes in a step); it is resent when it moved by more
  than the tracker's change ratio;
- a TOTAL (a controller mutation bucket's running total of partitions) is a count of events: the
  receiver debits what it grew by since it last heard it (`CountLedger`), so every change is sent,
  however small, and a lost datagram costs nothing (the next total carries it);
- a LEVEL (a member's adaptive capacity factor) is neither summed nor faded: a peer's latest value
  counts as it is while fresh, and not at all once stale (a factor fading towards 0 would cut the
  capacity of a fleet whose member died); it is resent as a rate is.

Wire codes are stable (never an enum's order); a new stream takes the next code and a kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .types import CapacityStream, QuotaType, UsageKind


class StreamKind(Enum):
    """How a stream's values are read by the receiver and resent by the sender (module docstring)."""

    RATE = "rate"
    TOTAL = "total"
    LEVEL = "level"

    @property
    def sent_on_any_change(self) -> bool:
        """A total is resent on every change (its growth is what is debited); the others when
        they moved by more than the change ratio."""
        return self is StreamKind.TOTAL


@dataclass(frozen=True, slots=True)
class Stream:
    """One stream of the exchange: its code on the wire and its kind."""

    code: int
    kind: StreamKind


_RATE, _TOTAL, _LEVEL = StreamKind.RATE, StreamKind.TOTAL, StreamKind.LEVEL

#: Every stream the exchange carries.
STREAMS: dict[UsageKind, Stream] = {
    QuotaType.PRODUCE: Stream(0, _RATE),
    QuotaType.FETCH: Stream(1, _RATE),
    QuotaType.REQUEST: Stream(2, _RATE),
    QuotaType.CONTROLLER_MUTATION: Stream(3, _TOTAL),
    QuotaType.PRODUCER_IDS: Stream(4, _RATE),
    QuotaType.CONNECTION_CREATION: Stream(5, _RATE),
    CapacityStream.CAPACITY_PRODUCE: Stream(6, _RATE),
    CapacityStream.CAPACITY_FETCH: Stream(7, _RATE),
    CapacityStream.CAPACITY_REQUEST: Stream(8, _RATE),
    CapacityStream.CAPACITY_FACTOR: Stream(9, _LEVEL),
}

#: Every stream by its member name (the hot loops key by name: an enum's own hash is a Python call).
STREAMS_BY_NAME: dict[str, UsageKind] = {stream.name: stream for stream in STREAMS}

#: The streams a change of any size is resent for, by member name (`UsageTracker.due`).
SENT_ON_ANY_CHANGE: frozenset[str] = frozenset(
    stream.name for stream, declared in STREAMS.items() if declared.kind.sent_on_any_change)

__all__ = ["SENT_ON_ANY_CHANGE", "STREAMS", "STREAMS_BY_NAME", "Stream", "StreamKind"]
