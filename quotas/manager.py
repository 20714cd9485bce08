"""A rate quota of one type: buckets per (user, client-id), Kafka's record-then-check.

Mirrors a broker's ClientQuotaManager, with time passed in: the traffic is always recorded (the
quota never rejects anything), then the bucket's rate is compared with its bound, and a
violation costs a throttle time. A bucket is found through the entity levels in `entity.py`;
its history survives quota changes as long as its key does not change.

Memory is bounded, however many client ids appear:

- A bucket whose rate holds no history (no recording for `samples x window_ms`, 11 s by
  default) and whose throttle is over is dropped by `expire_idle`: a new bucket for the same
  key measures exactly as the old one would have, so no quota decision changes (pinned by a
  Hypothesis test over random charge sequences). Only a measurement between charges (a metrics
  scrape) can leave a kept bucket a zero-valued sample whose start pads its window by less than
  one window more, i.e. more lenient: a dropped bucket is, if anything, the stricter one.
- A bucket that has throttled keeps its throttle counters (`throttle_total_ms`,
  `throttle_count`, exported as Prometheus counters) until Kafka's one-hour idle expiry, as a
  broker keeps a client's sensors for an hour: dropped with its rate, a throttle decided
  between two scrapes would never be seen. Its samples are freed once they expire (it is then
  *dormant*: a few hundred bytes), and a dormant bucket is the first to go when the cap below
  needs room.
- At most `max_buckets` buckets live per quota type. Past the cap, a bucket that a `<default>`
  entity would create (one per client id or per user: the unbounded kind) is not created: the
  charge goes to one shared overflow bucket (`OVERFLOW_KEY`), measured against the bound the
  entity resolves to, so a flood of client ids throttles itself as a group. Existing buckets
  keep their history (never evicted while they hold any), no charge is left unmetered, and
  explicitly configured entities, which the quota table bounds, always get their own bucket.

The quota's shape (see token_bucket.py): "kafka", the default, decides with the windowed rate
exactly as a broker does. "smooth" keeps recording the windowed rate (the rate reported in
`Charge.observed`, the metrics and the fleet's usage, and what expiry goes by) but decides with
a token bucket whose burst is one second of quota: the throttle is how long until the bucket is
back at zero. In a fleet, the windowed formula on the fleet's usage still applies on top (the
larger throttle wins), so the fleet-wide quota holds as in the "kafka" shape.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .entity import (
    DEFAULT,
    BucketKey,
    PrefixIndex,
    QuotaEntity,
    bucket_prefix,
    prefix_bucket_entities,
    resolve_entity,
)
from .fleet import DELTA_CHANGE_OF_BOUND, URGENT_CHANGE_RATIO, PeerView, UsageEntry
from .rate import DEFAULT_WINDOW, WindowConfig, WindowedRate, WindowedStat
from .throttle import bounded_throttle_time_ms, throttle_time_ms
from .token_bucket import BURST_MS, KAFKA, QUOTA_SHAPES, SMOOTH, QuotaShape, TokenBucket
from .types import QuotaType

#: Kafka expires a client's quota sensors after an hour without traffic
#: (`ClientQuotaManager.InactiveSensorExpirationTimeSeconds`).
IDLE_EXPIRY_MS = 3600 * 1000

#: Live buckets per quota type. Kafka has no such cap (a broker keeps a sensor per client id until
#: it idles out an hour later). A bucket charged once costs ~0.75 KB (its share of the resolution
#: cache included), so a flood of client ids under a `<default>` quota on produce, fetch and
#: request peaks at ~115 MB traced, ~125 MB RSS (bench/memory.py, budget 150 MB), however many ids
#: come. Full sample rings (~1.8 KB a bucket) need every bucket charged each second, 150,000
#: charges/s, more than one proxy process serves. 50,000 clients active within 11 s is far above
#: what one proxy fronts, so the cap only bites on a flood.
DEFAULT_MAX_BUCKETS = 50_000

#: Bucket key of the shared overflow bucket (the `__other__` label style of the metrics); should
#: a real (user, client-id) ever be named so, it shares the overflow bucket: stricter, never looser.
OVERFLOW_KEY = BucketKey("__overflow__", "__overflow__")

#: Buckets `expire_idle` examines per call, over all quota types: dropping one costs ~1 us
#: (mostly freeing it), so a call stays near 2 ms and can run every second from the event loop.
#: A larger backlog waits for later calls; the cap never waits (see `_make_room`).
EXPIRY_BUDGET = 2048

#: A recording moves its bucket to the young end of the expiry order at most this often, so the
#: hot path pays one comparison per charge; expiry may then come this much later than due.
REORDER_INTERVAL_MS = 1000

#: The resolution cache (11 levels walked per new (user, client-id)) is cleared when it reaches
#: this many entries, or the bucket cap if lower (an entry costs ~220 B, a third of a bucket).
_RESOLVED_MAX = 100_000

#: The sweep retires the resolution cache when it holds this many entries more than twice the
#: live buckets (entries of client ids that left), and frees it within its budget.
_CACHE_SLACK = 4096

#: Dicts keep their tables when entries go: once a manager holds fewer than 1/16 of its most
#: buckets (and that peak was above this), the sweep copies them into right-sized ones.
_COMPACT_MIN = 4096

#: How much earlier than the throttle's end a held connection may try again (see remaining_throttle_ms).
HOLD_HEAD_START_MS = 1

#: `urgent_above` of a bucket already waiting for its urgent report.
_NEVER = float("inf")

#: `seen_ms` of a dormant bucket: its next charge always moves it back among the recent ones.
_DORMANT_SEEN_MS = -(2**62)


#: Paused (throttled) buckets a delta listing measures again at most (see `local_usage`).
MAX_PAUSED_PER_DELTA = 1000


class Resolution(NamedTuple):
    """Where a (user, client-id) is charged, and whether a `<default>` entity led there."""

    bucket: BucketKey
    bound: float
    #: True when the entity matched has a `<default>` part: one bucket per client id or user,
    #: unbounded in number, so subject to `max_buckets`
    capped: bool


@dataclass(slots=True)
class Bucket:
    """One bucket's sensors: the quota rate, and the throttle times it caused (for metrics)."""

    rate: WindowedRate
    #: throttle times this bucket caused: Kafka's `throttle-time` sensor (avg and max); created
    #: by the first throttle, dropped again when its samples expire (None: nothing to report)
    throttle: WindowedStat | None = None
    #: the bound in force (updated at once when the quotas change)
    bound: float = 0.0
    #: a (user, client-id) charged to this bucket, to re-resolve it when the quotas change
    member_user: str | None = None
    member_client_id: str = ""
    #: whether a configured quota still leads to this bucket
    applies: bool = True
    throttle_total_ms: int = 0
    throttle_count: int = 0
    #: the throttles computed and reported only, in shadow (shadow.py)
    shadow_throttle_total_ms: int = 0
    shadow_throttle_count: int = 0
    #: end of the latest throttle this bucket caused: until then, every connection charging
    #: the bucket holds such requests back (the proxy's scope is the whole cluster)
    throttled_until_ms: int = 0
    #: when the bucket last moved to the young end of the expiry order
    seen_ms: int = 0
    #: its own rate when it was last listed for the fleet (what peers know of it), and the rate
    #: above which it asks for an urgent report (URGENT_CHANGE_RATIO of its bound higher)
    reported: float = 0.0
    urgent_above: float = 0.0
    #: the "smooth" shape's token bucket (None in the "kafka" shape), or the controller
    #: mutation quota's (see controller_mutation.py)
    tokens: TokenBucket | None = None
    #: until then the bucket holds state a new one would not (a controller mutation token
    #: bucket in debt is not full again before it): expiry and the cap leave it alone
    keep_until_ms: int = 0


class Charge(NamedTuple):
    """What one recording led to (a tuple: one is made per charged request)."""

    bucket: BucketKey | None  # None: no quota applies (unlimited)
    bound: float
    observed: float  # the rate decided on: with a fleet, the bucket's own plus its peers'
    throttle_ms: int
    #: the smooth shape's token bucket was in debt before this recording (see QuotaEngine.charge)
    in_debt: bool = False


UNLIMITED = Charge(None, float("inf"), 0.0, 0)


def _resolve(quotas: dict[QuotaEntity, float], prefixes: PrefixIndex, user: str,
             client_id: str) -> Resolution | None:
    """Kafka's eight levels and the client-id prefix levels, first match wins (see entity.py)."""
    found = resolve_entity(quotas, prefixes, user, client_id)
    if found is None:
        return None
    entity, key, bound = found
    return Resolution(key, bound, DEFAULT in (entity.user, entity.client_id))


class ClientQuotaManager:
    """Rate quotas of one type (produce bytes, fetch bytes, request time, ...).

    For the I/O layer: `buckets` (every live bucket, including dormant and overflow ones; its
    length is the live bucket count), `overflow_charges` (charges that went to the overflow
    bucket because the cap was reached) and `expire_idle`, to call about once a second.
    """

    def __init__(self, quota_type: QuotaType, window: WindowConfig = DEFAULT_WINDOW,
                 *, max_throttle_ms: int | None = None, max_buckets: int | None = DEFAULT_MAX_BUCKETS,
                 idle_expiry_ms: int = IDLE_EXPIRY_MS, shape: QuotaShape = KAFKA) -> None:
        if max_buckets is not None and max_buckets < 1:
            raise ValueError(f"max_buckets must be at least 1, got {max_buckets}")
        if shape not in QUOTA_SHAPES:
            raise ValueError(f"quota shape must be one of {', '.join(QUOTA_SHAPES)}, got {shape!r}")
        #: "kafka" (the windowed rate decides) or "smooth" (a one-second token bucket decides)
        self.shape = shape
        self._smooth = shape == SMOOTH
        self.quota_type = quota_type
        self.window = window
        #: The request quota caps a throttle at one window; byte rates are unbounded.
        self.max_throttle_ms = max_throttle_ms
        #: None: no cap (only for tests and tools; a proxy always has one)
        self.max_buckets = max_buckets
        self.idle_expiry_ms = idle_expiry_ms
        self.quotas: dict[QuotaEntity, float] = {}
        #: the client-id prefixes among `quotas`, for longest-prefix matching
        self.prefixes = PrefixIndex(())
        self.buckets: dict[BucketKey, Bucket] = {}
        #: buckets with history or a throttle in force, least recently charged first
        self._recent: OrderedDict[BucketKey, Bucket] = OrderedDict()
        #: buckets that throttled, kept without samples for their counters, oldest first
        self._dormant: OrderedDict[BucketKey, Bucket] = OrderedDict()
        #: (user, client-id) -> its resolution; walking 11 levels per charge is too slow, so it is
        #: cached until the quotas change (bounded: cleared when it reaches its limit)
        self._resolved: dict[tuple[str, str], Resolution | None] = {}
        self._resolved_max = min(_RESOLVED_MAX, max_buckets) if max_buckets else _RESOLVED_MAX
        #: a replaced cache, freed a budget at a time by `sweep` (freeing 50,000 entries at once
        #: would stall the event loop for milliseconds)
        self._retired: dict[tuple[str, str], Resolution | None] = {}
        #: the latest end of any bucket's throttle: before it, some request may have to wait
        self.throttled_until_ms = 0
        #: charges sent to the overflow bucket because `max_buckets` was reached
        self.overflow_charges = 0
        #: most buckets held since the dicts were last compacted
        self._high_water = 0
        #: buckets dropped by `expire_idle`, and dormant ones evicted early to make room
        self.expired_buckets = 0
        self.evicted_buckets = 0
        #: peers' rates for this quota type (see fleet.py); None, a lone proxy, costs one test
        self.peers: PeerView | None = None
        #: with a fleet: buckets charged, and throttled (-> throttle end), since the last delta listing
        self._charged: set[BucketKey] = set()
        self._throttled: dict[BucketKey, int] = {}
        self._on_urgent: Callable[[], None] | None = None
        self._urgent_asked = False
        #: buckets that rose by URGENT_CHANGE_RATIO of their bound since they were last listed
        self._urgent_keys: set[BucketKey] = set()

    def set_quotas(self, quotas: dict[QuotaEntity, float]) -> None:
        """Replace the configured entities; buckets whose key still applies keep their history."""
        self.quotas = dict(quotas)
        self.prefixes = PrefixIndex(self.quotas)
        self._retire_cache()
        # Kafka updates the quota of existing sensors at once. A bucket whose key no longer
        # applies keeps its history (the key may come back) until it idles out, but has no bound.
        for key, bucket in self.buckets.items():
            user = bucket.member_user
            if user is None:
                found = None
            elif bucket_prefix(bucket.member_client_id) is not None:
                found = self.resolve_key(key)  # a peer's bucket, known by its key only
            else:
                found = self._lookup(user, bucket.member_client_id)
            bucket.applies = found is not None and found.bucket == key
            if found is not None and bucket.applies:
                bucket.bound = found.bound

    def _lookup(self, user: str, client_id: str) -> Resolution | None:
        if not self.quotas:
            return None
        try:
            return self._resolved[(user, client_id)]
        except KeyError:
            pass
        if len(self._resolved) >= self._resolved_max:
            self._retire_cache()
        found = _resolve(self.quotas, self.prefixes, user, client_id)
        # a bucket key equal to (user, client-id) serves as the cache key too (one tuple less)
        own = found is not None and found.bucket == (user, client_id)
        self._resolved[found.bucket if found is not None and own else (user, client_id)] = found
        return found

    def resolve_key(self, key: BucketKey) -> Resolution | None:
        """How the quotas lead to a bucket known by its key only (a peer's): a prefix bucket's key
        names no client id to resolve, so its entity is looked up directly."""
        for entity in prefix_bucket_entities(key):
            bound = self.quotas.get(entity)
            if bound is not None:
                return Resolution(key, bound, entity.user == DEFAULT)
        return self._lookup(key.user, key.client_id)

    def _retire_cache(self) -> None:
        if self._retired:
            self._resolved.clear()  # still freeing the previous one: no choice but now
        else:
            self._retired, self._resolved = self._resolved, {}

    def resolve(self, user: str, client_id: str) -> tuple[BucketKey, float] | None:
        """The bucket key and bound that apply to (user, client_id); None: unlimited."""
        found = self._lookup(user, client_id)
        return None if found is None else (found.bucket, found.bound)

    # -- buckets: creation, the cap, the expiry order -----------------------------------------

    @property
    def live_buckets(self) -> int:
        """Buckets held now (at most `max_buckets`, plus explicitly configured ones and overflow)."""
        return len(self.buckets)

    @property
    def cached_resolutions(self) -> int:
        """Entries of the resolution cache, including a retired one not yet freed."""
        return len(self._resolved) + len(self._retired)

    def _add(self, key: BucketKey, now_ms: int) -> Bucket:
        bucket = Bucket(WindowedRate(self.window), seen_ms=now_ms,
                        tokens=TokenBucket() if self._smooth else None)
        self.buckets[key] = bucket
        self._recent[key] = bucket
        if len(self.buckets) > self._high_water:
            self._high_water = len(self.buckets)
        return bucket

    def _new_bucket(self, found: Resolution, user: str, client_id: str,
                    now_ms: int) -> tuple[BucketKey, Bucket]:
        """A bucket for a key not held yet, or the overflow bucket when the cap allows no more."""
        if (not found.capped or self.max_buckets is None or len(self.buckets) < self.max_buckets
                or self._make_room(now_ms)):
            return found.bucket, self._add(found.bucket, now_ms)
        self.overflow_charges += 1
        # not worth a cache entry: a flood of new ids would fill the cache as fast as the cap
        self._resolved.pop((user, client_id), None)
        bucket = self.buckets.get(OVERFLOW_KEY)
        if bucket is None:
            bucket = self._add(OVERFLOW_KEY, now_ms)
        elif now_ms - bucket.seen_ms >= REORDER_INTERVAL_MS:
            self._touch(OVERFLOW_KEY, bucket, now_ms)
        return OVERFLOW_KEY, bucket

    def _make_room(self, now_ms: int) -> bool:
        """Free one slot at the cap without forgetting any history: a dormant bucket (counters
        only), else the least recently charged bucket if its rate has expired and it is not
        throttled (`expire_idle` has not reached it yet). False: every bucket is in use."""
        if self._dormant:
            key, _ = self._dormant.popitem(last=False)
            del self.buckets[key]
            self.evicted_buckets += 1
            return True
        if self._recent:
            key = next(iter(self._recent))
            bucket = self._recent[key]
            if (bucket.rate.expired(now_ms) and bucket.throttled_until_ms <= now_ms
                    and bucket.keep_until_ms <= now_ms):
                del self._recent[key]
                del self.buckets[key]
                self.evicted_buckets += 1
                return True
        return False

    def _touch(self, key: BucketKey, bucket: Bucket, now_ms: int) -> None:
        """Move a charged bucket to the young end of the expiry order (waking a dormant one)."""
        bucket.seen_ms = now_ms
        if self._dormant.pop(key, None) is not None:
            self._recent[key] = bucket
        else:
            self._recent.move_to_end(key)

    # -- charging -------------------------------------------------------------------------------

    def record(self, user: str, client_id: str, value: float, now_ms: int) -> Charge:
        """Record `value` for (user, client_id); returns the throttle it causes (0 within quota)."""
        found = self._lookup(user, client_id)
        if found is None:
            return UNLIMITED
        key = found.bucket
        bound = found.bound
        bucket = self.buckets.get(key)
        if bucket is None:
            key, bucket = self._new_bucket(found, user, client_id, now_ms)
            if bucket.reported == 0.0:  # never listed: urgent once past 5 % of its bound
                bucket.urgent_above = URGENT_CHANGE_RATIO * bound
        elif now_ms - bucket.seen_ms >= REORDER_INTERVAL_MS:
            self._touch(key, bucket, now_ms)
        bucket.bound = bound
        bucket.applies = True
        bucket.member_user = user
        bucket.member_client_id = client_id
        rate = bucket.rate
        rate.record(value, now_ms)
        observed, window_ms = rate.measure_with_window(now_ms)
        peers = self.peers
        if peers is not None:
            # Kafka's formula on the fleet's usage: this bucket's own rate plus its peers'. A delta
            # report lists the buckets whose own rate moved by more than DELTA_CHANGE_OF_BOUND of the
            # bound since peers were told: marking only those here spares the delta listing from
            # measuring every charged bucket again (100,000 a second at 100,000 steady entities).
            if abs(observed - bucket.reported) > DELTA_CHANGE_OF_BOUND * bound:
                self._charged.add(key)
            if observed > bucket.urgent_above:
                self._urgent_keys.add(key)
                bucket.urgent_above = _NEVER  # listed soon: that resets it
                if not self._urgent_asked:
                    self._ask_urgent()
            reports = peers.reports.get(key)
            if reports is not None and now_ms <= reports.fresh_until_ms:
                observed += reports.total  # every peer's report is fresh: their plain sum
            elif reports is not None or peers.has_digests:
                observed += peers.rate(key, now_ms)  # some report is ageing, or a long name
        tokens = bucket.tokens
        in_debt = False
        if tokens is not None:
            in_debt = tokens.level(bound, now_ms) < 0.0
            throttle = tokens.record(value, bound, now_ms)
            bucket.keep_until_ms = tokens.full_at_ms(bound)  # expiry must not forgive a refilling bucket
            if peers is not None and observed > bound:
                throttle = max(throttle, throttle_time_ms(observed, bound, window_ms))
            if self.max_throttle_ms is not None and throttle > self.max_throttle_ms:
                throttle = self.max_throttle_ms
            if throttle == 0:
                return Charge(key, bound, observed, 0)
        elif observed <= bound:
            return Charge(key, bound, observed, 0)
        elif self.max_throttle_ms is None:
            throttle = throttle_time_ms(observed, bound, window_ms)
        else:
            throttle = bounded_throttle_time_ms(observed, bound, window_ms, self.max_throttle_ms)
        if now_ms + throttle > bucket.throttled_until_ms:
            bucket.throttled_until_ms = now_ms + throttle
            if bucket.throttled_until_ms > self.throttled_until_ms:
                self.throttled_until_ms = bucket.throttled_until_ms
        if peers is not None:
            self._throttled[key] = bucket.throttled_until_ms
        return Charge(key, bound, observed, throttle, in_debt)

    # -- the fleet ------------------------------------------------------------------------------

    def attach_fleet(self, peers: PeerView | None, on_urgent: Callable[[], None] | None = None) -> None:
        """Decide on local + peers' usage from now on (None: alone again); see QuotaEngine.attach_fleet."""
        self.peers = peers
        self._on_urgent = on_urgent if peers is not None else None
        self._charged = set()
        self._throttled = {}
        self._urgent_keys = set()

    def _ask_urgent(self) -> None:
        self._urgent_asked = True
        if self._on_urgent is not None:
            self._on_urgent()

    def local_usage(self, now_ms: int, changed_only: bool = False) -> list[UsageEntry]:
        """Each bucket's own rate, for the fleet's report (see QuotaEngine.local_usage).

        `changed_only`: only buckets charged since the last such listing, or throttled since then
        (a paused client's rate decays, and peers must see it fall or they under-admit; past
        MAX_PAUSED_PER_DELTA of them, in turns), whose rate moved by more than
        DELTA_CHANGE_OF_BOUND of their bound since they were last listed.
        """
        keys: set[BucketKey] | dict[BucketKey, Bucket] = self.buckets
        if changed_only:
            keys = self._charged
            throttled = self._throttled
            if len(throttled) <= MAX_PAUSED_PER_DELTA:
                keys.update(throttled)
                self._throttled = {key: until for key, until in throttled.items() if until > now_ms}
            else:
                # Past that many, the oldest-listed go now and to the back of the line (each is
                # listed every len / MAX_PAUSED_PER_DELTA deltas): measuring 100,000 paused buckets
                # ten times a second held the loop, and full reports slipped below one a second.
                for key in list(itertools.islice(throttled, MAX_PAUSED_PER_DELTA)):
                    until = throttled.pop(key)
                    keys.add(key)
                    if until > now_ms:
                        throttled[key] = until
        out = self._list(keys, now_ms, changed_only)
        self._charged = set()
        self._urgent_keys = set()
        self._urgent_asked = False
        return out

    def begin_full_listing(self) -> list[BucketKey]:
        """The buckets a full report lists, taken at once (measure them with `list_usage`, in
        slices if there are many). Marks are reset now, so a charge made while the slices are
        measured is listed again by the next delta report."""
        self._charged = set()
        self._urgent_keys = set()
        self._urgent_asked = False
        return list(self.buckets)

    def list_usage(self, keys: Sequence[BucketKey], now_ms: int) -> list[UsageEntry]:
        """Measure and list these buckets (those gone since are skipped), for a full report."""
        return self._list(keys, now_ms, False)

    def urgent_usage(self, now_ms: int) -> list[UsageEntry]:
        """The buckets that asked for an urgent report since they were last listed (see
        QuotaEngine.attach_fleet): an urgent report sends only these, so it stays small."""
        out = self._list(self._urgent_keys, now_ms, False)
        self._urgent_keys = set()
        self._urgent_asked = False
        return out

    def _list(self, keys: Iterable[BucketKey], now_ms: int,
              changed_only: bool) -> list[UsageEntry]:
        """Measure `keys`' buckets and list them (remembered as what peers know), with
        `changed_only` those that moved by more than DELTA_CHANGE_OF_BOUND of their bound."""
        buckets = self.buckets
        quota = self.quota_type
        out: list[UsageEntry] = []
        for key in keys:
            bucket = buckets.get(key)
            if bucket is None:
                continue
            rate = bucket.rate.measure(now_ms)
            if changed_only and abs(rate - bucket.reported) <= DELTA_CHANGE_OF_BOUND * bucket.bound:
                bucket.urgent_above = bucket.reported + URGENT_CHANGE_RATIO * bucket.bound
                continue
            bucket.reported = rate
            bucket.urgent_above = rate + URGENT_CHANGE_RATIO * bucket.bound
            out.append(UsageEntry(quota, key.user, key.client_id, rate))
        return out

    def unthrottle(self, user: str, client_id: str) -> None:
        """Hold nothing for (user, client_id)'s bucket: its throttles were reported only (shadow.py),
        and a switch to enforce must not apply one of them late. Its rate keeps every byte."""
        found = self._lookup(user, client_id)
        bucket = None if found is None else self.buckets.get(found.bucket)
        if bucket is not None:
            bucket.throttled_until_ms = 0

    def remaining_throttle_ms(self, user: str, client_id: str, now_ms: int) -> int:
        """How long (user, client_id)'s bucket stays throttled; 0 when it is not."""
        if now_ms + HOLD_HEAD_START_MS >= self.throttled_until_ms:  # no bucket is throttled now
            return 0
        found = self._lookup(user, client_id)
        if found is None:
            return 0
        bucket = self.buckets.get(found.bucket)
        if (bucket is None and found.capped and self.max_buckets is not None
                and len(self.buckets) >= self.max_buckets):
            bucket = self.buckets.get(OVERFLOW_KEY)  # where its next charge would go
        # One millisecond short of the throttle's end: connections held for another's throttle then
        # go before the one that caused it (whose mute ends exactly then), so a client's connections
        # to different brokers take turns instead of one winning every time and starving the others.
        return 0 if bucket is None else max(bucket.throttled_until_ms - now_ms - HOLD_HEAD_START_MS, 0)

    def unrecord(self, charge: Charge, value: float, now_ms: int) -> None:
        """Take a recording back (a throttled fetch's bytes are not sent, so not counted)."""
        bucket = self.buckets.get(charge.bucket) if charge.bucket is not None else None
        if bucket is not None:
            bucket.rate.unrecord(value, now_ms)
            if bucket.tokens is not None:
                bucket.tokens.unrecord(value, bucket.bound, now_ms)

    def record_throttle(self, charge: Charge, throttle_ms: int, now_ms: int, *, shadow: bool = False) -> None:
        """Count a throttle this quota decided (Kafka's `throttle-time` sensor, avg and max);
        `shadow`: computed and reported, not applied (counted apart; the sensor records both)."""
        bucket = self.buckets.get(charge.bucket) if charge.bucket is not None else None
        if bucket is None:
            return
        if bucket.throttle is None:
            bucket.throttle = WindowedStat(self.window)
        bucket.throttle.record(throttle_ms, now_ms)
        if shadow:
            bucket.shadow_throttle_total_ms += throttle_ms
            bucket.shadow_throttle_count += 1
            return
        bucket.throttle_total_ms += throttle_ms
        bucket.throttle_count += 1

    def max_value_in_window(self, user: str, client_id: str) -> float | None:
        """Kafka's cap for a fetch: the quota times (samples - 1) windows, i.e. 10x the quota per second.

        In the "smooth" shape, the burst (one second of quota): a fetch over it is delivered and
        paid back by the throttle after (see QuotaEngine.charge), so this bounds each payback.
        """
        found = self._lookup(user, client_id)
        if found is None:
            return None
        if self._smooth:
            return found.bound * BURST_MS / 1000.0
        return found.bound * (self.window.samples - 1) * self.window.window_ms / 1000.0

    # -- expiry ---------------------------------------------------------------------------------

    def expire_idle(self, now_ms: int, budget: int = EXPIRY_BUDGET) -> int:
        """Drop buckets that hold nothing a decision needs; returns how many went.

        Examines at most `budget` buckets, least recently charged first, and stops at the
        first that is still in use, so a call costs O(budget) however many buckets exist.
        A bucket goes once its rate has expired and its throttle is over, unless it has
        throttled: then it turns dormant (samples freed, counters kept) and goes an hour after
        its last charge (Kafka's sensor expiry).
        """
        return self.sweep(now_ms, budget)[0]

    def sweep(self, now_ms: int, budget: int) -> tuple[int, int]:
        """`expire_idle`, for a caller that shares one budget: (buckets dropped, buckets examined)."""
        history_ms = self.window.history_ms
        recent = self._recent
        dropped = examined = 0
        while recent and examined < budget:
            key, bucket = recent.popitem(last=False)
            last = bucket.rate.idle_since_ms
            if now_ms - bucket.seen_ms < history_ms or (last is not None and now_ms - last < history_ms):
                # still in use (its rate has history); every bucket behind it was charged no
                # earlier than REORDER_INTERVAL_MS before it
                recent[key] = bucket
                recent.move_to_end(key, last=False)
                break
            examined += 1
            if bucket.throttled_until_ms > now_ms or bucket.keep_until_ms > now_ms:
                # a long throttle, or tokens still refilling: look again later
                bucket.seen_ms = now_ms
                recent[key] = bucket
                continue
            if ((bucket.throttle_count or bucket.shadow_throttle_count) and last is not None
                    and now_ms - last < self.idle_expiry_ms):
                bucket.rate.clear()
                bucket.throttle = None  # its samples ended with the rate's (same window)
                bucket.seen_ms = _DORMANT_SEEN_MS
                self._dormant[key] = bucket
                continue
            del self.buckets[key]
            dropped += 1
        if not self._retired and len(self._resolved) > 2 * len(self.buckets) + _CACHE_SLACK:
            self._retire_cache()
        retired = self._retired
        if retired:
            while retired and examined < budget:
                retired.popitem()
                examined += 1
            if not retired:
                self._retired = {}  # a new dict: an emptied one keeps its table
        dormant = self._dormant
        while dormant and examined < budget:
            key, bucket = dormant.popitem(last=False)
            last = bucket.rate.idle_since_ms
            if last is not None and now_ms - last < self.idle_expiry_ms:
                dormant[key] = bucket
                dormant.move_to_end(key, last=False)
                break
            examined += 1
            del self.buckets[key]
            dropped += 1
        self.expired_buckets += dropped
        if self._high_water > _COMPACT_MIN and len(self.buckets) < self._high_water // 16:
            # at most 1/16 of the peak is copied: ~1 ms for a 50,000 peak
            self.buckets = dict(self.buckets)
            self._recent = OrderedDict(self._recent)
            self._dormant = OrderedDict(self._dormant)
            self._high_water = len(self.buckets)
        return dropped, examined
