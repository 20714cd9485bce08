"""Bounded quota state (issue 10 item 5): bucket expiry, dormant buckets, the cap and its overflow.

Every time is passed in (a fake clock of integer milliseconds). Speed and bytes are measured in
bench/memory.py, never asserted here.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.engine import NO_THROTTLE, EngineConfig, QuotaEngine, QuotaTable, Verdict
from quotas.entity import DEFAULT, BucketKey, QuotaEntity
from quotas.manager import IDLE_EXPIRY_MS, OVERFLOW_KEY, REORDER_INTERVAL_MS, ClientQuotaManager
from quotas.producer_ids import ProducerIdTracker
from quotas.rate import WindowConfig, WindowedRate
from quotas.types import QuotaType

P, F, R, PIDS = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS
CLIENT_DEFAULT = QuotaEntity(None, DEFAULT)
HISTORY_MS = 11_000  # Kafka's defaults: 11 samples of 1 s
PRODUCE = 0
FETCH = 1


def engine_with(table: QuotaTable, config: EngineConfig | None = None) -> QuotaEngine:
    engine = QuotaEngine(config)
    engine.set_quotas(table)
    return engine


def manager_with(quotas: dict[QuotaEntity, float], max_buckets: int | None = None) -> ClientQuotaManager:
    manager = ClientQuotaManager(P, max_buckets=max_buckets)
    manager.set_quotas(quotas)
    return manager


# -- the rate: when it holds no history ----------------------------------------------------------


def test_rate_expires_samples_times_window_after_its_last_recording() -> None:
    rate = WindowedRate()
    assert rate.expired(0)  # never recorded
    rate.record(5, 0)
    rate.record(5, 4_000)
    assert not rate.expired(4_000 + HISTORY_MS - 1)
    assert rate.total(4_000 + HISTORY_MS - 1) == 5  # the second recording still counts
    assert rate.expired(4_000 + HISTORY_MS)
    assert rate.total(4_000 + HISTORY_MS) == 0


def test_clearing_an_expired_rate_changes_no_measurement() -> None:
    """What `clear` forgets would have been reset before counting again."""
    kept, cleared = WindowedRate(), WindowedRate()
    for rate in (kept, cleared):
        for t in range(0, 12_000, 700):
            rate.record(t % 1300, t)
    assert cleared.expired(11_900 + HISTORY_MS)
    cleared.clear()
    for t, value in ((22_900, 10), (23_100, 500), (24_100, 7), (33_000, 1), (60_000, 3)):
        kept.record(value, t)
        cleared.record(value, t)
        assert kept.measure_with_window(t) == cleared.measure_with_window(t)


def test_measuring_an_empty_rate_allocates_no_sample() -> None:
    """A scrape of a dormant bucket must not grow it back; the figures are those of a new sample."""
    rate = WindowedRate()
    assert rate.measure_with_window(5_000) == (0.0, 10_000)
    assert rate._samples == []
    rate.record(1, 0)
    rate.clear()
    rate.measure(20_000)
    assert rate._samples == []
    assert rate.idle_since_ms == 0  # the last recording is remembered for the hour expiry


# -- buckets without history go --------------------------------------------------------------------


def test_a_bucket_goes_once_its_rate_expired() -> None:
    manager = manager_with({CLIENT_DEFAULT: 1000})
    manager.record("u", "app", 100, 0)
    assert manager.expire_idle(HISTORY_MS - 1) == 0
    assert manager.expire_idle(HISTORY_MS) == 1
    assert manager.buckets == {}
    assert manager.expired_buckets == 1


def test_a_bucket_still_throttled_stays_although_its_rate_expired() -> None:
    """Its `throttled_until_ms` holds the client's other connections back (hold_ms): keep it."""
    engine = engine_with({CLIENT_DEFAULT: {P: 100}})
    verdict = engine.charge("u", "app", 0, produce_bytes=100_000)  # (10000-100)/100 x 10 s
    assert verdict.throttle_ms == 990_000
    key = BucketKey("", "app")
    bucket = engine.managers[P].buckets[key]
    for now in range(HISTORY_MS, 990_000, 50_000):
        assert engine.expire_idle(now) == 0
        assert engine.managers[P].buckets[key] is bucket
        assert engine.hold_ms("u", "app", PRODUCE, now) == 990_000 - now - 1
    assert engine.managers[P].buckets[key].rate.total(989_999) == 0  # nothing left but the throttle
    assert engine.expire_idle(990_000) == 0  # now dormant: it throttled, so it stays an hour
    assert engine.hold_ms("u", "app", PRODUCE, 990_000) == 0


def test_a_throttle_that_lost_to_another_quota_still_holds_after_the_rate_expired() -> None:
    """Only the largest throttle is counted (its bucket gets throttle_count 1); the fetch bucket's
    smaller one still holds the client's fetches, so that bucket must stay although it never
    counted a throttle and its rate (un-recorded, as Kafka does) expired."""
    engine = engine_with({CLIENT_DEFAULT: {P: 100, F: 1000}})
    verdict = engine.charge("u", "app", 0, produce_bytes=60_000, fetch_bytes=30_000)
    assert (verdict.throttle_ms, verdict.quota) == (590_000, P)  # fetch alone: 20 s
    fetch = engine.managers[F].buckets[BucketKey("", "app")]
    assert (fetch.throttle_count, fetch.throttled_until_ms) == (0, 20_000)
    assert engine.expire_idle(15_000) == 0
    assert engine.hold_ms("u", "app", FETCH, 15_000) == 4_999
    # then it goes (it has no counters to keep), when the sweep looks again: one history later
    assert engine.expire_idle(25_999) == 0
    assert engine.expire_idle(26_000) == 1
    assert BucketKey("", "app") not in engine.managers[F].buckets


def test_a_throttled_bucket_turns_dormant_then_goes_after_an_hour() -> None:
    """The choice: a bucket that throttled keeps its counters an hour (as Kafka keeps sensors),
    but frees its samples as soon as they expire."""
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    assert engine.charge("u", "app", 0, produce_bytes=6000).throttle_ms == 2000
    manager = engine.managers[P]
    bucket = manager.buckets[BucketKey("", "app")]
    assert bucket.throttle is not None
    assert engine.expire_idle(HISTORY_MS) == 0
    assert manager.buckets[BucketKey("", "app")] is bucket
    assert bucket.rate._samples == [] and bucket.throttle is None  # dormant: counters only
    assert (bucket.throttle_count, bucket.throttle_total_ms) == (1, 2000)
    assert engine.expire_idle(IDLE_EXPIRY_MS - 1) == 0
    assert engine.expire_idle(IDLE_EXPIRY_MS) == 1
    assert manager.buckets == {}


def test_a_charge_wakes_a_dormant_bucket_with_a_fresh_rate_and_its_counters() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    fresh = engine_with({CLIENT_DEFAULT: {P: 500}})
    engine.charge("u", "app", 0, produce_bytes=6000)
    engine.expire_idle(HISTORY_MS)
    for t, size in ((20_000, 4000), (20_500, 1500), (31_000, 100), (40_000, 6000)):
        expected = fresh.charge("u", "app", t, produce_bytes=size)
        assert engine.charge("u", "app", t, produce_bytes=size) == expected
    bucket = engine.managers[P].buckets[BucketKey("", "app")]
    new = fresh.managers[P].buckets[BucketKey("", "app")]
    assert new.throttle_count > 0
    assert bucket.throttle_count == 1 + new.throttle_count  # the counters run on
    assert bucket.throttle_total_ms == 2000 + new.throttle_total_ms
    # awake again: it goes an hour after its latest charge, not the first one
    assert engine.expire_idle(IDLE_EXPIRY_MS + 1) == 0
    assert engine.expire_idle(40_000 + IDLE_EXPIRY_MS) == 1


def test_a_throttle_sensor_exists_only_once_a_throttle_was_recorded() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 500, R: 1.0}})
    engine.charge("u", "app", 0, produce_bytes=100, request_time_ms=1)
    assert all(b.throttle is None for m in engine.managers.values() for b in m.buckets.values())
    engine.charge("u", "app", 1, produce_bytes=6000, request_time_ms=1)
    assert engine.managers[P].buckets[BucketKey("", "app")].throttle is not None
    assert engine.managers[R].buckets[BucketKey("", "app")].throttle is None


# -- what one expiry call costs ---------------------------------------------------------------------


def test_one_call_examines_at_most_its_budget() -> None:
    manager = manager_with({CLIENT_DEFAULT: 10**9})
    for i in range(10):
        manager.record("u", f"c{i}", 1, 0)
    assert manager.sweep(HISTORY_MS, 3) == (3, 3)
    assert manager.sweep(HISTORY_MS, 3) == (3, 3)
    assert manager.sweep(HISTORY_MS, 100) == (4, 4)
    assert manager.buckets == {}


def test_expiry_stops_at_the_first_bucket_in_use() -> None:
    """Buckets are kept least recently charged first: the sweep never walks the live ones."""
    manager = manager_with({CLIENT_DEFAULT: 10**9})
    manager.record("u", "old", 1, 0)
    for i in range(1000):
        manager.record("u", f"live{i}", 1, 5_000)
    assert manager.sweep(HISTORY_MS, 10_000) == (1, 1)
    assert manager.sweep(HISTORY_MS + 1, 10_000) == (0, 0)
    assert len(manager.buckets) == 1000


def test_a_charged_bucket_moves_to_the_young_end() -> None:
    manager = manager_with({CLIENT_DEFAULT: 10**9})
    manager.record("u", "a", 1, 0)
    manager.record("u", "b", 1, 0)
    manager.record("u", "a", 1, REORDER_INTERVAL_MS)  # a is younger than b now
    assert manager.expire_idle(HISTORY_MS) == 1
    assert set(manager.buckets) == {BucketKey("", "a")}
    assert manager.expire_idle(REORDER_INTERVAL_MS + HISTORY_MS) == 1


def test_expiry_is_never_early_within_the_reorder_interval() -> None:
    """A charge less than REORDER_INTERVAL_MS after the last move keeps the order, not the bucket's
    expiry: the sweep checks the rate itself and waits (up to that interval) instead."""
    manager = manager_with({CLIENT_DEFAULT: 10**9})
    manager.record("u", "a", 1, 0)
    manager.record("u", "b", 1, 0)
    manager.record("u", "a", 1, REORDER_INTERVAL_MS - 1)
    assert manager.expire_idle(HISTORY_MS) == 0  # a is in front and in use: b waits behind it
    assert manager.expire_idle(HISTORY_MS + REORDER_INTERVAL_MS - 1) == 2


def test_expire_idle_shares_its_budget_and_rotates_over_quota_types() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 10**9, F: 10**9}})
    for i in range(6):
        engine.charge("u", f"c{i}", 0, produce_bytes=1, fetch_bytes=1)
    dropped = [engine.expire_idle(HISTORY_MS, budget=4) for _ in range(3)]
    assert dropped == [4, 4, 4]
    assert engine.bucket_counts()[P] == engine.bucket_counts()[F] == 0


def test_producer_id_filters_of_idle_users_go() -> None:
    tracker = ProducerIdTracker(window_ms=10_000, capacity=100, false_positive_rate=0.01, max_users=10)
    assert tracker.new_ids("alice", [1, 2], 0) == 2
    assert tracker.new_ids("bob", [1], 9_000) == 1
    assert tracker.expire(14_999, 100) == (0, 1)  # alice's only layer lives 1.5 windows
    assert tracker.expire(15_000, 100) == (1, 2)
    assert tracker.users == 1
    assert tracker.new_ids("alice", [1, 2], 15_000) == 2  # as a new filter would answer


def test_producer_id_users_are_bounded() -> None:
    tracker = ProducerIdTracker(window_ms=10_000, capacity=100, false_positive_rate=0.01, max_users=3)
    for user in range(50):
        tracker.new_ids(f"user{user}", [user], user)
    assert tracker.users == 3
    assert tracker.evictions == 47
    assert tracker.memory_bytes <= 3 * 3 * 120  # 3 users x 3 layers x 120 B of bits at most


# -- the cap ----------------------------------------------------------------------------------------


def test_past_the_cap_new_client_ids_share_the_overflow_bucket() -> None:
    manager = manager_with({CLIENT_DEFAULT: 1000}, max_buckets=3)
    for client in ("a", "b", "c"):
        assert manager.record("u", client, 9000, 0).bucket == BucketKey("", client)
    first = manager.record("u", "d", 6000, 0)
    assert (first.bucket, first.throttle_ms) == (OVERFLOW_KEY, 0)
    # e is new too: charged with d's 6000 B, so the flood throttles as a group
    second = manager.record("u", "e", 6000, 0)
    assert (second.bucket, second.throttle_ms) == (OVERFLOW_KEY, 2000)  # 1200 B/s against 1000
    assert manager.overflow_charges == 2
    assert len(manager.buckets) == 4  # the cap, plus the overflow bucket
    # the existing buckets kept their usage: 100 B more puts a at 910 B/s, still within
    assert manager.record("u", "a", 100, 0).observed == 910.0
    assert manager.record("u", "a", 1000, 0).throttle_ms == 100  # 1010 B/s


def test_overflow_is_measured_against_the_bound_the_entity_resolves_to() -> None:
    manager = manager_with({CLIENT_DEFAULT: 1000, QuotaEntity("big", DEFAULT): 100_000}, max_buckets=1)
    manager.record("u", "first", 1, 0)
    assert manager.record("u", "x", 20_000, 0).throttle_ms == 10_000  # 2000 B/s against 1000
    charge = manager.record("big", "y", 20_000, 0)  # 4000 B/s against big's 100000
    assert (charge.bucket, charge.throttle_ms) == (OVERFLOW_KEY, 0)


def test_explicitly_configured_entities_always_get_their_own_bucket() -> None:
    """The quota table bounds their number; a flood of default client ids must not reach them."""
    manager = manager_with({CLIENT_DEFAULT: 1000, QuotaEntity(None, "vip"): 5000,
                            QuotaEntity("alice", None): 5000}, max_buckets=2)
    manager.record("u", "flood1", 1, 0)
    manager.record("u", "flood2", 1, 0)
    assert manager.record("u", "flood3", 1, 0).bucket == OVERFLOW_KEY
    assert manager.record("u", "vip", 1, 0).bucket == BucketKey("", "vip")
    assert manager.record("alice", "any", 1, 0).bucket == BucketKey("alice", "")


def test_the_cap_makes_room_from_dormant_buckets_first() -> None:
    manager = manager_with({CLIENT_DEFAULT: 1000}, max_buckets=2)
    manager.record("u", "throttled", 20_000, 0)
    manager.record_throttle(manager.record("u", "throttled", 1, 0), 10_000, 0)
    manager.record("u", "busy", 1, 15_000)
    assert manager.expire_idle(15_000) == 0  # throttled: dormant, counters kept
    assert len(manager.buckets) == 2
    assert manager.record("u", "new", 1, 15_000).bucket == BucketKey("", "new")
    assert set(manager.buckets) == {BucketKey("", "busy"), BucketKey("", "new")}
    assert (manager.evicted_buckets, manager.overflow_charges) == (1, 0)


def test_the_cap_takes_an_expired_bucket_the_sweep_has_not_reached() -> None:
    manager = manager_with({CLIENT_DEFAULT: 1000}, max_buckets=2)
    manager.record("u", "gone", 1, 0)
    manager.record("u", "busy", 1, 5_000)
    assert manager.record("u", "new", 1, HISTORY_MS).bucket == BucketKey("", "new")
    assert set(manager.buckets) == {BucketKey("", "busy"), BucketKey("", "new")}


def test_the_cap_never_evicts_a_bucket_with_history_or_a_throttle() -> None:
    manager = manager_with({CLIENT_DEFAULT: 100}, max_buckets=2)
    manager.record("u", "throttled", 100_000, 0)  # throttled for 990 s, rate expired at 11 s
    manager.record("u", "busy", 1, 20_000)
    for now in (20_000, 100_000, 500_000):
        assert manager.record("u", "new", 1, now).bucket == OVERFLOW_KEY
    assert set(manager.buckets) == {BucketKey("", "throttled"), BucketKey("", "busy"), OVERFLOW_KEY}


def test_an_overflowed_client_is_held_by_the_overflow_bucket_throttle() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 1000}}, EngineConfig(max_buckets=1))
    engine.charge("u", "first", 0, produce_bytes=1)
    assert engine.charge("u", "x", 0, produce_bytes=12_000).throttle_ms == 2000
    assert engine.hold_ms("u", "y", PRODUCE, 500) == 1499  # y's next charge would go there too
    assert engine.hold_ms("u", "first", PRODUCE, 500) == 0


def test_live_buckets_and_overflow_counts_are_exported() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 10**9, R: 10**9}}, EngineConfig(max_buckets=2))
    for client in ("a", "b", "c", "d"):
        engine.charge("u", client, 0, produce_bytes=1, request_time_ms=1)
    assert engine.bucket_counts() == {P: 3, F: 0, R: 3, PIDS: 0}
    assert engine.overflow_counts() == {P: 2, F: 0, R: 2, PIDS: 0}
    assert engine.managers[P].live_buckets == 3


def test_the_default_cap() -> None:
    assert EngineConfig().max_buckets == 50_000
    engine = QuotaEngine()
    assert {m.max_buckets for m in engine.managers.values()} == {50_000}


# -- the claim: dropping an expired bucket changes no decision --------------------------------------

TABLE: QuotaTable = {
    CLIENT_DEFAULT: {P: 1000, F: 2000, R: 5.0},
    QuotaEntity("alice", None): {P: 500, PIDS: 1.0},
    QuotaEntity(DEFAULT, None): {PIDS: 2.0},
}
USERS = ("alice", "bob")
CLIENTS = ("a", "")  # few, so that charges and holds meet the same buckets
#: steps that cross the boundaries that matter: a window, the rate's history, a long throttle
STEPS = st.one_of(st.sampled_from([0, 1, 999, 1000, 5_000, 10_999, 11_000, 11_001, 60_000, 1_000_000]),
                  st.integers(0, 15_000))
#: bytes: none, within the quotas, or bursts whose throttle outlasts the rate's 11 s of history
BYTES = st.one_of(st.sampled_from([0, 0, 500, 12_000, 30_000, 60_000]), st.integers(0, 60_000))
CHARGE = st.tuples(
    st.just("charge"), STEPS, st.sampled_from(USERS), st.sampled_from(CLIENTS), BYTES, BYTES,
    st.none() | st.floats(0, 2000), st.lists(st.integers(0, 40), max_size=5))
HOLD = st.tuples(st.just("hold"), STEPS, st.sampled_from(USERS), st.sampled_from(CLIENTS),
                 st.sampled_from([PRODUCE, FETCH, 3]))
EXPIRY_CONFIG = EngineConfig(pid_window=WindowConfig(3, 4000), max_buckets=None)


def _step(engine: QuotaEngine, op: tuple[object, ...], now: int) -> Verdict | int:
    if op[0] == "hold":
        _, _, user, client, api_key = op
        assert isinstance(user, str) and isinstance(client, str) and isinstance(api_key, int)
        return engine.hold_ms(user, client, api_key, now)
    _, _, user, client, produce, fetch, request, pids = op
    assert isinstance(user, str) and isinstance(client, str) and isinstance(produce, int)
    assert isinstance(fetch, int) and isinstance(pids, list)
    assert request is None or isinstance(request, float)
    return engine.charge(user, client, now, produce_bytes=produce, fetch_bytes=fetch,
                         request_time_ms=request, producer_ids=pids)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(CHARGE, HOLD), min_size=20, max_size=80), budget=st.integers(1, 50))
def test_eager_expiry_gives_the_same_decisions_as_none(ops: list[tuple[object, ...]], budget: int) -> None:
    """Same charges, same clock: an engine expiring before every step (with a budget as small as one
    bucket) throttles and holds exactly as one that never forgets anything."""
    eager, never = engine_with(TABLE, EXPIRY_CONFIG), engine_with(TABLE, EXPIRY_CONFIG)
    now = 0
    throttled = 0
    for op in ops:
        step = op[1]
        assert isinstance(step, int)
        now += step
        eager.expire_idle(now, budget)
        expected = _step(never, op, now)
        assert _step(eager, op, now) == expected
        throttled += isinstance(expected, Verdict) and expected != NO_THROTTLE
    # the dropped buckets are really gone (this is not two engines that never expire)
    if now > IDLE_EXPIRY_MS + HISTORY_MS:
        for _ in range(200):
            eager.expire_idle(now + IDLE_EXPIRY_MS, 10_000)
        assert sum(eager.bucket_counts().values()) == 0


def test_the_resolution_cache_of_departed_client_ids_is_freed_within_the_budget() -> None:
    manager = manager_with({CLIENT_DEFAULT: 10**9})
    for i in range(6000):
        manager.record("u", f"c{i}", 1, 0)
    manager.record("u", "stays", 1, 10_000)
    assert len(manager._resolved) == 6001
    calls = 0
    while len(manager.buckets) > 1 or manager._retired:
        _, examined = manager.sweep(HISTORY_MS, 1000)
        assert examined <= 1000
        calls += 1
    assert calls >= 12  # 6000 buckets, then 6001 cache entries, 1000 at a time
    assert manager._resolved == {}
    assert manager.record("u", "stays", 1, 12_000).bucket == BucketKey("", "stays")  # resolved again


def test_overflowed_client_ids_take_no_cache_entry() -> None:
    """A flood past the cap must not fill the resolution cache in the buckets' stead."""
    manager = manager_with({CLIENT_DEFAULT: 10**9}, max_buckets=10)
    for i in range(1000):
        manager.record("u", f"c{i}", 1, 0)
    assert manager.overflow_charges == 990
    assert manager.cached_resolutions == 10


def test_dicts_are_compacted_once_the_buckets_shrank() -> None:
    """Python dicts keep their tables when entries go; after a flood the sweep copies the rest."""
    manager = manager_with({CLIENT_DEFAULT: 10**9})
    for i in range(5000):
        manager.record("u", f"flood{i}", 1, 0)
    manager.record("u", "a", 1, 5_000)
    manager.record("u", "b", 1, 6_000)
    flooded = manager.buckets
    while len(manager.buckets) > 2:
        manager.sweep(HISTORY_MS, 1000)
    assert manager.buckets is not flooded
    assert set(manager.buckets) == {BucketKey("", "a"), BucketKey("", "b")}
    assert manager.expire_idle(5_000 + HISTORY_MS) == 1  # the expiry order survived the copy
    assert set(manager.buckets) == {BucketKey("", "b")}
