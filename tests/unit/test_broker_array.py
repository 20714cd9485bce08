"""The brokers-array reader: the entries and offsets it finds, and its refusals of bad bytes.

kafka-python's schema-generated classes build every response, so the reader is checked against
Kafka's own field order (MetadataResponse.json, DescribeClusterResponse.json), not against
byte strings written by hand for the test.
"""

from __future__ import annotations

import struct
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.protocol.admin import DescribeClusterResponse
from kafka.protocol.metadata import MetadataResponse

from protocol.broker_array import (
    MIN_BROKER_BYTES,
    BrokerArray,
    describe_cluster_brokers,
    encode_address,
    metadata_brokers,
)
from protocol.errors import MalformedBody

from .wire import body, uvarint

MB = MetadataResponse.MetadataResponseBroker
MT = MetadataResponse.MetadataResponseTopic
MP = MT.MetadataResponsePartition
DCB = DescribeClusterResponse.DescribeClusterBroker

METADATA_VERSIONS = range(14)
DESCRIBE_CLUSTER_VERSIONS = range(3)
Broker = tuple[int, str, int, str | None]

BROKERS: list[Broker] = [
    (1, "broker1.internal", 9092, "rack-a"),
    (2, "brøker-2.internal", 9093, None),  # non-ASCII: lengths count bytes, not characters
    (-1, "", -1, None),  # a placeholder entry
    (30000, "10.0.0.3", 65535, ""),
]


def metadata_body(version: int, brokers: list[Broker], topics: int = 3) -> bytes:
    fields: dict[str, object] = {
        "throttle_time_ms": 7,
        "brokers": [MB(node_id=n, host=h, port=p, rack=r) for n, h, p, r in brokers],
        "cluster_id": "cluster-A",
        "controller_id": 1,
        "topics": [MT(error_code=0, name=f"topic-{i}", topic_id=uuid.UUID(int=i + 1), is_internal=False,
                      partitions=[MP(error_code=0, partition_index=0, leader_id=1, leader_epoch=0,
                                     replica_nodes=[1], isr_nodes=[1], offline_replicas=[])],
                      authorized_operations={3, 4})
                   for i in range(topics)],
        "authorized_operations": {2},
        "error_code": 0,
    }
    return body(MetadataResponse, version, **fields)


def describe_cluster_body(version: int, brokers: list[Broker], message: str | None = None) -> bytes:
    return body(DescribeClusterResponse, version, throttle_time_ms=0, error_code=0, error_message=message,
                endpoint_type=1, cluster_id="cluster-A", controller_id=1, authorized_operations={2, 5},
                brokers=[DCB(broker_id=n, host=h, port=p, rack=r, is_fenced=n == 1)
                         for n, h, p, r in brokers])


def entries(array: BrokerArray) -> list[tuple[int, str, int]]:
    return [(b.node_id, b.host, b.port) for b in array.brokers]


def rack_for(version: int, rack: str | None) -> str | None:
    return rack if version >= 1 else None


# -- what the reader finds -----------------------------------------------------------------------


@pytest.mark.parametrize("version", METADATA_VERSIONS)
def test_metadata_entries_and_array_bounds(version: int) -> None:
    prefix = b"\xaa\xbb\xcc"  # the reader must honour the body offset it is given
    frame = prefix + metadata_body(version, BROKERS)
    array = metadata_brokers(frame, len(prefix), version)
    assert entries(array) == [(n, h, p) for n, h, p, _ in BROKERS]
    assert array.flexible is (version >= 9)
    # The array starts after throttle_time_ms (v3+) and is exactly the bytes an empty array replaces.
    assert array.start == len(prefix) + (4 if version >= 3 else 0)
    without = metadata_body(version, [])
    empty_array = 1 if version >= 9 else 4
    assert frame[array.end:] == without[array.start - len(prefix) + empty_array:]


@pytest.mark.parametrize("version", METADATA_VERSIONS)
def test_metadata_address_spans_hold_host_and_port(version: int) -> None:
    frame = metadata_body(version, BROKERS)
    array = metadata_brokers(frame, 0, version)
    for broker in array.brokers:
        span = frame[broker.address_start : broker.address_end]
        assert span == encode_address(broker.host, broker.port, array.flexible)
        assert frame[broker.address_start - 4 : broker.address_start] == struct.pack(">i", broker.node_id)


@pytest.mark.parametrize("version", DESCRIBE_CLUSTER_VERSIONS)
@pytest.mark.parametrize("message", [None, "a top-level error message"])
def test_describe_cluster_entries_and_array_bounds(version: int, message: str | None) -> None:
    frame = describe_cluster_body(version, BROKERS, message)
    array = describe_cluster_brokers(frame, 0, version)
    assert entries(array) == [(n, h, p) for n, h, p, _ in BROKERS]
    assert array.flexible
    without = describe_cluster_body(version, [], message)
    assert frame[: array.start] == without[: array.start]
    assert frame[array.end :] == without[array.start + 1 :]
    for broker in array.brokers:
        span = frame[broker.address_start : broker.address_end]
        assert span == encode_address(broker.host, broker.port, True)


def test_metadata_with_tagged_fields_in_each_broker() -> None:
    """Tagged fields this proxy has no schema for are stepped over, at any length."""
    tagged = b"".join(
        struct.pack(">i", n) + uvarint(len(h) + 1) + h.encode() + struct.pack(">i", p) + b"\x00"
        + uvarint(2) + uvarint(3) + uvarint(1) + b"x" + uvarint(200) + uvarint(300) + b"y" * 300
        for n, h, p in [(1, "a", 1), (2, "b", 2)]
    )
    frame = b"\x00\x00\x00\x00" + uvarint(3) + tagged + b"rest-of-the-body"
    array = metadata_brokers(frame, 0, 12)
    assert entries(array) == [(1, "a", 1), (2, "b", 2)]
    assert frame[array.end :] == b"rest-of-the-body"


def test_encode_address_long_host_uses_a_multi_byte_varint() -> None:
    host = "h" * 200
    assert encode_address(host, 1, True) == uvarint(201) + host.encode() + b"\x00\x00\x00\x01"
    assert encode_address(host, 1, False) == b"\x00\xc8" + host.encode() + b"\x00\x00\x00\x01"


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "frame", "reason"), [
    (12, b"\x00\x00\x00\x00\x00", "brokers array count -1"),
    (1, b"\xff\xff\xff\xff", "brokers array count -1"),
    (1, b"\x00\x00\x01\x00", "brokers array of 256 entries in the 0 bytes left"),
    (12, b"\x00\x00", "the body ends before the brokers array"),
    (12, b"\x00\x00\x00\x00\x80\x80", "brokers array count at offset 4: truncated varint"),
    (12, b"\x00\x00\x00\x00\xff\xff\xff\xff\xff\x01", "varint longer than 5 bytes"),
    (0, b"\x00\x00\x00\x01" + b"\x00\x00\x00\x01\xff\xfe" + b"\x00" * 8,
     "broker 0 of 1 host has length -2 at offset 8"),
    (0, b"\x00\x00\x00\x01" + b"\x00\x00\x00\x01\xff\xff" + b"\x00" * 8,
     "broker 0 of 1 host has length -1 at offset 8"),
    (9, b"\x00\x00\x00\x00\x02" + b"\x00\x00\x00\x01\x00" + b"\x00" * 8,
     "broker 0 of 1 host has length -1 at offset 9"),
    (0, b"\x00\x00\x00\x01" + b"\x00\x00\x00\x01\x00\x20" + b"\x00" * 8,
     "broker 0 of 1 host of 32 bytes at offset 10 runs past the end"),
    (0, b"\x00\x00\x00\x01" + b"\x00\x00\x00\x01\x00\x02\xc3\x28" + b"\x00" * 6,
     "broker 0 of 1 host at offset 10 is not UTF-8"),
    (1, b"\x00\x00\x00\x01" + b"\x00\x00\x00\x01\x00\x00\x00\x00\x00\x01\x00\x09",
     "broker 0 of 1 rack of 9 bytes at offset 16 runs past the end"),
    (9, b"\x00\x00\x00\x00\x02" + b"\x00\x00\x00\x01\x01\x00\x00\x00\x01\x00\x01\x07",
     "broker 0 of 1 tagged field size at offset 17: truncated varint"),
    (9, b"\x00\x00\x00\x00\x02" + b"\x00\x00\x00\x01\x01\x00\x00\x00\x01\x00\x01\x07\x05ab",
     "broker 0 of 1 tagged field of 5 bytes runs past the end"),
])
def test_malformed_metadata_names_what_is_wrong(version: int, frame: bytes, reason: str) -> None:
    with pytest.raises(MalformedBody) as caught:
        metadata_brokers(frame, 0, version)
    assert f"Metadata v{version} response of {len(frame)} bytes does not parse: " in str(caught.value)
    assert reason in str(caught.value)


def test_count_bound_is_the_smallest_entry() -> None:
    """The count check refuses only counts that truly cannot fit: the smallest entry is accepted."""
    entry = b"\x00\x00\x00\x01" + b"\x00\x00" + b"\x00\x00\x00\x02"
    assert len(entry) == MIN_BROKER_BYTES
    array = metadata_brokers(b"\x00\x00\x00\x02" + entry * 2, 0, 0)
    assert entries(array) == [(1, "", 2), (1, "", 2)]
    with pytest.raises(MalformedBody, match="brokers array of 3 entries in the 20 bytes left"):
        metadata_brokers(b"\x00\x00\x00\x03" + entry * 2, 0, 0)


@pytest.mark.parametrize(("frame", "reason"), [
    (b"\x00\x00\x00\x00\x00\x00\x05ab", "error message of 4 bytes at offset 7 runs past the end"),
    (b"\x00\x00\x00\x00\x00\x00\x00\x01\x00", "cluster id has length -1 at offset 8"),
    (b"\x00\x00\x00\x00\x00\x00\x00\x01\x02a\x00\x00", "the body ends before the brokers array"),
])
def test_malformed_describe_cluster_names_what_is_wrong(frame: bytes, reason: str) -> None:
    with pytest.raises(MalformedBody, match=f"DescribeCluster v1 response of {len(frame)} bytes") as caught:
        describe_cluster_brokers(frame, 0, 1)
    assert reason in str(caught.value)


# -- properties ----------------------------------------------------------------------------------

hosts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
racks = st.none() | hosts
brokers_strategy = st.lists(
    st.tuples(st.integers(-1, 2**31 - 1), hosts, st.integers(-(2**31), 2**31 - 1), racks), max_size=8)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(version=st.sampled_from(METADATA_VERSIONS), brokers=brokers_strategy, topics=st.integers(0, 20))
def test_metadata_reader_agrees_with_kafka_python(version: int, brokers: list[Broker], topics: int) -> None:
    frame = metadata_body(version, brokers, topics)
    array = metadata_brokers(frame, 0, version)
    decoded = MetadataResponse.decode(frame, version=version)
    assert entries(array) == [(b.node_id, b.host, b.port) for b in decoded.brokers]
    empty_array = 1 if version >= 9 else 4
    assert frame[array.end :] == metadata_body(version, [], topics)[array.start + empty_array :]


@PROPERTY
@given(version=st.sampled_from(DESCRIBE_CLUSTER_VERSIONS), brokers=brokers_strategy,
       message=st.none() | hosts)
def test_describe_cluster_reader_agrees_with_kafka_python(version: int, brokers: list[Broker],
                                                          message: str | None) -> None:
    frame = describe_cluster_body(version, brokers, message)
    array = describe_cluster_brokers(frame, 0, version)
    decoded = DescribeClusterResponse.decode(frame, version=version)
    assert entries(array) == [(b.broker_id, b.host, b.port) for b in decoded.brokers]


@PROPERTY
@given(version=st.sampled_from(METADATA_VERSIONS), brokers=brokers_strategy.filter(bool), data=st.data())
def test_metadata_truncated_inside_the_array_always_raises_malformed_body(
        version: int, brokers: list[Broker], data: st.DataObject) -> None:
    frame = metadata_body(version, brokers, topics=0)
    end = metadata_brokers(frame, 0, version).end
    cut = data.draw(st.integers(0, end - 1), label="cut")
    with pytest.raises(MalformedBody):
        metadata_brokers(frame[:cut], 0, version)


@PROPERTY
@given(version=st.sampled_from(DESCRIBE_CLUSTER_VERSIONS), brokers=brokers_strategy.filter(bool),
       data=st.data())
def test_describe_cluster_truncated_inside_the_array_always_raises_malformed_body(
        version: int, brokers: list[Broker], data: st.DataObject) -> None:
    frame = describe_cluster_body(version, brokers)
    end = describe_cluster_brokers(frame, 0, version).end
    cut = data.draw(st.integers(0, end - 1), label="cut")
    with pytest.raises(MalformedBody):
        describe_cluster_brokers(frame[:cut], 0, version)


@PROPERTY
@given(version=st.sampled_from(METADATA_VERSIONS), garbage=st.binary(max_size=200))
def test_metadata_any_bytes_give_an_array_or_malformed_body(version: int, garbage: bytes) -> None:
    try:
        array = metadata_brokers(garbage, 0, version)
    except MalformedBody:
        return
    assert array.start <= array.end <= len(garbage)
    assert all(array.start < b.address_start < b.address_end <= array.end for b in array.brokers)


@PROPERTY
@given(version=st.sampled_from(DESCRIBE_CLUSTER_VERSIONS), garbage=st.binary(max_size=200))
def test_describe_cluster_any_bytes_give_an_array_or_malformed_body(version: int, garbage: bytes) -> None:
    try:
        array = describe_cluster_brokers(garbage, 0, version)
    except MalformedBody:
        return
    assert array.start <= array.end <= len(garbage)


@PROPERTY
@given(version=st.sampled_from(METADATA_VERSIONS), brokers=brokers_strategy.filter(bool), data=st.data())
def test_metadata_garbled_byte_gives_an_array_or_malformed_body(
        version: int, brokers: list[Broker], data: st.DataObject) -> None:
    frame = bytearray(metadata_body(version, brokers, topics=1))
    where = data.draw(st.integers(0, len(frame) - 1), label="where")
    frame[where] = data.draw(st.integers(0, 255), label="byte")
    try:
        array = metadata_brokers(bytes(frame), 0, version)
    except MalformedBody:
        return
    assert array.end <= len(frame)
