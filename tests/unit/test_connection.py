"""ProxyConnection: whole exchanges driven with byte strings, no sockets."""

from __future__ import annotations

import base64
import json

import pytest
from kafka.protocol.admin.client_quotas import DescribeClientQuotasRequest
from kafka.protocol.consumer import HeartbeatRequest, HeartbeatResponse
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    ApiVersionsResponse,
    FindCoordinatorRequest,
    FindCoordinatorResponse,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)

from protocol.api_versions import UNSUPPORTED_VERSION
from protocol.apis import KNOWN_APIS, ApiKey
from protocol.connection import BrokersSeen, Close, ProxyConnection, ToBroker, ToClient
from protocol.errors import MalformedBody
from protocol.frames import frame
from protocol.headers import encode_request_header, encode_response_header, parse_request_header
from protocol.sasl import ANONYMOUS
from protocol.skim import produce_acks

from .wire import (
    advertise,
    body,
    broker_frames,
    brokers_seen,
    client_frames,
    close_reasons,
    correlation_id,
    framed,
    of_type,
    request,
    response,
    to_broker,
    to_client,
)

MB = MetadataResponse.MetadataResponseBroker
AV = ApiVersionsResponse.ApiVersion
PTD = ProduceRequest.TopicProduceData
PPD = PTD.PartitionProduceData

SASL_AUTHENTICATION_FAILED = 58
INVALID_REQUEST = 42
REAL_BROKERS = [(1, "kafka-1.internal", 9092), (2, "kafka-2.internal", 9092)]


@pytest.fixture
def conn() -> ProxyConnection:
    return ProxyConnection(advertise, name="test")


# -- builders ---------------------------------------------------------------------------------


def metadata_request(cid: int, version: int = 12, client_id: str | None = "test-client") -> bytes:
    extra: dict[str, object] = {}
    if version >= 4:
        extra["allow_auto_topic_creation"] = False
    if 8 <= version <= 10:
        extra["include_cluster_authorized_operations"] = False
    if version >= 8:
        extra["include_topic_authorized_operations"] = False
    return request(MetadataRequest, version, cid, client_id, topics=None, **extra)


def metadata_fields(version: int, brokers: list[tuple[int, str, int]]) -> dict[str, object]:
    fields: dict[str, object] = {
        "brokers": [MB(node_id=n, host=h, port=p, rack=None) for n, h, p in brokers],
        "controller_id": 1, "topics": [],
    }
    if version >= 2:
        fields["cluster_id"] = "cluster"
    if version >= 3:
        fields["throttle_time_ms"] = 0
    return fields


def metadata_response(cid: int, version: int = 12,
                      brokers: list[tuple[int, str, int]] | None = None) -> bytes:
    return response(MetadataResponse, version, cid,
                    **metadata_fields(version, REAL_BROKERS if brokers is None else brokers))


def heartbeat_request(cid: int, version: int = 4) -> bytes:
    return request(HeartbeatRequest, version, cid, group_id="g", generation_id=3, member_id="m",
                   group_instance_id=None)


def heartbeat_response(cid: int, version: int = 4, error_code: int = 0) -> bytes:
    return response(HeartbeatResponse, version, cid, throttle_time_ms=0, error_code=error_code)


def produce_request(cid: int, version: int, acks: int, transactional_id: str | None = None) -> bytes:
    topic: dict[str, object] = {"partition_data": [PPD(index=0, records=b"\x00" * 70)]}
    topic["name"] = "orders"
    return request(ProduceRequest, version, cid, transactional_id=transactional_id, acks=acks,
                   timeout_ms=30000, topic_data=[PTD(**topic)])


def produce_response(cid: int, version: int) -> bytes:
    return response(ProduceResponse, version, cid, responses=[], throttle_time_ms=0)


def api_versions_request(cid: int, version: int) -> bytes:
    if version >= 3:
        return request(ApiVersionsRequest, version, cid, client_software_name="kp",
                       client_software_version="3.0")
    return request(ApiVersionsRequest, version, cid)


def too_new_api_versions_request(cid: int) -> bytes:
    version = KNOWN_APIS[ApiKey.API_VERSIONS].max_version + 1
    # The body is whatever a newer client sends; the proxy must not need to read it.
    header = encode_request_header(ApiKey.API_VERSIONS, version, cid, "future-client")
    return header + b"\x03kp\x043.0\x00"


def unknown_api_request(cid: int, key: int = 9999) -> bytes:
    assert key not in KNOWN_APIS
    return key.to_bytes(2, "big") + b"\x00\x00" + cid.to_bytes(4, "big") + b"\x00\x01c" + b"opaque body"


def handshake_request(cid: int, mechanism: str, version: int = 1) -> bytes:
    return request(SaslHandshakeRequest, version, cid, mechanism=mechanism)


def handshake_response(cid: int, version: int = 1, error_code: int = 0) -> bytes:
    return response(SaslHandshakeResponse, version, cid, error_code=error_code,
                    mechanisms=["PLAIN", "SCRAM-SHA-256", "OAUTHBEARER"])


def authenticate_request(cid: int, token: bytes, version: int = 2) -> bytes:
    return request(SaslAuthenticateRequest, version, cid, auth_bytes=token)


def authenticate_response(cid: int, token: bytes = b"", version: int = 2, error_code: int = 0) -> bytes:
    fields: dict[str, object] = {
        "error_code": error_code, "auth_bytes": token,
        "error_message": None if error_code == 0 else "Authentication failed: Invalid username or password",
    }
    if version >= 1:
        fields["session_lifetime_ms"] = 0
    return response(SaslAuthenticateResponse, version, cid, **fields)


def plain_token(user: str, password: str = "pw") -> bytes:
    return f"\x00{user}\x00{password}".encode()


def oauth_token(sub: str) -> bytes:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    jwt = f"{b64(b'{}')}.{b64(json.dumps({'sub': sub, 'exp': 9999999999}).encode())}.sig"
    return f"n,,\x01auth=Bearer {jwt}\x01\x01".encode()


def exchange(conn: ProxyConnection, req: bytes, resp: bytes) -> tuple[list[object], list[object]]:
    """Send one request and its response; both must pass without a close."""
    up = conn.receive_from_client(frame(req))
    assert close_reasons(up) == [], close_reasons(up)
    assert to_broker(up) == frame(req)
    down = conn.receive_from_broker(frame(resp))
    assert close_reasons(down) == [], close_reasons(down)
    return up, down


# -- forwarding and ordering ------------------------------------------------------------------


def test_single_request_forwarded_unchanged(conn: ProxyConnection) -> None:
    req = heartbeat_request(1)
    actions = conn.receive_from_client(frame(req))
    assert actions == [ToBroker([frame(req)[:4], req])]
    assert conn.in_flight == 1
    assert conn.client_id == "test-client"


def test_response_forwarded_unchanged(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(1)))
    resp = heartbeat_response(1, error_code=27)
    actions = conn.receive_from_broker(frame(resp))
    assert actions == [ToClient([frame(resp)[:4], resp])]
    assert conn.in_flight == 0


def test_pipelined_requests_forwarded_and_responses_matched_in_order(conn: ProxyConnection) -> None:
    reqs = [heartbeat_request(10), metadata_request(11, 1), unknown_api_request(12), heartbeat_request(13, 0)]
    actions = conn.receive_from_client(framed(*reqs))
    assert of_type(actions, ToBroker) == actions[:1]
    assert to_broker(actions) == framed(*reqs)
    assert conn.in_flight == 4

    resps = [
        heartbeat_response(10), metadata_response(11, 1, brokers=[]), encode_response_header(12, 0) + b"??",
        heartbeat_response(13, 0),
    ]
    down = conn.receive_from_broker(framed(*resps[:2]))
    assert [correlation_id(f) for f in client_frames(down)] == [10, 11]
    down = conn.receive_from_broker(framed(*resps[2:]))
    assert client_frames(down) == resps[2:]
    assert conn.in_flight == 0
    assert conn.closed is None


def test_requests_split_byte_by_byte(conn: ProxyConnection) -> None:
    stream = framed(heartbeat_request(1), metadata_request(2))
    sent = b""
    for i in range(len(stream)):
        actions = conn.receive_from_client(stream[i : i + 1])
        assert close_reasons(actions) == []
        sent += to_broker(actions)
    assert sent == stream
    assert conn.in_flight == 2


def test_responses_split_byte_by_byte(conn: ProxyConnection) -> None:
    conn.receive_from_client(framed(heartbeat_request(1), heartbeat_request(2)))
    stream = framed(heartbeat_response(1), heartbeat_response(2, error_code=25))
    received = b""
    for i in range(len(stream)):
        received += to_client(conn.receive_from_broker(stream[i : i + 1]))
    assert received == stream
    assert conn.in_flight == 0


def test_unknown_api_forwarded_and_answered_opaque(conn: ProxyConnection) -> None:
    req = unknown_api_request(5)
    actions = conn.receive_from_client(frame(req))
    assert to_broker(actions) == frame(req)
    resp = encode_response_header(5, 0) + b"\x00\x01 not a schema we know"
    assert client_frames(conn.receive_from_broker(frame(resp))) == [resp]


def test_wrong_correlation_id_closes_naming_both_ids(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(7)))
    actions = conn.receive_from_broker(frame(heartbeat_response(8)))
    (reason,) = close_reasons(actions)
    assert "correlation id 8" in reason
    assert "correlation id 7" in reason
    assert "Heartbeat" in reason
    assert to_client(actions) == b""
    assert conn.closed == reason


def test_unsolicited_response_closes(conn: ProxyConnection) -> None:
    actions = conn.receive_from_broker(frame(heartbeat_response(3)))
    (reason,) = close_reasons(actions)
    assert "correlation id 3" in reason
    assert "no request in flight" in reason
    assert to_client(actions) == b""


def test_extra_response_after_matched_ones_closes(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(1)))
    actions = conn.receive_from_broker(framed(heartbeat_response(1), heartbeat_response(2)))
    assert len(close_reasons(actions)) == 1
    assert conn.closed is not None


def test_negative_correlation_ids_match(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(-12)))
    actions = conn.receive_from_broker(frame(heartbeat_response(-12)))
    assert close_reasons(actions) == []
    assert conn.in_flight == 0


def test_client_id_tracks_latest_non_null(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(metadata_request(1, 1, client_id="first")))
    conn.receive_from_client(frame(metadata_request(2, 1, client_id=None)))
    assert conn.client_id == "first"
    conn.receive_from_client(frame(metadata_request(3, 1, client_id="second")))
    assert conn.client_id == "second"


# -- acks=0 Produce ---------------------------------------------------------------------------


PRODUCE_CASES = [
    (3, None), (3, "tx-1"), (7, None), (8, "transactional-producer-8"),
    (9, None), (9, "tx-9"), (11, "t" * 200), (12, None), (12, "x" * 127), (12, "y" * 128),
]


@pytest.mark.parametrize(("version", "transactional_id"), PRODUCE_CASES)
@pytest.mark.parametrize("acks", [0, 1, -1])
def test_produce_acks_read_after_transactional_id(version: int, transactional_id: str | None,
                                                  acks: int) -> None:
    req = produce_request(1, version, acks, transactional_id)
    assert produce_acks(req, parse_request_header(req)) == acks


@pytest.mark.parametrize(("version", "transactional_id"), PRODUCE_CASES)
def test_acks_zero_produce_takes_no_in_flight_slot(conn: ProxyConnection, version: int,
                                                   transactional_id: str | None) -> None:
    fire_and_forget = produce_request(1, version, 0, transactional_id)
    actions = conn.receive_from_client(framed(fire_and_forget, heartbeat_request(2)))
    assert to_broker(actions) == framed(fire_and_forget, heartbeat_request(2))
    assert conn.in_flight == 1
    down = conn.receive_from_broker(frame(heartbeat_response(2)))
    assert close_reasons(down) == []
    assert client_frames(down) == [heartbeat_response(2)]
    assert conn.in_flight == 0


@pytest.mark.parametrize("version", [3, 8, 9])
def test_acks_one_produce_takes_a_slot(conn: ProxyConnection, version: int) -> None:
    conn.receive_from_client(framed(produce_request(1, version, 1, "tx"), heartbeat_request(2)))
    assert conn.in_flight == 2
    down = conn.receive_from_broker(framed(produce_response(1, version), heartbeat_response(2)))
    assert [correlation_id(f) for f in client_frames(down)] == [1, 2]


def test_acks_zero_produce_with_header_tagged_fields(conn: ProxyConnection) -> None:
    plain = encode_request_header(ApiKey.PRODUCE, 9, 1, "p")
    produce_body = body(ProduceRequest, 9, transactional_id="tx", acks=0, timeout_ms=10, topic_data=[])
    req = plain[:-1] + b"\x01\x00\x03abc" + produce_body
    conn.receive_from_client(frame(req))
    assert conn.in_flight == 0


def test_produce_truncated_before_acks_closes(conn: ProxyConnection) -> None:
    req = produce_request(1, 9, 0, "tx-9")
    header = parse_request_header(req)
    truncated = req[: header.body_offset + 1 + len("tx-9")]
    with pytest.raises(MalformedBody, match="truncated before acks"):
        produce_acks(truncated, parse_request_header(truncated))
    actions = conn.receive_from_client(frame(truncated))
    (reason,) = close_reasons(actions)
    assert "Produce v9" in reason
    assert to_broker(actions) == b""


def test_produce_transactional_id_length_past_end_closes(conn: ProxyConnection) -> None:
    header = encode_request_header(ApiKey.PRODUCE, 5, 1, "p")
    actions = conn.receive_from_client(frame(header + b"\x00\x50abc"))
    assert close_reasons(actions) != []


# -- locally answered ApiVersions ------------------------------------------------------------


def test_too_new_api_versions_answered_locally_when_idle(conn: ProxyConnection) -> None:
    actions = conn.receive_from_client(frame(too_new_api_versions_request(3)))
    assert to_broker(actions) == b""
    (answer,) = client_frames(actions)
    assert correlation_id(answer) == 3
    decoded = ApiVersionsResponse.decode(answer[4:], version=0)
    assert decoded.error_code == UNSUPPORTED_VERSION
    assert conn.in_flight == 0


def test_local_refusal_queued_behind_in_flight_request(conn: ProxyConnection) -> None:
    actions = conn.receive_from_client(framed(heartbeat_request(1), too_new_api_versions_request(2)))
    assert to_broker(actions) == frame(heartbeat_request(1))
    assert to_client(actions) == b""  # must not overtake the Heartbeat answer
    down = conn.receive_from_broker(frame(heartbeat_response(1)))
    frames = client_frames(down)
    assert [correlation_id(f) for f in frames] == [1, 2]
    assert ApiVersionsResponse.decode(frames[1][4:], version=0).error_code == UNSUPPORTED_VERSION
    assert conn.in_flight == 0


def test_local_refusal_in_the_middle_of_a_pipeline(conn: ProxyConnection) -> None:
    actions = conn.receive_from_client(
        framed(heartbeat_request(1), too_new_api_versions_request(2), heartbeat_request(3)))
    assert to_broker(actions) == framed(heartbeat_request(1), heartbeat_request(3))
    down = conn.receive_from_broker(frame(heartbeat_response(1)))
    assert [correlation_id(f) for f in client_frames(down)] == [1, 2]
    down = conn.receive_from_broker(frame(heartbeat_response(3)))
    assert [correlation_id(f) for f in client_frames(down)] == [3]
    assert conn.closed is None


def test_local_refusal_sent_in_separate_call_still_waits(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(1)))
    assert to_client(conn.receive_from_client(frame(too_new_api_versions_request(2)))) == b""
    frames = client_frames(conn.receive_from_broker(frame(heartbeat_response(1))))
    assert [correlation_id(f) for f in frames] == [1, 2]


# -- bad input --------------------------------------------------------------------------------


def assert_closed_and_deaf(conn: ProxyConnection) -> None:
    assert conn.closed is not None
    assert conn.receive_from_client(frame(heartbeat_request(100))) == []
    assert conn.receive_from_broker(frame(heartbeat_response(100))) == []


def test_truncated_request_header_closes(conn: ProxyConnection) -> None:
    actions = conn.receive_from_client(frame(b"\x00\x03\x00"))
    (reason,) = close_reasons(actions)
    assert reason.startswith("client sent bad data")
    assert "frame has 3" in reason
    assert to_broker(actions) == b""
    assert_closed_and_deaf(conn)


def test_garbage_client_id_length_closes(conn: ProxyConnection) -> None:
    raw = bytearray(heartbeat_request(1))
    raw[8:10] = (-7).to_bytes(2, "big", signed=True)
    (reason,) = close_reasons(conn.receive_from_client(frame(bytes(raw))))
    assert "-7" in reason
    assert_closed_and_deaf(conn)


def test_oversize_request_closes_naming_size() -> None:
    conn = ProxyConnection(advertise, max_request_bytes=64)
    actions = conn.receive_from_client((65).to_bytes(4, "big") + b"x" * 10)
    (reason,) = close_reasons(actions)
    assert "65" in reason
    assert "64" in reason
    assert_closed_and_deaf(conn)


def test_negative_request_size_closes(conn: ProxyConnection) -> None:
    (reason,) = close_reasons(conn.receive_from_client(b"\xff\xff\xff\xfe"))
    assert "-2" in reason
    assert_closed_and_deaf(conn)


def test_request_at_size_limit_accepted() -> None:
    req = heartbeat_request(1)
    conn = ProxyConnection(advertise, max_request_bytes=len(req))
    assert to_broker(conn.receive_from_client(frame(req))) == frame(req)


def test_truncated_response_closes(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(1)))
    actions = conn.receive_from_broker(frame(b"\x00\x00"))
    (reason,) = close_reasons(actions)
    assert reason.startswith("broker sent bad data")
    assert "2 bytes" in reason
    assert_closed_and_deaf(conn)


def test_negative_response_size_closes(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(heartbeat_request(1)))
    (reason,) = close_reasons(conn.receive_from_broker(b"\x80\x00\x00\x01"))
    assert "broker sent bad data" in reason
    assert "-2147483647" in reason


def test_unparseable_metadata_response_closes(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(metadata_request(1)))
    actions = conn.receive_from_broker(frame(encode_response_header(1, 1) + b"\x00\x00\x00\x00\x09"))
    (reason,) = close_reasons(actions)
    assert "Metadata v12 response" in reason
    assert to_client(actions) == b""


def test_data_after_close_in_same_chunk_is_not_forwarded(conn: ProxyConnection) -> None:
    actions = conn.receive_from_client(framed(b"short", heartbeat_request(2)))
    assert close_reasons(actions) != []
    assert to_broker(actions) == b""
    assert conn.in_flight == 0


def test_metadata_above_max_version_closes(conn: ProxyConnection) -> None:
    too_new = KNOWN_APIS[ApiKey.METADATA].max_version + 1
    req = encode_request_header(ApiKey.METADATA, too_new, 1, "c") + b"\x01\x00\x00"
    actions = conn.receive_from_client(frame(req))
    (reason,) = close_reasons(actions)
    assert f"Metadata v{too_new} is above v{too_new - 1}" in reason
    assert to_broker(actions) == b""
    assert_closed_and_deaf(conn)


@pytest.mark.parametrize("key", [ApiKey.PRODUCE, ApiKey.FETCH, ApiKey.FIND_COORDINATOR,
                                 ApiKey.DESCRIBE_CLUSTER, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE])
def test_decoded_apis_above_max_version_close(conn: ProxyConnection, key: int) -> None:
    spec = KNOWN_APIS[key]
    req = encode_request_header(key, spec.max_version + 1, 1, "c") + b"\x00" * 20
    (reason,) = close_reasons(conn.receive_from_client(frame(req)))
    assert f"{spec.name} v{spec.max_version + 1}" in reason


def test_opaque_api_above_max_version_is_forwarded(conn: ProxyConnection) -> None:
    too_new = KNOWN_APIS[ApiKey.LIST_OFFSETS].max_version + 1
    req = encode_request_header(ApiKey.LIST_OFFSETS, too_new, 1, "c") + b"\x00" * 20
    actions = conn.receive_from_client(frame(req))
    assert close_reasons(actions) == []
    assert to_broker(actions) == frame(req)
    resp = encode_response_header(1, 1) + b"\x00" * 8
    assert client_frames(conn.receive_from_broker(frame(resp))) == [resp]


# -- address rewriting through the connection ------------------------------------------------


@pytest.mark.parametrize("version", [1, 12])
def test_metadata_addresses_rewritten_and_brokers_seen(conn: ProxyConnection, version: int) -> None:
    conn.receive_from_client(frame(metadata_request(4, version)))
    actions = conn.receive_from_broker(frame(metadata_response(4, version)))
    assert close_reasons(actions) == []
    # The proxy learns the brokers (and opens their ports) before the client reads their addresses.
    assert [type(a) for a in actions] == [BrokersSeen, ToClient]
    proxied = [(n, *advertise(n)) for n, _h, _p in REAL_BROKERS]
    assert client_frames(actions) == [metadata_response(4, version, brokers=proxied)]
    assert brokers_seen(actions) == {n: (h, p) for n, h, p in REAL_BROKERS}
    (seen,) = of_type(actions, BrokersSeen)
    assert seen.addresses == {1: ("kafka-1.internal", 9092), 2: ("kafka-2.internal", 9092)}


def test_find_coordinator_rewritten_through_connection(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(request(FindCoordinatorRequest, 3, 9, key="group", key_type=0)))
    resp = response(FindCoordinatorResponse, 3, 9, throttle_time_ms=0, error_code=0, error_message=None,
                    node_id=2, host="kafka-2.internal", port=9092)
    actions = conn.receive_from_broker(frame(resp))
    (out,) = client_frames(actions)
    decoded = FindCoordinatorResponse.decode(out[5:], version=3)
    assert (decoded.node_id, decoded.host, decoded.port) == (2, *advertise(2))
    assert brokers_seen(actions) == {2: ("kafka-2.internal", 9092)}


def test_response_without_addresses_has_no_brokers_seen(conn: ProxyConnection) -> None:
    conn.receive_from_client(frame(produce_request(6, 10, 1)))
    resp = produce_response(6, 10)
    actions = conn.receive_from_broker(frame(resp))
    assert of_type(actions, BrokersSeen) == []
    assert client_frames(actions) == [resp]


# -- ApiVersions through the connection ------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, 3, 4])
def test_api_versions_answer_clamped(conn: ProxyConnection, version: int) -> None:
    heartbeat = HeartbeatRequest.API_KEY
    broker = [(ApiKey.METADATA, 0, 99), (9999, 0, 1), (ApiKey.FETCH, 0, 2), (heartbeat, 0, 4)]
    extra: dict[str, object] = {} if version == 0 else {"throttle_time_ms": 0}
    resp = response(ApiVersionsResponse, version, 1, error_code=0,
                    api_keys=[AV(api_key=k, min_version=lo, max_version=hi) for k, lo, hi in broker], **extra)
    assert resp[4:] == body(ApiVersionsResponse, version, error_code=0,
                            api_keys=[AV(api_key=k, min_version=lo, max_version=hi) for k, lo, hi in broker],
                            **extra)  # header v0 even for flexible versions
    _up, down = exchange(conn, api_versions_request(1, version), resp)
    (out,) = client_frames(down)
    assert correlation_id(out) == 1
    decoded = ApiVersionsResponse.decode(out[4:], version=version)
    metadata_max = KNOWN_APIS[ApiKey.METADATA].max_version
    assert [(e.api_key, e.min_version, e.max_version) for e in decoded.api_keys] == [
        (ApiKey.METADATA, 0, metadata_max), (9999, 0, 1), (heartbeat, 0, 4),
        (ApiKey.DESCRIBE_CLIENT_QUOTAS, 0, 1), (ApiKey.ALTER_CLIENT_QUOTAS, 0, 1),
    ]


def test_api_versions_broker_error_v0_body(conn: ProxyConnection) -> None:
    # The proxy forwards v4; a broker that stops at v3 answers with a v0 body (KIP-511).
    broker_answer = encode_response_header(1, 0) + body(
        ApiVersionsResponse, 0, error_code=UNSUPPORTED_VERSION,
        api_keys=[AV(api_key=ApiKey.API_VERSIONS, min_version=0, max_version=3)])
    _up, down = exchange(conn, api_versions_request(1, 4), broker_answer)
    assert client_frames(down) == [broker_answer]


def test_api_versions_broker_error_at_request_version_passes(conn: ProxyConnection) -> None:
    # Kafka answers INVALID_REQUEST (bad client software name) in the request's own version:
    # only UNSUPPORTED_VERSION is sent as a v0 body. The client must get the error, not a close.
    broker_answer = encode_response_header(1, 0) + body(
        ApiVersionsResponse, 3, error_code=INVALID_REQUEST, api_keys=[], throttle_time_ms=0)
    _up, down = exchange(conn, api_versions_request(1, 3), broker_answer)
    (out,) = client_frames(down)
    assert out == broker_answer


# -- SASL with SaslHandshake v1 + SaslAuthenticate ------------------------------------------


@pytest.mark.parametrize("auth_version", [0, 1, 2])
def test_plain_principal_only_after_broker_success(conn: ProxyConnection, auth_version: int) -> None:
    exchange(conn, handshake_request(1, "PLAIN"), handshake_response(1))
    assert conn.principal == ANONYMOUS
    up = conn.receive_from_client(frame(authenticate_request(2, plain_token("alice"), auth_version)))
    assert to_broker(up) == frame(authenticate_request(2, plain_token("alice"), auth_version))
    assert conn.principal == ANONYMOUS  # a claim is not an identity
    down = conn.receive_from_broker(frame(authenticate_response(2, b"", auth_version)))
    assert client_frames(down) == [authenticate_response(2, b"", auth_version)]
    assert conn.principal == "alice"
    assert conn.authenticated_mechanism == "PLAIN"


@pytest.mark.parametrize("auth_version", [0, 2])
def test_plain_failed_answer_keeps_anonymous(conn: ProxyConnection, auth_version: int) -> None:
    exchange(conn, handshake_request(1, "PLAIN"), handshake_response(1))
    _up, down = exchange(conn, authenticate_request(2, plain_token("mallory"), auth_version),
                         authenticate_response(2, b"", auth_version, error_code=SASL_AUTHENTICATION_FAILED))
    assert client_frames(down) == [
        authenticate_response(2, b"", auth_version, error_code=SASL_AUTHENTICATION_FAILED)]
    assert conn.principal == ANONYMOUS
    assert conn.authenticated_mechanism is None


def test_scram_completes_only_on_server_final(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "SCRAM-SHA-256"), handshake_response(1))
    client_first = b"n,,n=us=2Cer=3Dname,r=rOprNGfwEbeRWgbNEkqO"
    server_first = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    exchange(conn, authenticate_request(2, client_first), authenticate_response(2, server_first))
    assert conn.principal == ANONYMOUS
    client_final = b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYD,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    server_final = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    exchange(conn, authenticate_request(3, client_final), authenticate_response(3, server_final))
    assert conn.principal == "us,er=name"
    assert conn.authenticated_mechanism == "SCRAM-SHA-256"


def test_scram_failure_on_final_keeps_anonymous(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "SCRAM-SHA-512"), handshake_response(1))
    exchange(conn, authenticate_request(2, b"n,,n=bob,r=abc"),
             authenticate_response(2, b"r=abcdef,s=c2FsdA==,i=4096"))
    exchange(conn, authenticate_request(3, b"c=biws,r=abcdef,p=bad"),
             authenticate_response(3, b"", error_code=SASL_AUTHENTICATION_FAILED))
    assert conn.principal == ANONYMOUS


def test_oauthbearer_sub_after_success(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "OAUTHBEARER"), handshake_response(1))
    exchange(conn, authenticate_request(2, oauth_token("svc-orders")), authenticate_response(2, b""))
    assert conn.principal == "svc-orders"
    assert conn.authenticated_mechanism == "OAUTHBEARER"


def test_oauthbearer_error_challenge_then_failure_keeps_anonymous(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "OAUTHBEARER"), handshake_response(1))
    exchange(conn, authenticate_request(2, oauth_token("svc-orders")),
             authenticate_response(2, b'{"status":"invalid_token"}'))
    assert conn.principal == ANONYMOUS
    exchange(conn, authenticate_request(3, b"\x01"),
             authenticate_response(3, b"", error_code=SASL_AUTHENTICATION_FAILED))
    assert conn.principal == ANONYMOUS
    assert conn.authenticated_mechanism is None


def test_handshake_v1_does_not_enter_raw_mode(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "PLAIN", version=1), handshake_response(1, version=1))
    # A raw token here would be a protocol error: v1 clients wrap tokens in SaslAuthenticate.
    actions = conn.receive_from_client(frame(b"\x00al\x00pw"))
    assert close_reasons(actions) != []


def test_sasl_authenticate_without_handshake_closes(conn: ProxyConnection) -> None:
    (reason,) = close_reasons(conn.receive_from_client(frame(authenticate_request(1, plain_token("x")))))
    assert "without a SaslHandshake" in reason


def test_unparseable_sasl_authenticate_response_closes(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "PLAIN"), handshake_response(1))
    conn.receive_from_client(frame(authenticate_request(2, plain_token("alice"))))
    (reason,) = close_reasons(conn.receive_from_broker(frame(encode_response_header(2, 1) + b"\x00")))
    assert "SaslAuthenticate v2 response: error_code (int16) runs past the end of the body" in reason
    assert conn.principal == ANONYMOUS


# -- SASL with SaslHandshake v0: raw tokens -------------------------------------------------


def test_raw_plain_after_handshake_v0(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "PLAIN", version=0), handshake_response(1, version=0))
    # A 6-byte raw token could never parse as a request header: it must pass untouched.
    token = plain_token("al", "p")
    assert len(token) < 10
    up = conn.receive_from_client(frame(token))
    assert close_reasons(up) == []
    assert to_broker(up) == frame(token)
    assert conn.in_flight == 0
    assert conn.principal == ANONYMOUS
    # The broker's success answer is an empty raw frame: no correlation id at all.
    down = conn.receive_from_broker(b"\x00\x00\x00\x00")
    assert close_reasons(down) == []
    assert to_client(down) == b"\x00\x00\x00\x00"
    assert conn.principal == "al"
    assert conn.authenticated_mechanism == "PLAIN"
    # Back to Kafka framing afterwards.
    _up, down = exchange(conn, metadata_request(2), metadata_response(2))
    assert [correlation_id(f) for f in client_frames(down)] == [2]


def test_raw_scram_after_handshake_v0(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "SCRAM-SHA-512", version=0), handshake_response(1, version=0))
    rounds = [
        (b"n,,n=zo=3De,r=nonce1", b"r=nonce1nonce2,s=c2FsdA==,i=4096"),
        (b"c=biws,r=nonce1nonce2,p=cHJvb2Y=", b"v=c2lnbmF0dXJl"),
    ]
    for i, (client_token, server_token) in enumerate(rounds):
        assert conn.principal == ANONYMOUS
        up = conn.receive_from_client(frame(client_token))
        assert to_broker(up) == frame(client_token)
        down = conn.receive_from_broker(frame(server_token))
        assert close_reasons(down) == []
        assert to_client(down) == frame(server_token)
        if i == 0:
            assert conn.principal == ANONYMOUS
    assert conn.principal == "zo=e"
    exchange(conn, heartbeat_request(5), heartbeat_response(5))


def test_raw_frames_split_across_chunks(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "PLAIN", version=0), handshake_response(1, version=0))
    stream = frame(plain_token("bob"))
    sent = b""
    for i in range(len(stream)):
        sent += to_broker(conn.receive_from_client(stream[i : i + 1]))
    assert sent == stream
    assert to_client(conn.receive_from_broker(b"\x00\x00")) == b""
    assert to_client(conn.receive_from_broker(b"\x00\x00")) == b"\x00\x00\x00\x00"
    assert conn.principal == "bob"


def test_failed_handshake_v0_does_not_enter_raw_mode(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "GSSAPI", version=0), handshake_response(1, version=0, error_code=33))
    up = conn.receive_from_client(frame(heartbeat_request(2)))
    assert conn.in_flight == 1  # parsed as a request, not swallowed as a raw token
    assert close_reasons(up) == []


# -- bookkeeping ------------------------------------------------------------------------------


def test_observer_sees_each_answered_exchange_once() -> None:
    """The metrics hook: one call per broker answer, none for acks=0 or the proxy's own answers."""
    seen: list[tuple[int, int, int, float]] = []
    conn = ProxyConnection(advertise, name="test",
                           observer=lambda *exchange: seen.append(exchange))  # type: ignore[arg-type]
    request = heartbeat_request(1)
    conn.receive_from_client(framed(request, produce_request(2, 9, 0), too_new_api_versions_request(3)),
                             now_ms=100.0)
    reply = heartbeat_response(1)
    conn.receive_from_broker(frame(reply), now_ms=102.5)
    assert seen == [(12, len(request), len(reply), 2.5)]


def test_close_action_type_and_reason(conn: ProxyConnection) -> None:
    actions = conn.receive_from_broker(frame(heartbeat_response(1)))
    assert actions == [Close(conn.closed or "")]


# -- established: what the I/O layer's setup timeout waits for ----------------------------------


def test_not_established_until_a_whole_request_arrives(conn: ProxyConnection) -> None:
    req = frame(heartbeat_request(1))
    assert not conn.established
    conn.receive_from_client(req[:-1])
    assert not conn.established  # the last byte is missing
    conn.receive_from_client(req[-1:])
    assert conn.established


def test_established_only_once_the_broker_accepts_sasl(conn: ProxyConnection) -> None:
    exchange(conn, api_versions_request(1, 3), encode_response_header(1, 0) + body(
        ApiVersionsResponse, 3, error_code=0, api_keys=[], throttle_time_ms=0))
    assert conn.established  # ApiVersions alone, no SASL asked for (yet)
    exchange(conn, handshake_request(2, "PLAIN"), handshake_response(2))
    assert not conn.established  # the exchange is under way
    assert conn.sasl_in_progress
    conn.receive_from_client(frame(authenticate_request(3, plain_token("alice"))))
    assert not conn.established  # a claim is not an acceptance
    conn.receive_from_broker(frame(authenticate_response(3)))
    assert conn.established and not conn.sasl_in_progress
    # A re-authentication later (KIP-368) does not make a set-up connection new again.
    exchange(conn, handshake_request(4, "PLAIN"), handshake_response(4))
    assert conn.established


def test_failed_sasl_never_establishes(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "PLAIN"), handshake_response(1))
    exchange(conn, authenticate_request(2, plain_token("mallory")),
             authenticate_response(2, error_code=SASL_AUTHENTICATION_FAILED))
    assert not conn.established


def test_gssapi_established_by_the_first_request_after_the_exchange(conn: ProxyConnection) -> None:
    """The proxy cannot see GSSAPI end; a broker takes another request only after it succeeded."""
    exchange(conn, handshake_request(1, "GSSAPI"), handshake_response(1))
    exchange(conn, authenticate_request(2, b"\x60\x82kerberos"), authenticate_response(2, b"\x60\x81reply"))
    exchange(conn, authenticate_request(3, b""), authenticate_response(3, b"\x05\x04wrap"))
    assert not conn.established
    assert conn.authenticated_mechanism is None
    conn.receive_from_client(frame(metadata_request(4)))
    assert conn.established


def test_raw_sasl_established_on_the_broker_raw_answer(conn: ProxyConnection) -> None:
    exchange(conn, handshake_request(1, "PLAIN", version=0), handshake_response(1, version=0))
    conn.receive_from_client(frame(plain_token("al", "p")))
    assert not conn.established
    conn.receive_from_broker(b"\x00\x00\x00\x00")
    assert conn.established


# -- request_memory_need: the I/O layer's budget for requests in flight ---------------------------


def test_memory_need_counts_the_declared_size_of_the_frame_being_read(conn: ProxyConnection) -> None:
    assert conn.request_memory_need == 0
    req = frame(heartbeat_request(1))
    conn.receive_from_client(req[:3])
    assert conn.request_memory_need == 3  # no size yet: what is buffered
    conn.receive_from_client(req[3:6])
    assert conn.request_memory_need == len(req)  # the whole frame, prefix included
    assert conn.request_bytes_held == 6  # what has arrived of it
    actions = conn.receive_from_client(req[6:] + frame(heartbeat_request(2))[:5])
    assert to_broker(actions) == req
    assert conn.request_memory_need == 4 + len(heartbeat_request(2))


def test_memory_need_of_a_huge_declared_request_before_its_body() -> None:
    conn = ProxyConnection(advertise)
    size = 90 * 1024 * 1024
    assert conn.receive_from_client(size.to_bytes(4, "big") + heartbeat_request(1)[:10]) == []
    assert conn.request_memory_need == 4 + size


def test_memory_need_counts_requests_waiting_behind_an_admin_answer(conn: ProxyConnection) -> None:
    describe = request(DescribeClientQuotasRequest, 1, 1, components=[], strict=False)
    waiting = [heartbeat_request(2), metadata_request(3)]
    partial = frame(heartbeat_request(4))[:7]
    conn.receive_from_client(framed(describe, *waiting) + partial)
    assert conn.waiting_requests
    assert conn.request_memory_need == sum(len(w) for w in waiting) + len(frame(heartbeat_request(4)))
    assert conn.request_bytes_held == sum(len(w) for w in waiting) + len(partial)
    actions = conn.answer_quota_admin(encode_response_header(1, 1) + b"\x00" * 8)
    assert [parse_request_header(f).correlation_id for f in broker_frames(actions)] == [2, 3]
    assert conn.request_memory_need == len(frame(heartbeat_request(4)))


def test_memory_need_is_zero_once_closed() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client((1000).to_bytes(4, "big") + b"\x00\x01")
    assert (conn.request_memory_need, conn.request_bytes_held) == (1004, 6)
    conn.receive_from_broker(frame(heartbeat_response(9)))  # unsolicited: closes
    assert conn.closed is not None
    assert (conn.request_memory_need, conn.request_bytes_held) == (0, 0)


# -- a request refused from its header, before its body is buffered -----------------------------


@pytest.mark.parametrize(("head", "named"), [
    ((-1).to_bytes(2, "big", signed=True) + b"\x00\x00", "api key -1 is negative"),
    ((-32768).to_bytes(2, "big", signed=True) + b"\x00\x01", "api key -32768 is negative"),
    (ApiKey.PRODUCE.to_bytes(2, "big") + (-1).to_bytes(2, "big", signed=True),
     "api version -1 is negative (Produce)"),
    ((9999).to_bytes(2, "big") + (-7).to_bytes(2, "big", signed=True),
     "api version -7 is negative (Unknown(9999))"),
], ids=["key -1", "key -32768", "Produce v-1", "unknown key v-7"])
def test_garbage_header_of_a_huge_request_refused_on_its_first_read(head: bytes, named: str) -> None:
    conn = ProxyConnection(advertise)
    size = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes: allowed by size
    first_read = size.to_bytes(4, "big") + head + b"\x00" * 4
    (reason,) = close_reasons(conn.receive_from_client(first_read))
    assert named in reason
    assert_closed_and_deaf(conn)


def test_header_checked_as_soon_as_its_four_bytes_are_in(conn: ProxyConnection) -> None:
    stream = (50_000).to_bytes(4, "big") + b"\xff\xfe\x00\x00"
    for i in range(7):
        assert conn.receive_from_client(stream[i : i + 1]) == []
    (reason,) = close_reasons(conn.receive_from_client(stream[7:]))
    assert "api key -2 is negative" in reason


def test_good_header_of_a_large_request_keeps_reading(conn: ProxyConnection) -> None:
    req = produce_request(1, 9, 1)
    padded = req + b"\x00" * 100_000  # a body the proxy never needs to read whole to start
    stream = frame(padded)
    assert conn.receive_from_client(stream[:20]) == []
    assert conn.receive_from_client(stream[20:1000]) == []
    assert conn.request_memory_need == len(stream)


def test_header_check_after_a_complete_frame_in_the_same_read(conn: ProxyConnection) -> None:
    stream = frame(heartbeat_request(1)) + (500).to_bytes(4, "big") + b"\x00\x0c\xff\xff"
    (reason,) = close_reasons(conn.receive_from_client(stream))
    assert "api version -1 is negative (Heartbeat)" in reason


def test_complete_request_with_negative_version_of_unknown_api_closes(conn: ProxyConnection) -> None:
    raw = bytearray(unknown_api_request(1))
    raw[2:4] = (-1).to_bytes(2, "big", signed=True)
    (reason,) = close_reasons(conn.receive_from_client(frame(bytes(raw))))
    assert "api version -1 is negative" in reason


def test_raw_sasl_token_is_not_read_as_a_header(conn: ProxyConnection) -> None:
    """After SaslHandshake v0 the client's frames are raw tokens: any first bytes are legal."""
    conn.receive_from_client(frame(handshake_request(1, "PLAIN", version=0)))
    token = b"\xff\xff\xff\xff" + b"\x00" * 20
    # The token may arrive before the broker's answer to the handshake has been read.
    assert conn.receive_from_client(frame(token)[:10]) == []
    assert close_reasons(conn.receive_from_broker(frame(handshake_response(1, version=0)))) == []
    up = conn.receive_from_client(frame(token)[10:])
    assert to_broker(up) == frame(token)
    assert conn.closed is None
