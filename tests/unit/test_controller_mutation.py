"""The controller mutation quota (KIP-599): Kafka's token bucket, and CreateTopics, CreatePartitions
and DeleteTopics through a whole connection with a fake clock (strict split and merge, permissive
throttles, the partition-count lookup, settlement by the broker's answer, hostile input)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.protocol.admin import (
    CreatePartitionsRequest,
    CreatePartitionsResponse,
    CreateTopicsRequest,
    CreateTopicsResponse,
    DeleteTopicsRequest,
    DeleteTopicsResponse,
)
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from protocol.apis import KNOWN_APIS, ApiKey
from protocol.connection import Mute, ProxyConnection, Throttled
from protocol.controller_mutations import (
    CREATE_TOPICS,
    LOOKUP_CORRELATION_ID,
    THROTTLING_QUOTA_EXCEEDED,
    decode_mutation,
)
from protocol.headers import parse_request_header, response_body_offset
from protocol.sasl import ANONYMOUS
from proxy.observability.metrics import ProxyMetrics
from quotas.controller_mutation import (
    ControllerMutationQuotaManager,
    MutationTokenBucket,
    MutationVerdict,
    mutation_throttle_ms,
)
from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import DEFAULT, BucketKey, QuotaEntity
from quotas.rate import WindowConfig
from quotas.types import QuotaType

from .wire import advertise, broker_frames, client_frames, close_reasons, framed, of_type, request, response

M = QuotaType.CONTROLLER_MUTATION
#: Kafka's own unit tests configure 10 samples of 1 s: a burst of 100 at 10 partitions/s.
KAFKA_TEST_WINDOW = WindowConfig(10, 1000)
T0 = 1_000_000
CLIENT = "admin-1"
KEY = BucketKey(ANONYMOUS, "")


def manager(rate: float = 10.0, window: WindowConfig = KAFKA_TEST_WINDOW) -> ControllerMutationQuotaManager:
    m = ControllerMutationQuotaManager(window)
    m.set_quotas({QuotaEntity("alice", None): rate})
    return m


# == the token bucket: Kafka's vectors ==========================================================


def test_strict_vector_90_90_accepted_third_refused_with_8000() -> None:
    """StrictControllerMutationQuotaTest: 90 and 90 accepted (tokens 10, then -80), the third 90 refused."""
    m = manager()
    assert m.charge_topics("alice", "c", [90], True, T0).throttle_ms == 0
    second = m.charge_topics("alice", "c", [90], True, T0)
    assert second.accepted == (True,) and second.throttle_ms == 0  # accepted into debt, nobody throttled
    third = m.charge_topics("alice", "c", [90], True, T0)
    assert third.accepted == (False,) and third.throttle_ms == 8000
    assert m.debt_throttle_ms("alice", "c", T0 + 5000) == 3000  # Kafka: throttle adjusted with time
    assert m.buckets[BucketKey("alice", "")].rate.total(T0) == 180  # the refused 90 was not recorded


def test_permissive_vector_throttles_0_8000_17000() -> None:
    m = manager()
    throttles = [m.charge_topics("alice", "c", [90], False, T0).throttle_ms for _ in range(3)]
    assert throttles == [0, 8000, 17000]
    assert m.debt_throttle_ms("alice", "c", T0 + 5000) == 12000


def test_throttle_time_is_java_math_round() -> None:
    """ControllerMutationQuotaManagerTest.testThrottleTime, plus half-up rounding."""
    throttles = [mutation_throttle_ms(t, 10) for t in (0.0, -5.0, -10.0, -0.0005, -0.00049)]
    assert throttles == [0, 500, 1000, 0, 0]
    assert mutation_throttle_ms(-0.0005, 1.0) == 1  # 0.5 ms rounds up, as Math.round


def test_manager_vector_spike_accepted_then_refused_for_one_second() -> None:
    """ControllerMutationQuotaManagerTest.testControllerMutationQuotaViolation (quota 10/s)."""
    m = manager()
    now = T0
    for _ in range(10):
        assert m.charge_topics("alice", "c", [10], True, now).throttle_ms == 0
        now += 1000
    assert m.charge_topics("alice", "c", [110], True, now).throttle_ms == 0  # 100 tokens: accepted
    refused = m.charge_topics("alice", "c", [110], True, now)
    assert refused.throttle_ms == 1000 and refused.accepted == (False,)
    assert m.charge_topics("alice", "c", [110], True, now + 1000).throttle_ms == 0  # back at zero


def test_default_burst_is_11_seconds_of_quota() -> None:
    m = ControllerMutationQuotaManager()
    m.set_quotas({QuotaEntity(None, "c"): 10.0})
    assert m.charge_topics("u", "c", [110], False, T0).throttle_ms == 0
    assert m.charge_topics("u", "c", [1], False, T0).throttle_ms == 100


def test_tokens_refill_at_the_rate_and_never_above_the_burst() -> None:
    bucket = MutationTokenBucket(10.0)
    assert bucket.level(10.0, T0) == 100
    bucket.record(150, 10.0, T0)
    assert bucket.level(10.0, T0 + 2000) == pytest.approx(-30)
    assert bucket.level(10.0, T0 + 60_000) == 100
    assert bucket.full_at_ms(10.0) == T0 + 15_000


def test_a_strict_request_refuses_topics_after_the_bucket_goes_negative() -> None:
    m = manager()
    verdict = m.charge_topics("alice", "c", [60, 60, 0, 5], True, T0)
    assert verdict.accepted == (True, True, True, False)  # a topic of cost 0 is never refused
    assert verdict.throttle_ms == 2000


def test_no_quota_means_nothing_charged() -> None:
    m = manager()
    assert m.charge_topics("bob", "c", [10**6], True, T0).accepted == (True,)
    assert m.buckets == {}


def test_a_bucket_in_debt_outlives_its_rate_history() -> None:
    """Dropped after 11 s like the others, a bucket 100 s in debt would hand out a fresh burst."""
    m = manager()
    m.charge_topics("alice", "c", [1100], True, T0)  # tokens -1000: 100 s to zero, 110 s to full
    assert m.expire_idle(T0 + 60_000) == 0
    assert m.debt_throttle_ms("alice", "c", T0 + 60_000) == 40_000
    assert m.expire_idle(T0 + 109_999) == 0  # looked at again one history (10 s) later
    assert m.expire_idle(T0 + 120_000) == 1
    assert m.charge_topics("alice", "c", [100], True, T0 + 120_000).throttle_ms == 0


def test_settling_gives_back_what_the_broker_refused() -> None:
    m = manager()
    m.charge_topics("alice", "c", [100], True, T0)
    m.settle("alice", "c", -100, T0)
    assert m.charge_topics("alice", "c", [100], True, T0).throttle_ms == 0  # the full burst again
    assert m.charge_topics("alice", "c", [1], False, T0).throttle_ms == 100


def test_the_engine_keeps_controller_mutations_out_of_the_fleet_reports() -> None:
    engine = QuotaEngine(EngineConfig(controller_window=KAFKA_TEST_WINDOW))
    engine.set_quotas({QuotaEntity("alice", None): {M: 10.0}})
    engine.charge_mutations("alice", "c", [50], False, T0)
    assert engine.controller_mutation.buckets[BucketKey("alice", "")].rate.total(T0) == 50
    assert engine.local_usage(T0) == []
    assert all(keys == [] for _quota, keys in engine.full_listing())
    assert M not in engine.managers and engine.all_managers()[M] is engine.controller_mutation


# == through a connection ==========================================================================


def engine(rate: float = 10.0, window: WindowConfig = KAFKA_TEST_WINDOW) -> QuotaEngine:
    e = QuotaEngine(EngineConfig(controller_window=window))
    e.set_quotas({QuotaEntity(None, CLIENT): {M: rate}})
    return e


def connection(e: QuotaEngine) -> ProxyConnection:
    return ProxyConnection(advertise, name="mutation-test", policy=e)


def create_topics(cid: int, *topics: tuple[str, int], version: int = 7, validate_only: bool = False,
                  assignments: dict[str, int] | None = None) -> bytes:
    cls = CreateTopicsRequest
    made = []
    for name, partitions in topics:
        given = [cls.CreatableTopic.CreatableReplicaAssignment(partition_index=i, broker_ids=[1])
                 for i in range((assignments or {}).get(name, 0))]
        made.append(cls.CreatableTopic(name=name, num_partitions=partitions,
                                       replication_factor=-1 if given else 1, assignments=given, configs=[]))
    return request(cls, version, cid, CLIENT, topics=made, timeout_ms=30_000, validate_only=validate_only)


def created(cid: int, *results: tuple[str, int, int], version: int = 7, throttle: int = 0) -> bytes:
    """A CreateTopics answer: (name, error code, partitions)."""
    cls = CreateTopicsResponse
    return response(cls, version, cid, throttle_time_ms=throttle, topics=[
        cls.CreatableTopicResult(name=n, topic_id=uuid.UUID(int=7), error_code=e, error_message=None,
                                 topic_config_error_code=0, num_partitions=p, replication_factor=1,
                                 configs=[]) for n, e, p in results])


def decode(cls: Any, frame_bytes: bytes, version: int, *, is_request: bool = False) -> Any:
    if is_request:
        offset = parse_request_header(frame_bytes).body_offset
    else:
        offset = response_body_offset(frame_bytes, KNOWN_APIS[cls.API_KEY].response_header_version(version))
    return cls.decode(memoryview(frame_bytes)[offset:], version=version)


def names_and_errors(message: Any, field: str) -> list[tuple[str | None, int]]:
    return [(r.name, r.error_code) for r in getattr(message, field)]


def test_strict_split_forwards_the_accepted_topics_and_merges_in_the_clients_order() -> None:
    conn = connection(engine())
    actions = conn.receive_from_client(framed(create_topics(7, ("a", 90), ("b", 90), ("c", 90))), T0)
    (forwarded,) = broker_frames(actions)
    assert [t.name for t in decode(CreateTopicsRequest, forwarded, 7, is_request=True).topics] == ["a", "b"]
    assert forwarded[:parse_request_header(forwarded).body_offset] == \
        create_topics(7, ("x", 1))[:parse_request_header(forwarded).body_offset]  # the client's header
    assert of_type(actions, Mute) == [Mute(8000)]
    assert of_type(actions, Throttled) == [Throttled(CREATE_TOPICS, 8000)]
    assert client_frames(actions) == []
    answer = conn.receive_from_broker(framed(created(7, ("a", 0, 90), ("b", 0, 90))), T0 + 300)
    (merged,) = client_frames(answer)
    message = decode(CreateTopicsResponse, merged, 7)
    assert names_and_errors(message, "topics") == [("a", 0), ("b", 0), ("c", THROTTLING_QUOTA_EXCEEDED)]
    assert message.throttle_time_ms == 7700  # Kafka deducts the time since the charge
    assert message.topics[0].num_partitions == 90 and message.topics[0].topic_id == uuid.UUID(int=7)
    assert of_type(answer, Mute) == []  # the mute from the charge still runs


def test_strict_refusal_in_the_middle_keeps_the_order() -> None:
    conn = connection(engine())
    actions = conn.receive_from_client(framed(create_topics(1, ("a", 120), ("b", 1), ("c", 0))), T0)
    (forwarded,) = broker_frames(actions)
    assert [t.name for t in decode(CreateTopicsRequest, forwarded, 7, is_request=True).topics] == ["a", "c"]
    answer = conn.receive_from_broker(framed(created(1, ("a", 0, 120), ("c", 37, -1))), T0)
    message = decode(CreateTopicsResponse, client_frames(answer)[0], 7)
    assert names_and_errors(message, "topics") == [("a", 0), ("b", THROTTLING_QUOTA_EXCEEDED), ("c", 37)]
    assert message.throttle_time_ms == 2000


def test_when_every_topic_is_refused_the_proxy_answers_alone() -> None:
    e = engine()
    conn = connection(e)
    conn.receive_from_client(framed(create_topics(1, ("a", 150))), T0)
    conn.receive_from_broker(framed(created(1, ("a", 0, 150))), T0 + 10)
    actions = conn.receive_from_client(framed(create_topics(2, ("b", 1), ("c", 2))), T0 + 20)
    assert broker_frames(actions) == []
    (answer,) = client_frames(actions)
    message = decode(CreateTopicsResponse, answer, 7)
    assert int.from_bytes(answer[:4], "big") == 2
    assert names_and_errors(message, "topics") == [("b", 89), ("c", 89)]
    assert message.throttle_time_ms == 4980 and of_type(actions, Mute) == [Mute(4980)]
    assert message.topics[0].error_message == "The throttling quota has been exceeded."


def test_permissive_versions_go_through_and_are_throttled_after() -> None:
    """One bucket over three connections (one per broker), so no mute holds the next request back."""
    e = engine()
    throttles = []
    for cid in (1, 2, 3):
        conn = connection(e)
        actions = conn.receive_from_client(framed(create_topics(cid, (f"t{cid}", 90), version=5)), T0)
        assert len(broker_frames(actions)) == 1
        answer = conn.receive_from_broker(framed(created(cid, (f"t{cid}", 0, 90), version=5)), T0 + 1)
        throttles.append(decode(CreateTopicsResponse, client_frames(answer)[0], 5).throttle_time_ms)
        assert of_type(actions, Mute) == ([Mute(throttles[-1] + 1)] if throttles[-1] else [])
    assert throttles == [0, 7999, 16999]  # Kafka's 0, 8000, 17000, less the 1 ms since each charge


def test_validate_only_is_charged_as_kafka_kraft_charges_it() -> None:
    conn = connection(engine())
    conn.receive_from_client(framed(create_topics(1, ("a", 100), version=7, validate_only=True)), T0)
    conn.receive_from_broker(framed(created(1, ("a", 0, 100))), T0)
    actions = conn.receive_from_client(framed(create_topics(2, ("a", 100), ("b", 1))), T0)
    (forwarded,) = broker_frames(actions)
    assert [t.name for t in decode(CreateTopicsRequest, forwarded, 7, is_request=True).topics] == ["a"]


def test_topics_the_broker_refuses_are_given_back() -> None:
    e = engine()
    conn = connection(e)
    conn.receive_from_client(framed(create_topics(1, ("exists", 100))), T0)
    conn.receive_from_broker(framed(created(1, ("exists", 36, -1))), T0)  # TOPIC_ALREADY_EXISTS
    assert e.controller_mutation.debt_throttle_ms(ANONYMOUS, CLIENT, T0) == 0
    actions = conn.receive_from_client(framed(create_topics(2, ("new", 100), ("next", 1))), T0)
    assert of_type(actions, Mute) == []  # the full bucket again: both accepted
    (forwarded,) = broker_frames(actions)
    assert len(decode(CreateTopicsRequest, forwarded, 7, is_request=True).topics) == 2


def test_default_partition_count_is_charged_as_the_answer_says_and_learned() -> None:
    e = engine()
    conn = connection(e)
    conn.receive_from_client(framed(create_topics(1, ("d", -1))), T0)
    bucket = e.controller_mutation.buckets[BucketKey("", CLIENT)]
    assert bucket.rate.total(T0) == 1  # Kafka's num.partitions default until an answer tells
    conn.receive_from_broker(framed(created(1, ("d", 0, 30))), T0)
    assert bucket.rate.total(T0) == 30 and e.default_partitions == 30
    conn.receive_from_client(framed(create_topics(2, ("e", -1), ("f", -1), ("g", -1))), T0)
    assert bucket.rate.total(T0) == 120


def test_manual_assignments_are_counted() -> None:
    e = engine()
    conn = connection(e)
    conn.receive_from_client(framed(create_topics(1, ("m", -1), assignments={"m": 4})), T0)
    assert e.controller_mutation.buckets[BucketKey("", CLIENT)].rate.total(T0) == 4


def test_duplicates_and_invalid_counts_cost_nothing() -> None:
    e = engine()
    conn = connection(e)
    invalid = create_topics(1, ("x", 500), ("x", 500), ("y", 0), ("z", -7))
    actions = conn.receive_from_client(framed(invalid), T0)
    assert len(broker_frames(actions)) == 1 and of_type(actions, Mute) == []
    assert KEY not in e.controller_mutation.buckets and not e.controller_mutation.buckets


def test_without_a_mutation_quota_the_request_is_not_even_decoded() -> None:
    e = QuotaEngine()
    e.set_quotas({QuotaEntity(None, CLIENT): {QuotaType.PRODUCE: 10.0}})
    conn = connection(e)
    garbage = create_topics(1, ("a", 1))[:-3]
    actions = conn.receive_from_client(framed(garbage), T0)
    assert broker_frames(actions) == [garbage]


def test_a_malformed_request_under_quota_closes_the_connection() -> None:
    conn = connection(engine())
    actions = conn.receive_from_client(framed(create_topics(1, ("a", 1))[:-3]), T0)
    assert close_reasons(actions) and "CreateTopicsRequest" in close_reasons(actions)[0]


# -- DeleteTopics and CreatePartitions: the partition-count lookup ------------------------------------


def metadata_answer(version: int, topics: list[tuple[str, int, uuid.UUID | None, int]]) -> bytes:
    """The lookup's answer: (name, partitions, topic id, error code)."""
    cls = MetadataResponse
    made = []
    for name, partitions, topic_id, error in topics:
        fields: dict[str, Any] = dict(
            error_code=error, name=name, is_internal=False,
            partitions=[cls.MetadataResponseTopic.MetadataResponsePartition(
                error_code=0, partition_index=i, leader_id=1, leader_epoch=0, replica_nodes=[1],
                isr_nodes=[1], offline_replicas=[]) for i in range(partitions)])
        if version >= 10:
            fields["topic_id"] = topic_id or uuid.UUID(int=0)
        made.append(cls.MetadataResponseTopic(**fields))
    return response(cls, version, LOOKUP_CORRELATION_ID, throttle_time_ms=0, brokers=[], cluster_id="c",
                    controller_id=1, topics=made)


def delete_topics(cid: int, *names: str, version: int = 6, ids: tuple[uuid.UUID, ...] = ()) -> bytes:
    cls = DeleteTopicsRequest
    if version >= 6:
        states = [cls.DeleteTopicState(name=n, topic_id=uuid.UUID(int=0)) for n in names]
        states += [cls.DeleteTopicState(name=None, topic_id=i) for i in ids]
        return request(cls, version, cid, CLIENT, topics=states, timeout_ms=30_000)
    return request(cls, version, cid, CLIENT, topic_names=list(names), timeout_ms=30_000)


def topic_id_of(name: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_DNS, name)


def deleted(cid: int, *results: tuple[str | None, int], version: int = 6,
            ids: dict[str, uuid.UUID] | None = None) -> bytes:
    """A DeleteTopics answer; as Kafka's, v6 names every topic's id, whether asked by name or id."""
    cls = DeleteTopicsResponse
    return response(cls, version, cid, throttle_time_ms=0, responses=[
        cls.DeletableTopicResult(name=n, topic_id=(ids or {}).get(n or "", topic_id_of(n or "")),
                                 error_code=e, error_message=None) for n, e in results])


def test_delete_topics_waits_for_the_lookup_and_is_charged_by_partitions() -> None:
    e = engine()
    conn = connection(e)
    after = request(MetadataRequest, 9, 43, CLIENT, topics=None, allow_auto_topic_creation=False,
                    include_topic_authorized_operations=False)
    actions = conn.receive_from_client(framed(delete_topics(42, "a", "b", "ghost"), after), T0)
    (lookup,) = broker_frames(actions)
    header = parse_request_header(lookup)
    assert (header.api_key, header.api_version, header.correlation_id, header.client_id) == \
        (ApiKey.METADATA, 9, LOOKUP_CORRELATION_ID, CLIENT)
    asked = decode(MetadataRequest, lookup, 9, is_request=True)
    assert sorted(t.name for t in asked.topics) == ["a", "b", "ghost"]
    assert asked.allow_auto_topic_creation is False
    assert conn.waiting_requests and conn.receive_from_client(b"", T0) == []
    answer = conn.receive_from_broker(framed(metadata_answer(9, [
        ("a", 60, None, 0), ("b", 60, None, 0), ("ghost", 0, None, 3)])), T0 + 5)
    assert client_frames(answer) == []  # the lookup is the proxy's own
    forwarded = broker_frames(answer)
    assert [parse_request_header(f).correlation_id for f in forwarded] == [42, 43]  # order kept
    names = [t.name for t in decode(DeleteTopicsRequest, forwarded[0], 6, is_request=True).topics]
    assert names == ["a", "b", "ghost"]  # a (60) accepted, b (60) accepted into debt, ghost costs 0
    assert e.controller_mutation.buckets[BucketKey("", CLIENT)].rate.total(T0 + 5) == 120
    result = conn.receive_from_broker(framed(deleted(42, ("b", 0), ("ghost", 3), ("a", 0))), T0 + 50)
    assert names_and_errors(decode(DeleteTopicsResponse, client_frames(result)[0], 6), "responses") == \
        [("b", 0), ("ghost", 3), ("a", 0)]  # not split: the broker's own answer, untouched


def test_delete_topics_strict_split_merges_in_the_clients_order() -> None:
    conn = connection(engine())
    conn.receive_from_client(framed(delete_topics(1, "a", "b", "c")), T0)
    actions = conn.receive_from_broker(framed(metadata_answer(9, [
        ("a", 50, None, 0), ("b", 60, None, 0), ("c", 5, None, 0)])), T0)
    (forwarded,) = broker_frames(actions)
    assert [t.name for t in decode(DeleteTopicsRequest, forwarded, 6, is_request=True).topics] == ["a", "b"]
    assert of_type(actions, Mute) == [Mute(1000)]
    result = conn.receive_from_broker(framed(deleted(1, ("b", 0), ("a", 0))), T0 + 10)
    message = decode(DeleteTopicsResponse, client_frames(result)[0], 6)
    assert names_and_errors(message, "responses") == [("a", 0), ("b", 0), ("c", THROTTLING_QUOTA_EXCEEDED)]
    assert message.throttle_time_ms == 990


def test_delete_topics_by_id_looks_up_every_topic() -> None:
    e = engine()
    conn = connection(e)
    ids = uuid.UUID(int=11), uuid.UUID(int=12)
    actions = conn.receive_from_client(framed(delete_topics(1, ids=ids)), T0)
    (lookup,) = broker_frames(actions)
    assert decode(MetadataRequest, lookup, 10, is_request=True).topics is None
    actions = conn.receive_from_broker(framed(metadata_answer(10, [
        ("x", 120, ids[0], 0), ("y", 3, ids[1], 0), ("other", 9, uuid.UUID(int=13), 0)])), T0)
    (forwarded,) = broker_frames(actions)
    assert [t.topic_id for t in decode(DeleteTopicsRequest, forwarded, 6, is_request=True).topics] == [ids[0]]
    result = conn.receive_from_broker(framed(deleted(1, ("x", 0), ids={"x": ids[0]})), T0)
    message = decode(DeleteTopicsResponse, client_frames(result)[0], 6)
    assert [(r.name, r.topic_id, r.error_code) for r in message.responses] == [
        ("x", ids[0], 0), ("y", ids[1], THROTTLING_QUOTA_EXCEEDED)]


def create_partitions(cid: int, *topics: tuple[str, int], version: int = 3,
                      validate_only: bool = False) -> bytes:
    cls = CreatePartitionsRequest
    return request(cls, version, cid, CLIENT, timeout_ms=30_000, validate_only=validate_only,
                   topics=[cls.CreatePartitionsTopic(name=n, count=c, assignments=None) for n, c in topics])


def test_create_partitions_charges_the_partitions_added() -> None:
    e = engine()
    conn = connection(e)
    conn.receive_from_client(framed(create_partitions(1, ("a", 50), ("b", 2), version=2)), T0)
    lookup = metadata_answer(9, [("a", 20, None, 0), ("b", 4, None, 0)])
    actions = conn.receive_from_broker(framed(lookup), T0)
    assert len(broker_frames(actions)) == 1
    assert e.controller_mutation.buckets[BucketKey("", CLIENT)].rate.total(T0) == 30  # b: no increase
    cls = CreatePartitionsResponse
    answer = response(cls, 2, 1, throttle_time_ms=0, results=[
        cls.CreatePartitionsTopicResult(name="a", error_code=0, error_message=None),
        cls.CreatePartitionsTopicResult(name="b", error_code=37, error_message="not an increase")])
    result = conn.receive_from_broker(framed(answer), T0)
    assert names_and_errors(decode(cls, client_frames(result)[0], 2), "results") == [("a", 0), ("b", 37)]


def test_a_garbage_lookup_answer_closes_the_connection() -> None:
    conn = connection(engine())
    conn.receive_from_client(framed(delete_topics(1, "a")), T0)
    bad = LOOKUP_CORRELATION_ID.to_bytes(4, "big", signed=True) + b"\x00\xff\xff\xff"
    assert close_reasons(conn.receive_from_broker(framed(bad), T0))


def test_decoding_refuses_neither_or_both_name_and_id() -> None:
    frame_bytes = request(DeleteTopicsRequest, 6, 1, CLIENT, timeout_ms=1, topics=[
        DeleteTopicsRequest.DeleteTopicState(name=None, topic_id=uuid.UUID(int=0)),
        DeleteTopicsRequest.DeleteTopicState(name="n", topic_id=uuid.UUID(int=5))])
    decoded = decode_mutation(frame_bytes, parse_request_header(frame_bytes))
    assert [t.invalid for t in decoded.topics] == [True, True] and not decoded.needs_lookup


def test_an_overflowed_client_id_is_checked_against_the_overflow_bucket() -> None:
    m = ControllerMutationQuotaManager(KAFKA_TEST_WINDOW, max_buckets=1)
    m.set_quotas({QuotaEntity(None, DEFAULT): 10.0})
    m.charge_topics("u", "first", [1], True, T0)
    assert m.charge_topics("u", "x", [150], True, T0).accepted == (True,)  # the overflow bucket: -50
    assert m.charge_topics("u", "y", [1], True, T0) == MutationVerdict((False,), 5000)
    assert m.charge_topics("u", "first", [1], True, T0).accepted == (True,)  # its own bucket


def test_metrics_export_the_mutation_rate_tokens_and_throttles() -> None:
    e = engine()
    e.charge_mutations(ANONYMOUS, CLIENT, [150], False, T0)  # 50 in debt: a 5 s throttle
    metrics = ProxyMetrics(e)
    asyncio.run(metrics.quotas.refresh())
    sample = metrics.registry.get_sample_value
    labels = {"quota": "controller_mutation_rate", "user": "", "client_id": CLIENT}
    assert sample("kthrottle_controller_mutation_rate_per_second", labels) is not None
    assert sample("kthrottle_throttle_time_seconds_total", {**labels, "mode": "enforced"}) == 5.0
    assert sample("kthrottle_throttles_total", {**labels, "mode": "enforced"}) == 1.0
    assert sample("kthrottle_throttles_total", {**labels, "mode": "shadow"}) is None
    assert sample("kthrottle_quota_limit", labels) == 10.0
    tokens = sample("kthrottle_controller_mutation_tokens", {"user": "", "client_id": CLIENT})
    assert tokens is not None and -50.0 <= tokens <= 100.0


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(min_value=-3, max_value=80), min_size=1, max_size=12),
       spent=st.integers(min_value=0, max_value=200), strict=st.booleans())
def test_split_and_merge_keep_the_clients_order(counts: list[int], spent: int, strict: bool) -> None:
    """Whatever the topics and the bucket: the broker gets exactly the accepted topics, in order;
    once some are refused, the client gets one result per topic, in its order, refused ones
    THROTTLING_QUOTA_EXCEEDED."""
    e = engine()
    if spent:
        e.charge_mutations(ANONYMOUS, CLIENT, [spent], False, T0)
    conn = connection(e)
    names = [f"t{i}" for i in range(len(counts))]
    version = 7 if strict else 5
    actions = conn.receive_from_client(framed(create_topics(1, *zip(names, counts, strict=True),
                                                            version=version)), T0)
    forwarded = broker_frames(actions)
    sent = [t.name for t in decode(CreateTopicsRequest, forwarded[0], version, is_request=True).topics] \
        if forwarded else []
    assert sent == [n for n in names if n in sent]  # a subsequence: the client's order
    if not strict:
        assert sent == names
    answer = client_frames(actions)
    if forwarded:
        answer = client_frames(conn.receive_from_broker(
            framed(created(1, *((n, 0, 1) for n in reversed(sent)), version=version)), T0))
    (merged,) = answer
    results = decode(CreateTopicsResponse, merged, version).topics
    if sent == names:  # nothing refused: the broker's answer goes on untouched
        assert [r.name for r in results] == list(reversed(names))
        return
    assert [r.name for r in results] == names  # merged (even from a broker answering out of order)
    assert [r.error_code == THROTTLING_QUOTA_EXCEEDED for r in results] == [n not in sent for n in names]


def test_delete_topics_v5_names_are_split_and_merged() -> None:
    """DeleteTopics v5 is strict too, and names topics in a plain string array."""
    conn = connection(engine())
    conn.receive_from_client(framed(delete_topics(1, "a", "b", version=5)), T0)
    lookup = metadata_answer(9, [("a", 101, None, 0), ("b", 1, None, 0)])
    (forwarded,) = broker_frames(conn.receive_from_broker(framed(lookup), T0))
    assert decode(DeleteTopicsRequest, forwarded, 5, is_request=True).topic_names == ["a"]
    result = conn.receive_from_broker(framed(deleted(1, ("a", 0), version=5)), T0)
    message = decode(DeleteTopicsResponse, client_frames(result)[0], 5)
    assert names_and_errors(message, "responses") == [("a", 0), ("b", THROTTLING_QUOTA_EXCEEDED)]
    assert message.throttle_time_ms == 100


def test_create_partitions_v3_is_strict_and_validate_only_is_charged() -> None:
    conn = connection(engine())
    conn.receive_from_client(framed(create_partitions(1, ("a", 111), ("b", 3), validate_only=True)), T0)
    actions = conn.receive_from_broker(framed(metadata_answer(9, [("a", 1, None, 0), ("b", 1, None, 0)])), T0)
    (forwarded,) = broker_frames(actions)
    assert [t.name for t in decode(CreatePartitionsRequest, forwarded, 3, is_request=True).topics] == ["a"]
    cls = CreatePartitionsResponse
    answer = response(cls, 3, 1, throttle_time_ms=0, results=[
        cls.CreatePartitionsTopicResult(name="a", error_code=0, error_message=None)])
    result = conn.receive_from_broker(framed(answer), T0)
    message = decode(cls, client_frames(result)[0], 3)
    assert names_and_errors(message, "results") == [("a", 0), ("b", THROTTLING_QUOTA_EXCEEDED)]
    assert message.throttle_time_ms == 1000  # 110 added of 100 tokens: 10 in debt at 10/s


def test_pipelined_mutations_each_wait_for_their_own_lookup() -> None:
    e = engine(rate=1000.0)
    conn = connection(e)
    actions = conn.receive_from_client(framed(delete_topics(1, "a"), delete_topics(2, "b")), T0)
    assert [parse_request_header(f).correlation_id for f in broker_frames(actions)] == [LOOKUP_CORRELATION_ID]
    actions = conn.receive_from_broker(framed(metadata_answer(9, [("a", 3, None, 0)])), T0)
    sent = broker_frames(actions)
    assert [parse_request_header(f).correlation_id for f in sent] == [1, LOOKUP_CORRELATION_ID]
    assert decode(MetadataRequest, sent[1], 9, is_request=True).topics[0].name == "b"
    # the broker answers in order: request 1, then the second lookup
    in_order = framed(deleted(1, ("a", 0)), metadata_answer(9, [("b", 4, None, 0)]))
    actions = conn.receive_from_broker(in_order, T0)
    assert [int.from_bytes(f[:4], "big") for f in client_frames(actions)] == [1]
    assert [parse_request_header(f).correlation_id for f in broker_frames(actions)] == [2]
    assert e.controller_mutation.buckets[BucketKey("", CLIENT)].rate.total(T0) == 7
    done = conn.receive_from_broker(framed(deleted(2, ("b", 0))), T0)
    assert [int.from_bytes(f[:4], "big") for f in client_frames(done)] == [2]


def test_the_controller_window_is_a_proxy_setting(tmp_path: Any) -> None:
    """Kafka's controller.quota.window.num / .size.seconds: [proxy] settings, checked like the others."""
    from config.settings import SettingsError, load_settings

    path = tmp_path / "kthrottle.toml"
    path.write_text("[proxy]\ncontroller_quota_window_num = 2\ncontroller_quota_window_size_seconds = 5\n")
    settings = load_settings(path)
    assert (settings.controller_quota_window_num, settings.controller_quota_window_size_seconds) == (2, 5)
    path.write_text("[proxy]\ncontroller_quota_window_num = 0\n")
    with pytest.raises(SettingsError, match="controller_quota_window_num = 0 must be a positive integer"):
        load_settings(path)
