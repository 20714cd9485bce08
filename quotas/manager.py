"""A rate quota of one type: buckets per (user, client-id), Kafka's record-then-check.

Mirrors a broker's ClientQuotaManager, with time passed in: the traffic is always recorded (the
quota never rejects anything), then the bucket's rate is compared with its bound, and a
violation costs a throttle time. A bucket is found through the entity levels in `entity.py`;
its history survives quota changes as long as its key does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .entity import BucketKey, QuotaEntity, resolve
from .rate import DEFAULT_WINDOW, WindowConfig, WindowedRate
from .throttle import bounded_throttle_time_ms, throttle_time_ms
from .types import QuotaType

#: Kafka expires a client's quota sensors after an hour without traffic.
IDLE_EXPIRY_MS = 3600 * 1000

_RESOLVED_MAX = 100_000

#: How much earlier than the throttle's end a held connection may try again (see remaining_throttle_ms).
HOLD_HEAD_START_MS = 1


@dataclass(slots=True)
class Bucket:
    """One bucket's sensors: the quota rate, and the throttle times it caused (for metrics)."""

    rate: WindowedRate
    #: throttle times this bucket caused: Kafka's `throttle-time` sensor (avg and max)
    throttle: WindowedRate
    #: the bound in force (updated at once when the quotas change)
    bound: float = 0.0
    #: a (user, client-id) charged to this bucket, to re-resolve it when the quotas change
    member: tuple[str, str] | None = None
    #: whether a configured quota still leads to this bucket
    applies: bool = True
    throttle_total_ms: int = 0
    throttle_count: int = 0
    #: end of the latest throttle this bucket caused: until then, every connection charging
    #: the bucket holds such requests back (the proxy's scope is the whole cluster)
    throttled_until_ms: int = 0


class Charge(NamedTuple):
    """What one recording led to (a tuple: one is made per charged request)."""

    bucket: BucketKey | None  # None: no quota applies (unlimited)
    bound: float
    observed: float
    throttle_ms: int


UNLIMITED = Charge(None, float("inf"), 0.0, 0)


class ClientQuotaManager:
    """Rate quotas of one type (produce bytes, fetch bytes, request time, ...)."""

    def __init__(self, quota_type: QuotaType, window: WindowConfig = DEFAULT_WINDOW,
                 *, max_throttle_ms: int | None = None) -> None:
        self.quota_type = quota_type
        self.window = window
        #: The request quota caps a throttle at one window; byte rates are unbounded.
        self.max_throttle_ms = max_throttle_ms
        self.quotas: dict[QuotaEntity, float] = {}
        self.buckets: dict[BucketKey, Bucket] = {}
        #: (user, client-id) -> its bucket and bound; resolving walks 8 levels, so it is cached
        #: until the quotas change (bounded: cleared when it grows past _RESOLVED_MAX entries)
        self._resolved: dict[tuple[str, str], tuple[BucketKey, float] | None] = {}
        #: the latest end of any bucket's throttle: before it, some request may have to wait
        self.throttled_until_ms = 0

    def set_quotas(self, quotas: dict[QuotaEntity, float]) -> None:
        """Replace the configured entities; buckets whose key still applies keep their history."""
        self.quotas = dict(quotas)
        self._resolved = {}
        # Kafka updates the quota of existing sensors at once. A bucket whose key no longer
        # applies keeps its history (the key may come back) until it idles out, but has no bound.
        for key, bucket in self.buckets.items():
            found = self.resolve(*bucket.member) if bucket.member is not None else None
            bucket.applies = found is not None and found[0] == key
            if found is not None and bucket.applies:
                bucket.bound = found[1]

    def resolve(self, user: str, client_id: str) -> tuple[BucketKey, float] | None:
        if not self.quotas:
            return None
        key = (user, client_id)
        try:
            return self._resolved[key]
        except KeyError:
            pass
        if len(self._resolved) >= _RESOLVED_MAX:
            self._resolved.clear()
        found = self._resolved[key] = resolve(self.quotas, user, client_id)
        return found

    def _bucket(self, key: BucketKey) -> Bucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = Bucket(WindowedRate(self.window), WindowedRate(self.window))
            self.buckets[key] = bucket
        return bucket

    def record(self, user: str, client_id: str, value: float, now_ms: int) -> Charge:
        """Record `value` for (user, client_id); returns the throttle it causes (0 within quota)."""
        found = self.resolve(user, client_id)
        if found is None:
            return UNLIMITED
        key, bound = found
        bucket = self._bucket(key)
        bucket.bound = bound
        bucket.applies = True
        bucket.member = (user, client_id)
        bucket.rate.record(value, now_ms)
        observed, window_ms = bucket.rate.measure_with_window(now_ms)
        if observed <= bound:
            return Charge(key, bound, observed, 0)
        if self.max_throttle_ms is None:
            throttle = throttle_time_ms(observed, bound, window_ms)
        else:
            throttle = bounded_throttle_time_ms(observed, bound, window_ms, self.max_throttle_ms)
        bucket.throttled_until_ms = max(bucket.throttled_until_ms, now_ms + throttle)
        self.throttled_until_ms = max(self.throttled_until_ms, bucket.throttled_until_ms)
        return Charge(key, bound, observed, throttle)

    def remaining_throttle_ms(self, user: str, client_id: str, now_ms: int) -> int:
        """How long (user, client_id)'s bucket stays throttled; 0 when it is not."""
        if now_ms + HOLD_HEAD_START_MS >= self.throttled_until_ms:  # no bucket is throttled now
            return 0
        found = self.resolve(user, client_id)
        if found is None:
            return 0
        bucket = self.buckets.get(found[0])
        # One millisecond short of the throttle's end: connections held for another's throttle then
        # go before the one that caused it (whose mute ends exactly then), so a client's connections
        # to different brokers take turns instead of one winning every time and starving the others.
        return 0 if bucket is None else max(bucket.throttled_until_ms - now_ms - HOLD_HEAD_START_MS, 0)

    def unrecord(self, charge: Charge, value: float, now_ms: int) -> None:
        """Take a recording back (a throttled fetch's bytes are not sent, so not counted)."""
        if charge.bucket is not None and charge.bucket in self.buckets:
            self.buckets[charge.bucket].rate.unrecord(value, now_ms)

    def record_throttle(self, charge: Charge, throttle_ms: int, now_ms: int) -> None:
        """Count a throttle this quota decided (Kafka's `throttle-time` sensor, avg and max)."""
        if charge.bucket is None:
            return
        bucket = self._bucket(charge.bucket)
        bucket.throttle.record(throttle_ms, now_ms)
        bucket.throttle_total_ms += throttle_ms
        bucket.throttle_count += 1

    def max_value_in_window(self, user: str, client_id: str) -> float | None:
        """Kafka's cap for a fetch: the quota times (samples - 1) windows, i.e. 10x the quota per second."""
        found = self.resolve(user, client_id)
        if found is None:
            return None
        return found[1] * (self.window.samples - 1) * self.window.window_ms / 1000.0

    def expire_idle(self, now_ms: int, idle_ms: int = IDLE_EXPIRY_MS) -> int:
        """Drop buckets without traffic for `idle_ms`; returns how many went."""
        stale = [key for key, bucket in self.buckets.items()
                 if (last := bucket.rate.idle_since_ms) is not None and now_ms - last >= idle_ms]
        for key in stale:
            del self.buckets[key]
        return len(stale)
