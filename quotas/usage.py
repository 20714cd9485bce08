"""Exact usage per (user, client-id) over consecutive intervals, for the usage events (issue 14).

The quota engine feeds every charge here (even with no quota configured) and the I/O layer calls
`take(now_ms)` once per interval: it returns what was counted since the previous `take` and starts
the next interval at the same instant, so intervals are consecutive, have no gaps, and each charge
is counted in exactly one of them. Summing intervals therefore never double counts, whatever the
range. Times are the caller's (wall-clock ms for the events); counting itself needs no clock.

Memory is bounded per interval: past MAX_USAGE_ENTITIES distinct entities, further ones are folded
into one entity named OTHER, and how many were folded is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import QuotaType

#: Distinct (user, client-id) entities counted per interval; further ones fold into OTHER. Kafka
#: has no equivalent (a broker keeps a quota sensor per entity without a cap and expires idle ones);
#: this bounds one interval's memory and events (~400 bytes of JSON each) the way
#: `proxy.metrics_max_entities` bounds the metrics' series.
MAX_USAGE_ENTITIES = 10_000

#: The entity the entities past MAX_USAGE_ENTITIES are counted under (as in the metrics' series).
OTHER = "__other__"


class EntityUsage:
    """One entity's sums over one interval."""

    __slots__ = ("capacity_throttles", "fetch_bytes", "new_producer_ids", "produce_bytes",
                 "request_time_ms", "requests", "shadow_capacity_throttles", "shadow_throttles", "throttles")

    def __init__(self) -> None:
        self.produce_bytes = 0
        self.fetch_bytes = 0
        #: requests per Kafka API key
        self.requests: dict[int, int] = {}
        self.request_time_ms = 0.0
        self.new_producer_ids = 0
        #: per quota key: [throttle count, throttle time ms]
        self.throttles: dict[QuotaType, list[int]] = {}
        #: per direction: [throttle count, throttle time ms] the cluster capacity decided
        self.capacity_throttles: dict[QuotaType, list[int]] = {}
        #: the same two, for throttles computed and reported only, in shadow (shadow.py)
        self.shadow_throttles: dict[QuotaType, list[int]] = {}
        self.shadow_capacity_throttles: dict[QuotaType, list[int]] = {}

    def add(self, other: EntityUsage) -> None:
        """Fold another entity's sums into this one."""
        self.produce_bytes += other.produce_bytes
        self.fetch_bytes += other.fetch_bytes
        for api_key, count in other.requests.items():
            self.requests[api_key] = self.requests.get(api_key, 0) + count
        self.request_time_ms += other.request_time_ms
        self.new_producer_ids += other.new_producer_ids
        for own, theirs in ((self.throttles, other.throttles),
                            (self.capacity_throttles, other.capacity_throttles),
                            (self.shadow_throttles, other.shadow_throttles),
                            (self.shadow_capacity_throttles, other.shadow_capacity_throttles)):
            for quota_type, (count, time_ms) in theirs.items():
                mine = own.setdefault(quota_type, [0, 0])
                mine[0] += count
                mine[1] += time_ms


@dataclass(slots=True)
class UsageInterval:
    """What `take` returns: the sums of [start_ms, end_ms) per (user, client-id)."""

    start_ms: int
    end_ms: int
    #: consecutive from 0 per UsageAccount: a missing number is an interval lost on the way
    seq: int
    entities: dict[tuple[str, str], EntityUsage] = field(default_factory=dict)
    #: entities counted under (OTHER, OTHER) because MAX_USAGE_ENTITIES was reached
    folded_entities: int = 0


class UsageAccount:
    """The current interval's sums; `record` and `throttled` are on the request path."""

    __slots__ = ("_current", "_folded", "_other", "_seq", "_start_ms", "max_entities")

    def __init__(self, start_ms: int, max_entities: int = MAX_USAGE_ENTITIES) -> None:
        if max_entities < 1:
            raise ValueError(f"max_entities must be at least 1, got {max_entities}")
        self.max_entities = max_entities
        self._start_ms = start_ms
        self._seq = 0
        self._current: dict[tuple[str, str], EntityUsage] = {}
        self._other: EntityUsage | None = None
        #: the entities seen this interval past the cap (counted once each)
        self._folded: set[tuple[str, str]] = set()

    @property
    def start_ms(self) -> int:
        """Where the current interval began."""
        return self._start_ms

    def _entity(self, user: str, client_id: str) -> EntityUsage:
        key = (user, client_id)
        entity = self._current.get(key)
        if entity is not None:
            return entity
        if len(self._current) < self.max_entities:
            entity = self._current[key] = EntityUsage()
            return entity
        if len(self._folded) < self.max_entities:  # the set of folded names is bounded too
            self._folded.add(key)
        if self._other is None:
            self._other = EntityUsage()
        return self._other

    def record(self, user: str, client_id: str, api_key: int | None, produce_bytes: int, fetch_bytes: int,
               request_time_ms: float | None, new_producer_ids: int = 0) -> None:
        """One charge: `api_key` counts one request of that API (None: a request already counted,
        such as a Produce's response after its arrival was charged)."""
        entity = self._entity(user, client_id)
        if api_key is not None:
            requests = entity.requests
            requests[api_key] = requests.get(api_key, 0) + 1
        if produce_bytes:
            entity.produce_bytes += produce_bytes
        if fetch_bytes:
            entity.fetch_bytes += fetch_bytes
        if request_time_ms is not None:
            entity.request_time_ms += request_time_ms
        if new_producer_ids:
            entity.new_producer_ids += new_producer_ids

    def unrecord_fetch(self, user: str, client_id: str, fetch_bytes: int) -> None:
        """A throttled Fetch emptied of its records: its bytes were not delivered, nor charged."""
        self._entity(user, client_id).fetch_bytes -= fetch_bytes

    def throttled(self, user: str, client_id: str, quota_type: QuotaType, throttle_ms: int, *,
                  shadow: bool = False) -> None:
        """A throttle `quota_type` decided (the largest one of its request, as Kafka records);
        `shadow`: computed and reported only (shadow.py), counted apart."""
        entity = self._entity(user, client_id)
        _count(entity.shadow_throttles if shadow else entity.throttles, quota_type, throttle_ms)

    def capacity_throttled(self, user: str, client_id: str, direction: QuotaType, throttle_ms: int, *,
                           shadow: bool = False) -> None:
        """A throttle the cluster capacity decided (the tenant was above its fair share), counted
        apart from the quotas' throttles."""
        entity = self._entity(user, client_id)
        _count(entity.shadow_capacity_throttles if shadow else entity.capacity_throttles, direction,
               throttle_ms)

    def take(self, now_ms: int) -> UsageInterval:
        """The interval [start, now_ms) and a new one from now_ms; `now_ms` never goes back."""
        end_ms = max(now_ms, self._start_ms)
        entities = self._current
        folded = len(self._folded)
        if self._other is not None:
            mine = entities.get((OTHER, OTHER))
            if mine is None:
                entities[(OTHER, OTHER)] = self._other
            else:
                mine.add(self._other)
        interval = UsageInterval(self._start_ms, end_ms, self._seq, entities, folded)
        self._start_ms = end_ms
        self._seq += 1
        self._current = {}
        self._other = None
        self._folded = set()
        return interval


__all__ = ["MAX_USAGE_ENTITIES", "OTHER", "EntityUsage", "UsageAccount", "UsageInterval"]


def _count(throttles: dict[QuotaType, list[int]], quota_type: QuotaType, throttle_ms: int) -> None:
    """One more throttle of `throttle_ms` under `quota_type`: [count, total ms]."""
    counts = throttles.get(quota_type)
    if counts is None:
        throttles[quota_type] = [1, throttle_ms]
    else:
        counts[0] += 1
        counts[1] += throttle_ms
