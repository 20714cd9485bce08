"""The hand-written skim readers agree with kafka-python's decoders, and refuse what does not add up."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceResponse

from protocol.errors import MalformedBody
from protocol.skim import fetch_response_has_tags, produce_response_has_tags

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
