"""APIs kafka-python has no class for: forwarded opaque, offered in ApiVersions, and the few whose
bodies carry broker addresses (ShareFetch, ShareAcknowledge, DescribeQuorum) rewritten.

ShareFetch and ShareAcknowledge frames are built here by hand from Kafka 4.3.1's
ShareFetchResponse.json and ShareAcknowledgeResponse.json, since kafka-python has no class to build
them with; DescribeQuorum comes from kafka-python's class.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.protocol.admin import DescribeQuorumResponse
from kafka.protocol.consumer import HeartbeatRequest, HeartbeatResponse
from kafka.protocol.metadata import ApiVersionsResponse

from protocol.addresses import needs_rewrite, rewrite_addresses
from protocol.api_versions import clamp_api_versions, offered_range
from protocol.apis import KNOWN_APIS, OPAQUE_APIS, ApiKey, api_name, response_header_version
from protocol.connection import Action, Mute, ProxyConnection, Throttled
from protocol.errors import MalformedBody
from protocol.frames import frame
from protocol.headers import encode_response_header, parse_request_header, response_body_offset
from protocol.node_endpoints import share_node_endpoints, strip_quorum_nodes
from quotas.engine import QuotaEngine, QuotaTable
from quotas.entity import BucketKey, QuotaEntity
from quotas.types import QuotaType

from .wire import (
    advertise,
    body,
    brokers_seen,
    client_frames,
    close_reasons,
    framed,
    of_type,
    request,
    response,
    tagged_section,
    to_broker,
    to_client,
    uvarint,
)

AV = ApiVersionsResponse.ApiVersion
SHARE_FETCH, SHARE_ACK = ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE
CONSUMER_GROUP_HEARTBEAT = 68
PUSH_TELEMETRY = 72
NO_SCHEMA = 9999  # a key no Kafka has: nothing at all is known about it
assert NO_SCHEMA not in KNOWN_APIS and NO_SCHEMA not in OPAQUE_APIS
assert SHARE_FETCH not in KNOWN_APIS and CONSUMER_GROUP_HEARTBEAT not in KNOWN_APIS

ANON = QuotaEntity("ANONYMOUS", None)
F, R = QuotaType.FETCH, QuotaType.REQUEST
NOT_LEADER_OR_FOLLOWER = 6


# -- hand encoders (Kafka's compact encodings) ---------------------------------------------------


def cstr(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode()
    return uvarint(len(raw) + 1) + raw


def carray(items: list[bytes]) -> bytes:
    return uvarint(len(items) + 1) + b"".join(items)


def i16(v: int) -> bytes:
    return v.to_bytes(2, "big", signed=True)


def i32(v: int) -> bytes:
    return v.to_bytes(4, "big", signed=True)


def i64(v: int) -> bytes:
    return v.to_bytes(8, "big", signed=True)


@dataclass
class Partition:
    index: int = 0
    error: int = 0
    records: bytes = b"\x00" * 30
    acquired: list[tuple[int, int, int]] = field(default_factory=lambda: [(0, 9, 1)])
    tags: bytes = b"\x00"


@dataclass
class Share:
    """A ShareFetch (fetch=True) or ShareAcknowledge response body."""

    fetch: bool = True
    version: int = 1
    topics: list[tuple[bytes, list[Partition]]] = field(default_factory=list)
    endpoints: list[tuple[int, str, int, str | None]] = field(default_factory=list)
    error_message: str | None = None
    tags: bytes = b"\x00"

    def partition(self, p: Partition) -> bytes:
        out = i32(p.index) + i16(p.error) + cstr(None)
        if self.fetch:
            out += i16(0) + cstr(None)
        out += i32(2) + i32(7) + b"\x00"  # CurrentLeader and its tagged fields
        if self.fetch:
            out += uvarint(len(p.records) + 1) + p.records
            out += carray([i64(a) + i64(b) + i16(c) + b"\x00" for a, b, c in p.acquired])
        return out + p.tags

    def encode(self, endpoints: list[tuple[int, str, int, str | None]] | None = None) -> bytes:
        out = i32(0) + i16(0) + cstr(self.error_message)
        if self.version >= (1 if self.fetch else 2):
            out += i32(30_000)  # AcquisitionLockTimeoutMs
        out += carray([topic_id + carray([self.partition(p) for p in parts]) + b"\x00"
                       for topic_id, parts in self.topics])
        nodes = self.endpoints if endpoints is None else endpoints
        out += carray([i32(n) + cstr(h) + i32(p) + cstr(r) + b"\x00" for n, h, p, r in nodes])
        return out + self.tags

    @property
    def key(self) -> int:
        return SHARE_FETCH if self.fetch else SHARE_ACK

    def frame(self, cid: int = 1, endpoints: list[tuple[int, str, int, str | None]] | None = None) -> bytes:
        return encode_response_header(cid, 1) + self.encode(endpoints)

    def advertised(self) -> list[tuple[int, str, int, str | None]]:
        return [(n, *advertise(n), r) if n >= 0 and h else (n, h, p, r) for n, h, p, r in self.endpoints]


def moved_leaders(fetch: bool = True, version: int = 1) -> Share:
    topic = uuid.UUID(int=7).bytes
    parts = [Partition(0), Partition(1, NOT_LEADER_OR_FOLLOWER, b"", [])]
    return Share(fetch, version, [(topic, parts)],
                 [(2, "kafka-2.internal", 9092, "rack-b"), (3, "kafka-3.internal", 9093, None)])


def opaque_request(key: int, version: int, cid: int, client_id: str | None = "k4-client",
                   header_tags: bytes = b"\x00", payload: bytes = b"\x07opaque") -> bytes:
    """A request header v2 (or v1 when header_tags is empty) and a body nobody decodes."""
    raw = b"" if client_id is None else client_id.encode()
    return (key.to_bytes(2, "big") + version.to_bytes(2, "big") + i32(cid)
            + (len(raw) if client_id is not None else -1).to_bytes(2, "big", signed=True) + raw
            + header_tags + payload)


def share_fetch_request(cid: int, version: int = 1, max_wait: int = 500) -> bytes:
    fields = cstr("share-group") + cstr("member-1") + i32(1) + i32(max_wait) + i32(1) + i32(50 << 20)
    return opaque_request(SHARE_FETCH, version, cid, payload=fields + b"\x00")


@pytest.fixture
def conn() -> ProxyConnection:
    return ProxyConnection(advertise, name="k4")


def exchange(conn: ProxyConnection, req: bytes, resp: bytes, sent_ms: float = 0,
             answered_ms: float = 0) -> tuple[list[Action], list[Action]]:
    up = conn.receive_from_client(frame(req), sent_ms)
    return up, conn.receive_from_broker(frame(resp), answered_ms)


# -- headers and names -----------------------------------------------------------------------------


@pytest.mark.parametrize("header_tags", [b"", b"\x00", tagged_section({0: b"\x01\x02", 3: b""})],
                         ids=["v1", "v2", "v2-with-tags"])
def test_an_unknown_keys_header_is_read_whatever_its_version(header_tags: bytes) -> None:
    """Header v1 and v2 differ only after the client id, so all four fields read the same."""
    req = opaque_request(NO_SCHEMA, 3, 4242, "someone", header_tags)
    header = parse_request_header(req)
    assert (header.api_key, header.api_version, header.correlation_id, header.client_id) == \
        (NO_SCHEMA, 3, 4242, "someone")
    assert header.body_offset == -1  # where the body starts is not known, and not needed


def test_a_kafka4_api_without_a_kafka_python_class_has_its_body_found() -> None:
    req = opaque_request(CONSUMER_GROUP_HEARTBEAT, 1, 9, header_tags=tagged_section({1: b"ab"}))
    header = parse_request_header(req)
    assert req[header.body_offset:] == b"\x07opaque"
    assert api_name(CONSUMER_GROUP_HEARTBEAT) == "ConsumerGroupHeartbeat"
    assert api_name(SHARE_FETCH) == "ShareFetch"
    assert api_name(NO_SCHEMA) == "Unknown(9999)"
    assert response_header_version(SHARE_FETCH, 1) == 1
    assert response_header_version(NO_SCHEMA, 0) is None


def test_opaque_table_does_not_shadow_kafka_python() -> None:
    assert not set(OPAQUE_APIS) & set(KNOWN_APIS)


# -- opaque framing and correlation -----------------------------------------------------------------


def test_unknown_apis_pipelined_with_known_ones_pass_byte_for_byte(conn: ProxyConnection) -> None:
    reqs = [
        opaque_request(CONSUMER_GROUP_HEARTBEAT, 1, 1),
        request(HeartbeatRequest, 4, 2, group_id="g", generation_id=1, member_id="m", group_instance_id=None),
        opaque_request(NO_SCHEMA, 0, 3, None, b""),
        opaque_request(PUSH_TELEMETRY, 0, 4, header_tags=tagged_section({5: b"xyz"})),
    ]
    up = conn.receive_from_client(framed(*reqs))
    assert to_broker(up) == framed(*reqs)
    assert conn.in_flight == 4
    resps = [
        encode_response_header(1, 1) + i32(0) + b"member-epoch-and-more",
        response(HeartbeatResponse, 4, 2, throttle_time_ms=0, error_code=0),
        i32(3) + b"\x02\x05\x01" + b"a response header v1 with a tag, or a v0 body: either way",
        encode_response_header(4, 1) + b"\x00" * 10,
    ]
    stream = framed(*resps)
    received = b""
    for i in range(len(stream)):  # split anywhere, even inside a correlation id
        received += to_client(conn.receive_from_broker(stream[i : i + 1]))
    assert received == stream
    assert conn.in_flight == 0 and conn.closed is None


@pytest.mark.parametrize("key", [NO_SCHEMA, CONSUMER_GROUP_HEARTBEAT])
def test_an_unknown_apis_response_out_of_order_closes_naming_it(conn: ProxyConnection, key: int) -> None:
    conn.receive_from_client(frame(opaque_request(key, 0, 11)))
    (reason,) = close_reasons(conn.receive_from_broker(frame(i32(12) + b"\x00"))) or [""]
    assert "correlation id 12" in reason and "correlation id 11" in reason
    assert api_name(key) in reason


def test_an_unknown_apis_response_shorter_than_a_correlation_id_closes(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(opaque_request(NO_SCHEMA, 0, 1)))
    (reason,) = close_reasons(conn.receive_from_broker(frame(b"\x00\x01")))
    assert "has no correlation id" in reason


# -- ApiVersions -----------------------------------------------------------------------------------


def api_versions_body(version: int, ranges: list[tuple[int, int, int]]) -> bytes:
    extra = {} if version == 0 else {"throttle_time_ms": 0}
    return body(ApiVersionsResponse, version, error_code=0,
                api_keys=[AV(api_key=k, min_version=lo, max_version=hi) for k, lo, hi in ranges], **extra)


@pytest.mark.parametrize("version", [0, 3, 4])
def test_api_versions_keeps_what_the_proxy_forwards_opaque(version: int) -> None:
    broker = [
        (ApiKey.FETCH, 4, 18),  # known, offered as far as the proxy's schemas go (v18)
        (ApiKey.DESCRIBE_QUORUM, 0, 9),  # controller addresses read by hand: up to v2
        (CONSUMER_GROUP_HEARTBEAT, 0, 1),  # KIP-848: the broker's range
        (PUSH_TELEMETRY, 0, 0),  # KIP-714
        (SHARE_FETCH, 1, 7),  # KIP-932, addresses read by hand: v0 to v2
        (SHARE_ACK, 1, 2),
        (NO_SCHEMA, 0, 3),  # a key from a Kafka newer than any schema here: the broker's range
    ]
    clamped, dropped = clamp_api_versions(api_versions_body(version, broker), version)
    assert dropped == 0
    got = {e.api_key: (e.min_version, e.max_version)
           for e in ApiVersionsResponse.decode(clamped, version=version).api_keys}
    assert got == {
        ApiKey.FETCH: (4, 18), ApiKey.DESCRIBE_QUORUM: (0, 2), CONSUMER_GROUP_HEARTBEAT: (0, 1),
        PUSH_TELEMETRY: (0, 0), SHARE_FETCH: (1, 2), SHARE_ACK: (1, 2), NO_SCHEMA: (0, 3),
        ApiKey.DESCRIBE_CLIENT_QUOTAS: (0, 1), ApiKey.ALTER_CLIENT_QUOTAS: (0, 1),
    }


def test_api_versions_drops_a_readable_api_whose_versions_do_not_meet() -> None:
    clamped, dropped = clamp_api_versions(api_versions_body(3, [(SHARE_FETCH, 3, 5)]), 3)
    assert dropped == 1
    assert SHARE_FETCH not in {e.api_key for e in ApiVersionsResponse.decode(clamped, version=3).api_keys}


def test_offered_ranges() -> None:
    assert offered_range(NO_SCHEMA) is None
    assert offered_range(CONSUMER_GROUP_HEARTBEAT) is None
    assert offered_range(SHARE_FETCH) == (0, 2)
    assert offered_range(ApiKey.DESCRIBE_QUORUM) == (0, 2)
    fetch = KNOWN_APIS[ApiKey.FETCH]
    assert offered_range(ApiKey.FETCH) == (fetch.min_version, fetch.max_version)


@pytest.mark.parametrize(("key", "version", "what"), [
    (SHARE_FETCH, 3, "ShareFetch v3 is outside v0 to v2"),
    (SHARE_ACK, 9, "ShareAcknowledge v9 is outside v0 to v2"),
    (ApiKey.DESCRIBE_QUORUM, 3, "DescribeQuorum v3 is"),
])
def test_a_version_whose_addresses_cannot_be_found_is_refused(conn: ProxyConnection, key: int, version: int,
                                                              what: str) -> None:
    actions = conn.receive_from_client(frame(opaque_request(key, version, 1)))
    (reason,) = close_reasons(actions)
    assert what in reason
    assert to_broker(actions) == b""


# -- ShareFetch / ShareAcknowledge NodeEndpoints ----------------------------------------------------


@pytest.mark.parametrize(("fetch", "version"), [(True, 0), (True, 1), (True, 2), (False, 1), (False, 2)])
def test_share_node_endpoints_are_rewritten_and_nothing_else(conn: ProxyConnection, fetch: bool,
                                                             version: int) -> None:
    share = moved_leaders(fetch, version)
    share.tags = tagged_section({0: b"unknown top-level tag"})
    _up, down = exchange(conn, opaque_request(share.key, version, 1), share.frame())
    (answer,) = client_frames(down)
    assert answer == share.frame(endpoints=share.advertised())
    assert brokers_seen(down) == {2: ("kafka-2.internal", 9092), 3: ("kafka-3.internal", 9093)}
    assert b"internal" not in answer


@pytest.mark.parametrize("fetch", [True, False])
def test_share_response_without_endpoints_goes_on_as_the_same_bytes(fetch: bool) -> None:
    share = Share(fetch, 2, [(uuid.UUID(int=1).bytes, [Partition(i) for i in range(3)])])
    original = share.frame()
    result = rewrite_addresses(share.key, 2, original, 1, advertise)
    assert result.frame is original
    assert result.discovered == {}


def test_placeholder_endpoints_are_left_alone() -> None:
    share = moved_leaders()
    share.endpoints = [(-1, "", 0, None), (4, "kafka-4", 1, None)]
    result = rewrite_addresses(SHARE_FETCH, 1, share.frame(), 1, advertise)
    assert result.frame == share.frame(endpoints=share.advertised())
    assert result.discovered == {4: ("kafka-4", 1)}


def test_every_share_fetch_version_needs_rewriting() -> None:
    assert all(needs_rewrite(SHARE_FETCH, v) and needs_rewrite(SHARE_ACK, v) for v in range(3))
    assert not needs_rewrite(ApiKey.DESCRIBE_QUORUM, 1) and needs_rewrite(ApiKey.DESCRIBE_QUORUM, 2)


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda b: b[:6] + uvarint(1000) + b[7:], "error message of 999 bytes at offset 13 runs past the end"),
    (lambda b: b[:11] + b"\x00" + b[12:], "responses is null at offset 16"),  # frame offsets: header is 5
    (lambda b: b[:11] + uvarint(1000) + b[12:], "responses of 999 entries in the 173 bytes left"),
], ids=["message", "null responses", "responses count"])
def test_malformed_share_fetch_names_the_field(conn: ProxyConnection, mutate: object, reason: str) -> None:
    share = moved_leaders()
    good = share.encode()
    assert good[11] == 2  # one topic: the responses count sits after 4 + 2 + 1 + 4 bytes
    bad = mutate(good)  # type: ignore[operator]
    conn.receive_from_client(frame(opaque_request(SHARE_FETCH, 1, 1)))
    (close,) = close_reasons(conn.receive_from_broker(frame(encode_response_header(1, 1) + bad)))
    assert close.startswith(f"broker sent bad data: ShareFetch v1 response of {4 + 1 + len(bad)} bytes "
                            "does not parse: ")
    assert reason in close


def test_null_records_are_refused_after_v0() -> None:
    share = moved_leaders()
    share.topics[0][1][0].records = b""
    body_v1 = share.encode()
    # records of length 0 are the compact byte 1; null is 0 and only v0 allows it
    at = body_v1.index(i32(2) + i32(7) + b"\x00" + b"\x01") + 9
    nulled = body_v1[:at] + b"\x00" + body_v1[at + 1:]
    with pytest.raises(MalformedBody, match="topic 0 of 1 partition 0 records have length -1"):
        share_node_endpoints(SHARE_FETCH, nulled, 0, 1)
    share.version = 0
    body_v0 = share.encode()
    at = body_v0.index(i32(2) + i32(7) + b"\x00" + b"\x01") + 9
    assert share_node_endpoints(SHARE_FETCH, body_v0[:at] + b"\x00" + body_v0[at + 1:], 0, 0).brokers


def test_every_truncation_is_a_clean_malformed_body() -> None:
    full = moved_leaders().encode()
    for cut in range(len(full) - 1):  # the last byte is the top-level tags, never read
        with pytest.raises(MalformedBody, match=f"ShareFetch v1 response of {cut} bytes does not parse"):
            share_node_endpoints(SHARE_FETCH, full[:cut], 0, 1)


# -- properties ------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
hosts = st.text(st.characters(exclude_categories=["Cs"]), max_size=30)
partitions_strategy = st.builds(
    Partition, index=st.integers(0, 2**31 - 1), error=st.sampled_from([0, NOT_LEADER_OR_FOLLOWER]),
    records=st.binary(max_size=200),
    acquired=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 5)), max_size=3),
    tags=st.sampled_from([b"\x00", tagged_section({9: b"t"})]))
shares = st.builds(
    Share, fetch=st.booleans(), version=st.integers(1, 2),
    topics=st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.lists(partitions_strategy, max_size=4)),
                    max_size=3),
    endpoints=st.lists(st.tuples(st.integers(0, 1000), hosts.filter(bool), st.integers(0, 65535),
                                 st.none() | hosts), max_size=4, unique_by=lambda e: e[0]),
    error_message=st.none() | hosts, tags=st.sampled_from([b"\x00", tagged_section({0: b"x"})]))


@PROPERTY
@given(share=shares)
def test_any_share_response_gets_proxy_addresses_and_keeps_every_other_byte(share: Share) -> None:
    result = rewrite_addresses(share.key, share.version, share.frame(), 1, advertise)
    assert result.frame == share.frame(endpoints=share.advertised())
    assert result.discovered == {n: (h, p) for n, h, p, _r in share.endpoints}


@PROPERTY
@given(share=shares, data=st.data())
def test_any_damage_is_a_clean_close_never_a_crash(share: Share, data: st.DataObject) -> None:
    good = share.frame()
    position = data.draw(st.integers(4, len(good) - 1))
    damage = data.draw(st.sampled_from(["cut", "byte", "insert"]))
    if damage == "cut":
        bad = good[:position]
    elif damage == "byte":
        bad = good[:position] + bytes([data.draw(st.integers(0, 255))]) + good[position + 1:]
    else:
        bad = good[:position] + data.draw(st.binary(min_size=1, max_size=8)) + good[position:]
    conn = ProxyConnection(advertise)
    conn.receive_from_client(frame(opaque_request(share.key, share.version, 1)))
    actions = conn.receive_from_broker(frame(bad))
    reasons = close_reasons(actions)
    if reasons:
        (reason,) = reasons
        name = "ShareFetch" if share.fetch else "ShareAcknowledge"
        assert reason.startswith(f"broker sent bad data: {name} v{share.version} response"), reason
        assert to_client(actions) == b""
    else:  # the damage left a well-formed answer: whatever goes on names only proxy addresses
        (answer,) = client_frames(actions)
        seen = share_node_endpoints(share.key, answer, response_body_offset(answer, 1), share.version)
        real = [b for b in seen.brokers if b.node_id >= 0 and b.host]
        assert all((b.host, b.port) == advertise(b.node_id) for b in real)


@PROPERTY
@given(garbage=st.binary(max_size=120), version=st.integers(0, 2), fetch=st.booleans())
def test_arbitrary_bodies_parse_or_are_refused_by_name(garbage: bytes, version: int, fetch: bool) -> None:
    key = SHARE_FETCH if fetch else SHARE_ACK
    try:
        share_node_endpoints(key, garbage, 0, version)
    except MalformedBody as exc:
        assert "does not parse" in str(exc)
    try:
        strip_quorum_nodes(garbage, 0, version)
    except MalformedBody as exc:
        assert f"DescribeQuorum v{version} response of {len(garbage)} bytes does not parse" in str(exc)


# -- DescribeQuorum ----------------------------------------------------------------------------------

DQ = DescribeQuorumResponse


def quorum_body(version: int, nodes: bool = True) -> bytes:
    def replica(node: int) -> object:
        fields: dict[str, object] = {"replica_id": node, "log_end_offset": 100 + node}
        if version >= 1:
            fields |= {"last_fetch_timestamp": 5, "last_caught_up_timestamp": 6}
        if version >= 2:
            fields["replica_directory_id"] = uuid.UUID(int=node)
        return DQ.TopicData.PartitionData.ReplicaState(**fields)

    partition: dict[str, object] = {"partition_index": 0, "error_code": 0, "leader_id": 1, "leader_epoch": 4,
                                    "high_watermark": 99, "current_voters": [replica(1), replica(2)],
                                    "observers": [replica(7)]}
    fields: dict[str, object] = {"error_code": 0, "topics": [
        DQ.TopicData(topic_name="__cluster_metadata", partitions=[DQ.TopicData.PartitionData(**partition)])]}
    if version >= 2:
        fields |= {"error_message": None, "nodes": [
            DQ.Node(node_id=n, listeners=[DQ.Node.Listener(name="CONTROLLER", host=f"ctl-{n}.internal",
                                                           port=9000 + n)]) for n in (1, 2)] if nodes else []}
        partition["error_message"] = None
    return body(DQ, version, **fields)


def test_describe_quorum_names_no_controller(conn: ProxyConnection) -> None:
    tagged = quorum_body(2)[:-1] + tagged_section({0: b"unknown"})
    request_ = opaque_request(ApiKey.DESCRIBE_QUORUM, 2, 1)
    _up, down = exchange(conn, request_, encode_response_header(1, 1) + tagged)
    (answer,) = client_frames(down)
    assert b"internal" not in answer
    assert answer == encode_response_header(1, 1) + quorum_body(2, nodes=False)[:-1] + tagged_section(
        {0: b"unknown"})
    decoded = DQ.decode(answer[5:], version=2)
    assert decoded.nodes == []
    assert [r.replica_id for r in decoded.topics[0].partitions[0].current_voters] == [1, 2]
    assert brokers_seen(down) == {}  # controllers get no proxy listener


@pytest.mark.parametrize("version", [0, 1])
def test_describe_quorum_before_v2_has_nothing_to_remove(version: int) -> None:
    original = encode_response_header(1, 1) + quorum_body(version)
    assert strip_quorum_nodes(original, 5, version) is original


def test_describe_quorum_every_truncation_is_a_clean_malformed_body() -> None:
    full = quorum_body(2)
    for cut in range(len(full) - 1):
        with pytest.raises(MalformedBody, match=f"DescribeQuorum v2 response of {cut} bytes does not parse"):
            strip_quorum_nodes(full[:cut], 0, 2)


# -- quotas ----------------------------------------------------------------------------------------


def engine_with(table: QuotaTable) -> QuotaEngine:
    engine = QuotaEngine()
    engine.set_quotas(table)
    return engine


def throttles(actions: list[Action]) -> tuple[list[int], list[int]]:
    return [a.throttle_ms for a in of_type(actions, Throttled)], [a.ms for a in of_type(actions, Mute)]


def test_an_opaque_apis_time_is_charged_and_its_throttle_written_first() -> None:
    engine = engine_with({ANON: {R: 1.0}})
    conn = ProxyConnection(advertise, policy=engine)
    resp = encode_response_header(1, 1) + i32(20) + b"rest of a ConsumerGroupHeartbeat body"
    up, down = exchange(conn, opaque_request(CONSUMER_GROUP_HEARTBEAT, 1, 1), resp, 10_000, 10_105)
    (answer,) = client_frames(down)
    # 105 ms is 1.05 % of one thread over the padded 10 s window: (0.05 / 1) * 10 s, as for any API
    assert answer == encode_response_header(1, 1) + i32(500) + resp[9:]
    assert throttles(up + down) == ([500], [500])


def test_a_key_no_schema_describes_is_charged_and_muted_but_its_bytes_kept() -> None:
    engine = engine_with({ANON: {R: 1.0}})
    conn = ProxyConnection(advertise, policy=engine)
    resp = i32(1) + b"\x00\x00\x00\x14 whatever layout"
    up, down = exchange(conn, opaque_request(NO_SCHEMA, 0, 1), resp, 0, 105)
    assert client_frames(down) == [resp]
    assert throttles(up + down) == ([500], [500])
    assert engine.managers[R].buckets[BucketKey("ANONYMOUS", "")].rate.total(105) == \
        pytest.approx(10.5)


def test_share_fetch_bytes_count_against_the_consumer_quota_and_its_records_are_kept() -> None:
    engine = engine_with({ANON: {F: 10}})
    conn = ProxyConnection(advertise, policy=engine)
    share = moved_leaders()
    up, down = exchange(conn, share_fetch_request(1), share.frame(), 0, 3)
    (answer,) = client_frames(down)
    size = 4 + len(share.encode(share.advertised()))  # what the client gets, measured as for Fetch
    expected = int((size / 10 - 10) / 10 * 10_000 + 0.5)
    assert expected > 0
    assert answer[5:9] == i32(expected)
    assert answer[9:] == share.frame(endpoints=share.advertised())[9:]  # records and all, rewritten
    assert throttles(up + down) == ([expected], [expected])


def test_share_fetch_long_poll_is_not_request_time() -> None:
    engine = engine_with({ANON: {R: 1000.0}})
    conn = ProxyConnection(advertise, policy=engine)
    exchange(conn, share_fetch_request(1, max_wait=500), moved_leaders().frame(), 0, 505)
    assert engine.managers[R].buckets[BucketKey("ANONYMOUS", "")].rate.total(505) == \
        pytest.approx(0.5)  # 5 ms of work, not 505


def test_share_fetch_waits_while_the_fetch_bucket_is_throttled() -> None:
    engine = engine_with({ANON: {F: 10}})
    conn = ProxyConnection(advertise, policy=engine)
    exchange(conn, share_fetch_request(1), moved_leaders().frame(), 0, 3)  # throttled
    other = ProxyConnection(advertise, policy=engine)  # e.g. the connection to another leader
    actions = other.receive_from_client(frame(share_fetch_request(2)), 10)
    assert to_broker(actions) == b""
    assert of_type(actions, Mute)


def test_a_truncated_response_header_of_a_throttled_opaque_api_is_named() -> None:
    conn = ProxyConnection(advertise, policy=engine_with({ANON: {R: 1.0}}))
    _up, down = exchange(conn, opaque_request(CONSUMER_GROUP_HEARTBEAT, 1, 1), i32(1) + b"\x81", 0, 105)
    (reason,) = close_reasons(down)
    assert reason == "broker sent bad data: ConsumerGroupHeartbeat v1 response header: truncated varint"
