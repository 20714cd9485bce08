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

In a fleet the bucket is fleet-wide. Every member keeps a replica of each bucket: it debits its
own charges at once, and its peers' as they report them. A token bucket is debited by events, not
set from a rate, so the exchange carries, per bucket, the partitions this member charged since it
made the bucket (a running total, sent in every delta that follows a charge and asking for an urgent
report), and a receiver debits what each peer's total grew by (`fleet.CountLedger`). Each replica
refills once, at the quota's rate, so N members allow the quota once, not N times; a member decides
on the charges it has heard of, a report's latency behind (milliseconds). Refunds (a topic the
broker refused) stay local: peers keep the debit, stricter by it until the bucket refills.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .entity import BucketKey
from .fleet import UsageEntry, wire_name
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
        tokens = min(burst, self.refill(rate, burst, now_ms) - value)
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
                 max_buckets: int | None = DEFAULT_MAX_BUCKETS, idle_expiry_ms: int = IDLE_EXPIRY_MS,
                 max_throttle_ms: int | None = None) -> None:
        super().__init__(QuotaType.CONTROLLER_MUTATION, window, max_buckets=max_buckets,
                         idle_expiry_ms=idle_expiry_ms, max_throttle_ms=max_throttle_ms)
        #: Kafka's burst in seconds of quota: `TokenBucket.burst` = samples x window size
        self.burst_seconds = window.samples * window.window_ms / 1000.0
        #: in a fleet: per bucket, the bucket and the partitions charged here since it was made
        #: (its running total for peers; a bucket made again starts a new total)
        self._totals: dict[BucketKey, tuple[Bucket, float]] | None = None
        #: buckets charged since the last delta listing
        self._counted: set[BucketKey] = set()
        self._on_count: Callable[[], None] | None = None

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
            totals = self._totals
            if totals is not None and charge.bucket is not None and value > 0:
                held = totals.get(charge.bucket)
                total = held[1] if held is not None and held[0] is bucket else 0.0
                totals[charge.bucket] = (bucket, total + value)
                self._counted.add(charge.bucket)
                if self._on_count is not None:
                    self._on_count()
        return charge

    # -- the fleet: one bucket over every member ------------------------------------------------

    def attach_counts(self, on_count: Callable[[], None] | None) -> None:
        """Share the buckets with a fleet from now on: charges are totalled for `count_usage`, and
        `on_count` (no I/O: it asks the exchange for an urgent report) is called on each."""
        self._totals = {}
        self._counted = set()
        self._on_count = on_count

    def count_usage(self, keys: Sequence[BucketKey] | None = None,
                    changed_only: bool = False) -> list[UsageEntry]:
        """The running totals for the fleet's report: of `keys` (None: every bucket), or with
        `changed_only` of the buckets charged since the last such listing."""
        totals = self._totals
        if totals is None:
            return []
        if changed_only:
            listed: Sequence[BucketKey] | set[BucketKey] = self._counted
            self._counted = set()
        else:
            listed = list(totals) if keys is None else keys
        out: list[UsageEntry] = []
        for key in listed:
            held = totals.get(key)
            if held is None:
                continue
            if self.buckets.get(key) is not held[0]:  # expired here: listed no more (peers hear 0)
                del totals[key]
                continue
            out.append(UsageEntry(QuotaType.CONTROLLER_MUTATION, key.user, key.client_id, held[1]))
        return out

    def begin_count_listing(self) -> list[BucketKey]:
        """The buckets a full report lists (see QuotaEngine.full_listing); charges from now on are
        listed again by the next delta report."""
        self._counted = set()
        return list(self._totals) if self._totals is not None else []

    def peer_charged(self, key: tuple[str, str], partitions: float, whole: bool, now_ms: int) -> None:
        """Debit what a peer charged to one of its buckets (`fleet.CountLedger`) from this member's
        replica. `whole`: its total was heard for the first time, so the debit is capped at one
        burst. A key no quota here leads to (or a long name) is left alone."""
        found = self._replica(BucketKey(*key), now_ms)
        if found is None:
            return
        bucket_key, bucket = found
        tokens = bucket.tokens
        if not isinstance(tokens, MutationTokenBucket) or bucket.bound <= 0:
            return
        if whole:
            partitions = min(partitions, bucket.bound * self.burst_seconds)
        tokens.record(partitions, bucket.bound, now_ms)
        bucket.keep_until_ms = tokens.full_at_ms(bucket.bound)
        self._touch(bucket_key, bucket, now_ms)

    def _replica(self, key: BucketKey, now_ms: int) -> tuple[BucketKey, Bucket] | None:
        """The bucket a peer's key names here: held, or made when the quotas lead to that key."""
        bucket = self.buckets.get(key)
        if bucket is not None:
            return key, bucket
        found = self.resolve_key(key)
        if found is None or found.bucket != key:
            for held_key, held in self.buckets.items():  # a long name travels as its digest
                if (wire_name(held_key.user), wire_name(held_key.client_id)) == key:
                    return held_key, held
            return None
        if (found.capped and self.max_buckets is not None and len(self.buckets) >= self.max_buckets
                and not self._make_room(now_ms)):
            return None
        bucket = self._add(key, now_ms)
        bucket.bound = found.bound
        bucket.member_user = key.user
        bucket.member_client_id = key.client_id
        return key, bucket

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
                      now_ms: int, *, shadow: bool = False) -> MutationVerdict:
        """Charge one request's topics in order: `costs[i]` partitions for topic i.

        A topic of cost 0 (one the broker will refuse before charging it) is neither charged nor
        refused. Strict: refused once the bucket is in debt, throttle of the last refusal;
        permissive: all recorded, throttle of the last violation (the largest). `shadow`: the
        throttle is counted as a shadow one (see shadow.py).
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
        if self.max_throttle_ms is not None and throttle > self.max_throttle_ms:
            throttle = self.max_throttle_ms  # the proxy's max_throttle_time_ms
        if throttle > 0:
            found = self.resolve(user, client_id)
            if found is not None:
                self.record_throttle(Charge(found[0], found[1], 0.0, throttle), throttle, now_ms,
                                     shadow=shadow)
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
