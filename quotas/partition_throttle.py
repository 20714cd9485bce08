"""KIP-73 partition throttles, translated from followers to consumers.

Kafka's leader throttles replication by listing partitions (`leader.replication.throttled.replicas`,
`partition:broker,...` or `*`) and one shared byte rate (`leader.replication.throttled.rate`). A
throttled partition whose fetch arrives while that rate is over comes back with empty records
(offsets, high watermark and errors kept) instead of delaying the whole response; the others in
the same response are untouched. A proxy sees consumers, not followers, so here an operator lists
a topic's partitions (or all of them) with one shared byte rate, optionally only for some users
and/or client ids, and the proxy empties those partitions in Fetch responses while it is over.

What follows Kafka (`ReplicationQuotaManager`):
- the rate is Kafka's `SimpleRate`: samples as for quotas (`replication.quota.window.num` 11 x
  `replication.quota.window.size.seconds` 1 s), but divided by the time since the oldest sample
  started, at least one window: no padding to 10 windows, so no 10x burst at the start;
- "over" is Kafka's `Sensor.checkQuotas`: the rate measured now is above the bound;
- bytes of an emptied partition are not recorded (Kafka records `sizeOfThrottledPartitions` of
  the response it sends, where they are empty); there is no throttle time and no mute.

What differs: Kafka decides every throttled partition of a response against the rate as it was
before the response and records the response's throttled bytes afterwards. KIP-73 describes
`quota.recordAndMaybeAdjust(bytesRequestedForPartition)` partition by partition, and that is what
is done here: partitions are decided in response order, each against the rate including the
bytes let through earlier in the same response. A response then overshoots by at most one
partition's records, not by all its throttled partitions.

Pure: time is passed in, nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .rate import WindowConfig, WindowedRate

#: At most this many throttles. Kafka has no such list: a broker has one leader and one follower
#: `ReplicationQuotaManager` (one shared rate each) and the throttled replicas are a per-topic
#: config, bounded only by the topic config's size. Each throttle here costs a rate (~1 KB) and is
#: looked at per throttled partition of each Fetch response, so the list stays small.
MAX_PARTITION_THROTTLES = 1000

#: Kafka's defaults for replication quotas: `replication.quota.window.num` = 11 samples of
#: `replication.quota.window.size.seconds` = 1 s.
REPLICATION_WINDOW = WindowConfig(samples=11, window_ms=1000)

#: (user, client id) answers `applies_to` remembers; cleared whole when full (a new client id
#: costs one pass over the throttles), and whenever the throttles change.
APPLIES_CACHE_MAX = 10_000


class SimpleRate(WindowedRate):
    """Kafka's `SimpleRate`: the sampled sum divided by the time since the oldest sample started.

    Unlike the quotas' `Rate`, the window is not padded to `samples - 1` whole windows; only the
    first window counts as a whole one (`max(elapsed, window)`), "to avoid an artificially high
    rate when the gap between readings is close to 0".
    """

    __slots__ = ()

    def measure_with_window(self, now_ms: int) -> tuple[float, int]:
        config = self.config
        expired = now_ms - config.samples * config.window_ms
        total = 0.0
        oldest = now_ms
        for sample in self._samples:
            if sample.last_event_ms <= expired:  # SampledStat.purgeObsoleteSamples
                sample.reset(now_ms)
            else:
                total += sample.value
                if sample.start_ms < oldest:
                    oldest = sample.start_ms
        window = max(now_ms - oldest, config.window_ms)
        return total * 1000.0 / window, window

    def ms_until_at_most(self, bound: float, now_ms: int) -> int:
        """How long, with nothing more recorded, until the rate is at most `bound` (0: it is now).

        Between two purges the sum and the oldest start stay put, so the rate falls as
        sum / (t - oldest) and reaches the bound at oldest + sum / bound; a sample purged on the
        way (`samples x window_ms` after its last event) takes its value and start with it.
        """
        if self.measure(now_ms) <= bound:
            return 0
        history = self.config.samples * self.config.window_ms
        live = sorted((s for s in self._samples if s.last_event_ms > now_ms - history),
                      key=lambda s: s.last_event_ms)
        at = now_ms
        while live:
            total = sum(s.value for s in live)
            oldest = min(s.start_ms for s in live)
            need_ms = total * 1000.0 / bound  # the window that brings this sum to the bound
            under = at if need_ms <= self.config.window_ms else max(oldest + math.ceil(need_ms), at)
            purged = live[0].last_event_ms + history
            if under < purged:
                return under - now_ms
            at = purged
            live.pop(0)
        return at - now_ms


@dataclass(frozen=True, slots=True)
class PartitionThrottle:
    """One throttle as configured: which partitions, at what shared rate, for whom."""

    #: label in metrics and key across reloads (a throttle keeps its rate while its name stays)
    name: str
    topic: str
    #: throttled partition indexes; None for every partition of the topic (`"*"`)
    partitions: frozenset[int] | None
    #: shared bytes per second of all its partitions' records (`leader.replication.throttled.rate`)
    byte_rate: float
    #: only these principals' fetches are throttled; None for everyone
    users: frozenset[str] | None = None
    #: only these client ids' fetches are throttled; None for every client id
    client_ids: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a partition throttle needs a name")
        if not self.topic:
            raise ValueError(f"partition throttle {self.name}: topic must not be empty")
        if not (math.isfinite(self.byte_rate) and self.byte_rate > 0):
            raise ValueError(f"partition throttle {self.name}: byte_rate {self.byte_rate} must be "
                             "a finite number greater than 0")
        if self.partitions is not None and (not self.partitions or min(self.partitions) < 0):
            raise ValueError(f"partition throttle {self.name}: partitions must be non-negative "
                             "indexes, at least one, or None for all")

    def concerns(self, user: str, client_id: str) -> bool:
        """Whether this throttle applies to a client (both filters must match where given)."""
        return ((self.users is None or user in self.users)
                and (self.client_ids is None or client_id in self.client_ids))

    def covers(self, partition: int) -> bool:
        return self.partitions is None or partition in self.partitions


class ThrottleState:
    """A throttle's live state: its rate and what it let through or withheld (for metrics)."""

    __slots__ = ("definition", "let_through_bytes", "rate", "shadow_withheld_bytes",
                 "shadow_withheld_partitions", "withheld_bytes", "withheld_partitions")

    def __init__(self, definition: PartitionThrottle, window: WindowConfig) -> None:
        self.definition = definition
        self.rate = SimpleRate(window)
        #: record bytes of its partitions sent on to clients (Kafka's LeaderReplication byte-rate input)
        self.let_through_bytes = 0
        #: record bytes of its partitions emptied while it was over, and how many partitions
        self.withheld_bytes = 0
        self.withheld_partitions = 0
        #: the same for a proxy in shadow: what it would have emptied, and let through
        self.shadow_withheld_bytes = 0
        self.shadow_withheld_partitions = 0


@dataclass(frozen=True, slots=True)
class ThrottleStats:
    """One throttle's figures for a scrape."""

    name: str
    topic: str
    byte_rate: float
    #: the rate measured now (bytes/s), as the decision sees it
    rate: float
    let_through_bytes: int
    withheld_bytes: int
    withheld_partitions: int
    shadow_withheld_bytes: int = 0
    shadow_withheld_partitions: int = 0


class PartitionThrottles:
    """Every configured throttle, and the per-partition decisions of Fetch responses."""

    def __init__(self, window: WindowConfig = REPLICATION_WINDOW,
                 max_throttles: int = MAX_PARTITION_THROTTLES, shadow: bool = False) -> None:
        self.window = window
        self.max_throttles = max_throttles
        #: the proxy's `[proxy] shadow` (shadow.py): a partition over its throttle is counted as
        #: withheld in shadow, and let through (and recorded, since it is delivered)
        self.shadow = shadow
        self._states: dict[str, ThrottleState] = {}
        #: topic -> the throttles naming it, in configuration order
        self._by_topic: dict[str, tuple[ThrottleState, ...]] = {}
        self._topics: frozenset[str] = frozenset()
        #: whether some throttle has neither a user nor a client-id filter
        self._for_everyone = False
        self._applies: dict[tuple[str, str], bool] = {}

    # -- configuration -----------------------------------------------------------------------------

    def set_throttles(self, definitions: Iterable[PartitionThrottle]) -> None:
        """Apply a new list; a throttle whose name is kept keeps its rate history and counters.

        As Kafka's `ReplicationQuotaManager.updateQuota` and `markThrottled` change the bound and
        the partitions of a sensor that lives on, a throttle whose rate or partitions change under
        the same name is not reset (a reload must not grant a fresh burst).
        """
        definitions = list(definitions)
        if len(definitions) > self.max_throttles:
            raise ValueError(f"{len(definitions)} partition throttles, more than the "
                             f"{self.max_throttles} allowed")
        names = [definition.name for definition in definitions]
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"partition throttle names must be unique: {', '.join(twice)} given twice")
        states: dict[str, ThrottleState] = {}
        by_topic: dict[str, list[ThrottleState]] = {}
        for definition in definitions:
            state = self._states.get(definition.name)
            if state is None:
                state = ThrottleState(definition, self.window)
            else:
                state.definition = definition
            states[definition.name] = state
            by_topic.setdefault(definition.topic, []).append(state)
        self._states = states
        self._by_topic = {topic: tuple(found) for topic, found in by_topic.items()}
        self._topics = frozenset(by_topic)
        self._for_everyone = any(d.users is None and d.client_ids is None for d in definitions)
        self._applies = {}

    @property
    def throttles(self) -> list[PartitionThrottle]:
        return [state.definition for state in self._states.values()]

    @property
    def topics(self) -> frozenset[str]:
        """Topics some throttle names (whose ids the proxy must learn for Fetch v13+)."""
        return self._topics

    def __bool__(self) -> bool:
        return bool(self._states)

    # -- decisions ---------------------------------------------------------------------------------

    def applies_to(self, user: str, client_id: str) -> bool:
        """Whether any throttle can concern this client's fetches.

        Cheap, so the connection can ask it per Fetch: only then must it buffer the response
        whole (to empty partitions in it) instead of streaming it through.
        """
        if not self._states:
            return False
        if self._for_everyone:
            return True
        key = (user, client_id)
        answer = self._applies.get(key)
        if answer is None:
            answer = any(state.definition.concerns(user, client_id) for state in self._states.values())
            if len(self._applies) >= APPLIES_CACHE_MAX:
                self._applies.clear()
            self._applies[key] = answer
        return answer

    def concerns_topic(self, topic: str) -> bool:
        return topic in self._by_topic

    def decide(self, user: str, client_id: str, topic: str, partition: int, record_bytes: int,
               now_ms: int) -> bool:
        """Whether a partition's records go through (True, and they are recorded) or are emptied.

        Emptied when a throttle covering it for this client is over its rate now; its bytes are
        then counted as withheld by each throttle that was over, and recorded by none (KIP-73:
        what is not sent does not count). Let through, they are recorded by every throttle that
        covers it, so the next partition of the same response already sees them.
        """
        states = self._by_topic.get(topic)
        if states is None or record_bytes <= 0:
            return True
        if len(states) == 1:  # the usual case: one throttle per topic, no list built
            state = states[0]
            definition = state.definition
            if not (definition.covers(partition) and definition.concerns(user, client_id)):
                return True
            if state.rate.measure(now_ms) > definition.byte_rate:
                if not self.shadow:
                    state.withheld_bytes += record_bytes
                    state.withheld_partitions += 1
                    return False
                state.shadow_withheld_bytes += record_bytes
                state.shadow_withheld_partitions += 1
            state.rate.record(record_bytes, now_ms)
            state.let_through_bytes += record_bytes
            return True
        covering = [state for state in states
                    if state.definition.covers(partition) and state.definition.concerns(user, client_id)]
        over = [state for state in covering if state.rate.measure(now_ms) > state.definition.byte_rate]
        if over and not self.shadow:
            for state in over:
                state.withheld_bytes += record_bytes
                state.withheld_partitions += 1
            return False
        for state in over:
            state.shadow_withheld_bytes += record_bytes
            state.shadow_withheld_partitions += 1
        for state in covering:
            state.rate.record(record_bytes, now_ms)
            state.let_through_bytes += record_bytes
        return True

    def wait_ms(self, user: str, client_id: str, topic: str, partition: int, now_ms: int) -> int:
        """How long until every throttle covering this partition for this client is under its rate.

        0 when none is over. The connection may hold a response whose records were all emptied
        this long (within the fetch's max_wait_ms): answered at once, the client would fetch the
        same records again at once, and the broker read them again, for nothing.
        """
        wait = 0
        for state in self._by_topic.get(topic, ()):
            definition = state.definition
            if definition.covers(partition) and definition.concerns(user, client_id):
                wait = max(wait, state.rate.ms_until_at_most(definition.byte_rate, now_ms))
        return wait

    # -- metrics -----------------------------------------------------------------------------------

    def stats(self, now_ms: int) -> list[ThrottleStats]:
        """Every throttle's figures now, in configuration order (bounded by `max_throttles`)."""
        return [ThrottleStats(state.definition.name, state.definition.topic, state.definition.byte_rate,
                              state.rate.measure(now_ms), state.let_through_bytes, state.withheld_bytes,
                              state.withheld_partitions, state.shadow_withheld_bytes,
                              state.shadow_withheld_partitions)
                for state in self._states.values()]


__all__ = [
    "MAX_PARTITION_THROTTLES", "REPLICATION_WINDOW", "PartitionThrottle", "PartitionThrottles",
    "SimpleRate", "ThrottleState", "ThrottleStats",
]
