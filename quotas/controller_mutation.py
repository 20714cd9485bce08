"""The controller mutation quota (KIP-599): partitions created or deleted, in a token bucket.

Kafka charges CreateTopics (partitions created), CreatePartitions (partitions added) and
DeleteTopics (partitions of each topic deleted) to a per-(user, client-id) sensor holding a
`TokenBucket` (the decision) and a `Rate` (the `mutation-rate` metric), resolved through the same
eight entity levels as the other client quotas (`ControllerMutationQuotaManager.scala`,
`TokenBucket.java`, `Sensor.checkQuotas`). The arithmetic, with time passed in:

- burst = `controller.quota.window.num x controller.quota.window.size.seconds x rate` (11 x 1 s by
  default); the bucket starts full, refills `rate x dt`, never above the burst;
- a recording subtracts the partition count (never refused by the bucket itself);
- the bucket is violated when its tokens are < 0; the throttle is `round(-tokens / rate x 1000)`
  ms (Java's Math.round: half up), with no cap.

How a request uses it depends on its version (`ControllerMutationQuotaManager.newQuotaFor`):
strict (CreateTopics >= v6, DeleteTopics >= v5, CreatePartitions >= v3) checks the bucket *before*
each topic and, if it is negative, refuses that topic with THROTTLING_QUOTA_EXCEEDED and the
throttle, recording nothing; a topic accepted is recorded even if it drives the bucket deep into
debt, and then throttles nobody (`StrictControllerMutationQuota`). Permissive (older versions)
records every topic and throttles by the last violation (`PermissiveControllerMutationQuota`).

The bucket is per proxy: the fleet exchange (fleet.py) carries windowed rates, not token levels,
so the engine keeps this manager out of the ones it shares (a fleet of N proxies, each seeing part
of a client's mutations, allows up to N x the quota).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .entity import BucketKey
from .manager import DEFAULT_MAX_BUCKETS, IDLE_EXPIRY_MS, OVERFLOW_KEY, Bucket, Charge, ClientQuotaManager
from .rate import WindowConfig
from .token_bucket import TokenBucket
from .types import QuotaType

#: Kafka's `controller.quota.window.num` default (QuotaConfig.NUM_CONTROLLER_QUOTA_SAMPLES_DEFAULT).
CONTROLLER_QUOTA_WINDOW_NUM = 11
#: Kafka's `controller.quota.window.size.seconds` default (QuotaConfig.QUOTA_WINDOW_SIZE_SECONDS_DEFAULT).
CONTROLLER_QUOTA_WINDOW_SIZE_MS = 1000
CONTROLLER_QUOTA_WINDOW = WindowConfig(CONTROLLER_QUOTA_WINDOW_NUM, CONTROLLER_QUOTA_WINDOW_SIZE_MS)


def mutation_throttle_ms(tokens: float, rate: float) -> int:
    """Kafka's `ControllerMutationQuotaManager.throttleTimeMs`: Math.round(-tokens / rate * 1000);
    0 when the bucket is not in debt."""
    if tokens >= 0.0:
        return 0
    return math.floor(-tokens / rate * 1000.0 + 0.5)


class MutationTokenBucket(TokenBucket):
    """Kafka's `TokenBucket` as the controller mutation quota configures it.

    It reuses the smooth shape's refill (`min(burst, tokens + rate x dt)`), with Kafka's burst of
    `samples x window` seconds of quota and its rounding of the throttle to nearest.
    """

    __slots__ = ("burst_seconds",)

    def __init__(self, burst_seconds: float) -> None:
        super().__init__()
        self.burst_seconds = burst_seconds

    def record(self, value: float, rate: float, now_ms: int) -> int:
        """Record `value` (Sensor.record, checked afterwards): the throttle it leaves (0: not in debt)."""
        burst = rate * self.burst_seconds
        tokens = min(burst, self._refill(rate, burst, now_ms) - value)
        self.tokens = tokens
        return mutation_throttle_ms(tokens, rate)

    def level(self, rate: float, now_ms: int) -> float:
        burst = rate * self.burst_seconds
        tokens = self.tokens
        if tokens is None:
            return burst
        return min(burst, tokens + rate * max(now_ms - self.updated_ms, 0) / 1000.0)

    def full_at_ms(self, rate: float) -> int:
        """When the bucket is full again if nothing more is recorded (a new bucket is the same from then)."""
        if self.tokens is None:
            return self.updated_ms
        missing = rate * self.burst_seconds - self.tokens
        return self.updated_ms + max(math.ceil(missing / rate * 1000.0), 0)


@dataclass(frozen=True, slots=True)
class MutationVerdict:
    """What the quota made of one request's topics, in the request's order."""

    #: per topic: False where a strict request's topic is refused (THROTTLING_QUOTA_EXCEEDED)
    accepted: tuple[bool, ...]
    #: the throttle the response reports (`ControllerMutationQuota.throttleTime`) and the
    #: connection is muted for; 0 when not throttled
    throttle_ms: int


class ControllerMutationQuotaManager(ClientQuotaManager):
    """Controller mutation buckets per (user, client-id): a ClientQuotaManager whose decision is
    Kafka's KIP-599 token bucket (its windowed rate is the `mutation-rate` metric only).

    Bucket caps, entity resolution, throttle counters and idle expiry are the base class's; a
    bucket in debt is kept until it would be full again (`keep_until_ms`), since dropping it
    earlier would hand its client a fresh burst.
    """

    def __init__(self, window: WindowConfig = CONTROLLER_QUOTA_WINDOW, *,
                 max_buckets: int | None = DEFAULT_MAX_BUCKETS, idle_expiry_ms: int = IDLE_EXPIRY_MS) -> None:
        super().__init__(QuotaType.CONTROLLER_MUTATION, window, max_buckets=max_buckets,
                         idle_expiry_ms=idle_expiry_ms)
        #: Kafka's burst in seconds of quota: `TokenBucket.burst` = samples x window size
        self.burst_seconds = window.samples * window.window_ms / 1000.0

    def _add(self, key: BucketKey, now_ms: int) -> Bucket:
        bucket = super()._add(key, now_ms)
        bucket.tokens = MutationTokenBucket(self.burst_seconds)
        return bucket

    def record(self, user: str, client_id: str, value: float, now_ms: int) -> Charge:
        """Record `value` partitions (Kafka's permissive `record` with its quota check after)."""
        charge = super().record(user, client_id, value, now_ms)
        bucket = self.buckets.get(charge.bucket) if charge.bucket is not None else None
        if bucket is not None and isinstance(bucket.tokens, MutationTokenBucket):
            bucket.keep_until_ms = bucket.tokens.full_at_ms(bucket.bound)
        return charge

    def debt_throttle_ms(self, user: str, client_id: str, now_ms: int) -> int:
        """The strict check (`Sensor.checkQuotas` on the TokenBucket): the throttle of a bucket
        in debt now, 0 when it is not (or no quota applies). Records nothing."""
        found = self._lookup(user, client_id)
        if found is None:
            return 0
        bucket = self.buckets.get(found.bucket)
        if (bucket is None and found.capped and self.max_buckets is not None
                and len(self.buckets) >= self.max_buckets):
            bucket = self.buckets.get(OVERFLOW_KEY)  # where its charge would go
        if bucket is None or not isinstance(bucket.tokens, MutationTokenBucket):
            return 0  # a new bucket starts full
        return mutation_throttle_ms(bucket.tokens.level(bucket.bound, now_ms), bucket.bound)

    def tokens(self, bucket: Bucket, now_ms: int) -> float:
        """A bucket's tokens now (Kafka's `tokens` metric)."""
        tokens = bucket.tokens
        return tokens.level(bucket.bound, now_ms) if tokens is not None else 0.0

    def charge_topics(self, user: str, client_id: str, costs: Sequence[int], strict: bool,
                      now_ms: int) -> MutationVerdict:
        """Charge one request's topics in order: `costs[i]` partitions for topic i.

        A topic of cost 0 (one the broker will refuse before charging it) is neither charged nor
        refused. Strict: refused once the bucket is in debt, throttle of the last refusal;
        permissive: all recorded, throttle of the last violation (the largest).
        """
        if self.resolve(user, client_id) is None:
            return MutationVerdict((True,) * len(costs), 0)
        accepted: list[bool] = []
        throttle = 0
        for cost in costs:
            if cost <= 0:
                accepted.append(True)
                continue
            if strict:
                refused = self.debt_throttle_ms(user, client_id, now_ms)
                if refused > 0:
                    accepted.append(False)
                    throttle = refused
                    continue
                self.record(user, client_id, cost, now_ms)
            else:
                charge = self.record(user, client_id, cost, now_ms)
                if charge.throttle_ms > 0:
                    throttle = charge.throttle_ms
            accepted.append(True)
        if throttle > 0:
            found = self.resolve(user, client_id)
            if found is not None:
                self.record_throttle(Charge(found[0], found[1], 0.0, throttle), throttle, now_ms)
        return MutationVerdict(tuple(accepted), throttle)

    def settle(self, user: str, client_id: str, partitions: int, now_ms: int) -> None:
        """Correct a charge once the broker's answer says what was really done: give back what a
        refused topic was charged (`partitions` < 0), or charge what a topic created with the
        broker's default partition count cost beyond the estimate. Never throttles by itself."""
        if partitions == 0:
            return
        found = self.resolve(user, client_id)
        if found is None:
            return
        if partitions > 0:
            self.record(user, client_id, partitions, now_ms)
            return
        charge = Charge(found[0], found[1], 0.0, 0)
        self.unrecord(charge, -partitions, now_ms)
        bucket = self.buckets.get(found[0])
        if bucket is not None and isinstance(bucket.tokens, MutationTokenBucket):
            bucket.keep_until_ms = bucket.tokens.full_at_ms(bucket.bound)


__all__ = [
    "CONTROLLER_QUOTA_WINDOW", "CONTROLLER_QUOTA_WINDOW_NUM", "CONTROLLER_QUOTA_WINDOW_SIZE_MS",
    "ControllerMutationQuotaManager", "MutationTokenBucket", "MutationVerdict", "mutation_throttle_ms",
]
