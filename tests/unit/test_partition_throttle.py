"""KIP-73 partition throttles: Kafka's SimpleRate, the per-partition decisions, the config tables
and the metrics."""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from config.partition_throttles import load_partition_throttles, parse_partition_throttles
from config.quotas import QuotaConfigError
from protocol.topic_names import TopicNames
from proxy.observability.partition_throttle_metrics import register_partition_throttle_metrics
from quotas.partition_throttle import (
    APPLIES_CACHE_MAX,
    MAX_PARTITION_THROTTLES,
    REPLICATION_WINDOW,
    PartitionThrottle,
    PartitionThrottles,
    SimpleRate,
)
from quotas.rate import WindowConfig, WindowedRate


def throttle(name: str = "backfill", topic: str = "events", partitions: frozenset[int] | None = None,
             byte_rate: float = 1000.0, users: frozenset[str] | None = None,
             client_ids: frozenset[str] | None = None) -> PartitionThrottle:
    return PartitionThrottle(name, topic, partitions, byte_rate, users, client_ids)


def throttles(*definitions: PartitionThrottle) -> PartitionThrottles:
    live = PartitionThrottles()
    live.set_throttles(definitions)
    return live


# -- Kafka's SimpleRate ----------------------------------------------------------------------------


def test_replication_window_is_kafkas_default() -> None:
    assert (REPLICATION_WINDOW.samples, REPLICATION_WINDOW.window_ms) == (11, 1000)


def test_simple_rate_counts_the_first_window_whole_and_no_more() -> None:
    rate = SimpleRate(REPLICATION_WINDOW)
    rate.record(1000, 0)
    assert rate.measure(0) == 1000.0  # max(elapsed 0, one window)
    assert rate.measure(500) == 1000.0
    assert rate.measure(2000) == 500.0  # the time since the oldest sample, unpadded
    assert rate.measure(4000) == 250.0
    padded = WindowedRate(REPLICATION_WINDOW)
    padded.record(1000, 0)
    assert padded.measure(2000) == 100.0  # the quotas' Rate pads to 10 windows: not this one


def test_simple_rate_spans_its_samples() -> None:
    rate = SimpleRate(REPLICATION_WINDOW)
    for second in range(5):
        rate.record(300, second * 1000)
    assert rate.measure(5000) == 1500 * 1000 / 5000
    assert rate.window_ms(5000) == 5000


def test_simple_rate_forgets_samples_eleven_windows_old() -> None:
    rate = SimpleRate(REPLICATION_WINDOW)
    rate.record(5000, 0)
    rate.record(1000, 6000)
    assert rate.measure(10_999) == 6000 * 1000 / 10_999
    assert rate.measure(11_000) == 1000 * 1000 / 5000  # the first sample is purged; the other began at 6 s
    assert rate.measure(17_000) == 0.0


def test_ms_until_at_most() -> None:
    rate = SimpleRate(REPLICATION_WINDOW)
    rate.record(3000, 0)
    assert rate.ms_until_at_most(1000, 0) == 3000  # 3000 B over 3 s is 1000 B/s
    assert rate.ms_until_at_most(1000, 1000) == 2000
    assert rate.ms_until_at_most(3000, 0) == 0  # at most: 3000 B over the first whole window
    assert rate.ms_until_at_most(1000, 3000) == 0


def test_ms_until_at_most_counts_samples_purged_on_the_way() -> None:
    rate = SimpleRate(REPLICATION_WINDOW)
    rate.record(5000, 0)
    rate.record(1000, 6000)
    # 6000 B would need 60 s at 100 B/s, but the first sample goes at 11 s; then 1000 B since 6 s
    # reach 100 B/s at 16 s, before the second goes at 17 s.
    assert rate.ms_until_at_most(100, 7000) == 9000
    assert copy.deepcopy(rate).measure(16_000) == 100.0
    assert copy.deepcopy(rate).measure(15_999) > 100.0


@settings(max_examples=300, deadline=None)
@given(records=st.lists(st.tuples(st.integers(0, 1500), st.integers(1, 5_000_000)), min_size=1, max_size=30),
       later=st.integers(0, 3000), bound=st.sampled_from([100_000, 1_000_000, 3_000_000]))
def test_ms_until_at_most_is_the_first_moment_at_most(records: list[tuple[int, int]], later: int,
                                                       bound: int) -> None:
    rate = SimpleRate(REPLICATION_WINDOW)
    now = 0
    for step, value in records:
        now += step
        rate.record(value, now)
    now += later
    wait = copy.deepcopy(rate).ms_until_at_most(bound, now)
    assert copy.deepcopy(rate).measure(now + wait) <= bound
    if wait > 0:
        assert copy.deepcopy(rate).measure(now + wait - 1) > bound


def test_wait_ms_is_for_the_throttles_covering_the_partition() -> None:
    live = throttles(throttle("a", partitions=frozenset({0}), byte_rate=1000),
                     throttle("b", byte_rate=500, client_ids=frozenset({"etl"})))
    assert live.decide("u", "etl", "events", 0, 1000, 0)
    assert live.wait_ms("u", "etl", "events", 0, 0) == 2000  # b: 1000 B at 500 B/s; a is at its rate
    assert live.wait_ms("u", "live", "events", 0, 0) == 0  # b does not concern this client
    assert live.wait_ms("u", "etl", "events", 1, 0) == 2000
    assert live.wait_ms("u", "etl", "other", 0, 0) == 0


# -- decisions ------------------------------------------------------------------------------------


def test_let_through_while_under_then_emptied_while_over() -> None:
    live = throttles(throttle(byte_rate=1000))
    assert live.decide("alice", "app", "events", 0, 600, 0)
    assert live.decide("alice", "app", "events", 1, 600, 0)  # 600 B/s so far: not over
    assert not live.decide("alice", "app", "events", 2, 100, 0)  # 1200 B/s: over
    (stats,) = live.stats(0)
    assert (stats.let_through_bytes, stats.withheld_bytes, stats.withheld_partitions) == (1200, 100, 1)
    assert stats.rate == 1200.0  # the emptied partition's bytes are not recorded (KIP-73)


@pytest.mark.parametrize("two", [False, True])
def test_in_shadow_a_partition_over_its_throttle_is_counted_and_let_through(two: bool) -> None:
    live = PartitionThrottles(shadow=True)
    live.set_throttles([throttle(byte_rate=1000), *([throttle("other", byte_rate=5000)] if two else [])])
    assert live.decide("alice", "app", "events", 0, 1200, 0)
    assert live.decide("alice", "app", "events", 2, 100, 0)  # 1200 B/s: over, let through in shadow
    stats = live.stats(0)[0]
    assert (stats.withheld_bytes, stats.shadow_withheld_bytes) == (0, 100)
    assert stats.shadow_withheld_partitions == 1
    assert stats.let_through_bytes == 1300 and stats.rate == 1300.0, "delivered, so recorded"


def test_equal_to_the_rate_is_not_over() -> None:
    live = throttles(throttle(byte_rate=1000))
    assert live.decide("u", "c", "events", 0, 1200, 0)
    assert not live.decide("u", "c", "events", 0, 10, 1100)  # 1200 / 1.1 s > 1000
    assert live.decide("u", "c", "events", 0, 10, 1200)  # exactly 1000 B/s: Kafka's bound is inclusive


def test_partitions_are_decided_in_order_with_earlier_bytes_counted() -> None:
    live = throttles(throttle(byte_rate=1000))
    answers = [live.decide("u", "c", "events", p, 400, 50) for p in range(5)]
    assert answers == [True, True, True, False, False]  # the third pushes it over: optimistic, as Kafka


def test_throttled_bytes_are_not_recorded_so_the_rate_recovers() -> None:
    live = throttles(throttle(byte_rate=1000))
    assert live.decide("u", "c", "events", 0, 3000, 0)
    for now in range(0, 3000, 100):
        assert not live.decide("u", "c", "events", 0, 5000, now)
    assert live.stats(2999)[0].rate == pytest.approx(3000 * 1000 / 2999)
    assert live.decide("u", "c", "events", 0, 5000, 3000)


def test_other_topics_and_partitions_are_untouched() -> None:
    live = throttles(throttle(partitions=frozenset({0, 2}), byte_rate=1))
    assert live.decide("u", "c", "events", 0, 100, 0)
    assert not live.decide("u", "c", "events", 2, 100, 0)
    assert live.decide("u", "c", "events", 1, 10**9, 0)
    assert live.decide("u", "c", "other", 0, 10**9, 0)
    assert live.stats(0)[0].let_through_bytes == 100
    assert live.topics == frozenset({"events"})


def test_empty_records_are_not_decided() -> None:
    live = throttles(throttle(byte_rate=1))
    assert live.decide("u", "c", "events", 0, 100, 0)
    assert live.decide("u", "c", "events", 0, 0, 0)
    assert live.stats(0)[0].withheld_partitions == 0


@pytest.mark.parametrize(("users", "client_ids", "concerned"), [
    (None, None, [True, True, True, True]),
    (frozenset({"alice"}), None, [True, True, False, False]),
    (None, frozenset({"replay"}), [True, False, True, False]),
    (frozenset({"alice"}), frozenset({"replay"}), [True, False, False, False]),
])
def test_user_and_client_filters(users: frozenset[str] | None, client_ids: frozenset[str] | None,
                                 concerned: list[bool]) -> None:
    clients = [("alice", "replay"), ("alice", "live"), ("bob", "replay"), ("bob", "live")]
    live = throttles(throttle(byte_rate=1, users=users, client_ids=client_ids))
    assert [live.applies_to(u, c) for u, c in clients] == concerned
    for (user, client_id), expected in zip(clients, concerned, strict=True):
        live.decide(user, client_id, "events", 0, 10, 0)  # over at once for the concerned ones
        assert live.decide(user, client_id, "events", 0, 10, 0) is not expected


def test_applies_to_follows_changes_and_nothing_applies_without_throttles() -> None:
    live = PartitionThrottles()
    assert not live.applies_to("alice", "app")
    live.set_throttles([throttle(users=frozenset({"bob"}))])
    assert not live.applies_to("alice", "app")
    live.set_throttles([throttle(users=frozenset({"alice"}))])
    assert live.applies_to("alice", "app")
    live.set_throttles([])
    assert not live.applies_to("alice", "app")


def test_applies_to_cache_is_bounded() -> None:
    live = throttles(throttle(client_ids=frozenset({"c1"})))
    for index in range(APPLIES_CACHE_MAX + 10):
        assert live.applies_to("u", f"c{index}") is (index == 1)
    assert len(live._applies) <= APPLIES_CACHE_MAX


def test_unchanged_throttles_keep_their_history_across_reloads() -> None:
    live = throttles(throttle("a", byte_rate=1000), throttle("b", topic="logs", byte_rate=1000))
    assert live.decide("u", "c", "events", 0, 5000, 0)
    assert live.decide("u", "c", "logs", 0, 5000, 0)
    live.set_throttles([throttle("a", byte_rate=2000), throttle("b2", topic="logs", byte_rate=1000)])
    # "a" keeps its rate (5000 B/s) under its new bound; "b" became "b2", a new throttle.
    assert not live.decide("u", "c", "events", 0, 10, 100)
    assert live.decide("u", "c", "logs", 0, 10, 100)
    by_name = {s.name: s for s in live.stats(100)}
    assert by_name["a"].let_through_bytes == 5000 and by_name["a"].byte_rate == 2000
    assert by_name["b2"].let_through_bytes == 10
    assert set(by_name) == {"a", "b2"}


def test_overlapping_throttles_all_must_allow() -> None:
    live = throttles(throttle("wide", byte_rate=10_000),
                     throttle("narrow", partitions=frozenset({1}), byte_rate=100))
    assert live.decide("u", "c", "events", 1, 500, 0)  # both under: recorded by both
    assert not live.decide("u", "c", "events", 1, 500, 0)  # narrow over
    assert live.decide("u", "c", "events", 0, 500, 0)  # only wide covers partition 0
    by_name = {s.name: s for s in live.stats(0)}
    assert (by_name["wide"].let_through_bytes, by_name["wide"].withheld_bytes) == (1000, 0)
    assert (by_name["narrow"].let_through_bytes, by_name["narrow"].withheld_bytes) == (500, 500)


def test_the_number_of_throttles_is_bounded_and_names_unique() -> None:
    live = PartitionThrottles(max_throttles=2)
    with pytest.raises(ValueError, match="more than the 2 allowed"):
        live.set_throttles([throttle(f"t{i}") for i in range(3)])
    with pytest.raises(ValueError, match="t0 given twice"):
        live.set_throttles([throttle("t0"), throttle("t0", topic="other")])
    assert PartitionThrottles().max_throttles == MAX_PARTITION_THROTTLES


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_a_definition_needs_a_finite_positive_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="byte_rate"):
        throttle(byte_rate=rate)


def test_a_definition_needs_partitions_or_all() -> None:
    with pytest.raises(ValueError, match="partitions"):
        throttle(partitions=frozenset())
    with pytest.raises(ValueError, match="partitions"):
        throttle(partitions=frozenset({-1}))


def test_long_run_rate_holds_to_the_bound() -> None:
    """A consumer fetching 64 KiB a partition every 10 ms gets the bound over a minute."""
    live = throttles(throttle(byte_rate=100_000))
    sent = 0
    for now in range(0, 60_000, 10):
        if live.decide("u", "c", "events", now // 10 % 3, 65_536, now):
            sent += 65_536
    assert 0.98 <= sent / 60 / 100_000 <= 1.05


# -- the quota file -----------------------------------------------------------------------------


def parse(text: str) -> list[PartitionThrottle]:
    return parse_partition_throttles(tomllib.loads(text))


def test_parse_tables() -> None:
    found = parse("""
[[quota]]
user = "alice"
consumer_byte_rate = 1000

[[partition_throttle]]
topic = "events"
partitions = [0, 2]
byte_rate = 5242880

[[partition_throttle]]
name = "replay"
topic = "events"
partitions = "*"
byte_rate = 1000.0
users = ["etl", "batch"]
client_ids = ["replayer"]
""")
    assert found == [
        PartitionThrottle("events", "events", frozenset({0, 2}), 5242880.0),
        PartitionThrottle("replay", "events", None, 1000.0, frozenset({"etl", "batch"}),
                          frozenset({"replayer"})),
    ]
    assert parse("[[quota]]\nuser = 'a'\nconsumer_byte_rate = 1\n") == []


ALL = 'topic = "t"\npartitions = "*"\nbyte_rate = 1\n'


@pytest.mark.parametrize(("table", "message"), [
    ('partitions = "*"\nbyte_rate = 1', "partition_throttle #1: topic = None must be a Kafka topic name"),
    ('topic = "a b"\npartitions = "*"\nbyte_rate = 1', "topic = 'a b' must be a Kafka topic name"),
    ('topic = ".."\npartitions = "*"\nbyte_rate = 1', "topic = '..' must be"),
    ('topic = "t"\nbyte_rate = 1', "(topic t): partitions = None must be \"*\""),
    ('topic = "t"\npartitions = []\nbyte_rate = 1', "partitions = [] must be"),
    ('topic = "t"\npartitions = "0"\nbyte_rate = 1', "partitions = '0' must be"),
    ('topic = "t"\npartitions = [0, -1]\nbyte_rate = 1', "partitions has -1, which is not a partition index"),
    ('topic = "t"\npartitions = [true]\nbyte_rate = 1', "partitions has True"),
    ('topic = "t"\npartitions = [1.5]\nbyte_rate = 1', "partitions has 1.5"),
    ('topic = "t"\npartitions = "*"', "byte_rate is missing"),
    ('topic = "t"\npartitions = "*"\nbyte_rate = 0', "byte_rate = 0 must be greater than 0"),
    ('topic = "t"\npartitions = "*"\nbyte_rate = -5', "byte_rate = -5 must be greater than 0"),
    ('topic = "t"\npartitions = "*"\nbyte_rate = inf', "byte_rate = inf must be greater than 0"),
    ('topic = "t"\npartitions = "*"\nbyte_rate = nan', "byte_rate = nan must be greater than 0"),
    ('topic = "t"\npartitions = "*"\nbyte_rate = 10.5', "must be a whole number of bytes per second"),
    ('topic = "t"\npartitions = "*"\nbyte_rate = "1MB"', "byte_rate = '1MB' is not a number"),
    (ALL + 'users = "alice"', "users = 'alice' must be a non-empty list"),
    (ALL + 'users = []', "users = [] must be a non-empty list"),
    (ALL + 'client_ids = [""]', "client_ids has '', which is not"),
    (ALL + 'user = "alice"', "unknown key user = 'alice' (write users"),
    (ALL + 'rate = 5', "unknown key rate = 5"),
    (ALL + 'name = ""', "name = '' must be a non-empty string"),
])
def test_invalid_tables_name_the_table_and_field(table: str, message: str) -> None:
    with pytest.raises(QuotaConfigError) as info:
        parse(f"[[partition_throttle]]\n{table}\n")
    assert message in str(info.value)


def test_duplicate_names_and_too_many_tables_are_refused() -> None:
    twice = '[[partition_throttle]]\ntopic = "t"\npartitions = "*"\nbyte_rate = 1\n'
    with pytest.raises(QuotaConfigError, match="#2: name 't' is already used by partition_throttle #1"):
        parse(twice * 2)
    with pytest.raises(QuotaConfigError, match="must be an array of tables"):
        parse_partition_throttles({"partition_throttle": {"topic": "t"}})
    with pytest.raises(QuotaConfigError, match="more than the 1000 allowed"):
        parse_partition_throttles({"partition_throttle": [{}] * (MAX_PARTITION_THROTTLES + 1)})


def test_load_partition_throttles(tmp_path: Path) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text('[[partition_throttle]]\ntopic = "t"\npartitions = [3]\nbyte_rate = 7\n')
    assert load_partition_throttles(path) == [PartitionThrottle("t", "t", frozenset({3}), 7.0)]
    path.write_text("[[partition_throttle]\n")
    with pytest.raises(QuotaConfigError, match="cannot read quota file"):
        load_partition_throttles(path)


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_report_rate_bound_and_counters() -> None:
    live = throttles(throttle("backfill", byte_rate=1000))
    live.decide("u", "c", "events", 0, 2000, 0)
    live.decide("u", "c", "events", 1, 300, 0)
    live.set_throttles([*live.throttles, throttle("logs", topic="logs")])
    names = TopicNames()
    names.learn(b"\x01" * 16, "events")
    registry = CollectorRegistry()
    collector = register_partition_throttle_metrics(registry, live, names)
    assert b"kthrottle_partition_throttle" not in generate_latest(registry)  # nothing before a refresh
    collector.refresh(1000)
    text = generate_latest(registry).decode()
    labels = '{throttle="backfill",topic="events"}'
    assert f"kthrottle_partition_throttle_byte_rate_bytes_per_second{labels} 2000.0" in text
    assert f"kthrottle_partition_throttle_limit_bytes_per_second{labels} 1000.0" in text
    assert f"kthrottle_partition_throttle_let_through_bytes_total{labels} 2000.0" in text
    enforced = '{mode="enforced",throttle="backfill",topic="events"}'
    assert f"kthrottle_partition_throttle_withheld_bytes_total{enforced} 300.0" in text
    assert f"kthrottle_partition_throttle_withheld_partitions_total{enforced} 1.0" in text
    assert 'mode="shadow",' not in text
    assert 'kthrottle_partition_throttle_topic_id_unknown{topic="events"} 0.0' in text
    assert 'kthrottle_partition_throttle_topic_id_unknown{topic="logs"} 1.0' in text


def test_window_config_is_used() -> None:
    live = PartitionThrottles(window=WindowConfig(samples=2, window_ms=100))
    live.set_throttles([throttle(byte_rate=1000)])
    assert live.decide("u", "c", "events", 0, 1000, 0)
    assert not live.decide("u", "c", "events", 0, 1, 50)  # 1000 B over one 100 ms window
    assert live.decide("u", "c", "events", 0, 1, 200)  # 2 x 100 ms later the sample is gone
