"""Emptying refused partitions in Fetch responses (v4 to v18), and topic ids learned from Metadata."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.metadata import MetadataResponse

from protocol.apis import KNOWN_APIS, ApiKey
from protocol.errors import MalformedBody
from protocol.fetch_partitions import (
    FETCH_FIRST_READABLE,
    FETCH_LAST_READABLE,
    ThrottledFetch,
    empty_refused_partitions,
    throttle_fetch,
    throttle_fetch_response,
)
from protocol.headers import response_body_offset
from protocol.topic_names import TopicNames, learn_metadata_topics
from quotas.partition_throttle import PartitionThrottle, PartitionThrottles

from .wire import response

FTR = FetchResponse.FetchableTopicResponse
PD = FTR.PartitionData
NE = FetchResponse.NodeEndpoint
MB = MetadataResponse.MetadataResponseBroker
MT = MetadataResponse.MetadataResponseTopic
MP = MT.MetadataResponsePartition

VERSIONS = range(FETCH_FIRST_READABLE, FETCH_LAST_READABLE + 1)
ORDERS_ID = uuid.UUID(int=7)
LOGS_ID = uuid.UUID(int=8)


def records(size: int, fill: int = 1) -> bytes:
    """Bytes that stand for record batches (opaque to the reader; any length)."""
    return bytes([fill]) * size


def partition(index: int, data: bytes | None, version: int, *, tags: bool = False,
              aborted: int = 1, error: int | None = None) -> Any:
    fields: dict[str, Any] = dict(
        partition_index=index, error_code=index % 2 if error is None else error, high_watermark=1000 + index,
        last_stable_offset=900 + index, log_start_offset=10 + index,
        aborted_transactions=[PD.AbortedTransaction(producer_id=77 + i, first_offset=905 + i)
                              for i in range(aborted)] if aborted >= 0 else None,
        preferred_read_replica=index % 3 - 1, records=data)
    if tags and version >= 12:
        fields["diverging_epoch"] = PD.EpochEndOffset(epoch=4, end_offset=99)
        fields["current_leader"] = PD.LeaderIdAndEpoch(leader_id=2, leader_epoch=5)
        fields["snapshot_id"] = PD.SnapshotId(end_offset=50, epoch=3)
    return PD(**fields)


def topic(name: str, topic_id: uuid.UUID, partitions: list[Any], version: int) -> Any:
    return FTR(topic_id=topic_id, partitions=partitions) if version >= 13 else FTR(topic=name,
                                                                                   partitions=partitions)


def fetch_frame(version: int, topics: list[Any], node_endpoints: list[Any] | None = None) -> bytes:
    fields: dict[str, Any] = dict(throttle_time_ms=0, error_code=0, session_id=4321, responses=topics)
    if node_endpoints is not None:
        fields["node_endpoints"] = node_endpoints
    return response(FetchResponse, version, 99, **fields)


def sample(version: int, *, tags: bool = False, endpoints: bool = False) -> bytes:
    return fetch_frame(version, [
        topic("orders", ORDERS_ID, [partition(0, records(100), version, tags=tags),
                                    partition(1, records(200, 2), version, tags=tags),
                                    partition(2, None, version), partition(3, b"", version)], version),
        topic("logs", LOGS_ID, [partition(0, records(300, 3), version, tags=tags, aborted=-1)], version),
    ], [NE(node_id=2, host="broker2.internal", port=9093, rack="r2")] if endpoints else None)


def decode(frame: bytes, version: int) -> Any:
    start = response_body_offset(frame, KNOWN_APIS[ApiKey.FETCH].response_header_version(version))
    return FetchResponse.decode(memoryview(frame)[start:], version=version)


def everything_but_records(message: Any) -> Any:
    """The decoded response as plain data with every partition's records left out."""
    data = message.to_dict()
    for entry in data["responses"]:
        for part in entry["partitions"]:
            part.pop("records")
    return data


def names() -> TopicNames:
    found = TopicNames()
    found.learn(ORDERS_ID.bytes, "orders")
    found.learn(LOGS_ID.bytes, "logs")
    return found


def refuse(*refused: tuple[str, int]) -> tuple[list[tuple[str, int, int]], Any]:
    asked: list[tuple[str, int, int]] = []

    def decide(topic_name: str, index: int, size: int) -> bool:
        asked.append((topic_name, index, size))
        return (topic_name, index) not in refused

    return asked, decide


# -- rewriting -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_refused_partitions_are_emptied_and_all_else_kept(version: int) -> None:
    frame = sample(version, tags=True, endpoints=version >= 16)
    asked, decide = refuse(("orders", 1), ("logs", 0))
    emptied = empty_refused_partitions(frame, version, decide, names().name)
    # Asked in response order, only for partitions with records, with their sizes.
    assert asked == [("orders", 0, 100), ("orders", 1, 200), ("logs", 0, 300)]
    before, after = decode(frame, version), decode(emptied, version)
    assert everything_but_records(after) == everything_but_records(before)
    got = [None if p.records is None else bytes(p.records) for t in after.responses for p in t.partitions]
    assert got == [records(100), b"", None, b"", b""]
    assert emptied[:4] == frame[:4]  # correlation id
    # Compact lengths of 200 and 300 take two bytes, an empty one one byte.
    assert len(emptied) == len(frame) - 500 - (2 if version >= 12 else 0)
    if version >= 16:
        assert [(e.node_id, e.host, e.port, e.rack) for e in after.node_endpoints] == [
            (2, "broker2.internal", 9093, "r2")]


@pytest.mark.parametrize("version", VERSIONS)
def test_nothing_refused_returns_the_same_bytes_object(version: int) -> None:
    frame = sample(version, endpoints=version >= 16)
    asked, decide = refuse()
    assert empty_refused_partitions(frame, version, decide, names().name) is frame
    assert len(asked) == 3


def test_node_endpoints_are_kept_byte_for_byte() -> None:
    with_endpoints = sample(16, endpoints=True)
    without = sample(16)
    tail = len(with_endpoints) - len(without) + 1  # the endpoints section replaces the empty one
    _, decide = refuse(("orders", 0), ("orders", 1), ("logs", 0))
    emptied = empty_refused_partitions(with_endpoints, 16, decide, names().name)
    assert emptied[-tail:] == with_endpoints[-tail:]
    assert emptied[-tail - 3:] != with_endpoints[-tail - 3:]  # the last partition's records did change


@pytest.mark.parametrize("version", [4, 11, 12])
def test_emptied_records_are_as_kafka_sends_an_empty_partition(version: int) -> None:
    refused = fetch_frame(version, [topic("t", ORDERS_ID, [partition(0, records(50), version)], version)])
    empty = fetch_frame(version, [topic("t", ORDERS_ID, [partition(0, b"", version)], version)])
    assert empty_refused_partitions(refused, version, lambda *_: False, names().name) == empty


def test_topic_ids_unknown_are_let_through_and_counted() -> None:
    frame = sample(13)
    known = TopicNames()
    known.learn(LOGS_ID.bytes, "logs")
    asked, decide = refuse(("logs", 0))
    emptied = empty_refused_partitions(frame, 13, decide, known.name)
    assert asked == [("logs", 0, 300)]
    assert known.unknown(["orders", "logs"]) == ["orders"]
    assert len(emptied) == len(frame) - 300 - 1  # a two-byte compact length became one byte


def test_topic_ids_need_a_lookup() -> None:
    with pytest.raises(ValueError, match="topic_name lookup"):
        empty_refused_partitions(sample(13), 13, lambda *_: True)
    with pytest.raises(ValueError, match="Fetch v3 is outside"):
        empty_refused_partitions(sample(4), 3, lambda *_: True)


@pytest.mark.parametrize("version", [11, 13])
def test_throttle_fetch_response_with_the_throttles(version: int) -> None:
    """Through `PartitionThrottles`: the first partition of `orders` fills the rate, the second is
    emptied in the same response; `logs` and other clients are untouched."""
    live = PartitionThrottles()
    live.set_throttles([PartitionThrottle("backfill", "orders", None, 50.0, client_ids=frozenset({"etl"}))])
    frame = sample(version)
    emptied = throttle_fetch_response(live, names(), "alice", "etl", frame, version, 0)
    got = [None if p.records is None else bytes(p.records)
           for t in decode(emptied, version).responses for p in t.partitions]
    assert got == [records(100), b"", None, b"", records(300, 3)]
    (stats,) = live.stats(0)
    assert (stats.let_through_bytes, stats.withheld_bytes) == (100, 200)
    assert throttle_fetch_response(live, names(), "alice", "live", frame, version, 0) is frame
    # 100 bytes over max(elapsed, 1 s) = 100 B/s > 50: still over a second later, not after two.
    assert throttle_fetch_response(live, names(), "alice", "etl", frame, version, 1000) != frame
    again = throttle_fetch_response(live, names(), "alice", "etl", frame, version, 2000)
    assert len(again) == len(frame) - 200 - (1 if version >= 12 else 0)


def quiet(version: int, *, error: int = 0, tags: bool = False) -> bytes:
    """Like `sample`, with no partition error (unless `error`) and no tagged fields (unless `tags`)."""
    return fetch_frame(version, [
        topic("orders", ORDERS_ID, [partition(0, records(100), version, error=0),
                                    partition(1, records(200, 2), version, error=0),
                                    partition(2, None, version, error=error, tags=tags)], version),
        topic("logs", LOGS_ID, [partition(0, records(300, 3), version, aborted=-1, error=0)], version),
    ])


def test_throttle_fetch_holds_only_responses_left_without_records() -> None:
    live = PartitionThrottles()
    live.set_throttles([PartitionThrottle("orders", "orders", None, 50.0),
                        PartitionThrottle("logs", "logs", None, 100.0)])
    frame = quiet(12)
    first = throttle_fetch(live, names(), "u", "c", frame, 12, 0)
    assert first.hold_ms == 0  # orders 1 emptied, but orders 0 and logs 0 went through
    assert len(first.frame) == len(frame) - 200 - 1
    second = throttle_fetch(live, names(), "u", "c", frame, 12, 500)
    # Everything emptied: held until the first throttle is under its rate again (orders: 100 B at
    # 50 B/s from 0 s, at 2 s; logs: 300 B at 100 B/s, at 3 s).
    assert second.hold_ms == 1500
    assert len(second.frame) == len(frame) - 600 - 2
    # An error or a partition's tagged field (a new leader...) is news: not held.
    assert throttle_fetch(live, names(), "u", "c", quiet(12, error=6), 12, 500).hold_ms == 0
    assert throttle_fetch(live, names(), "u", "c", quiet(12, tags=True), 12, 500).hold_ms == 0
    assert throttle_fetch(live, names(), "u", "c", quiet(11), 11, 500).hold_ms == 1500
    third = throttle_fetch(live, names(), "u", "c", frame, 12, 2000)
    assert third.hold_ms == 0 and len(third.frame) == len(frame) - 500 - 2  # orders 0 again
    live.set_throttles([PartitionThrottle("orders", "orders", None, 50.0, client_ids=frozenset({"c"}))])
    assert throttle_fetch(live, names(), "u", "other", frame, 12, 2000) == ThrottledFetch(frame)


# -- hostile input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [4, 7, 11, 12, 13, 16])
def test_every_truncation_is_malformed(version: int) -> None:
    frame = sample(version, tags=True, endpoints=version >= 16)
    for end in range(len(frame)):
        with pytest.raises(MalformedBody, match=f"Fetch v{version} response of {end} bytes does not parse"):
            empty_refused_partitions(frame[:end], version, lambda *_: False, names().name)


@pytest.mark.parametrize("version", [4, 12])
def test_trailing_bytes_are_malformed(version: int) -> None:
    frame = sample(version)
    with pytest.raises(MalformedBody, match=r"the end of the response at offset \d+ is followed by 1 more"):
        empty_refused_partitions(frame + b"\x00", version, lambda *_: True, names().name)


def test_huge_counts_and_negative_lengths_are_malformed() -> None:
    header = (99).to_bytes(4, "big") + (0).to_bytes(4, "big")  # v4: correlation id, throttle time
    with pytest.raises(MalformedBody, match="topics count at offset 12 2147483647 is more than the bytes"):
        empty_refused_partitions(header + (2**31 - 1).to_bytes(4, "big"), 4, lambda *_: True)
    one = fetch_frame(4, [FTR(topic="t", partitions=[partition(0, b"", 4, aborted=0)])])
    bad = one[:-4] + (-2).to_bytes(4, "big", signed=True)
    with pytest.raises(MalformedBody, match=r"records length at offset \d+ is -2"):
        empty_refused_partitions(bad, 4, lambda *_: True)
    aborted_at = len(one) - 8  # aborted transactions count, then records length
    bad = one[:aborted_at] + (-3).to_bytes(4, "big", signed=True) + one[aborted_at + 4:]
    with pytest.raises(MalformedBody, match=r"aborted transactions count at offset \d+ is -3"):
        empty_refused_partitions(bad, 4, lambda *_: True)


# -- property: any response, any decisions ------------------------------------------------------------

partition_data = st.tuples(
    st.integers(0, 2**31 - 1),  # index
    st.none() | st.binary(max_size=64),  # records
    st.integers(-1, 3),  # aborted transactions (-1: null)
    st.booleans(),  # tagged fields
)
topics_data = st.lists(st.tuples(st.text("abcxyz._-", min_size=1, max_size=12), st.uuids(),
                                 st.lists(partition_data, max_size=5)), max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version=st.sampled_from(VERSIONS), topics=topics_data, refuse_seed=st.integers(0, 2**16),
       endpoints=st.booleans())
def test_property_only_refused_records_change(version: int, topics: list[Any], refuse_seed: int,
                                              endpoints: bool) -> None:
    known = TopicNames()
    built = []
    for name, topic_id, parts in topics:
        known.learn(topic_id.bytes, name)
        built.append(topic(name, topic_id, [partition(i, data, version, tags=tags, aborted=aborted)
                                            for i, data, aborted, tags in parts], version))
    frame = fetch_frame(version, built, [NE(node_id=1, host="h", port=1, rack=None)]
                        if endpoints and version >= 16 else None)
    asked: list[tuple[str, int, int]] = []

    def decide(topic_name: str, index: int, size: int) -> bool:
        asked.append((topic_name, index, size))
        return bool((refuse_seed >> (len(asked) % 16)) & 1)

    emptied = empty_refused_partitions(frame, version, decide, known.name)
    before, after = decode(frame, version), decode(emptied, version)
    assert everything_but_records(after) == everything_but_records(before)
    expected_asks = []
    expected_records = []
    replay = 0
    for _name, topic_id, parts in topics:
        for index, data, _aborted, _tags in parts:
            if data:
                replay += 1
                expected_asks.append((known.name(topic_id.bytes), index, len(data)))
                let = bool((refuse_seed >> (replay % 16)) & 1)
                expected_records.append(data if let else b"")
            else:
                expected_records.append(data)
    assert asked == expected_asks
    got = [None if p.records is None else bytes(p.records) for t in after.responses for p in t.partitions]
    assert got == expected_records
    if all(decision for decision in (bool((refuse_seed >> (n % 16)) & 1) for n in range(1, replay + 1))):
        assert emptied is frame


# -- topic ids from Metadata ----------------------------------------------------------------------


def metadata_frame(version: int, topics: list[tuple[str | None, uuid.UUID, int]]) -> bytes:
    return response(MetadataResponse, version, 5, throttle_time_ms=0,
                    brokers=[MB(node_id=n, host=f"broker{n}", port=9092, rack=None) for n in (1, 2)],
                    cluster_id="c", controller_id=1, authorized_operations=set(), error_code=0,
                    topics=[MT(error_code=0, name=name, topic_id=topic_id, is_internal=False,
                               partitions=[MP(error_code=0, partition_index=i, leader_id=1, leader_epoch=2,
                                              replica_nodes=[1, 2], isr_nodes=[1], offline_replicas=[2])
                                           for i in range(count)])
                            for name, topic_id, count in topics])


WANTED = frozenset({"orders", "logs", "unknown"})


@pytest.mark.parametrize("version", range(10, 14))
def test_metadata_teaches_wanted_topic_ids(version: int) -> None:
    frame = metadata_frame(version, [("other", uuid.UUID(int=99), 2), ("orders", ORDERS_ID, 3),
                                     ("logs", LOGS_ID, 0), ("unknown", uuid.UUID(int=0), 0)])
    found = TopicNames()
    assert learn_metadata_topics(found, frame, version, WANTED) == 2
    assert (found.name(ORDERS_ID.bytes), found.name(LOGS_ID.bytes)) == ("orders", "logs")
    assert found.name(uuid.UUID(int=99).bytes) is None  # not throttled: not kept
    assert len(found) == 2
    assert found.unknown(WANTED) == ["unknown"]


def test_metadata_walk_goes_on_past_names_inside_other_names() -> None:
    frame = metadata_frame(12, [("my-orders", uuid.UUID(int=5), 1), ("logs", LOGS_ID, 1),
                                ("orders", ORDERS_ID, 2)])
    found = TopicNames()
    assert learn_metadata_topics(found, frame, 12, {"orders"}) == 1
    assert found.name(ORDERS_ID.bytes) == "orders" and len(found) == 1


def test_metadata_without_wanted_names_is_not_read() -> None:
    frame = metadata_frame(12, [("logs", LOGS_ID, 1)])
    garbage = frame[:-8]  # truncated, but no wanted name occurs in it
    assert learn_metadata_topics(TopicNames(), garbage, 12, {"orders"}) == 0
    assert learn_metadata_topics(TopicNames(), frame, 12, set()) == 0


@pytest.mark.parametrize("version", [1, 9])
def test_metadata_before_v10_has_no_ids(version: int) -> None:
    found = TopicNames()
    frame = metadata_frame(version, [("orders", ORDERS_ID, 1)])
    assert learn_metadata_topics(found, frame, version, WANTED) == 0
    assert len(found) == 0


def test_metadata_topics_named_by_id_only_are_skipped() -> None:
    found = TopicNames()
    frame = metadata_frame(12, [(None, ORDERS_ID, 1), ("logs", LOGS_ID, 1)])
    assert learn_metadata_topics(found, frame, 12, WANTED) == 1
    assert found.name(ORDERS_ID.bytes) is None and found.name(LOGS_ID.bytes) == "logs"


@pytest.mark.parametrize("version", [10, 12])
def test_truncated_metadata_is_malformed(version: int) -> None:
    frame = metadata_frame(version, [("orders", uuid.UUID(int=5), 2), ("zzz", uuid.UUID(int=6), 2),
                                     ("logs", LOGS_ID, 1)])
    name_at = frame.index(b"logs")
    for end in range(name_at):  # every cut before the wanted name, which still occurs in the rest
        cut = frame[:end] + frame[name_at:name_at + 4]
        with pytest.raises(MalformedBody, match=f"Metadata v{version} response"):
            learn_metadata_topics(TopicNames(), cut, version, {"logs"})


def test_metadata_partitions_with_many_replicas() -> None:
    """The inline step and the field-by-field path agree (200 replicas need a two-byte count)."""
    many = list(range(200))
    frame = response(MetadataResponse, 12, 5, throttle_time_ms=0, brokers=[], cluster_id=None,
                     controller_id=1, authorized_operations=set(), error_code=0,
                     topics=[MT(error_code=0, name="big", topic_id=uuid.UUID(int=3), is_internal=False,
                                partitions=[MP(error_code=0, partition_index=0, leader_id=1, leader_epoch=2,
                                               replica_nodes=many, isr_nodes=many, offline_replicas=[])]),
                             MT(error_code=0, name="logs", topic_id=LOGS_ID, is_internal=True,
                                partitions=[])])
    found = TopicNames()
    assert learn_metadata_topics(found, frame, 12, {"logs"}) == 1
    assert found.name(LOGS_ID.bytes) == "logs"


def test_topic_names_are_bounded_oldest_first() -> None:
    found = TopicNames(max_topics=2)
    ids = [uuid.UUID(int=i).bytes for i in range(1, 4)]
    for index, topic_id in enumerate(ids):
        found.learn(topic_id, f"t{index}")
    assert len(found) == 2
    assert [found.name(i) for i in ids] == [None, "t1", "t2"]
    found.learn(ids[1], "t1")  # already known: unchanged order
    found.learn(ids[0], "t0")
    assert [found.name(i) for i in ids] == ["t0", None, "t2"]
    found.learn(bytes(16), "zero")
    found.learn(b"short", "short")
    assert len(found) == 2
    with pytest.raises(ValueError, match="at least 1"):
        TopicNames(0)
