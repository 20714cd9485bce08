"""Usage accounting (quotas/usage.py), its feed from the quota engine and the connection, the
events' JSON (proxy/observability/usage_event_schema.py) and the `[usage]` table (config/usage.py)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config.cluster_login import ClusterLogin
from config.settings import SettingsError, load_settings
from config.usage import DEFAULT_TOPIC, SASL_PASSWORD_ENV, parse_usage_table
from protocol.apis import ApiKey
from protocol.connection import ProxyConnection
from protocol.frames import frame
from proxy.observability.usage_event_schema import ProxyIdentity, build_event, encode_events, event_key
from quotas.capacity import REFRESH_INTERVAL_MS, CapacityConfig
from quotas.engine import QuotaEngine
from quotas.entity import DEFAULT, BucketKey, QuotaEntity
from quotas.types import QuotaType
from quotas.usage import OTHER, UsageAccount

from .test_connection import heartbeat_request, heartbeat_response, produce_request, produce_response
from .test_streaming import fetch_request, fetch_response
from .wire import advertise

# -- the account --------------------------------------------------------------------------------


def test_sums_are_exact_per_entity() -> None:
    account = UsageAccount(1000)
    account.record("alice", "etl", ApiKey.PRODUCE, 100, 0, None)
    account.record("alice", "etl", None, 0, 0, 2.5)  # the Produce's response: counted already
    account.record("alice", "etl", ApiKey.FETCH, 0, 700, 1.25)
    account.record("bob", "", ApiKey.METADATA, 0, 0, 0.5)
    account.throttled("alice", "etl", QuotaType.PRODUCE, 300)
    account.throttled("alice", "etl", QuotaType.PRODUCE, 200)
    interval = account.take(2000)
    alice = interval.entities[("alice", "etl")]
    assert (alice.produce_bytes, alice.fetch_bytes, alice.request_time_ms) == (100, 700, 3.75)
    assert alice.requests == {ApiKey.PRODUCE: 1, ApiKey.FETCH: 1}
    assert alice.throttles == {QuotaType.PRODUCE: [2, 500]}
    assert interval.entities[("bob", "")].requests == {ApiKey.METADATA: 1}
    assert (interval.start_ms, interval.end_ms, interval.seq) == (1000, 2000, 0)


def test_intervals_are_consecutive_and_nothing_counts_twice() -> None:
    account = UsageAccount(0)
    account.record("u", "c", ApiKey.PRODUCE, 10, 0, None)
    first = account.take(500)
    account.record("u", "c", ApiKey.PRODUCE, 20, 0, None)
    second = account.take(900)
    third = account.take(1300)  # nothing counted: an empty interval
    assert [(i.start_ms, i.end_ms, i.seq) for i in (first, second, third)] == [
        (0, 500, 0), (500, 900, 1), (900, 1300, 2)]
    assert first.entities[("u", "c")].produce_bytes == 10
    assert second.entities[("u", "c")].produce_bytes == 20
    assert third.entities == {}
    assert account.take(1200).start_ms == 1300  # a clock that steps back does not reopen time


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 10_000), st.booleans()),
                max_size=60))
def test_any_split_into_intervals_sums_to_the_total(charges: list[tuple[str, int, bool]]) -> None:
    account = UsageAccount(0)
    totals: dict[str, int] = {}
    taken = []
    for now, (user, size, cut) in enumerate(charges):
        account.record(user, "", ApiKey.PRODUCE, size, 0, None)
        totals[user] = totals.get(user, 0) + size
        if cut:
            taken.append(account.take(now))
    taken.append(account.take(len(charges)))
    summed: dict[str, int] = {}
    for interval in taken:
        for (user, _), usage in interval.entities.items():
            summed[user] = summed.get(user, 0) + usage.produce_bytes
    assert summed == totals
    assert all(a.end_ms == b.start_ms for a, b in itertools.pairwise(taken))


def test_entities_past_the_cap_fold_into_other() -> None:
    account = UsageAccount(0, max_entities=2)
    for user in ("a", "b", "c", "d", "c"):
        account.record(user, "x", ApiKey.PRODUCE, 5, 0, None)
    account.throttled("d", "x", QuotaType.FETCH, 40)
    account.capacity_throttled("c", "x", QuotaType.PRODUCE, 7)
    interval = account.take(10)
    assert set(interval.entities) == {("a", "x"), ("b", "x"), (OTHER, OTHER)}
    other = interval.entities[(OTHER, OTHER)]
    assert (other.produce_bytes, other.requests, interval.folded_entities) == (15, {ApiKey.PRODUCE: 3}, 2)
    assert other.throttles == {QuotaType.FETCH: [1, 40]}
    assert other.capacity_throttles == {QuotaType.PRODUCE: [1, 7]}
    assert account.take(20).folded_entities == 0  # the cap is per interval


# -- fed by the engine ------------------------------------------------------------------------------


def test_engine_counts_without_any_quota() -> None:
    engine = QuotaEngine()
    engine.usage = UsageAccount(0)
    engine.charge("u", "c", 10, produce_bytes=50, api_key=ApiKey.PRODUCE)
    engine.charge("u", "c", 20, produce_bytes=50, request_time_ms=3.0)
    usage = engine.usage.take(100).entities[("u", "c")]
    assert (usage.produce_bytes, usage.request_time_ms, usage.requests) == (100, 3.0, {ApiKey.PRODUCE: 1})


def test_new_producer_ids_are_counted_where_a_producer_id_quota_reads_them() -> None:
    engine = QuotaEngine()
    engine.usage = UsageAccount(0)
    assert not engine.wants_producer_ids("u")  # the seen-before test is too dear to run for counting
    engine.set_quotas({QuotaEntity("u", None): {QuotaType.PRODUCER_IDS: 100.0}})
    assert engine.wants_producer_ids("u") and not engine.wants_producer_ids("v")
    engine.charge("u", "c", 10, produce_bytes=50, producer_ids=[7, 8], api_key=ApiKey.PRODUCE)
    engine.charge("u", "c", 20, produce_bytes=50, producer_ids=[8, 9], api_key=ApiKey.PRODUCE)
    assert engine.usage.take(100).entities[("u", "c")].new_producer_ids == 3


def test_engine_without_usage_counts_nothing_and_reads_no_producer_ids() -> None:
    engine = QuotaEngine()
    assert not engine.wants_producer_ids("anyone")
    assert engine.charge("u", "c", 10, produce_bytes=50, api_key=ApiKey.PRODUCE).throttle_ms == 0
    assert engine.usage is None


def test_engine_counts_throttles_under_the_deciding_quota_and_takes_back_an_emptied_fetch() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, "slow"): {QuotaType.PRODUCE: 100.0, QuotaType.FETCH: 100.0}})
    engine.usage = account = UsageAccount(0)
    throttles = 0
    for now in range(0, 10_000, 500):
        verdict = engine.charge("", "slow", now, produce_bytes=1000, api_key=ApiKey.PRODUCE)
        throttles += verdict.throttle_ms > 0
    verdict = engine.charge("", "slow", 10_000, fetch_bytes=5000, request_time_ms=1.0, api_key=ApiKey.FETCH)
    assert verdict.throttle_ms > 0 and not verdict.deliver_fetch  # Kafka's shape: emptied
    usage = account.take(20_000).entities[("", "slow")]
    assert usage.produce_bytes == 20 * 1000
    assert usage.fetch_bytes == 0  # not delivered, not charged
    assert usage.throttles[QuotaType.PRODUCE][0] == throttles > 0
    assert usage.throttles[QuotaType.FETCH][0] == 1
    bucket = engine.managers[QuotaType.PRODUCE].buckets[("", "slow")]
    assert usage.throttles[QuotaType.PRODUCE] == [bucket.throttle_count, bucket.throttle_total_ms]
    assert engine.quotas_for("", "slow") == {QuotaType.PRODUCE: 100.0, QuotaType.FETCH: 100.0}


def test_engine_counts_capacity_throttles_apart_from_the_quotas() -> None:
    """A tenant over the cluster capacity (no quota of its own) is throttled by the capacity: the
    usage counts those throttles under `capacity_throttles`, exactly as the capacity's own counters
    (kthrottle_capacity_throttles_total), and none under `throttles`."""
    engine = QuotaEngine()
    engine.capacity.configure(CapacityConfig(produce_byte_rate=10_000.0))
    engine.usage = account = UsageAccount(0)
    throttled = 0
    for now in range(0, 10_000, 50):  # 100 kB/s offered against a 10 kB/s capacity
        if now % REFRESH_INTERVAL_MS == 0:
            engine.capacity.refresh(now)
        verdict = engine.charge("u", "c", now, produce_bytes=5000, api_key=ApiKey.PRODUCE)
        throttled += verdict.capacity and verdict.throttle_ms > 0
    usage = account.take(10_000).entities[("u", "c")]
    flow = engine.capacity.directions[QuotaType.PRODUCE].flows[BucketKey("u", "c")]
    assert throttled > 0 and usage.throttles == {}
    assert usage.capacity_throttles == {QuotaType.PRODUCE: [flow.throttle_count, flow.throttle_total_ms]}
    assert flow.throttle_count == throttled


def test_quotas_in_force_are_resolved_as_charges_are() -> None:
    engine = QuotaEngine()
    assert engine.quotas_for("alice", "etl") == {}
    engine.set_quotas({QuotaEntity("alice", None): {QuotaType.REQUEST: 50.0},
                       QuotaEntity(DEFAULT, None): {QuotaType.PRODUCER_IDS: 5.0},
                       QuotaEntity(None, DEFAULT): {QuotaType.PRODUCE: 1e6}})
    assert engine.quotas_for("alice", "etl") == {QuotaType.REQUEST: 50.0, QuotaType.PRODUCER_IDS: 5.0,
                                                 QuotaType.PRODUCE: 1e6}


# -- fed by the connection: each request counted once, by API ---------------------------------------


def test_connection_counts_each_request_once_per_api() -> None:
    engine = QuotaEngine()
    engine.usage = account = UsageAccount(0)
    conn = ProxyConnection(advertise, policy=engine)
    produce = produce_request(1, 9, acks=-1)
    conn.receive_from_client(frame(produce), 1.0)
    conn.receive_from_broker(frame(produce_response(1, 9)), 3.0)
    conn.receive_from_client(frame(produce_request(2, 9, acks=0)), 4.0)  # no response: counted on arrival
    conn.receive_from_client(frame(heartbeat_request(3)), 5.0)
    conn.receive_from_broker(frame(heartbeat_response(3)), 6.5)
    conn.receive_from_client(fetch_request(4, client="test-client"), 7.0)  # a 500 ms long poll
    fetched = fetch_response(4, b"r" * 300)
    conn.receive_from_broker(frame(fetched), 9.0)
    usage = account.take(10).entities[("ANONYMOUS", "test-client")]
    assert usage.requests == {ApiKey.PRODUCE: 2, 12: 1, ApiKey.FETCH: 1}  # 12: Heartbeat
    assert usage.produce_bytes == 2 * len(produce)
    assert usage.request_time_ms == 2.0 + 1.5 + 0.0  # the fetch's wait is its long poll, not charged
    # as the fetch quota measures a response: size field included, v1 header (5 bytes) not
    assert usage.fetch_bytes == 4 + len(fetched) - 5


# -- the events -------------------------------------------------------------------------------------


def test_event_json_follows_schema_1() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity("alice", None): {QuotaType.PRODUCE: 1048576.0}})
    account = UsageAccount(1_700_000_000_000)
    account.record("alice", "etl", ApiKey.PRODUCE, 123, 0, None, 1)
    account.record("alice", "etl", None, 0, 0, 12.5)
    account.record("alice", "etl", ApiKey.METADATA, 0, 0, 0.0)
    account.record("ANONYMOUS", "", ApiKey.FETCH, 0, 456, 0.0)
    account.throttled("alice", "etl", QuotaType.PRODUCE, 1500)
    account.capacity_throttled("alice", "etl", QuotaType.PRODUCE, 200)
    account.capacity_throttled("alice", "etl", QuotaType.PRODUCE, 300)
    account.capacity_throttled("alice", "etl", QuotaType.FETCH, 40)
    interval = account.take(1_700_000_010_000)
    identity = ProxyIdentity("proxy-a", "0.0.0.0:9192", 42).as_json()
    records = dict(encode_events(engine, identity, interval, sorted(interval.entities)))
    alice = json.loads(records[b'["alice","etl"]'])
    assert alice == {
        "schema": 1,
        "proxy": {"host": "proxy-a", "listen": "0.0.0.0:9192", "pid": 42, "member": None, "fleet": None},
        "interval": {"start_ms": 1_700_000_000_000, "end_ms": 1_700_000_010_000, "seq": 0},
        "user": "alice", "client_id": "etl",
        "produce_bytes": 123, "fetch_bytes": 0,
        "requests": {"Produce": 1, "Metadata": 1},
        "request_time_ms": 12.5,
        "new_producer_ids": 1,
        "throttles": {"producer_byte_rate": {"count": 1, "time_ms": 1500}},
        "capacity_throttles": {"producer_byte_rate": {"count": 2, "time_ms": 500},
                               "consumer_byte_rate": {"count": 1, "time_ms": 40}},
        "shadow_throttles": {}, "shadow_capacity_throttles": {},
        "quotas": {"producer_byte_rate": 1048576.0},
    }
    anonymous = json.loads(records[b'["ANONYMOUS",""]'])
    assert (anonymous["fetch_bytes"], anonymous["requests"], anonymous["throttles"],
            anonymous["capacity_throttles"], anonymous["quotas"]) == (456, {"Fetch": 1}, {}, {}, {})


def test_event_key_is_the_entity_and_an_empty_user_reads_anonymous() -> None:
    assert event_key("al\"ice", "é") == '["al\\"ice","é"]'.encode()
    account = UsageAccount(0)
    account.record("", "c", ApiKey.METADATA, 0, 0, None)
    interval = account.take(1)
    event = build_event({}, interval, "", "c", interval.entities[("", "c")], {})
    assert event["user"] == "ANONYMOUS"


def test_the_other_entity_says_how_many_it_folds() -> None:
    account = UsageAccount(0, max_entities=1)
    account.record("a", "", ApiKey.METADATA, 0, 0, None)
    account.record("b", "", ApiKey.METADATA, 0, 0, None)
    interval = account.take(1)
    records = dict(encode_events(QuotaEngine(), {}, interval, list(interval.entities)))
    other = json.loads(records[event_key(OTHER, OTHER)])
    assert other["folded_entities"] == 1 and other["quotas"] == {}


# -- the [usage] table ------------------------------------------------------------------------------


def test_usage_table_defaults_and_values(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[proxy]\n")
    assert load_settings(path).usage is None
    path.write_text("[usage]\n")
    usage = load_settings(path).usage
    assert usage is not None
    assert (usage.interval_ms, usage.topic, usage.retention_ms) == (10_000, DEFAULT_TOPIC, 7 * 86_400_000)
    path.write_text('[usage]\ninterval_ms = 1000\ntopic = "usage.v1"\nretention_ms = -1\npartitions = 1\n'
                    'replication_factor = -1\nbootstrap_servers = ["k1:9092", "k2:9092"]\n'
                    'max_pending_intervals = 2\nbuffer_memory = 4096\n'
                    'sasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "kt"\nsasl_password = "pw"\n')
    usage = load_settings(path).usage
    assert usage is not None
    assert (usage.interval_ms, usage.topic, usage.retention_ms, usage.partitions, usage.replication_factor,
            usage.bootstrap_servers, usage.max_pending_intervals, usage.buffer_memory) == (
        1000, "usage.v1", -1, 1, -1, [("k1", 9092), ("k2", 9092)], 2, 4096)
    assert usage.login == ClusterLogin("SCRAM-SHA-512", "kt", "pw")


@pytest.mark.parametrize(("table", "named"), [
    ({"interval_ms": 50}, "usage.interval_ms = 50"),
    ({"interval_ms": "10s"}, "usage.interval_ms = '10s'"),
    ({"topic": "bad topic"}, "usage.topic = 'bad topic'"),
    ({"retention_ms": 0}, "usage.retention_ms = 0"),
    ({"partitions": 0}, "usage.partitions = 0"),
    ({"replication_factor": -2}, "usage.replication_factor = -2"),
    ({"bootstrap_servers": ["nope"]}, "usage.bootstrap_servers entry 'nope'"),
    ({"max_pending_intervals": 0}, "usage.max_pending_intervals = 0"),
    ({"buffer_memory": True}, "usage.buffer_memory = True"),
    ({"sasl_mechanism": "GSSAPI"}, "usage.sasl_mechanism = 'GSSAPI'"),
    ({"sasl_mechanism": "PLAIN"}, "needs usage.sasl_username"),
    ({"sasl_mechanism": "PLAIN", "sasl_username": "u"}, "needs usage.sasl_password"),
    ({"sasl_username": "u"}, "usage.sasl_mechanism is not"),
    ({"flush_ms": 1}, "unknown setting usage.flush_ms"),
])
def test_bad_usage_values_name_the_key(table: dict[str, object], named: str) -> None:
    with pytest.raises(SettingsError) as error:
        parse_usage_table(table, environ={})
    assert named in str(error.value)


def test_sasl_password_from_the_environment() -> None:
    usage = parse_usage_table({"sasl_mechanism": "PLAIN", "sasl_username": "u"},
                              environ={SASL_PASSWORD_ENV: "secret"})
    assert usage.login.password == "secret"
