"""The "smooth" quota shape: a token bucket whose burst is one second of quota.

Kafka measures a client quota over `samples x window` (11 s by default, padded to 10 s for a
new client), so a greedy client first sends ~10 s of quota at once, then moves in an 11 s
sawtooth whose 5-second rates swing between ~0.3x and ~2.2x the quota. Operators who protect
brokers may prefer the burst bounded: with `quota_shape = "smooth"` each bucket also charges a
token bucket (KIP-599's `TokenBucket`, the controller mutation quota's, with a burst of one
second of quota as Redpanda's client quotas use), and the throttle is how long until the
bucket is back at zero. A greedy client then never gets more than one second of quota plus one
request ahead of the quota, at any time scale.

Arithmetic, with time passed in (ms) and the rate per second:
- tokens start full (= burst), refill at `rate x dt`, never above the burst;
- a recording subtracts its value (the request is always served: record-then-check, as Kafka);
- when tokens < 0 the throttle is `ceil(-tokens / rate x 1000)` ms: exactly when the bucket is
  back at zero (KIP-599 rounds to nearest; rounding up lets a client muted for the throttle
  send its next request into a bucket at zero or above instead of earning a 1 ms throttle).

A full bucket holds no history: a bucket refilled for `burst / rate` (1 s) behaves as a new
one, so the windowed rate's 11 s expiry (which the manager keeps using) never forgets tokens.
"""

from __future__ import annotations

import math
from typing import Final, Literal

#: Kafka's own windowed rate, exactly (the default).
KAFKA: Final = "kafka"
#: A token bucket with a one-second burst on top of the windowed rate.
SMOOTH: Final = "smooth"

QuotaShape = Literal["kafka", "smooth"]

#: The values `[proxy] quota_shape` accepts.
QUOTA_SHAPES: Final[tuple[QuotaShape, ...]] = (KAFKA, SMOOTH)

#: The burst of the smooth shape, in ms of quota. KIP-599's controller mutation quota uses
#: `quota.window.num x quota.window.size.seconds` (11 s); Redpanda's client quotas one second,
#: which is what bounds a greedy client's 5-second rates within ~1.2x the quota.
BURST_MS = 1000


class TokenBucket:
    """One bucket's tokens (in the quota's unit), refilled at the bound in force."""

    __slots__ = ("tokens", "updated_ms")

    def __init__(self) -> None:
        #: None: full (the bound, hence the burst, is only known at the first recording)
        self.tokens: float | None = None
        self.updated_ms = 0

    def refill(self, rate: float, burst: float, now_ms: int) -> float:
        """The tokens at `now_ms` (refilled at `rate`, at most `burst`); the caller stores what it takes."""
        tokens = self.tokens
        if tokens is None:
            tokens = burst
        elif now_ms > self.updated_ms:
            tokens = min(burst, tokens + rate * (now_ms - self.updated_ms) / 1000.0)
        else:
            tokens = min(burst, tokens)  # a lowered bound shrinks the burst at once
        self.updated_ms = max(now_ms, self.updated_ms)
        return tokens

    def record(self, value: float, rate: float, now_ms: int) -> int:
        """Take `value` at `rate` per second; returns ms until the bucket is back at zero (0: not below)."""
        burst = rate * BURST_MS / 1000.0
        tokens = self.refill(rate, burst, now_ms) - value
        self.tokens = min(burst, tokens)
        if tokens >= 0.0:
            return 0
        return math.ceil(-tokens / rate * 1000.0)

    def unrecord(self, value: float, rate: float, now_ms: int) -> None:
        """Give `value` back (a throttled fetch's records are not sent, as Kafka un-records them)."""
        self.record(-value, rate, now_ms)

    def full_at_ms(self, rate: float) -> int:
        """When the bucket is full again at `rate`: until then, forgetting it would forgive a debt
        (or a spent burst) that the next decision still needs."""
        tokens = self.tokens
        burst = rate * BURST_MS / 1000.0
        if tokens is None or tokens >= burst:
            return self.updated_ms
        return self.updated_ms + math.ceil((burst - tokens) / rate * 1000.0)

    def level(self, rate: float, now_ms: int) -> float:
        """Tokens at `now_ms` (negative: in debt), without recording anything."""
        burst = rate * BURST_MS / 1000.0
        tokens = self.tokens
        if tokens is None:
            return burst
        return min(burst, tokens + rate * max(now_ms - self.updated_ms, 0) / 1000.0)
