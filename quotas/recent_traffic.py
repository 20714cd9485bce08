"""One connection's bytes in and out per second over the last few seconds (pure; time passed in).

For the proxy's connections view (`/connections`, `kthrottle top`'s connections), not for quotas:
a quota's rate is Kafka's windowed `Rate` (rate.py) per entity, with its history and padding. This
meter answers "how busy is this connection now" for every open connection, so it must cost the
hot path next to nothing: recording is a few integer operations on preallocated slots, with no
allocation and no work that grows with time or traffic.

Kept: one slot per whole second of the monotonic clock, `RECENT_SECONDS` of them used round-robin.
A recording into a slot left from an older second empties it first. The rate sums the slots of
the current second and the `RECENT_SECONDS - 1` before it, and divides by the time they cover:
from the start of the oldest of those seconds (or the connection's start, if later) to now, but at
least `MIN_SPAN_MS`, so a connection a few ms old does not read as a burst.
"""

from __future__ import annotations

#: The rate covers the current second and the 4 before it: between 4 and 5 seconds of traffic.
RECENT_SECONDS = 5
#: A span shorter than this is measured as this long (a new connection's first request).
MIN_SPAN_MS = 1000


class RecentTraffic:
    """Bytes from the client (`bytes_in`) and to it (`bytes_out`) per second, recently."""

    __slots__ = ("_in", "_out", "_second", "started_ms")

    def __init__(self, now_ms: float) -> None:
        self.started_ms = now_ms
        self._second = [-1] * RECENT_SECONDS
        self._in = [0] * RECENT_SECONDS
        self._out = [0] * RECENT_SECONDS

    def received(self, size: int, now_ms: float) -> None:
        """`size` bytes read from the client at `now_ms`."""
        second = int(now_ms) // 1000
        slot = second % RECENT_SECONDS
        if self._second[slot] != second:
            self._start(slot, second)
        self._in[slot] += size

    def sent(self, size: int, now_ms: float) -> None:
        """`size` bytes written (or queued) to the client at `now_ms`."""
        second = int(now_ms) // 1000
        slot = second % RECENT_SECONDS
        if self._second[slot] != second:
            self._start(slot, second)
        self._out[slot] += size

    def _start(self, slot: int, second: int) -> None:
        self._second[slot] = second
        self._in[slot] = 0
        self._out[slot] = 0

    def rates(self, now_ms: float) -> tuple[float, float]:
        """(bytes in, bytes out) per second over the recent seconds, at `now_ms`."""
        second = int(now_ms) // 1000
        oldest = second - RECENT_SECONDS + 1
        total_in = total_out = 0
        for slot in range(RECENT_SECONDS):
            if oldest <= self._second[slot] <= second:
                total_in += self._in[slot]
                total_out += self._out[slot]
        span_ms = max(now_ms - max(oldest * 1000.0, self.started_ms), MIN_SPAN_MS)
        return total_in * 1000.0 / span_ms, total_out * 1000.0 / span_ms


__all__ = ["MIN_SPAN_MS", "RECENT_SECONDS", "RecentTraffic"]
