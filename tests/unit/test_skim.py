"""The hand-written skim readers agree with kafka-python's decoders, and refuse what does not add up."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from kafka.protocol.admin import DescribeGroupsRequest, DescribeTopicPartitionsRequest, ElectLeadersRequest
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceResponse

from protocol.errors import MalformedBody
from protocol.skim import decode_strict, fetch_response_has_tags, produce_response_has_tags

from .wire import body, tagged_section

PTR = ProduceResponse.TopicProduceResponse
PPR = PTR.PartitionProduceResponse
FTR = FetchResponse.FetchableTopicResponse
FPD = FTR.PartitionData
AT = FPD.AbortedTransaction


def produce_body(rng: random.Random, version: int, endpoints: bool) -> bytes:
    """A Produce response with random topics, partitions, record errors and messages."""
    topics = []
    for t in range(rng.randrange(0, 4)):
        partitions = []
        for p in range(rng.randrange(0, 4)):
            errors = [PPR.BatchIndexAndErrorMessage(batch_index=i, batch_index_error_message=rng.choice(
                [None, "", "bad batch " * rng.randrange(1, 30)])) for i in range(rng.randrange(0, 3))]
            fields: dict[str, object] = {
                "index": p, "error_code": rng.choice([0, 6]), "base_offset": rng.randrange(2**40),
                "log_append_time_ms": -1, "log_start_offset": 0, "record_errors": errors,
                "error_message": rng.choice([None, "", "leader moved"])}
            if rng.random() < 0.5:
                fields["current_leader"] = PPR.LeaderIdAndEpoch(leader_id=2, leader_epoch=rng.randrange(99))
            partitions.append(PPR(**fields))
        topic: dict[str, object] = {"partition_responses": partitions}
        if version >= 13:
            topic["topic_id"] = uuid.UUID(int=rng.randrange(1, 2**64))
        else:
            topic["name"] = f"topic-{t}" * rng.randrange(1, 5)
        topics.append(PTR(**topic))
    extra: dict[str, object] = {}
    if endpoints:
        extra["node_endpoints"] = [ProduceResponse.NodeEndpoint(node_id=1, host="b1", port=9092, rack=None)]
    return body(ProduceResponse, version, responses=topics, throttle_time_ms=rng.randrange(100), **extra)


def fetch_body(rng: random.Random, version: int, endpoints: bool) -> bytes:
    """A Fetch response with random topics, partitions, aborted transactions and records."""
    topics = []
    for t in range(rng.randrange(0, 4)):
        partitions = []
        for p in range(rng.randrange(0, 4)):
            aborted = rng.choice([None, [], [AT(producer_id=rng.randrange(2**40), first_offset=i)
                                             for i in range(rng.randrange(1, 4))]])
            fields: dict[str, object] = {
                "partition_index": p, "error_code": 0, "high_watermark": 100, "last_stable_offset": 100,
                "log_start_offset": 0, "aborted_transactions": aborted, "preferred_read_replica": -1,
                "records": rng.choice([None, b"", rng.randbytes(rng.randrange(1, 5000))])}
            if rng.random() < 0.5:
                fields["current_leader"] = FPD.LeaderIdAndEpoch(leader_id=3, leader_epoch=1)
            partitions.append(FPD(**fields))
        topic: dict[str, object] = {"partitions": partitions}
        if version >= 13:
            topic["topic_id"] = uuid.UUID(int=rng.randrange(1, 2**64))
        else:
            topic["topic"] = f"topic-{t}"
        topics.append(FTR(**topic))
    extra: dict[str, object] = {}
    if endpoints:
        extra["node_endpoints"] = [FetchResponse.NodeEndpoint(node_id=1, host="b1", port=9092, rack="r")]
    return body(FetchResponse, version, throttle_time_ms=0, error_code=0, session_id=rng.randrange(2**31),
                responses=topics, **extra)


CASES = [(ProduceResponse, produce_body, produce_response_has_tags, v) for v in (10, 11, 12, 13)] + [
    (FetchResponse, fetch_body, fetch_response_has_tags, v) for v in (16, 17, 18)]


@pytest.mark.parametrize(("cls", "build", "skim", "version"), CASES)
def test_the_skim_agrees_with_the_decoder(cls: Any, build: Any, skim: Any, version: int) -> None:
    rng = random.Random(version)
    for _ in range(200):
        endpoints = rng.random() < 0.5
        data = build(rng, version, endpoints)
        assert bool(cls.decode(data, version=version).node_endpoints) is endpoints
        assert skim(data, 0, version) is endpoints


def test_an_unknown_top_level_tag_counts() -> None:
    """A future broker's top-level field is not NodeEndpoints, but only a decode can tell: it goes to one."""
    data = produce_body(random.Random(1), 10, endpoints=False)
    assert produce_response_has_tags(data[:-1] + tagged_section({9: b"future"}), 0, 10)


def test_the_skim_starts_at_the_body_offset() -> None:
    data = fetch_body(random.Random(2), 16, endpoints=True)
    assert fetch_response_has_tags(b"\x00\x00\x00\x07\x00" + data, 5, 16)


@pytest.mark.parametrize(("skim", "build", "version"), [
    (produce_response_has_tags, produce_body, 10), (fetch_response_has_tags, fetch_body, 16)])
def test_every_truncation_is_malformed(skim: object, build: object, version: int) -> None:
    rng = random.Random(3)
    data = b""
    while len(data) < 40:  # one with a few partitions in it
        data = build(rng, version, False)  # type: ignore[operator]
    for cut in range(len(data)):
        with pytest.raises(MalformedBody, match=f"v{version} response does not parse"):
            skim(data[:cut], 0, version)  # type: ignore[operator]


def test_bytes_after_the_end_are_malformed() -> None:
    data = fetch_body(random.Random(4), 16, endpoints=False)
    with pytest.raises(MalformedBody, match="1 bytes after the end"):
        fetch_response_has_tags(data + b"\x00", 0, 16)


def test_an_absurd_array_count_fails_at_once() -> None:
    """A count larger than the bytes left is refused before any loop runs over it."""
    data = b"\x00" * 10 + b"\xff\xff\xff\xff\x0f"  # compact array of 2**32 - 2 topics
    with pytest.raises(MalformedBody, match="array of"):
        fetch_response_has_tags(data, 0, 16)


# -- decode_strict: length prefixes as Kafka's readers take them ---------------------------------


def strict(cls: Any, raw: bytes, version: int) -> Any:
    return decode_strict(cls, raw, 0, version, f"{cls.__name__[:-7]} v{version} request")


@pytest.mark.parametrize("version", [0, 5])  # classic int16 lengths, then compact ones
def test_strict_names_a_null_element_of_a_string_array(version: int) -> None:
    raw = body(DescribeGroupsRequest, version, groups=["a", None], include_authorized_operations=False)
    with pytest.raises(MalformedBody, match=rf"DescribeGroups v{version} request: groups\[1\] is null"):
        strict(DescribeGroupsRequest, raw, version)
    good = body(DescribeGroupsRequest, version, groups=["a", ""], include_authorized_operations=True)
    assert strict(DescribeGroupsRequest, good, version).groups == ["a", ""]


def test_strict_refuses_a_fixed_width_array_longer_than_the_body() -> None:
    raw = body(ElectLeadersRequest, 0, topic_partitions=[
        ElectLeadersRequest.TopicPartitions(topic="t", partitions=[1, 2, 3])], timeout_ms=1)
    # the partitions count sits right after the topic name
    cut = raw.index(b"\x00\x00\x00\x03")
    bad = raw[:cut] + b"\x00\x00\x00\x05" + raw[cut + 4 :]  # 20 bytes claimed, 16 left
    with pytest.raises(MalformedBody, match=r"topic_partitions\[0\]\.partitions of 5 int32 runs past"):
        strict(ElectLeadersRequest, bad, 0)


def test_strict_nullable_struct_marker() -> None:
    """KIP-893: a nested struct may be null with a one-byte -1 marker."""
    cls = DescribeTopicPartitionsRequest
    for cursor in (None, cls.Cursor(topic_name="t", partition_index=3)):
        raw = body(cls, 0, topics=[cls.TopicRequest(name="t")], response_partition_limit=5, cursor=cursor)
        assert strict(cls, raw, 0).cursor == cursor
    raw = body(cls, 0, topics=[], response_partition_limit=5, cursor=cls.Cursor(topic_name="t",
                                                                                  partition_index=3))
    at = raw.index(b"\x02t")  # the cursor's topic name: compact length 1 + 1
    spoiled = raw[:at] + b"\x7f" + raw[at + 1 :]  # now it claims 126 bytes
    with pytest.raises(MalformedBody, match=r"cursor\.topic_name has length 126 but only 7 bytes"):
        strict(cls, spoiled, 0)


def test_strict_steps_over_unknown_tagged_fields() -> None:
    raw = body(DescribeGroupsRequest, 5, groups=["g"], include_authorized_operations=False)
    tagged = raw[:-1] + tagged_section({7: b"future", 9: b""})
    assert strict(DescribeGroupsRequest, tagged, 5).groups == ["g"]
    with pytest.raises(MalformedBody, match="does not parse: tagged field runs past the end"):
        strict(DescribeGroupsRequest, raw[:-1] + b"\x01\x07\x09abc", 5)


@pytest.mark.parametrize("length", [b"\xff\xfe", b"\x80\x00"])
def test_strict_refuses_negative_lengths_other_than_null(length: bytes) -> None:
    raw = body(DescribeGroupsRequest, 0, groups=["abc"])
    bad = raw[:4] + length + raw[6:]
    value = int.from_bytes(length, "big", signed=True)
    with pytest.raises(MalformedBody, match=rf"groups\[0\] has length {value}$"):
        strict(DescribeGroupsRequest, bad, 0)
