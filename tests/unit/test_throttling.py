"""Body edits for throttling: the throttle field, emptied Fetch records, Fetch sizes, producer ids."""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest
from kafka.protocol.consumer import FetchRequest, FetchResponse, HeartbeatRequest, HeartbeatResponse
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataResponse
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)
from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder

from protocol.addresses import rewrite_addresses
from protocol.apis import KNOWN_APIS, ApiKey
from protocol.connection import Action, Mute, ProxyConnection, Throttled, ThrottleMode, ToClient
from protocol.errors import MalformedBody
from protocol.frames import FrameSplitter, frame
from protocol.headers import parse_request_header, response_body_offset
from protocol.sasl import ANONYMOUS
from protocol.skim import produce_producer_ids
from protocol.throttling import (
    ThrottleField,
    cap_fetch_bytes,
    empty_fetch_response,
    fetch_max_wait_ms,
    read_throttle,
    set_throttle,
    throttle_field,
)
from quotas.engine import EngineConfig, QuotaEngine, QuotaTable
from quotas.entity import DEFAULT, BucketKey, QuotaEntity
from quotas.rate import WindowConfig
from quotas.types import QuotaType

from .wire import (
    advertise,
    broker_frames,
    client_frames,
    correlation_id,
    framed,
    of_type,
    request,
    response,
    tagged_section,
    to_broker,
    to_client,
)

P, F, R, PIDS = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS

FT = FetchRequest.FetchTopic
FP = FT.FetchPartition
FTR = FetchResponse.FetchableTopicResponse
PD = FTR.PartitionData
PTD = ProduceRequest.TopicProduceData
PPD = PTD.PartitionProduceData
TPR = ProduceResponse.TopicProduceResponse
PPR = TPR.PartitionProduceResponse
MB = MetadataResponse.MetadataResponseBroker
AV = ApiVersionsResponse.ApiVersion

INT32_MAX = 2**31 - 1


def versions(key: int) -> range:
    spec = KNOWN_APIS[key]
    return range(spec.min_version, spec.max_version + 1)


def body_offset(frame: bytes, key: int, version: int) -> int:
    return response_body_offset(frame, KNOWN_APIS[key].response_header_version(version))


def decode_response(cls: Any, frame: bytes, version: int) -> Any:
    return cls.decode(memoryview(frame)[body_offset(frame, cls.API_KEY, version):], version=version)


# -- where the field is --------------------------------------------------------------------------


@pytest.mark.parametrize("version", versions(ApiKey.FETCH))
def test_fetch_field_is_first(version: int) -> None:
    assert throttle_field(ApiKey.FETCH, version) is ThrottleField.FIRST


@pytest.mark.parametrize("version", versions(ApiKey.METADATA))
def test_metadata_field_is_first_from_v3(version: int) -> None:
    expected = ThrottleField.FIRST if version >= 3 else ThrottleField.NONE
    assert throttle_field(ApiKey.METADATA, version) is expected


@pytest.mark.parametrize("version", versions(ApiKey.PRODUCE))
def test_produce_field_is_inside(version: int) -> None:
    assert throttle_field(ApiKey.PRODUCE, version) is ThrottleField.INSIDE


@pytest.mark.parametrize("version", versions(ApiKey.API_VERSIONS))
def test_api_versions_field_is_inside_from_v1(version: int) -> None:
    expected = ThrottleField.INSIDE if version >= 1 else ThrottleField.NONE
    assert throttle_field(ApiKey.API_VERSIONS, version) is expected


@pytest.mark.parametrize(("key", "version"), [
    *((ApiKey.SASL_HANDSHAKE, v) for v in versions(ApiKey.SASL_HANDSHAKE)),
    *((ApiKey.SASL_AUTHENTICATE, v) for v in versions(ApiKey.SASL_AUTHENTICATE)),
    (9999, 0),
])
def test_sasl_and_unknown_apis_have_no_field(key: int, version: int) -> None:
    assert throttle_field(key, version) is ThrottleField.NONE


@pytest.mark.parametrize(("key", "version", "expected"), [
    (12, 0, ThrottleField.NONE), (12, 1, ThrottleField.FIRST),  # Heartbeat
    (10, 0, ThrottleField.NONE), (10, 1, ThrottleField.FIRST),  # FindCoordinator
    (22, 0, ThrottleField.FIRST),  # InitProducerId
    (48, 0, ThrottleField.FIRST), (60, 0, ThrottleField.FIRST),  # DescribeClientQuotas, DescribeCluster
])
def test_other_apis_follow_kip_219_table(key: int, version: int, expected: ThrottleField) -> None:
    assert throttle_field(key, version) is expected


# -- reading and patching in place ----------------------------------------------------------------


def metadata_response(version: int, throttle: int = 0) -> bytes:
    fields: dict[str, object] = {
        "brokers": [MB(node_id=1, host="kafka-1", port=9092, rack=None)], "controller_id": 1, "topics": [],
    }
    if version >= 2:
        fields["cluster_id"] = "cluster"
    if version >= 3:
        fields["throttle_time_ms"] = throttle
    return response(MetadataResponse, version, 5, **fields)


@pytest.mark.parametrize("version", [3, 9, 12, 13])
def test_set_throttle_first_changes_only_those_four_bytes(version: int) -> None:
    frame = metadata_response(version, throttle=7)
    offset = body_offset(frame, ApiKey.METADATA, version)
    assert read_throttle(ApiKey.METADATA, version, frame, offset) == 7
    patched = set_throttle(ApiKey.METADATA, version, frame, offset, 1234)
    assert len(patched) == len(frame)
    changed = [i for i, (a, b) in enumerate(zip(frame, patched, strict=True)) if a != b]
    assert changed and all(offset <= i < offset + 4 for i in changed)
    assert patched[offset:offset + 4] == (1234).to_bytes(4, "big")
    assert read_throttle(ApiKey.METADATA, version, patched, offset) == 1234
    assert decode_response(MetadataResponse, patched, version).throttle_time_ms == 1234


def test_set_throttle_clamps_to_int32() -> None:
    frame = metadata_response(12)
    offset = body_offset(frame, ApiKey.METADATA, 12)
    negative = set_throttle(ApiKey.METADATA, 12, frame, offset, -5)
    assert read_throttle(ApiKey.METADATA, 12, negative, offset) == 0
    huge = set_throttle(ApiKey.METADATA, 12, frame, offset, 10**12)
    assert read_throttle(ApiKey.METADATA, 12, huge, offset) == INT32_MAX


@pytest.mark.parametrize("version", [0, 1, 2])
def test_set_throttle_without_field_leaves_the_frame(version: int) -> None:
    frame = metadata_response(version)
    offset = body_offset(frame, ApiKey.METADATA, version)
    assert set_throttle(ApiKey.METADATA, version, frame, offset, 500) == frame
    assert read_throttle(ApiKey.METADATA, version, frame, offset) == 0


def test_heartbeat_throttle_patched() -> None:
    frame = response(HeartbeatResponse, 4, 9, throttle_time_ms=0, error_code=27)
    offset = body_offset(frame, 12, 4)
    decoded = decode_response(HeartbeatResponse, set_throttle(12, 4, frame, offset, 321), 4)
    assert (decoded.throttle_time_ms, decoded.error_code) == (321, 27)


def produce_response(version: int, throttle: int = 0) -> bytes:
    topic: dict[str, object] = {"partition_responses": [
        PPR(index=0, error_code=0, base_offset=1000, log_append_time_ms=-1, log_start_offset=3,
            record_errors=[], error_message=None),
        PPR(index=4, error_code=6, base_offset=-1, log_append_time_ms=-1, log_start_offset=-1,
            record_errors=[TPR.PartitionProduceResponse.BatchIndexAndErrorMessage(
                batch_index=2, batch_index_error_message="bad")] if version >= 8 else [],
            error_message="not leader" if version >= 8 else None),
    ]}
    if version >= 13:
        topic["topic_id"] = uuid.UUID(int=42)
    else:
        topic["name"] = "orders"
    return response(ProduceResponse, version, 11, responses=[TPR(**topic)], throttle_time_ms=throttle)


def partition_results(message: Any) -> list[tuple[object, ...]]:
    return [(p.index, p.error_code, p.base_offset, p.log_start_offset, p.error_message,
             [(e.batch_index, e.batch_index_error_message) for e in p.record_errors])
            for topic in message.responses for p in topic.partition_responses]


@pytest.mark.parametrize("version", versions(ApiKey.PRODUCE))
def test_set_throttle_in_produce_keeps_partition_results(version: int) -> None:
    frame = produce_response(version, throttle=0)
    offset = body_offset(frame, ApiKey.PRODUCE, version)
    before = decode_response(ProduceResponse, frame, version)
    patched = set_throttle(ApiKey.PRODUCE, version, frame, offset, 2100)
    after = decode_response(ProduceResponse, patched, version)
    assert after.throttle_time_ms == 2100
    assert partition_results(after) == partition_results(before)
    assert len(partition_results(after)) == 2
    assert patched[:offset] == frame[:offset]  # header (correlation id) untouched
    if version >= 13:
        assert after.responses[0].topic_id == uuid.UUID(int=42)
    else:
        assert after.responses[0].name == "orders"


def test_set_throttle_in_produce_keeps_node_endpoints() -> None:
    """Produce v10+ carries NodeEndpoints as a tagged field after the throttle: it must survive."""
    endpoint = ProduceResponse.NodeEndpoint(node_id=3, host="kafka-3", port=9092, rack="r1")
    frame = response(ProduceResponse, 11, 1, responses=[], throttle_time_ms=0, node_endpoints=[endpoint])
    offset = body_offset(frame, ApiKey.PRODUCE, 11)
    after = decode_response(ProduceResponse, set_throttle(ApiKey.PRODUCE, 11, frame, offset, 50), 11)
    assert after.throttle_time_ms == 50
    assert [(e.node_id, e.host, e.port, e.rack) for e in after.node_endpoints] == [(3, "kafka-3", 9092, "r1")]


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_set_throttle_in_api_versions(version: int) -> None:
    fields: dict[str, object] = {
        "error_code": 0, "throttle_time_ms": 0,
        "api_keys": [AV(api_key=0, min_version=3, max_version=11),
                     AV(api_key=1, min_version=4, max_version=17)],
    }
    frame = response(ApiVersionsResponse, version, 1, **fields)
    offset = 4  # ApiVersions responses always use header v0
    patched = set_throttle(ApiKey.API_VERSIONS, version, frame, offset, 77)
    after = decode_response(ApiVersionsResponse, patched, version)
    assert after.throttle_time_ms == 77
    assert [(a.api_key, a.min_version, a.max_version) for a in after.api_keys] == [(0, 3, 11), (1, 4, 17)]


# -- emptied fetch responses ----------------------------------------------------------------------

RECORDS = b"\x00" * 8 + (60).to_bytes(4, "big") + b"\x01" * 60  # opaque to the proxy


def fetch_response(version: int, session_id: int = 0, throttle: int = 0) -> bytes:
    def partition(index: int, error: int, records: bytes | None) -> Any:
        return PD(partition_index=index, error_code=error, high_watermark=1000 + index,
                  last_stable_offset=900 + index, log_start_offset=10 + index,
                  aborted_transactions=[PD.AbortedTransaction(producer_id=77, first_offset=905)],
                  preferred_read_replica=-1, records=records)

    topic: dict[str, object] = {"partitions": [partition(0, 0, RECORDS), partition(1, 1, RECORDS),
                                               partition(2, 0, None)]}
    if version >= 13:
        topic["topic_id"] = uuid.UUID(int=7)
    else:
        topic["topic"] = "orders"
    return response(FetchResponse, version, 21, throttle_time_ms=throttle, error_code=0,
                    session_id=session_id, responses=[FTR(**topic)])


def partition_state(message: Any) -> list[tuple[object, ...]]:
    return [(p.partition_index, p.error_code, p.high_watermark, p.last_stable_offset, p.log_start_offset,
             [(a.producer_id, a.first_offset) for a in p.aborted_transactions or []])
            for topic in message.responses for p in topic.partitions]


@pytest.mark.parametrize("version", versions(ApiKey.FETCH))
def test_empty_fetch_response_keeps_all_but_records(version: int) -> None:
    session = 1234 if version >= 7 else 0
    frame = fetch_response(version, session_id=session)
    offset = body_offset(frame, ApiKey.FETCH, version)
    before = decode_response(FetchResponse, frame, version)
    emptied = empty_fetch_response(frame, offset, version, 3000)
    after = decode_response(FetchResponse, emptied, version)
    assert emptied[:offset] == frame[:offset]
    assert after.throttle_time_ms == 3000
    assert read_throttle(ApiKey.FETCH, version, emptied, offset) == 3000
    assert after.session_id == session
    assert after.error_code == 0
    assert partition_state(after) == partition_state(before)
    records = [p.records for topic in after.responses for p in topic.partitions]
    assert [bytes(r) if r is not None else None for r in records] == [b"", b"", None]
    assert len(emptied) < len(frame) - 2 * len(RECORDS) + 8
    if version >= 13:
        assert after.responses[0].topic_id == uuid.UUID(int=7)


@pytest.mark.parametrize("version", [16, 17, 18])
def test_empty_fetch_response_keeps_the_v16_tagged_fields(version: int) -> None:
    """NodeEndpoints (rewritten before the throttle applies) and a tag kafka-python does not know
    stay byte for byte; its encoder alone would drop the unknown one."""
    plain = fetch_response(version)
    assert plain.endswith(b"\x00")  # no top-level tagged fields
    # One NodeEndpoint: count, node id, host, port, rack (null), its tagged fields.
    endpoint = b"\x02" + (2).to_bytes(4, "big") + b"\x02b" + (9092).to_bytes(4, "big") + b"\x00\x00"
    frame = plain[:-1] + tagged_section({0: endpoint, 7: b"future"})
    rewritten = rewrite_addresses(ApiKey.FETCH, version, frame, 1, advertise).frame
    offset = body_offset(rewritten, ApiKey.FETCH, version)
    emptied = empty_fetch_response(rewritten, offset, version, 3000)
    after = decode_response(FetchResponse, emptied, version)
    assert [(e.node_id, e.host, e.port) for e in after.node_endpoints] == [(2, *advertise(2))]
    assert after.unknown_tags == {"_7": b"future"}
    assert after.throttle_time_ms == 3000
    assert [p.records for t in after.responses for p in t.partitions] == [b"", b"", None]


def test_empty_fetch_response_clamps_the_throttle() -> None:
    frame = fetch_response(12)
    offset = body_offset(frame, ApiKey.FETCH, 12)
    emptied = empty_fetch_response(frame, offset, 12, 2**40)
    assert decode_response(FetchResponse, emptied, 12).throttle_time_ms == INT32_MAX


def test_empty_fetch_response_of_garbage_is_malformed() -> None:
    frame = fetch_response(12)
    offset = body_offset(frame, ApiKey.FETCH, 12)
    with pytest.raises(MalformedBody, match="Fetch response v12"):
        empty_fetch_response(frame[: offset + 20], offset, 12, 10)


def test_version_above_the_schemas_has_no_known_field() -> None:
    too_new = KNOWN_APIS[ApiKey.METADATA].max_version + 1
    assert throttle_field(ApiKey.METADATA, too_new) is ThrottleField.NONE
    assert throttle_field(ApiKey.METADATA, -1) is ThrottleField.NONE
    frame = b"\x00\x00\x00\x01\x00" + b"\x00" * 12
    assert set_throttle(ApiKey.METADATA, too_new, frame, 5, 100) is frame


def test_throttle_not_patched_into_a_response_too_short_for_it() -> None:
    short = response(HeartbeatResponse, 4, 1, throttle_time_ms=0, error_code=0)[:7]
    with pytest.raises(MalformedBody, match="Heartbeat v4 response of 7 bytes ends before its throttle"):
        set_throttle(12, 4, short, 5, 100)  # Heartbeat


# -- fetch request sizes --------------------------------------------------------------------------


def fetch_request(version: int, max_wait: int = 500, min_bytes: int = 1,
                  max_bytes: int = 52_428_800) -> bytes:
    topic: dict[str, object] = {"partitions": [FP(partition=0, current_leader_epoch=5, fetch_offset=42,
                                                  last_fetched_epoch=-1, log_start_offset=-1,
                                                  partition_max_bytes=1_048_576)]}
    if version >= 13:
        topic["topic_id"] = uuid.UUID(int=7)
    else:
        topic["topic"] = "orders"
    extra: dict[str, object] = {}
    if version >= 15:
        extra["replica_state"] = FetchRequest.ReplicaState(replica_id=-1, replica_epoch=-1)
    return request(FetchRequest, version, 3, "consumer-1", replica_id=-1, max_wait_ms=max_wait,
                   min_bytes=min_bytes, max_bytes=max_bytes, isolation_level=1, session_id=99,
                   session_epoch=4, topics=[FT(**topic)], forgotten_topics_data=[], rack_id="rack-a",
                   **extra)


def decode_request(frame: bytes) -> Any:
    header = parse_request_header(frame)
    return FetchRequest.decode(memoryview(frame)[header.body_offset:], version=header.api_version)


CAP_VERSIONS = [4, 11, 12, 13, 14, 15, 16, 17, 18]


@pytest.mark.parametrize("version", CAP_VERSIONS)
def test_fetch_max_wait_is_read(version: int) -> None:
    frame = fetch_request(version, max_wait=777)
    assert fetch_max_wait_ms(frame, parse_request_header(frame)) == 777


@pytest.mark.parametrize("version", CAP_VERSIONS)
def test_cap_lowers_max_and_min_bytes(version: int) -> None:
    frame = fetch_request(version, min_bytes=50_000, max_bytes=52_428_800)
    capped = cap_fetch_bytes(frame, parse_request_header(frame), 25_000)
    before, after = decode_request(frame), decode_request(capped)
    assert (after.max_bytes, after.min_bytes) == (25_000, 25_000)
    assert len(capped) == len(frame)
    assert after.max_wait_ms == before.max_wait_ms == 500
    assert after.isolation_level == 1
    if version >= 7:
        assert (after.session_id, after.session_epoch) == (99, 4)
    if version >= 11:
        assert after.rack_id == "rack-a"
    assert after.topics[0].partitions[0].fetch_offset == 42
    assert after.topics[0].partitions[0].partition_max_bytes == 1_048_576
    if version < 15:
        assert after.replica_id == -1


@pytest.mark.parametrize("version", CAP_VERSIONS)
def test_cap_keeps_a_smaller_min_bytes(version: int) -> None:
    frame = fetch_request(version, min_bytes=1, max_bytes=52_428_800)
    after = decode_request(cap_fetch_bytes(frame, parse_request_header(frame), 25_000))
    assert (after.max_bytes, after.min_bytes) == (25_000, 1)


@pytest.mark.parametrize("version", [11, 15])
def test_cap_above_max_bytes_leaves_the_frame(version: int) -> None:
    frame = fetch_request(version, max_bytes=10_000)
    assert cap_fetch_bytes(frame, parse_request_header(frame), 25_000) is frame


@pytest.mark.parametrize("version", [0, 1, 2])
def test_cap_leaves_a_fetch_without_max_bytes(version: int) -> None:
    """Found by the property tests: before v3 the bytes where max_bytes would be are the topics
    array's count, which the cap used to lower (here from 2 topics to 1)."""
    topics = [FT(topic=name, partitions=[FP(partition=0, fetch_offset=1, partition_max_bytes=100)])
              for name in ("a", "b")]
    frame = request(FetchRequest, version, 3, "old-consumer", replica_id=-1, max_wait_ms=500,
                    min_bytes=50_000, topics=topics)
    assert cap_fetch_bytes(frame, parse_request_header(frame), 1) is frame
    assert [t.topic for t in decode_request(frame).topics] == ["a", "b"]


def test_truncated_fetch_request_is_malformed() -> None:
    frame = fetch_request(11)
    header = parse_request_header(frame)
    short = frame[: header.body_offset + 10]
    with pytest.raises(MalformedBody):
        cap_fetch_bytes(short, header, 100)
    with pytest.raises(MalformedBody):
        fetch_max_wait_ms(frame[: header.body_offset + 6], header)


# -- producer ids in record batches --------------------------------------------------------------


def batch(producer_id: int = -1, epoch: int = -1, sequence: int = -1, *, transactional: bool = False,
          compression: int = 0, records: int = 3) -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=compression, batch_size=1 << 20,
                                   transactional=transactional, producer_id=producer_id,
                                   producer_epoch=epoch, base_sequence=sequence)
    for i in range(records):
        builder.append(timestamp=1_700_000_000_000 + i, key=b"k%d" % i, value=b"v" * 50)
    builder.close()
    return bytes(builder.buffer())


def produce_request(version: int, partitions: dict[str, list[bytes | None]]) -> bytes:
    topics = []
    for index, (name, records) in enumerate(partitions.items()):
        data = [PPD(index=i, records=r) for i, r in enumerate(records)]
        topic: dict[str, object] = {"partition_data": data}
        if version >= 13:
            topic["topic_id"] = uuid.UUID(int=index + 1)
        else:
            topic["name"] = name
        topics.append(PTD(**topic))
    return request(ProduceRequest, version, 1, "producer-1", transactional_id="tx" if version >= 3 else None,
                   acks=-1, timeout_ms=30_000, topic_data=topics)


def pids(frame: bytes) -> list[int]:
    return produce_producer_ids(frame, parse_request_header(frame))


def test_built_batches_carry_the_producer_id() -> None:
    """The builder really writes the ids we look for (read back with kafka-python's own reader)."""
    data = batch(4242, 3, 17) + batch(5353, 0, 0)
    read = MemoryRecords(data)
    found = []
    while (b := read.next_batch()) is not None:
        found.append((b.producer_id, b.producer_epoch, b.base_sequence))
    assert found == [(4242, 3, 17), (5353, 0, 0)]


@pytest.mark.parametrize("version", versions(ApiKey.PRODUCE))
def test_producer_id_of_an_idempotent_batch(version: int) -> None:
    assert pids(produce_request(version, {"orders": [batch(4242, 0, 0)]})) == [4242]


@pytest.mark.parametrize("version", [3, 9, 13])
def test_producer_ids_of_several_batches_partitions_and_topics(version: int) -> None:
    frame = produce_request(version, {
        "orders": [batch(1, 0, 0) + batch(2, 5, 100) + batch(3, 0, 7), batch(4, 1, 0)],
        "payments": [batch(5, 0, 0, transactional=True), batch(-1)],
    })
    assert pids(frame) == [1, 2, 3, 4, 5]


def test_producer_id_of_a_compressed_batch() -> None:
    """The batch header stays uncompressed: gzip (the codec in the standard library) shows it."""
    frame = produce_request(9, {"orders": [batch(9_000_000_001, 2, 0, compression=1, records=20)]})
    assert pids(frame) == [9_000_000_001]


def test_non_idempotent_batches_have_no_producer_id() -> None:
    frame = produce_request(9, {"orders": [batch(-1), batch(-1) + batch(-1)], "logs": [None, b""]})
    assert pids(frame) == []


def test_mixed_idempotent_and_plain_batches() -> None:
    frame = produce_request(9, {"orders": [batch(-1) + batch(77, 0, 0) + batch(-1) + batch(78, 0, 3)]})
    assert pids(frame) == [77, 78]


def test_truncated_batch_is_not_misread() -> None:
    """A batch cut short after its header still yields its id; a half header yields nothing."""
    whole = batch(31, 0, 0)
    assert pids(produce_request(9, {"orders": [whole + whole[:61]]})) == [31, 31]
    assert pids(produce_request(9, {"orders": [whole + whole[:40]]})) == [31]


def test_unparseable_produce_request_is_malformed() -> None:
    frame = produce_request(9, {"orders": [batch(1, 0, 0)]})
    header = parse_request_header(frame)
    with pytest.raises(MalformedBody, match="Produce v9 request"):
        produce_producer_ids(frame[: header.body_offset + 12], header)


@pytest.mark.parametrize("version", [3, 8, 9, 13])
def test_every_truncated_produce_request_is_malformed(version: int) -> None:
    """The hand-written reader notices any missing byte, records included, as a decoder would."""
    frame = produce_request(version, {"orders": [batch(1, 0, 0)], "logs": [None, batch(2, 0, 0)]})
    header = parse_request_header(frame)
    assert pids(frame) == [1, 2]
    for cut in range(header.body_offset, len(frame)):
        with pytest.raises(MalformedBody, match=f"Produce v{version} request"):
            produce_producer_ids(frame[:cut], header)


# == a whole connection with a real QuotaEngine and a fake clock ================================
#
# The proxy may decide a throttle when a request arrives (Produce bytes, producer ids) or when its
# response comes back (Fetch bytes, request time); these tests check what the client experiences
# over the whole exchange, so they hold either way: the response carries the throttle, and the
# connection is muted for it exactly once.


def engine_with(table: QuotaTable, config: EngineConfig | None = None) -> QuotaEngine:
    engine = QuotaEngine(config)
    engine.set_quotas(table)
    return engine


def proxy(engine: QuotaEngine, mode: ThrottleMode = "mute") -> ProxyConnection:
    return ProxyConnection(advertise, name="quota-test", policy=engine, throttle_mode=mode)


def kafka_throttle(observed: float, bound: float, window_ms: int = 10_000) -> int:
    """QuotaUtils.throttleTime, written out independently of the code under test."""
    return math.floor((observed - bound) / bound * window_ms + 0.5)


def acks_request(cid: int, acks: int, version: int = 9, records: bytes = b"\x00" * 70) -> bytes:
    topic = PTD(name="orders", partition_data=[PPD(index=0, records=records)])
    return request(ProduceRequest, version, cid, "producer-1", transactional_id=None, acks=acks,
                   timeout_ms=30_000, topic_data=[topic])


def ok_produce_response(cid: int, version: int = 9, throttle: int = 0) -> bytes:
    results = [TPR(name="orders", partition_responses=[
        PPR(index=0, error_code=0, base_offset=500, log_append_time_ms=-1, log_start_offset=0,
            record_errors=[], error_message=None)])]
    return response(ProduceResponse, version, cid, responses=results, throttle_time_ms=throttle)


def heartbeat_request(cid: int) -> bytes:
    return request(HeartbeatRequest, 4, cid, "consumer-1", group_id="g", generation_id=1, member_id="m",
                   group_instance_id=None)


def heartbeat_response(cid: int, throttle: int = 0) -> bytes:
    return response(HeartbeatResponse, 4, cid, throttle_time_ms=throttle, error_code=0)


def consumer_fetch_request(cid: int, version: int = 12, max_wait: int = 500, min_bytes: int = 1,
                           max_bytes: int = 52_428_800) -> bytes:
    whole = fetch_request(version, max_wait=max_wait, min_bytes=min_bytes, max_bytes=max_bytes)
    return whole[:4] + cid.to_bytes(4, "big") + whole[8:]


def records_fetch_response(cid: int, version: int = 12, throttle: int = 0, session_id: int = 55) -> bytes:
    whole = fetch_response(version, session_id=session_id, throttle=throttle)
    return cid.to_bytes(4, "big") + whole[4:]


def throttles(actions: list[Action]) -> tuple[list[int], list[int]]:
    """(Throttled ms, Mute ms) among the actions."""
    return ([a.throttle_ms for a in of_type(actions, Throttled)], [a.ms for a in of_type(actions, Mute)])


def exchange(conn: ProxyConnection, req: bytes, resp: bytes, sent_ms: int,
             answered_ms: int) -> tuple[list[Action], list[Action]]:
    up = conn.receive_from_client(frame(req), now_ms=sent_ms)
    down = conn.receive_from_broker(frame(resp), now_ms=answered_ms)
    return up, down


ANON = QuotaEntity(ANONYMOUS, None)
EVERYONE = QuotaEntity(None, DEFAULT)


# -- produce -----------------------------------------------------------------------------------


def test_produce_over_quota_is_answered_with_throttle_and_muted() -> None:
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine)
    req = acks_request(1, acks=1)
    up, down = exchange(conn, req, ok_produce_response(1), 1000, 1020)
    assert to_broker(up) == frame(req)
    expected = kafka_throttle(len(req) * 1000 / 10_000, 10)  # header + body over the padded 10 s
    assert expected > 0
    (answer,) = client_frames(down)
    assert correlation_id(answer) == 1
    decoded = decode_response(ProduceResponse, answer, 9)
    assert decoded.throttle_time_ms == expected
    assert partition_results(decoded) == [(0, 0, 500, 0, None, [])]
    assert throttles(up + down) == ([expected], [expected])


def test_produce_below_quota_is_untouched() -> None:
    engine = engine_with({ANON: {P: 10**6, R: 100.0}})
    conn = proxy(engine)
    up, down = exchange(conn, acks_request(1, acks=-1), ok_produce_response(1), 0, 3)
    assert to_client(down) == frame(ok_produce_response(1))
    assert throttles(up + down) == ([], [])


def test_broker_throttle_passes_when_the_proxy_does_not_throttle() -> None:
    engine = engine_with({ANON: {P: 10**6}})
    conn = proxy(engine)
    up, down = exchange(conn, acks_request(1, acks=1), ok_produce_response(1, throttle=4321), 0, 3)
    assert to_client(down) == frame(ok_produce_response(1, throttle=4321))
    assert throttles(up + down) == ([], [])


def test_broker_larger_produce_throttle_is_kept() -> None:
    """Proxy and broker throttles combine by max, also where the field sits inside the body."""
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine)
    req = acks_request(1, acks=1)
    up, down = exchange(conn, req, ok_produce_response(1, throttle=60_000), 0, 5)
    mine = kafka_throttle(len(req) / 10, 10)
    assert 0 < mine < 60_000
    assert throttles(up + down) == ([mine], [mine])
    (answer,) = client_frames(down)
    assert decode_response(ProduceResponse, answer, 9).throttle_time_ms == 60_000


def test_broker_larger_fetch_throttle_is_kept() -> None:
    engine = engine_with({ANON: {F: 10}})
    conn = proxy(engine)
    up, down = exchange(conn, consumer_fetch_request(1), records_fetch_response(1, throttle=60_000), 0, 1)
    (answer,) = client_frames(down)
    assert decode_response(FetchResponse, answer, 12).throttle_time_ms == 60_000
    (mine,), _ = throttles(up + down)
    assert 0 < mine < 60_000


def test_proxy_larger_throttle_replaces_a_smaller_broker_one() -> None:
    engine = engine_with({ANON: {R: 1.0}})
    conn = proxy(engine)
    _, down = exchange(conn, heartbeat_request(1), heartbeat_response(1, throttle=20), 0, 105)
    (answer,) = client_frames(down)
    assert decode_response(HeartbeatResponse, answer, 4).throttle_time_ms == 500


def test_acks_zero_produce_over_quota_is_muted_at_once() -> None:
    engine = engine_with({ANON: {P: 10, R: 0.001}})
    conn = proxy(engine)
    req = acks_request(1, acks=0)
    up = conn.receive_from_client(frame(req), now_ms=2000)
    expected = kafka_throttle(len(req) / 10, 10)
    assert to_broker(up) == frame(req)
    assert throttles(up) == ([expected], [expected])
    assert not of_type(up, ToClient)
    assert conn.in_flight == 0
    # no request time is charged for it (Kafka exempts acks=0 from the request quota)
    assert engine.managers[R].buckets == {}


def test_acks_zero_produce_takes_no_response_slot_when_throttled() -> None:
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine)
    conn.receive_from_client(frame(acks_request(1, acks=0)), now_ms=0)
    up, down = exchange(conn, heartbeat_request(2), heartbeat_response(2), 60_000, 60_001)
    assert [correlation_id(f) for f in client_frames(down)] == [2]
    assert throttles(up + down) == ([], [])


def test_acks_zero_produce_within_quota_is_not_muted() -> None:
    engine = engine_with({ANON: {P: 10**6}})
    conn = proxy(engine)
    req = acks_request(1, acks=0)
    up = conn.receive_from_client(frame(req), now_ms=0)
    assert throttles(up) == ([], [])
    assert engine.managers[P].buckets[BucketKey(ANONYMOUS, "")].rate.total(0) == len(req)


def test_produce_bytes_are_charged_to_the_sasl_user() -> None:
    engine = engine_with({QuotaEntity("alice", None): {P: 10}})
    conn = proxy(engine)
    exchange(conn, request(SaslHandshakeRequest, 1, 1, mechanism="PLAIN"),
             response(SaslHandshakeResponse, 1, 1, error_code=0, mechanisms=["PLAIN"]), 0, 1)
    exchange(conn, request(SaslAuthenticateRequest, 2, 2, auth_bytes=b"\x00alice\x00pw"),
             response(SaslAuthenticateResponse, 2, 2, error_code=0, error_message=None, auth_bytes=b"",
                      session_lifetime_ms=0), 2, 3)
    assert conn.principal == "alice"
    req = acks_request(3, acks=1)
    up, down = exchange(conn, req, ok_produce_response(3), 4, 5)
    expected = kafka_throttle(len(req) / 10, 10)
    assert throttles(up + down) == ([expected], [expected])
    assert set(engine.managers[P].buckets) == {BucketKey("alice", "")}


def test_producer_ids_are_charged_when_the_user_has_that_quota() -> None:
    # two 10 s samples: the rate is padded to 10 s, and ids are remembered for 5 to 10 s
    engine = engine_with({ANON: {PIDS: 1.0}}, EngineConfig(pid_window=WindowConfig(2, 10_000)))
    conn = proxy(engine)
    ids = b"".join(batch(1000 + i, 0, 0, records=1) for i in range(11))  # 11 new ids over 10 s: 1.1/s
    up, down = exchange(conn, acks_request(1, acks=-1, records=ids), ok_produce_response(1), 0, 2)
    assert throttles(up + down) == ([1000], [1000])
    (answer,) = client_frames(down)
    assert decode_response(ProduceResponse, answer, 9).throttle_time_ms == 1000
    # after the throttle, the same ids again are not new
    up, down = exchange(conn, acks_request(2, acks=-1, records=ids), ok_produce_response(2), 1500, 1502)
    assert throttles(up + down) == ([], [])
    # one more new id: 12 over 11.5 s -> (12/11.5 - 1) * 11500 = 500 ms
    more = ids + batch(2000, 0, 0, records=1)
    up, down = exchange(conn, acks_request(3, acks=-1, records=more), ok_produce_response(3), 1500, 1503)
    assert throttles(up + down) == ([500], [500])


def test_producer_ids_are_not_read_for_users_without_that_quota() -> None:
    engine = engine_with({QuotaEntity("alice", None): {PIDS: 1.0}},
                         EngineConfig(pid_window=WindowConfig(11, 1000)))
    conn = proxy(engine)
    ids = b"".join(batch(1000 + i, 0, 0, records=1) for i in range(50))
    up, down = exchange(conn, acks_request(1, acks=-1, records=ids), ok_produce_response(1), 0, 2)
    assert throttles(up + down) == ([], [])
    assert engine.producer_ids.users == 0


# -- fetch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [4, 12, 13, 16])
def test_fetch_over_consumer_quota_is_answered_empty_with_throttle(version: int) -> None:
    engine = engine_with({ANON: {F: 10}})
    conn = proxy(engine)
    broker_answer = records_fetch_response(1, version, session_id=55 if version >= 7 else 0)
    up, down = exchange(conn, consumer_fetch_request(1, version), broker_answer, 0, 3)
    size = len(broker_answer) - body_offset(broker_answer, ApiKey.FETCH, version) + 4
    expected = kafka_throttle(size / 10, 10)
    (answer,) = client_frames(down)
    decoded = decode_response(FetchResponse, answer, version)
    assert decoded.throttle_time_ms == expected
    assert throttles(up + down) == ([expected], [expected])
    assert decoded.session_id == (55 if version >= 7 else 0)
    records = [p.records for t in decoded.responses for p in t.partitions]
    assert [bytes(r) if r is not None else None for r in records] == [b"", b"", None]
    assert partition_state(decoded) == partition_state(decode_response(FetchResponse, broker_answer, version))
    # the bytes the client did not get are not counted
    assert engine.managers[F].buckets[BucketKey(ANONYMOUS, "")].rate.total(3) == 0


def test_metrics_see_the_empty_fetch_the_client_got() -> None:
    """Response bytes per API count what went to the client, not what the broker sent."""
    seen: list[tuple[int, int, int, float]] = []
    conn = ProxyConnection(advertise, policy=engine_with({ANON: {F: 10}}),
                           observer=lambda *exchange: seen.append(exchange))
    broker_answer = records_fetch_response(1, 12)
    _, down = exchange(conn, consumer_fetch_request(1), broker_answer, 0, 3)
    (answer,) = client_frames(down)
    assert len(answer) < len(broker_answer)
    assert [(key, size) for key, _, size, _ in seen] == [(ApiKey.FETCH, len(answer))]


def test_fetch_within_consumer_quota_is_untouched() -> None:
    engine = engine_with({ANON: {F: 10**6}})
    conn = proxy(engine)
    _, down = exchange(conn, consumer_fetch_request(1), records_fetch_response(1), 0, 3)
    assert to_client(down) == frame(records_fetch_response(1))


@pytest.mark.parametrize("version", [4, 11, 12, 15, 18])
def test_fetch_request_max_bytes_capped_under_a_consumer_quota(version: int) -> None:
    engine = engine_with({ANON: {F: 2500}})
    conn = proxy(engine)
    up = conn.receive_from_client(frame(consumer_fetch_request(1, version, min_bytes=30_000)), now_ms=0)
    (forwarded,) = broker_frames(up)
    decoded = decode_request(forwarded)
    assert (decoded.max_bytes, decoded.min_bytes) == (25_000, 25_000)
    assert decoded.max_wait_ms == 500


def test_fetch_request_untouched_without_a_consumer_quota() -> None:
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine)
    req = consumer_fetch_request(1)
    assert to_broker(conn.receive_from_client(frame(req), now_ms=0)) == frame(req)


# -- delay mode ----------------------------------------------------------------------------------


def client_writes(actions: list[Action]) -> list[tuple[int, list[int]]]:
    """(delay_ms, correlation ids) of each ToClient, in action order."""
    return [(a.delay_ms, [correlation_id(f) for f in FrameSplitter(2**31 - 1).feed(b"".join(a.chunks))])
            for a in of_type(actions, ToClient)]


def request_ids(actions: list[Action]) -> list[int]:
    """Correlation ids of the requests forwarded to the broker, in order."""
    return [parse_request_header(f).correlation_id for f in FrameSplitter(2**31 - 1).feed(to_broker(actions))]


def test_delay_mode_holds_the_throttled_response_and_what_follows() -> None:
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine, mode="delay")
    req = acks_request(2, acks=1)
    up = conn.receive_from_client(framed(heartbeat_request(1), req, heartbeat_request(3)), now_ms=0)
    # the request after the throttled Produce waits unread until the mute passes
    assert request_ids(up) == [1, 2]
    down = conn.receive_from_broker(framed(heartbeat_response(1), ok_produce_response(2)), now_ms=4)
    expected = kafka_throttle(len(req) / 10, 10)
    # the earlier answer goes at once, the throttled one after its throttle
    assert client_writes(down) == [(0, [1]), (expected, [2])]
    held = next(a for a in of_type(down, ToClient) if a.delay_ms)
    (produce_answer,) = FrameSplitter(2**31 - 1).feed(b"".join(held.chunks))
    assert decode_response(ProduceResponse, produce_answer, 9).throttle_time_ms == expected
    assert throttles(up + down) == ([expected], [expected])
    resumed = conn.resume(now_ms=expected + 1)
    assert request_ids(resumed) == [3]
    assert client_writes(conn.receive_from_broker(frame(heartbeat_response(3)), now_ms=expected + 2)) == [
        (0, [3])]


def test_requests_behind_a_throttled_produce_wait_and_are_charged_when_they_go_on() -> None:
    """A broker reads nothing from a muted connection: pipelined Produce requests behind a
    throttled one are neither forwarded nor charged until the mute has passed."""
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine)
    first, second, third = (acks_request(cid, acks=1) for cid in (1, 2, 3))
    up = conn.receive_from_client(framed(first, second, third), now_ms=0)
    assert to_broker(up) == frame(first)
    (mute,) = of_type(up, Mute)
    assert mute.ms == kafka_throttle(len(first) / 10, 10)
    assert conn.in_flight == 1
    # a timer firing early only re-arms the mute
    (early,) = conn.resume(now_ms=mute.ms - 3)
    assert isinstance(early, Mute) and 3 <= early.ms <= 4
    # more bytes while muted wait behind them, and re-arm the mute for what is left of it (the
    # I/O layer's timer may have fired a hair early: nothing would wake the waiting requests)
    assert conn.receive_from_client(frame(acks_request(4, acks=1)), now_ms=mute.ms - 0.4) == [Mute(1)]
    resumed = conn.resume(now_ms=mute.ms)
    assert request_ids(resumed) == [2]
    (again,) = of_type(resumed, Mute)
    assert again.ms > 0  # charged now, and still over the quota: the next wait
    assert conn.resume(now_ms=mute.ms + again.ms + 1) != []


def test_delay_mode_fetch_is_held_and_emptied() -> None:
    engine = engine_with({ANON: {F: 10}})
    conn = proxy(engine, mode="delay")
    _, down = exchange(conn, consumer_fetch_request(7), records_fetch_response(7), 0, 2)
    ((delay, ids),) = client_writes(down)
    assert ids == [7] and delay > 0
    (answer,) = client_frames(down)
    assert decode_response(FetchResponse, answer, 12).throttle_time_ms == delay


def test_mute_mode_answers_at_once() -> None:
    engine = engine_with({ANON: {P: 10}})
    conn = proxy(engine, mode="mute")
    _, down = exchange(conn, acks_request(1, acks=1), ok_produce_response(1), 0, 4)
    assert [delay for delay, _ in client_writes(down)] == [0]


# -- request time ------------------------------------------------------------------------------


def test_request_time_is_the_upstream_round_trip() -> None:
    engine = engine_with({ANON: {R: 1.0}})
    conn = proxy(engine)
    up, down = exchange(conn, heartbeat_request(1), heartbeat_response(1), 10_000, 10_105)
    # 105 ms -> 10.5 units -> 1.05 % over the padded 10 s -> (0.05 / 1) * 10000
    (answer,) = client_frames(down)
    assert decode_response(HeartbeatResponse, answer, 4).throttle_time_ms == 500
    assert throttles(up + down) == ([500], [500])


def test_request_time_exactly_at_the_quota_is_not_throttled() -> None:
    engine = engine_with({ANON: {R: 1.0}})
    conn = proxy(engine)
    up, down = exchange(conn, heartbeat_request(1), heartbeat_response(1), 0, 100)  # exactly 1 %
    assert to_client(down) == frame(heartbeat_response(1))
    assert throttles(up + down) == ([], [])
    assert engine.managers[R].buckets[BucketKey(ANONYMOUS, "")].rate.total(100) == pytest.approx(10.0)


def test_api_versions_and_sasl_are_not_charged_request_time() -> None:
    engine = engine_with({EVERYONE: {R: 0.001}})
    conn = proxy(engine)
    av = response(ApiVersionsResponse, 3, 1, error_code=0, throttle_time_ms=0,
                  api_keys=[AV(api_key=0, min_version=3, max_version=11)])
    up, down = exchange(conn, request(ApiVersionsRequest, 3, 1, client_software_name="kp",
                                      client_software_version="3"), av, 0, 5000)
    assert throttles(up + down) == ([], [])
    up, down = exchange(conn, request(SaslHandshakeRequest, 1, 2, mechanism="PLAIN"),
                        response(SaslHandshakeResponse, 1, 2, error_code=0, mechanisms=["PLAIN"]), 5000, 9000)
    assert throttles(up + down) == ([], [])
    up, down = exchange(conn, request(SaslAuthenticateRequest, 2, 3, auth_bytes=b"\x00u\x00p"),
                        response(SaslAuthenticateResponse, 2, 3, error_code=0, error_message=None,
                                 auth_bytes=b"", session_lifetime_ms=0), 9000, 15_000)
    assert throttles(up + down) == ([], [])
    assert engine.managers[R].buckets == {}
    # while any other request is charged, here 2 ms against a tiny quota: capped at one window
    up, down = exchange(conn, heartbeat_request(4), heartbeat_response(4), 15_000, 15_002)
    assert throttles(up + down) == ([1000], [1000])


def test_fetch_long_poll_wait_is_not_charged() -> None:
    engine = engine_with({ANON: {R: 1.0}})
    conn = proxy(engine)
    up, down = exchange(conn, consumer_fetch_request(1, max_wait=500), records_fetch_response(1), 0, 550)
    assert to_client(down) == frame(records_fetch_response(1))  # 50 ms charged: 0.5 %
    assert throttles(up + down) == ([], [])
    assert engine.managers[R].buckets[BucketKey(ANONYMOUS, "")].rate.total(550) == pytest.approx(5.0)
    # 700 ms against 500 ms of allowed waiting: 200 ms more -> 2.5 % -> over one window, capped
    up, down = exchange(conn, consumer_fetch_request(2, max_wait=500), records_fetch_response(2), 1000, 1700)
    (answer,) = client_frames(down)
    decoded = decode_response(FetchResponse, answer, 12)
    assert decoded.throttle_time_ms == 1000
    assert [bytes(p.records) for t in decoded.responses for p in t.partitions if p.records is not None] \
        == [b"", b""]
    assert throttles(up + down) == ([1000], [1000])


def test_connections_held_by_a_shared_bucket_take_turns() -> None:
    """A client's connections to different brokers share its bucket. When a throttle ends, the ones
    held for it go first (1 ms ahead): without that, the connection whose request caused the
    throttle wins every time (its timer was set first) and the client's other brokers starve."""
    engine = engine_with({ANON: {P: 10}})
    winner, held = proxy(engine), proxy(engine)
    first = winner.receive_from_client(frame(acks_request(1, acks=1)), now_ms=0)
    (mute,) = of_type(first, Mute)
    waiting = held.receive_from_client(frame(acks_request(2, acks=1)), now_ms=1)
    assert to_broker(waiting) == b""
    (hold,) = of_type(waiting, Mute)
    # Kafka's throttle for the first request (its bytes over a new client's padded 10 s window)...
    expected = kafka_throttle(len(acks_request(1, acks=1)) / 10, 10)
    assert mute.ms == expected
    # ...and the held one, 1 ms later, is woken 1 ms (HOLD_HEAD_START_MS) before that throttle ends
    assert hold.ms == expected - 1 - 1
    resumed = held.resume(now_ms=1 + hold.ms)
    assert request_ids(resumed) == [2]  # ...and goes on
    later = winner.receive_from_client(frame(acks_request(3, acks=1)), now_ms=mute.ms)
    assert to_broker(later) == b""  # the first connection now waits its turn
