"""Broker address rewriting: clients must only ever learn proxy addresses, with node ids intact."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.protocol.admin import DescribeClusterResponse
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.metadata import FindCoordinatorResponse, MetadataResponse
from kafka.protocol.producer import ProduceResponse

from protocol.addresses import needs_rewrite, rewrite_addresses
from protocol.apis import KNOWN_APIS, ApiKey
from protocol.broker_array import Address, Advertise, metadata_brokers
from protocol.errors import MalformedBody, ProtocolError
from protocol.headers import encode_response_header, response_body_offset

from .wire import advertise, body, response, tagged_section, uvarint

MB = MetadataResponse.MetadataResponseBroker
MT = MetadataResponse.MetadataResponseTopic
MP = MT.MetadataResponsePartition
COORD = FindCoordinatorResponse.Coordinator
DCB = DescribeClusterResponse.DescribeClusterBroker
PTR = ProduceResponse.TopicProduceResponse
PPR = PTR.PartitionProduceResponse
FTR = FetchResponse.FetchableTopicResponse
FPD = FTR.PartitionData

# A record batch stands in for real data: the rewrite must carry it through byte for byte.
RECORDS = bytes(range(61)) + b"payload-that-must-survive"


def metadata_fields(version: int, brokers: list[tuple[int, str, int]]) -> dict[str, object]:
    fields: dict[str, object] = {
        "brokers": [MB(node_id=n, host=h, port=p, rack=f"rack-{n}") for n, h, p in brokers],
        "controller_id": 2,
        "topics": [MT(error_code=0, name="orders", is_internal=False, partitions=[
            MP(error_code=0, partition_index=0, leader_id=2, leader_epoch=3, replica_nodes=[2, 1],
               isr_nodes=[2, 1], offline_replicas=[]),
        ])],
    }
    if version >= 2:
        fields["cluster_id"] = "cluster-A"
    if version >= 3:
        fields["throttle_time_ms"] = 25
    if version >= 10:
        fields["topics"][0].topic_id = uuid.UUID(int=42)  # type: ignore[index]
    return fields


REAL = [(1, "broker1.internal", 9092), (2, "broker2.internal", 9093), (3, "broker3.internal", 9094)]
PROXIED = [(n, *advertise(n)) for n, _h, _p in REAL]


# -- which responses need a look --------------------------------------------------------------


@pytest.mark.parametrize(("key", "version", "expected"), [
    (ApiKey.METADATA, 0, True),
    (ApiKey.METADATA, 13, True),
    (ApiKey.FIND_COORDINATOR, 0, True),
    (ApiKey.DESCRIBE_CLUSTER, 0, True),
    (ApiKey.PRODUCE, 9, False),
    (ApiKey.PRODUCE, 10, True),
    (ApiKey.FETCH, 15, False),
    (ApiKey.FETCH, 16, True),
    (ApiKey.LIST_OFFSETS, 8, False),
    (ApiKey.API_VERSIONS, 3, False),
])
def test_needs_rewrite(key: int, version: int, expected: bool) -> None:
    assert needs_rewrite(key, version) is expected


# -- Metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "header_version"), [(0, 0), (1, 0), (5, 0), (8, 0), (9, 1), (12, 1)])
def test_metadata_addresses_rewritten_everything_else_kept(version: int, header_version: int) -> None:
    frame = response(MetadataResponse, version, 17, **metadata_fields(version, REAL))
    assert frame[:4] == (17).to_bytes(4, "big")
    result = rewrite_addresses(ApiKey.METADATA, version, frame, header_version, advertise)
    expected = response(MetadataResponse, version, 17, **metadata_fields(version, PROXIED))
    assert result.frame == expected
    assert result.discovered == {n: (h, p) for n, h, p in REAL}


def test_metadata_v12_decoded_result_keeps_node_ids_and_topics() -> None:
    frame = response(MetadataResponse, 12, 3, **metadata_fields(12, REAL))
    result = rewrite_addresses(ApiKey.METADATA, 12, frame, 1, advertise)
    decoded = MetadataResponse.decode(result.frame[5:], version=12)
    assert [(b.node_id, b.host, b.port, b.rack) for b in decoded.brokers] == [
        (1, "proxy.test", 19001, "rack-1"),
        (2, "proxy.test", 19002, "rack-2"),
        (3, "proxy.test", 19003, "rack-3"),
    ]
    assert decoded.controller_id == 2
    assert decoded.cluster_id == "cluster-A"
    assert decoded.throttle_time_ms == 25
    assert decoded.topics[0].partitions[0].leader_id == 2
    assert decoded.topics[0].topic_id == uuid.UUID(int=42)


def test_metadata_advertise_called_with_node_ids() -> None:
    calls: list[int] = []

    def recording(node_id: int) -> tuple[str, int]:
        calls.append(node_id)
        return advertise(node_id)

    frame = response(MetadataResponse, 1, 3, **metadata_fields(1, REAL))
    rewrite_addresses(ApiKey.METADATA, 1, frame, 0, recording)
    assert sorted(calls) == [1, 2, 3]


def test_metadata_without_brokers_is_the_same_object() -> None:
    frame = response(MetadataResponse, 12, 3, **metadata_fields(12, []))
    result = rewrite_addresses(ApiKey.METADATA, 12, frame, 1, advertise)
    assert result.frame is frame
    assert result.discovered == {}


def test_metadata_response_header_tagged_fields_preserved() -> None:
    header = encode_response_header(9, 0) + tagged_section({0: b"hdr-tag", 4: b"\x00\x01"})
    msg_body = body(MetadataResponse, 12, **metadata_fields(12, REAL))
    result = rewrite_addresses(ApiKey.METADATA, 12, header + msg_body, 1, advertise)
    assert result.frame.startswith(header)
    expected_body = body(MetadataResponse, 12, **metadata_fields(12, PROXIED))
    assert result.frame[len(header):] == expected_body


def test_metadata_garbage_body_raises_malformed_body() -> None:
    frame = encode_response_header(9, 1) + b"\x00\x00\x00\x00\x05\x01"
    with pytest.raises(MalformedBody, match=r"Metadata v12 response of 11 bytes does not parse"):
        rewrite_addresses(ApiKey.METADATA, 12, frame, 1, advertise)
    assert issubclass(MalformedBody, ProtocolError)


# -- FindCoordinator --------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "header_version"), [(0, 0), (1, 0), (2, 0), (3, 1)])
def test_find_coordinator_single(version: int, header_version: int) -> None:
    fields: dict[str, object] = {"error_code": 0, "node_id": 3, "host": "broker3.internal", "port": 9094}
    if version >= 1:
        fields.update(throttle_time_ms=0, error_message=None)
    frame = response(FindCoordinatorResponse, version, 55, **fields)
    result = rewrite_addresses(ApiKey.FIND_COORDINATOR, version, frame, header_version, advertise)
    fields.update(host="proxy.test", port=19003)
    assert result.frame == response(FindCoordinatorResponse, version, 55, **fields)
    assert result.discovered == {3: ("broker3.internal", 9094)}


def test_find_coordinator_v3_error_left_alone() -> None:
    frame = response(FindCoordinatorResponse, 3, 55, throttle_time_ms=0, error_code=15,
                     error_message="The coordinator is not available.", node_id=-1, host="", port=-1)
    result = rewrite_addresses(ApiKey.FIND_COORDINATOR, 3, frame, 1, advertise)
    assert result.frame is frame
    assert result.discovered == {}


def test_find_coordinator_v4_batched_with_errored_coordinator() -> None:
    def coordinators(host: str, port: int) -> list[object]:
        return [
            COORD(key="group-a", node_id=2, host=host, port=port, error_code=0, error_message=None),
            COORD(key="group-b", node_id=-1, host="", port=-1, error_code=15, error_message="not available"),
            COORD(key="group-c", node_id=2, host=host, port=port, error_code=0, error_message=None),
        ]

    frame = response(FindCoordinatorResponse, 4, 8, throttle_time_ms=0,
                     coordinators=coordinators("broker2.internal", 9093))
    result = rewrite_addresses(ApiKey.FIND_COORDINATOR, 4, frame, 1, advertise)
    assert result.frame == response(FindCoordinatorResponse, 4, 8, throttle_time_ms=0,
                                    coordinators=coordinators("proxy.test", 19002))
    assert result.discovered == {2: ("broker2.internal", 9093)}
    decoded = FindCoordinatorResponse.decode(result.frame[5:], version=4)
    errored = decoded.coordinators[1]
    assert (errored.node_id, errored.host, errored.port, errored.error_code) == (-1, "", -1, 15)


def test_find_coordinator_v6_all_errored_is_same_object() -> None:
    frame = response(FindCoordinatorResponse, 6, 8, throttle_time_ms=0, coordinators=[
        COORD(key="tx", node_id=-1, host="", port=-1, error_code=15, error_message=None),
    ])
    result = rewrite_addresses(ApiKey.FIND_COORDINATOR, 6, frame, 1, advertise)
    assert result.frame is frame


# -- DescribeCluster --------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1, 2])
def test_describe_cluster(version: int) -> None:
    def fields(brokers: list[tuple[int, str, int]]) -> dict[str, object]:
        out: dict[str, object] = {
            "throttle_time_ms": 0, "error_code": 0, "error_message": None, "cluster_id": "cluster-A",
            "controller_id": 1, "authorized_operations": {3, 4},
            "brokers": [DCB(broker_id=n, host=h, port=p, rack=None) for n, h, p in brokers],
        }
        if version >= 1:
            out["endpoint_type"] = 1
        return out

    frame = response(DescribeClusterResponse, version, 4, **fields(REAL))
    result = rewrite_addresses(ApiKey.DESCRIBE_CLUSTER, version, frame, 1, advertise)
    assert result.frame == response(DescribeClusterResponse, version, 4, **fields(PROXIED))
    assert result.discovered == {n: (h, p) for n, h, p in REAL}


# -- Produce v10+ / Fetch v16+ NodeEndpoints (KIP-951) -------------------------------------------


def produce_fields(endpoints: list[tuple[int, str, int]] | None, version: int = 10) -> dict[str, object]:
    partition = PPR(index=0, error_code=6, base_offset=-1, log_append_time_ms=-1, log_start_offset=-1,
                    record_errors=[], error_message=None,
                    current_leader=PPR.LeaderIdAndEpoch(leader_id=2, leader_epoch=7))
    topic: dict[str, object] = {"partition_responses": [partition]}
    if version >= 13:
        topic["topic_id"] = uuid.UUID(int=7)
    else:
        topic["name"] = "orders"
    fields: dict[str, object] = {"responses": [PTR(**topic)], "throttle_time_ms": 0}
    if endpoints is not None:
        fields["node_endpoints"] = [ProduceResponse.NodeEndpoint(node_id=n, host=h, port=p, rack="r")
                                    for n, h, p in endpoints]
    return fields


@pytest.mark.parametrize("version", [10, 11, 13])
def test_produce_node_endpoints_rewritten(version: int) -> None:
    frame = response(ProduceResponse, version, 70, **produce_fields([REAL[1]], version))
    result = rewrite_addresses(ApiKey.PRODUCE, version, frame, 1, advertise)
    assert result.frame == response(ProduceResponse, version, 70, **produce_fields([PROXIED[1]], version))
    assert result.discovered == {2: ("broker2.internal", 9093)}
    decoded = ProduceResponse.decode(result.frame[5:], version=version)
    # The known tagged field inside the partition (KIP-951 CurrentLeader) survives the re-encode.
    leader = decoded.responses[0].partition_responses[0].current_leader
    assert (leader.leader_id, leader.leader_epoch) == (2, 7)


@pytest.mark.parametrize("version", [10, 13])
def test_produce_without_node_endpoints_is_the_very_same_bytes(version: int) -> None:
    frame = response(ProduceResponse, version, 70, **produce_fields(None, version))
    result = rewrite_addresses(ApiKey.PRODUCE, version, frame, 1, advertise)
    assert result.frame is frame
    assert result.discovered == {}


def test_produce_without_node_endpoints_keeps_unknown_tagged_fields() -> None:
    msg_body = body(ProduceResponse, 10, **produce_fields(None))
    assert msg_body.endswith(b"\x00")
    with_unknown = msg_body[:-1] + tagged_section({9: b"future-field"})
    frame = encode_response_header(70, 1) + with_unknown
    result = rewrite_addresses(ApiKey.PRODUCE, 10, frame, 1, advertise)
    assert result.frame is frame
    assert result.frame.endswith(b"future-field")


def fetch_fields(endpoints: list[tuple[int, str, int]] | None, version: int = 16) -> dict[str, object]:
    partition = FPD(partition_index=0, error_code=0, high_watermark=100, last_stable_offset=100,
                    log_start_offset=0, aborted_transactions=None, preferred_read_replica=-1, records=RECORDS,
                    current_leader=FPD.LeaderIdAndEpoch(leader_id=3, leader_epoch=9))
    fields: dict[str, object] = {
        "throttle_time_ms": 0, "error_code": 0, "session_id": 12,
        "responses": [FTR(topic_id=uuid.UUID(int=5), partitions=[partition])],
    }
    if endpoints is not None:
        fields["node_endpoints"] = [FetchResponse.NodeEndpoint(node_id=n, host=h, port=p, rack=None)
                                    for n, h, p in endpoints]
    return fields


@pytest.mark.parametrize("version", [16, 17, 18])
def test_fetch_node_endpoints_rewritten_records_intact(version: int) -> None:
    frame = response(FetchResponse, version, 71, **fetch_fields(REAL, version))
    result = rewrite_addresses(ApiKey.FETCH, version, frame, 1, advertise)
    assert result.frame == response(FetchResponse, version, 71, **fetch_fields(PROXIED, version))
    assert result.discovered == {n: (h, p) for n, h, p in REAL}
    assert RECORDS in result.frame


@pytest.mark.parametrize("version", [16, 18])
def test_fetch_without_node_endpoints_is_the_very_same_bytes(version: int) -> None:
    frame = response(FetchResponse, version, 71, **fetch_fields(None, version))
    result = rewrite_addresses(ApiKey.FETCH, version, frame, 1, advertise)
    assert result.frame is frame
    assert result.discovered == {}


def test_fetch_empty_node_endpoints_is_the_very_same_bytes() -> None:
    frame = response(FetchResponse, 16, 71, **fetch_fields([]))
    result = rewrite_addresses(ApiKey.FETCH, 16, frame, 1, advertise)
    assert result.frame is frame


def test_truncated_response_header_tagged_section_raises() -> None:
    frame = encode_response_header(1, 0) + b"\x01\x00\x30abc"
    with pytest.raises(ProtocolError):
        rewrite_addresses(ApiKey.METADATA, 12, frame, 1, advertise)


# -- the brokers-array splice against the old decode+swap+encode path ----------------------------


def _decode_swap_encode(api_key: int, version: int, frame: bytes,
                        rewrite_to: Advertise) -> tuple[bytes, dict[int, Address]]:
    """The rewrite as it was before the splice: decode it all, swap (host, port), encode it all.

    Kept here, never in the proxy, as the oracle: its output is what kafka-python, built from
    Kafka's schemas, says the rewritten response is.
    """
    spec = KNOWN_APIS[api_key]
    start = response_body_offset(frame, spec.response_header_version(version))
    message = spec.response_class.decode(memoryview(frame)[start:], version=version)
    seen: dict[int, Address] = {}
    for broker in message.brokers:
        node_id = broker.node_id if api_key == ApiKey.METADATA else broker.broker_id
        if node_id < 0 or not broker.host:
            continue
        seen[node_id] = (broker.host, broker.port)
        broker.host, broker.port = rewrite_to(node_id)
    if not seen:
        return frame, seen
    return frame[:start] + bytes(message.encode()), seen


Broker = tuple[int, str, int, str | None]
#: Several brokers, racks null, empty and set, a non-ASCII host and a placeholder entry.
MIXED: list[Broker] = [
    (1, "broker1.internal", 9092, "rack-a"),
    (2, "brøker-2.internal", 9093, None),
    (-1, "", -1, None),
    (3, "10.0.0.3", 9094, ""),
    (1000, "b" * 150, 65535, "r" * 130),  # lengths that need two-byte varints
]


def big_metadata(version: int, brokers: list[Broker], topics: int) -> bytes:
    parts = [MP(error_code=0, partition_index=p, leader_id=1 + p % 3, leader_epoch=p, replica_nodes=[1, 2, 3],
                isr_nodes=[1, 2], offline_replicas=[3]) for p in range(3)]
    fields: dict[str, object] = {
        "throttle_time_ms": 11,
        "brokers": [MB(node_id=n, host=h, port=p, rack=r) for n, h, p, r in brokers],
        "cluster_id": "cluster-A",
        "controller_id": 3,
        "topics": [MT(error_code=0, name=f"topic-{i:05d}", topic_id=uuid.UUID(int=i + 1), is_internal=i == 0,
                      partitions=parts[: 1 + i % 3], authorized_operations={3, 4})
                   for i in range(topics)],
        "authorized_operations": {2, 7},
        "error_code": 0,
    }
    return response(MetadataResponse, version, 99, **fields)


def rewrite(api_key: int, version: int, frame: bytes) -> Any:
    header_version = KNOWN_APIS[api_key].response_header_version(version)
    return rewrite_addresses(api_key, version, frame, header_version, advertise)


@pytest.mark.parametrize("version", range(14))
def test_metadata_splice_equals_decode_and_encode(version: int) -> None:
    frame = big_metadata(version, MIXED, topics=2000)
    expected, seen = _decode_swap_encode(ApiKey.METADATA, version, frame, advertise)
    result = rewrite(ApiKey.METADATA, version, frame)
    assert expected != frame  # the oracle did change something
    assert result.frame == expected
    assert result.discovered == seen == {n: (h, p) for n, h, p, _r in MIXED if n >= 0}


@pytest.mark.parametrize("version", range(14))
def test_metadata_only_placeholders_is_the_same_object(version: int) -> None:
    frame = big_metadata(version, [(-1, "", -1, None), (4, "", 0, None)], topics=5)
    result = rewrite(ApiKey.METADATA, version, frame)
    assert result.frame is frame
    assert result.discovered == {}


@pytest.mark.parametrize("version", [0, 1, 2])
def test_describe_cluster_splice_equals_decode_and_encode(version: int) -> None:
    frame = response(DescribeClusterResponse, version, 5, throttle_time_ms=3, error_code=0,
                     error_message="all fine", endpoint_type=1, cluster_id="cluster-A", controller_id=2,
                     authorized_operations={3},
                     brokers=[DCB(broker_id=n, host=h, port=p, rack=r, is_fenced=n == 2)
                              for n, h, p, r in MIXED])
    expected, seen = _decode_swap_encode(ApiKey.DESCRIBE_CLUSTER, version, frame, advertise)
    result = rewrite(ApiKey.DESCRIBE_CLUSTER, version, frame)
    assert result.frame == expected != frame
    assert result.discovered == seen


def _flexible_broker(node_id: int, host: str, port: int, tags: bytes) -> bytes:
    raw = host.encode()
    return node_id.to_bytes(4, "big") + uvarint(len(raw) + 1) + raw + port.to_bytes(4, "big") + b"\x00" + tags


@pytest.mark.parametrize("version", [9, 12, 13])
def test_metadata_unknown_tagged_fields_survive(version: int) -> None:
    """Tagged fields of a newer Kafka (per broker, per topic, top level) go on byte for byte,
    which the old re-encode could not do: kafka-python drops tags it has no schema for."""
    plain = body(MetadataResponse, version, **metadata_fields(version, []))
    # Throttle time, then the empty brokers array (one byte: 0 + 1), then the rest of the body.
    assert plain[4] == 1
    rest = plain[5:-1] + tagged_section({3: b"top-level-future"})
    broker_tags = [tagged_section({0: b"\x01\x02"}), tagged_section({}), tagged_section({9: b"z" * 200})]

    def with_brokers(brokers: list[tuple[int, str, int]]) -> bytes:
        entries = b"".join(_flexible_broker(n, h, p, tags)
                           for (n, h, p), tags in zip(brokers, broker_tags, strict=True))
        return encode_response_header(17, 1) + plain[:4] + uvarint(len(brokers) + 1) + entries + rest

    result = rewrite_addresses(ApiKey.METADATA, version, with_brokers(REAL), 1, advertise)
    assert result.frame == with_brokers(PROXIED)
    assert result.frame.endswith(b"top-level-future")
    assert result.discovered == {n: (h, p) for n, h, p in REAL}


def test_metadata_splice_does_not_read_past_the_brokers() -> None:
    """What follows the brokers array is not the proxy's business: even bytes no schema accepts
    go on untouched, where the old path refused the whole response."""
    frame = response(MetadataResponse, 1, 3, **metadata_fields(1, REAL))
    array = metadata_brokers(frame, 4, 1)
    garbled = frame[: array.end] + b"\xff" * 7
    result = rewrite_addresses(ApiKey.METADATA, 1, garbled, 0, advertise)
    assert result.frame.endswith(b"\xff" * 7)
    assert result.discovered == {n: (h, p) for n, h, p in REAL}


hosts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
#: Node ids up to 2**20: the test's advertise maps node N to port 19000 + N, which must stay an int32.
brokers_strategy = st.lists(
    st.tuples(st.integers(-1, 2**20), hosts, st.integers(-(2**31), 2**31 - 1), st.none() | hosts),
    max_size=6)
topic_strategy = st.tuples(
    st.integers(-(2**15), 2**15 - 1), st.text(min_size=1, max_size=20), st.uuids(), st.booleans(),
    st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(-1, 2**31 - 1),
                       st.lists(st.integers(0, 2**31 - 1), max_size=4)), max_size=3))
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def metadata_frame(version: int, brokers: list[Broker], topics: list[Any], cluster_id: str | None) -> bytes:
    return response(MetadataResponse, version, 1, **{
        "throttle_time_ms": 0,
        "brokers": [MB(node_id=n, host=h, port=p, rack=r) for n, h, p, r in brokers],
        "cluster_id": cluster_id,
        "controller_id": 1,
        "topics": [MT(error_code=e, name=name, topic_id=tid, is_internal=internal,
                      partitions=[MP(error_code=0, partition_index=i, leader_id=leader, leader_epoch=0,
                                     replica_nodes=replicas, isr_nodes=replicas, offline_replicas=[])
                                  for i, leader, replicas in parts])
                   for e, name, tid, internal, parts in topics],
        "authorized_operations": set(),
        "error_code": 0,
    })


@PROPERTY
@given(version=st.sampled_from(range(14)), brokers=brokers_strategy,
       topics=st.lists(topic_strategy, max_size=8), cluster_id=st.none() | hosts)
def test_metadata_round_trip_property(version: int, brokers: list[Broker], topics: list[Any],
                                      cluster_id: str | None) -> None:
    frame = metadata_frame(version, brokers, topics, cluster_id)
    expected, seen = _decode_swap_encode(ApiKey.METADATA, version, frame, advertise)
    result = rewrite(ApiKey.METADATA, version, frame)
    assert result.frame == expected
    assert result.discovered == seen
    if not seen:
        assert result.frame is frame
    # The rewritten response decodes, with the proxy's addresses and the node ids kept.
    decoded = MetadataResponse.decode(result.frame[5 if version >= 9 else 4 :], version=version)
    assert [b.node_id for b in decoded.brokers] == [n for n, _h, _p, _r in brokers]


@PROPERTY
@given(version=st.sampled_from(range(3)), brokers=brokers_strategy, message=st.none() | hosts)
def test_describe_cluster_round_trip_property(version: int, brokers: list[Broker],
                                              message: str | None) -> None:
    frame = response(DescribeClusterResponse, version, 5, throttle_time_ms=0, error_code=0,
                     error_message=message, endpoint_type=2, cluster_id="c", controller_id=-1,
                     authorized_operations=set(),
                     brokers=[DCB(broker_id=n, host=h, port=p, rack=r, is_fenced=False)
                              for n, h, p, r in brokers])
    expected, seen = _decode_swap_encode(ApiKey.DESCRIBE_CLUSTER, version, frame, advertise)
    result = rewrite(ApiKey.DESCRIBE_CLUSTER, version, frame)
    assert result.frame == expected
    assert result.discovered == seen


@PROPERTY
@given(version=st.sampled_from(range(14)), brokers=brokers_strategy.filter(bool), data=st.data())
def test_metadata_truncated_or_garbled_raises_malformed_body_only(
        version: int, brokers: list[Broker], data: st.DataObject) -> None:
    frame = metadata_frame(version, brokers, [], "c")
    header = 5 if version >= 9 else 4
    array_end = metadata_brokers(frame, header, version).end
    cut = data.draw(st.integers(header, array_end - 1), label="cut")
    with pytest.raises(MalformedBody, match=rf"Metadata v{version} response of {cut} bytes does not parse"):
        rewrite(ApiKey.METADATA, version, frame[:cut])
    garbled = bytearray(frame)
    where = data.draw(st.integers(header, len(frame) - 1), label="where")
    garbled[where] ^= data.draw(st.integers(1, 255), label="flip")
    try:
        result = rewrite(ApiKey.METADATA, version, bytes(garbled))
    except MalformedBody:
        return
    assert len(result.frame) >= header


@PROPERTY
@given(key=st.sampled_from([ApiKey.METADATA, ApiKey.DESCRIBE_CLUSTER]), version=st.integers(0, 13),
       garbage=st.binary(max_size=120))
def test_any_body_gives_a_result_or_malformed_body(key: int, version: int, garbage: bytes) -> None:
    version = min(version, KNOWN_APIS[key].max_version)
    frame = encode_response_header(1, KNOWN_APIS[key].response_header_version(version)) + garbage
    try:
        result = rewrite(key, version, frame)
    except MalformedBody:
        return
    assert result.frame[:4] == frame[:4]
