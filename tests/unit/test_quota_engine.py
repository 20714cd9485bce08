"""QuotaEngine: all of a client's quotas together, as a broker combines them per request."""

from __future__ import annotations

import pytest

from quotas.engine import NO_THROTTLE, EngineConfig, QuotaEngine, QuotaTable
from quotas.entity import DEFAULT, BucketKey, QuotaEntity
from quotas.manager import IDLE_EXPIRY_MS
from quotas.rate import WindowConfig
from quotas.types import QuotaType

P, F, R, PIDS = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS
CLIENT_DEFAULT = QuotaEntity(None, DEFAULT)
KEY = BucketKey("", "app")


def engine_with(table: QuotaTable, config: EngineConfig | None = None) -> QuotaEngine:
    engine = QuotaEngine(config)
    engine.set_quotas(table)
    return engine


def throttle_counts(engine: QuotaEngine, key: BucketKey = KEY) -> dict[QuotaType, int]:
    return {quota_type: manager.buckets[key].throttle_count
            for quota_type, manager in engine.managers.items() if key in manager.buckets}


# -- Kafka's vectors through charge() ----------------------------------------------------------


def test_produce_vector_through_charge() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    for t in range(0, 10_000, 1000):
        assert engine.charge("ANONYMOUS", "unknown", t, produce_bytes=400) == NO_THROTTLE
    verdict = engine.charge("ANONYMOUS", "unknown", 10_500, produce_bytes=2300)
    assert (verdict.throttle_ms, verdict.quota) == (2100, P)


def test_request_vector_through_charge() -> None:
    """Request time in ms is charged as percent of a thread: 4 ms a second is 0.4 %."""
    engine = engine_with({QuotaEntity("ANONYMOUS", "test-client"): {R: 1.0}})
    for t in range(0, 10_000, 1000):
        assert engine.charge("ANONYMOUS", "test-client", t, request_time_ms=4).throttle_ms == 0
    verdict = engine.charge("ANONYMOUS", "test-client", 10_500, request_time_ms=67.1)
    assert (verdict.throttle_ms, verdict.quota) == (210, R)


def test_request_throttle_is_capped_and_lasts_ten_seconds() -> None:
    engine = engine_with({CLIENT_DEFAULT: {R: 1.0}})
    assert engine.charge("u", "app", 0, request_time_ms=500).throttle_ms == 1000
    for t in range(1000, 11_000, 1000):
        assert engine.charge("u", "app", t, request_time_ms=0).throttle_ms == 1000
    assert engine.charge("u", "app", 11_000, request_time_ms=0).throttle_ms == 0


def test_no_quotas_means_no_throttle_and_no_buckets() -> None:
    engine = QuotaEngine()
    assert engine.charge("u", "app", 0, produce_bytes=10**9, request_time_ms=10**6) == NO_THROTTLE
    assert all(not manager.buckets for manager in engine.managers.values())
    assert engine.fetch_max_bytes("u", "app") is None
    assert engine.wants_producer_ids("u") is False


# -- several quotas ------------------------------------------------------------------------------

BOTH = {CLIENT_DEFAULT: {P: 500, R: 1.0}}


def test_largest_throttle_wins_and_only_its_sensor_counts() -> None:
    engine = engine_with(BOTH)
    # produce: 6000 B / 10 s = 600 B/s -> 2000 ms; request: 200 ms -> 2 % -> capped at 1000 ms
    verdict = engine.charge("u", "app", 0, produce_bytes=6000, request_time_ms=200)
    assert (verdict.throttle_ms, verdict.quota) == (2000, P)
    assert throttle_counts(engine) == {P: 1, R: 0}
    throttle = engine.managers[P].buckets[KEY].throttle
    assert throttle is not None and throttle.maximum(0) == 2000
    assert engine.managers[R].buckets[KEY].throttle is None  # never throttled: no sensor at all


def test_request_throttle_wins_when_larger() -> None:
    engine = engine_with(BOTH)
    # produce: 5200 B -> 520 B/s -> 400 ms; request: 1000 ms (cap)
    verdict = engine.charge("u", "app", 0, produce_bytes=5200, request_time_ms=200)
    assert (verdict.throttle_ms, verdict.quota) == (1000, R)
    assert throttle_counts(engine) == {P: 0, R: 1}
    assert engine.managers[R].buckets[KEY].throttle_total_ms == 1000


def test_tie_goes_to_the_request_quota() -> None:
    engine = engine_with(BOTH)
    # produce: 5500 B -> 550 B/s -> 1000 ms; request: capped at 1000 ms
    verdict = engine.charge("u", "app", 0, produce_bytes=5500, request_time_ms=200)
    assert (verdict.throttle_ms, verdict.quota) == (1000, R)
    assert throttle_counts(engine) == {P: 0, R: 1}


def test_every_quota_is_recorded_even_the_losers() -> None:
    """Record-then-check: the produce bytes count although the request quota decided the throttle."""
    engine = engine_with(BOTH)
    engine.charge("u", "app", 0, produce_bytes=5200, request_time_ms=200)
    assert engine.managers[P].buckets[KEY].rate.total(0) == 5200
    assert engine.managers[R].buckets[KEY].rate.total(0) == pytest.approx(20.0)


# -- fetch ----------------------------------------------------------------------------------------


def test_throttled_fetch_is_unrecorded() -> None:
    engine = engine_with({CLIENT_DEFAULT: {F: 100}})
    verdict = engine.charge("u", "app", 0, fetch_bytes=2000)  # 200 B/s -> (100/100) * 10000
    assert (verdict.throttle_ms, verdict.quota) == (10_000, F)
    bucket = engine.managers[F].buckets[KEY]
    assert bucket.rate.total(0) == 0
    assert bucket.throttle_count == 1
    # had the 2000 B stayed, 500 B more would be 250 B/s; without them it is 50 B/s
    assert engine.charge("u", "app", 10, fetch_bytes=500).throttle_ms == 0


def test_fetch_is_unrecorded_when_the_request_quota_throttles() -> None:
    engine = engine_with({CLIENT_DEFAULT: {F: 100, R: 1.0}})
    verdict = engine.charge("u", "app", 0, fetch_bytes=900, request_time_ms=200)
    assert (verdict.throttle_ms, verdict.quota) == (1000, R)
    assert engine.managers[F].buckets[KEY].rate.total(0) == 0
    assert throttle_counts(engine) == {F: 0, R: 1}


def test_unthrottled_fetch_stays_recorded() -> None:
    engine = engine_with({CLIENT_DEFAULT: {F: 100}})
    assert engine.charge("u", "app", 0, fetch_bytes=900).throttle_ms == 0
    assert engine.managers[F].buckets[KEY].rate.total(0) == 900
    assert engine.charge("u", "app", 0, fetch_bytes=200).throttle_ms == 1000  # 110 B/s


def test_fetch_max_bytes_is_ten_times_the_quota() -> None:
    engine = engine_with({CLIENT_DEFAULT: {F: 2500}, QuotaEntity("bob", None): {P: 10}})
    assert engine.fetch_max_bytes("u", "app") == 25_000
    assert engine.fetch_max_bytes("bob", "app") == 25_000
    only_produce = engine_with({CLIENT_DEFAULT: {P: 10}})
    assert only_produce.fetch_max_bytes("u", "app") is None


def test_fetch_max_bytes_follows_the_window_config() -> None:
    """Kafka's testMaxValueInQuotaWindowWithNonDefaultQuotaWindow: 4 samples -> 3 x quota."""
    engine = engine_with({QuotaEntity(DEFAULT, None): {F: 10}}, EngineConfig(window=WindowConfig(4, 1000)))
    assert engine.fetch_max_bytes("userA", "client1") == 30
    two_second_windows = engine_with({CLIENT_DEFAULT: {F: 10}}, EngineConfig(window=WindowConfig(11, 2000)))
    assert two_second_windows.fetch_max_bytes("u", "app") == 200


# -- producer ids ---------------------------------------------------------------------------------

PID_CONFIG = EngineConfig(pid_window=WindowConfig(11, 1000))


def pid_total(engine: QuotaEngine, user: str) -> float:
    return engine.managers[PIDS].buckets[BucketKey(user, "")].rate.total(0)


def test_producer_id_quota_counts_first_seen_ids_only() -> None:
    engine = engine_with({QuotaEntity("alice", None): {PIDS: 1.0}}, PID_CONFIG)
    assert engine.wants_producer_ids("alice")
    assert engine.charge("alice", "app", 0, producer_ids=list(range(1, 11))) == NO_THROTTLE
    assert pid_total(engine, "alice") == 10
    assert engine.charge("alice", "other-client", 0, producer_ids=[1, 2, 3, 10]) == NO_THROTTLE
    assert pid_total(engine, "alice") == 10
    # the 11th id: 11 per 10 s against 1/s -> (0.1 / 1) * 10000
    verdict = engine.charge("alice", "app", 0, producer_ids=[5, 11])
    assert (verdict.throttle_ms, verdict.quota) == (1000, PIDS)
    assert pid_total(engine, "alice") == 11


def test_producer_id_quota_is_per_user() -> None:
    engine = engine_with({QuotaEntity(DEFAULT, None): {PIDS: 1.0}}, PID_CONFIG)
    assert engine.wants_producer_ids("anyone")
    engine.charge("alice", "a", 0, producer_ids=list(range(10)))
    engine.charge("bob", "b", 0, producer_ids=list(range(10)))  # the same ids are new for bob
    assert pid_total(engine, "alice") == 10
    assert pid_total(engine, "bob") == 10


def test_producer_ids_of_users_without_the_quota_are_not_charged() -> None:
    engine = engine_with({QuotaEntity("alice", None): {PIDS: 1.0}, CLIENT_DEFAULT: {P: 10**9}}, PID_CONFIG)
    assert not engine.wants_producer_ids("bob")
    assert engine.charge("bob", "app", 0, producer_ids=list(range(1000))) == NO_THROTTLE
    assert engine.managers[PIDS].buckets == {}


@pytest.mark.parametrize("entity", [QuotaEntity(None, "app"), QuotaEntity(None, DEFAULT),
                                    QuotaEntity("bob", "app"), QuotaEntity("bob", DEFAULT)])
def test_producer_id_quota_applies_to_user_entities_only(entity: QuotaEntity) -> None:
    """The KIP-936 draft counts per user principal; a client-id entity must never govern it."""
    engine = engine_with({entity: {PIDS: 1.0}}, PID_CONFIG)
    assert not engine.wants_producer_ids("bob")
    assert engine.charge("bob", "app", 0, producer_ids=list(range(1000))) == NO_THROTTLE


def test_producer_ids_and_bytes_together_take_the_max() -> None:
    engine = engine_with({QuotaEntity("alice", None): {PIDS: 1.0, P: 500}}, PID_CONFIG)
    # 7000 B -> 700 B/s -> 4000 ms; 12 new ids -> 1.2 ids/s -> 2000 ms
    verdict = engine.charge("alice", "app", 0, produce_bytes=7000, producer_ids=list(range(12)))
    assert (verdict.throttle_ms, verdict.quota) == (4000, P)
    assert engine.managers[PIDS].buckets[BucketKey("alice", "")].throttle_count == 0
    # 12 more ids -> 2.4 ids/s -> 14000 ms beats 100 B more (710 B/s -> 4200 ms)
    verdict = engine.charge("alice", "app", 0, produce_bytes=100, producer_ids=list(range(12, 24)))
    assert (verdict.throttle_ms, verdict.quota) == (14_000, PIDS)


# -- configuration changes and idle buckets ----------------------------------------------------


def test_set_quotas_keeps_history_of_unchanged_buckets() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 1000}})
    engine.charge("u", "app", 0, produce_bytes=9000)
    engine.set_quotas({CLIENT_DEFAULT: {P: 500}, QuotaEntity("other", None): {F: 1}})
    assert engine.charge("u", "app", 0, produce_bytes=1).throttle_ms == 8002


def test_removed_quota_is_unlimited_again() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 10}})
    assert engine.charge("u", "app", 0, produce_bytes=1000).throttle_ms > 0
    engine.set_quotas({CLIENT_DEFAULT: {F: 10}})
    assert engine.charge("u", "app", 0, produce_bytes=10**6) == NO_THROTTLE


def test_idle_buckets_go_when_their_rate_expires() -> None:
    """No charge for samples x window (11 s): the rate holds nothing, so the bucket goes."""
    engine = engine_with({CLIENT_DEFAULT: {P: 500, R: 1.0}})
    engine.charge("u", "app", 0, produce_bytes=100, request_time_ms=1)
    engine.charge("v", "other", 5_000, produce_bytes=100)
    assert engine.expire_idle(10_999) == 0
    assert engine.expire_idle(11_000) == 2  # u's produce and request buckets
    assert KEY not in engine.managers[P].buckets
    assert BucketKey("", "other") in engine.managers[P].buckets
    assert engine.expire_idle(15_999) == 0
    assert engine.expire_idle(16_000) == 1
    assert all(not manager.buckets for manager in engine.managers.values())


def test_throttled_buckets_stay_an_hour() -> None:
    """A bucket that throttled keeps its counters until Kafka's one-hour sensor expiry."""
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    assert engine.charge("u", "app", 0, produce_bytes=5600).throttle_ms == 1200
    assert engine.expire_idle(11_000) == 0
    bucket = engine.managers[P].buckets[KEY]
    assert (bucket.throttle_count, bucket.throttle_total_ms) == (1, 1200)
    assert IDLE_EXPIRY_MS == 3_600_000
    assert engine.expire_idle(3_599_999) == 0
    assert engine.expire_idle(3_600_000) == 1
    assert all(not manager.buckets for manager in engine.managers.values())


def test_recent_traffic_keeps_a_bucket() -> None:
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    engine.charge("u", "app", 0, produce_bytes=100)
    engine.charge("u", "app", 5_000, produce_bytes=100)
    assert engine.expire_idle(11_000) == 0
    assert engine.expire_idle(15_999) == 0
    assert engine.expire_idle(16_000) == 1


def test_reading_metrics_does_not_keep_an_idle_bucket_alive() -> None:
    """A Prometheus scrape measures every bucket (proxy/observability/metrics.py); only traffic counts
    as activity.

    Kafka expires a sensor by its last *record*; measuring must not make an idle client look active.
    """
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    engine.charge("u", "quiet", 0, produce_bytes=100)  # within quota: goes with its rate
    engine.charge("u", "loud", 0, produce_bytes=6000)  # throttled: stays an hour
    for scrape_ms in range(1_000, 3_600_000, 15_000):  # what QuotaCollector reads
        for manager in engine.managers.values():
            for bucket in manager.buckets.values():
                bucket.rate.measure(scrape_ms)
                if bucket.throttle is not None:
                    bucket.throttle.average(scrape_ms)
                    bucket.throttle.maximum(scrape_ms)
        engine.expire_idle(scrape_ms)
        if scrape_ms >= 11_000:
            assert set(engine.managers[P].buckets) == {BucketKey("", "loud")}
    assert engine.expire_idle(3_600_000) == 1


# -- max_throttle_time_ms: no throttle above it ---------------------------------------------------


def test_max_throttle_caps_every_quota_and_holds_nothing_longer() -> None:
    """Kafka's vector would throttle 2100 ms; capped at 300, and a request on another connection is
    held at most 300 ms. The usage still counts in full, so the next request is throttled again."""
    config = EngineConfig(max_throttle_ms=300)
    engine = engine_with({CLIENT_DEFAULT: {P: 500, F: 500, R: 1.0},
                          QuotaEntity(DEFAULT, None): {PIDS: 0.001}}, config)
    for t in range(0, 10_000, 1000):
        engine.charge("ANONYMOUS", "unknown", t, produce_bytes=400)
    assert engine.charge("ANONYMOUS", "unknown", 10_500, produce_bytes=2300).throttle_ms == 300
    assert 0 < engine.hold_ms("ANONYMOUS", "unknown", 0, 10_500) <= 300
    assert engine.hold_ms("ANONYMOUS", "unknown", 0, 10_801) == 0
    assert engine.charge("ANONYMOUS", "unknown", 10_801, produce_bytes=1).throttle_ms == 300
    assert engine.charge("x", "app", 0, fetch_bytes=10**7).throttle_ms == 300
    assert engine.charge("y", "app", 0, request_time_ms=500).throttle_ms == 300
    assert engine.charge("z", "app", 0, producer_ids=list(range(50))).throttle_ms == 300


def test_max_throttle_caps_the_capacity_and_controller_mutations() -> None:
    from quotas.capacity import CapacityConfig
    from quotas.types import EntitySetting

    engine = engine_with({CLIENT_DEFAULT: {QuotaType.CONTROLLER_MUTATION: 1.0, EntitySetting.SHARE: 1.0}},
                         EngineConfig(max_throttle_ms=250))
    engine.capacity.configure(CapacityConfig(produce_byte_rate=1000.0))
    throttles = []
    for t in range(0, 3000, 100):
        engine.capacity.refresh(t)
        throttles.append(engine.charge("u", "app", t, produce_bytes=100_000).throttle_ms)
    assert max(throttles) == 250, throttles
    assert engine.charge("u", "app", 3000, produce_bytes=100_000).capacity
    verdict = engine.charge_mutations("u", "app", [500], False, 0)
    assert verdict.throttle_ms == 250


def test_uncapped_throttles_go_above_the_cap_used_above() -> None:
    """The same traffic without the cap: the figures the cap changed were really above it."""
    engine = engine_with({CLIENT_DEFAULT: {P: 500}})
    for t in range(0, 10_000, 1000):
        engine.charge("ANONYMOUS", "unknown", t, produce_bytes=400)
    assert engine.charge("ANONYMOUS", "unknown", 10_500, produce_bytes=2300).throttle_ms > 300
    assert engine.charge_mutations("u", "app", [500], False, 0).throttle_ms == 0  # no quota there


def test_a_max_throttle_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_throttle_ms must be at least 1, got 0"):
        EngineConfig(max_throttle_ms=0)
