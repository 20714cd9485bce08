"""Large Fetch responses pass through as they arrive, v16+ ones with their NodeEndpoints rewritten."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kafka.protocol.consumer import FetchRequest, FetchResponse

from protocol.api_versions import clamp_api_versions
from protocol.connection import STREAM_MIN_BYTES, Mute, ProxyConnection
from protocol.fetch_stream import FETCH_STREAM_VERSIONS, PADDING_TAG, node_endpoints_slack
from protocol.frames import frame
from protocol.headers import encode_request_header, encode_response_header
from quotas.engine import QuotaEngine
from quotas.entity import QuotaEntity
from quotas.types import QuotaType

from .wire import advertise, brokers_seen, close_reasons, to_client

VERSION = 15


def fetch_request(cid: int, client: str = "c") -> bytes:
    body = FetchRequest[VERSION](max_wait_ms=500, min_bytes=1, max_bytes=50_000_000, isolation_level=0,
                                 session_id=0, session_epoch=-1, topics=[], forgotten_topics_data=[],
                                 rack_id="").encode()
    return frame(encode_request_header(1, VERSION, cid, client) + bytes(body))


def fetch_response(cid: int, records: bytes) -> bytes:
    R = FetchResponse[VERSION]
    T = R.FetchableTopicResponse
    partition = T.PartitionData(partition_index=0, error_code=0, high_watermark=10, last_stable_offset=10,
                                log_start_offset=0, aborted_transactions=None, preferred_read_replica=-1,
                                records=records)
    body = R(throttle_time_ms=0, error_code=0, session_id=7,
             responses=[T(topic_id=uuid.UUID(int=1), partitions=[partition])]).encode()
    return encode_response_header(cid, 1) + bytes(body)


def test_large_fetch_streams_before_it_is_complete() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request(1) + fetch_request(2))
    big = frame(fetch_response(1, b"r" * (3 * STREAM_MIN_BYTES)))
    small = frame(fetch_response(2, b"s" * 100))
    first = conn.receive_from_broker(big[:1000])
    assert to_client(first) == big[:1000], "the head of a large response was held back"
    out = to_client(first)
    for start in range(1000, len(big), 7000):
        out += to_client(conn.receive_from_broker(big[start : start + 7000]))
    assert out == big
    # The next response is matched and forwarded as usual.
    assert to_client(conn.receive_from_broker(small)) == small
    assert conn.in_flight == 0 and conn.closed is None


def test_stream_end_and_next_frame_in_one_chunk() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request(1) + fetch_request(2))
    big = frame(fetch_response(1, b"r" * (2 * STREAM_MIN_BYTES)))
    small = frame(fetch_response(2, b"s" * 10))
    out = to_client(conn.receive_from_broker(big[:5000]))
    out += to_client(conn.receive_from_broker(big[5000:] + small))
    assert out == big + small
    assert conn.in_flight == 0


def test_small_fetch_is_not_streamed() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request(1))
    small = frame(fetch_response(1, b"s" * 1000))
    assert to_client(conn.receive_from_broker(small[:500])) == b""
    assert to_client(conn.receive_from_broker(small[500:])) == small


def test_wrong_correlation_id_is_caught_before_streaming() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request(1))
    big = frame(fetch_response(9, b"r" * (2 * STREAM_MIN_BYTES)))
    actions = conn.receive_from_broker(big[:2000])
    assert conn.closed is not None and "does not match" in conn.closed
    assert to_client(actions) == b""


def test_over_quota_fetch_is_buffered_and_emptied() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, "c"): {QuotaType.FETCH: 10_000.0}})
    conn = ProxyConnection(advertise, policy=engine)
    conn.receive_from_client(fetch_request(1), now_ms=0)
    big = frame(fetch_response(1, b"r" * (3 * STREAM_MIN_BYTES)))
    assert to_client(conn.receive_from_broker(big[:4000], now_ms=5)) == b"", "an over-quota fetch streamed"
    actions = conn.receive_from_broker(big[4000:], now_ms=6)
    payload = to_client(actions)
    response = FetchResponse.decode(payload[9:], version=VERSION)
    assert response.throttle_time_ms > 0
    assert response.session_id == 7
    assert [p.records for t in response.responses for p in t.partitions] == [b""]
    assert [a.ms for a in actions if isinstance(a, Mute)] == [response.throttle_time_ms]


def test_within_quota_fetch_streams_and_is_charged_once() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, "c"): {QuotaType.FETCH: 1e9}})
    conn = ProxyConnection(advertise, policy=engine)
    conn.receive_from_client(fetch_request(1), now_ms=0)
    big = frame(fetch_response(1, b"r" * (3 * STREAM_MIN_BYTES)))
    out = to_client(conn.receive_from_broker(big[:4000], now_ms=1))
    out += to_client(conn.receive_from_broker(big[4000:], now_ms=2))
    assert out == big
    (bucket,) = engine.managers[QuotaType.FETCH].buckets.values()
    assert bucket.rate.total(2) == len(big) - 5  # 4 + body: charged exactly once


@pytest.mark.parametrize("broker_max, offered", [(18, 18), (17, 17), (19, 18)])
def test_fetch_offered_up_to_what_the_stream_reader_knows(broker_max: int, offered: int) -> None:
    from kafka.protocol.metadata import ApiVersionsResponse

    R = ApiVersionsResponse[3]
    body = R(error_code=0, api_keys=[R.ApiVersion(api_key=1, min_version=4, max_version=broker_max)],
             throttle_time_ms=0).encode()
    clamped, _ = clamp_api_versions(bytes(body), 3)
    fetch = [e for e in R.decode(clamped).api_keys if e.api_key == 1]
    assert [(e.min_version, e.max_version) for e in fetch] == [(4, offered)]
    assert offered <= FETCH_STREAM_VERSIONS[1]


# -- Fetch v16+: streamed with NodeEndpoints rewritten ---------------------------------------------------

REAL_ENDPOINTS = [(2, "b2", 9092), (3, "broker-3.kafka.internal.example.com", 9093)]


def fetch_request_v(cid: int, version: int, client: str = "c") -> bytes:
    body = FetchRequest[version](max_wait_ms=500, min_bytes=1, max_bytes=50_000_000, isolation_level=0,
                                 session_id=0, session_epoch=-1, topics=[], forgotten_topics_data=[],
                                 rack_id="").encode()
    return frame(encode_request_header(1, version, cid, client) + bytes(body))


def fetch_response_v(cid: int, version: int, records: bytes,
                     endpoints: list[tuple[int, str, int]] | None) -> bytes:
    R = FetchResponse[version]
    T = R.FetchableTopicResponse
    P = T.PartitionData
    data = P(partition_index=0, error_code=0, high_watermark=10, last_stable_offset=10, log_start_offset=0,
             aborted_transactions=None, preferred_read_replica=-1, records=records)
    moved = P(partition_index=1, error_code=6, high_watermark=-1, last_stable_offset=-1, log_start_offset=-1,
              aborted_transactions=None, preferred_read_replica=-1, records=None,
              current_leader=P.LeaderIdAndEpoch(leader_id=2, leader_epoch=8))
    fields: dict[str, Any] = {"throttle_time_ms": 0, "error_code": 0, "session_id": 7,
                              "responses": [T(topic_id=uuid.UUID(int=1), partitions=[data, moved])]}
    if endpoints is not None:
        fields["node_endpoints"] = [R.NodeEndpoint(node_id=n, host=h, port=p, rack=None)
                                    for n, h, p in endpoints]
    return encode_response_header(cid, 1) + bytes(R(**fields).encode())


def read_client_frame(out: bytes, version: int) -> Any:
    """The one frame in `out`: its size prefix must be exact, and kafka-python must read all of it."""
    size = int.from_bytes(out[:4], "big")
    assert len(out) == 4 + size, "the announced size is not what was sent"
    R = FetchResponse[version]
    decode = R._struct.compiled_decode_from(version, compact=True, tagged=True, data_class=R[None])
    message, pos = decode(memoryview(out), 4 + 5)
    assert pos == len(out), "bytes left after the response"
    return message


@pytest.mark.parametrize("version", [16, 17, 18])
def test_large_fetch_v16_streams_with_proxy_node_endpoints(version: int) -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request_v(1, version))
    response = fetch_response_v(1, version, b"r" * (3 * STREAM_MIN_BYTES), REAL_ENDPOINTS)
    big = frame(response)
    first = conn.receive_from_broker(big[:1000])
    assert len(to_client(first)) > 900, "the head of a large v16+ response was held back"
    actions = list(first)
    for start in range(1000, len(big), 7000):
        actions += conn.receive_from_broker(big[start : start + 7000])
    out = to_client(actions)
    message = read_client_frame(out, version)
    assert [(e.node_id, e.host, e.port) for e in message.node_endpoints] == \
        [(n, *advertise(n)) for n, _h, _p in REAL_ENDPOINTS]
    assert bytes(message.responses[0].partitions[0].records) == b"r" * (3 * STREAM_MIN_BYTES)
    assert brokers_seen(actions) == {n: (h, p) for n, h, p in REAL_ENDPOINTS}
    assert b"broker-3.kafka" not in out and b"b2" not in out[-200:]
    assert conn.in_flight == 0 and conn.closed is None


def test_v16_stream_announces_the_slack_up_front_and_pads_it() -> None:
    known = {1: ("proxy.test", 9092), 2: ("b2", 9092)}
    conn = ProxyConnection(advertise, known_brokers=lambda: known)
    conn.receive_from_client(fetch_request_v(1, 17))
    big = frame(fetch_response_v(1, 17, b"r" * (2 * STREAM_MIN_BYTES), None))
    first = to_client(conn.receive_from_broker(big[:5000]))
    slack = node_endpoints_slack(advertise, known)
    assert slack == (len("proxy.test") - 2) + (len("proxy.test") + 1 - 2)
    assert int.from_bytes(first[:4], "big") == len(big) - 4 + slack
    assert first[4:] == big[4:5000], "bytes before the tail were changed"
    out = first + to_client(conn.receive_from_broker(big[5000:]))
    message = read_client_frame(out, 17)
    assert not message.node_endpoints
    assert message.unknown_tags == {f"_{PADDING_TAG}": bytes(slack - 3)}


def test_next_response_follows_a_v16_stream() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request_v(1, 16) + fetch_request_v(2, 16))
    big = frame(fetch_response_v(1, 16, b"r" * (2 * STREAM_MIN_BYTES), REAL_ENDPOINTS))
    small = frame(fetch_response_v(2, 16, b"s" * 10, REAL_ENDPOINTS))
    out = to_client(conn.receive_from_broker(big[:5000]))
    out += to_client(conn.receive_from_broker(big[5000:] + small))
    first_size = int.from_bytes(out[:4], "big")
    read_client_frame(out[: 4 + first_size], 16)
    rest = read_client_frame(out[4 + first_size :], 16)  # buffered: rewritten exactly, no slack
    assert [(e.host, e.port) for e in rest.node_endpoints] == [advertise(n) for n, _h, _p in REAL_ENDPOINTS]
    assert len(out) - 4 - first_size < len(small), "the small response grew"
    assert conn.in_flight == 0


def test_a_rewrite_beyond_the_slack_closes_instead_of_a_wrong_frame() -> None:
    known = {2: ("proxy.test", 9092)}  # slack for one unknown broker with a 1-character host only
    conn = ProxyConnection(advertise, known_brokers=lambda: known)
    conn.receive_from_client(fetch_request_v(1, 17))
    endpoints = [(2, "a", 1), (3, "b", 1), (4, "c", 1)]  # three hosts of one character
    big = frame(fetch_response_v(1, 17, b"r" * (2 * STREAM_MIN_BYTES), endpoints))
    head = to_client(conn.receive_from_broker(big[:5000]))
    actions = conn.receive_from_broker(big[5000:])
    assert conn.closed is not None and "slack" in conn.closed and "wrong frame" in conn.closed
    assert len(head) + len(to_client(actions)) < len(big), "the tail went out anyway"
    assert close_reasons(actions) == [conn.closed]


def test_a_streamed_v16_response_with_a_bad_tail_closes() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request_v(1, 16))
    response = fetch_response_v(1, 16, b"r" * (2 * STREAM_MIN_BYTES), None)
    bad = frame(response[:-1] + b"\x02")  # two tagged fields announced, none there
    conn.receive_from_broker(bad[:5000])
    conn.receive_from_broker(bad[5000:])
    assert conn.closed is not None and "tagged fields do not parse" in conn.closed


def test_observer_sees_the_announced_size_of_a_v16_stream() -> None:
    seen: list[tuple[int, int, int, float]] = []
    conn = ProxyConnection(advertise, observer=lambda *a: seen.append(a))
    conn.receive_from_client(fetch_request_v(1, 17))
    big = frame(fetch_response_v(1, 17, b"r" * (2 * STREAM_MIN_BYTES), REAL_ENDPOINTS))
    out = to_client(conn.receive_from_broker(big[:5000]) + conn.receive_from_broker(big[5000:]))
    assert [s[2] for s in seen] == [len(out) - 4]


def test_over_quota_v16_fetch_is_buffered_emptied_and_rewritten() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, "c"): {QuotaType.FETCH: 10_000.0}})
    conn = ProxyConnection(advertise, policy=engine)
    conn.receive_from_client(fetch_request_v(1, 17), now_ms=0)
    big = frame(fetch_response_v(1, 17, b"r" * (3 * STREAM_MIN_BYTES), REAL_ENDPOINTS))
    assert to_client(conn.receive_from_broker(big[:4000], now_ms=5)) == b""
    actions = conn.receive_from_broker(big[4000:], now_ms=6)
    message = read_client_frame(to_client(actions), 17)
    assert message.throttle_time_ms > 0
    assert [p.records for t in message.responses for p in t.partitions] == [b"", None]
    assert [(e.host, e.port) for e in message.node_endpoints] == \
        [advertise(n) for n, _h, _p in REAL_ENDPOINTS]
    assert brokers_seen(actions) == {n: (h, p) for n, h, p in REAL_ENDPOINTS}


# -- regressions found in review ---------------------------------------------------------------------


def api_versions_too_new(cid: int) -> bytes:
    from kafka.protocol.metadata import ApiVersionsRequest

    from protocol.apis import KNOWN_APIS

    newest = KNOWN_APIS[18].max_version
    header = encode_request_header(18, newest, cid, "c")
    body = bytes(ApiVersionsRequest[newest](client_software_name="c", client_software_version="1").encode())
    return frame(header[:2] + (newest + 1).to_bytes(2, "big") + header[4:] + body)


def correlation_ids(data: bytes) -> list[int]:
    ids, pos = [], 0
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + 4], "big")
        ids.append(int.from_bytes(data[pos + 4 : pos + 8], "big"))
        pos += 4 + size
    return ids


def test_local_answer_waits_for_a_response_mid_stream() -> None:
    conn = ProxyConnection(advertise)
    conn.receive_from_client(fetch_request(1))
    big = frame(fetch_response(1, b"r" * (3 * STREAM_MIN_BYTES)))
    out = to_client(conn.receive_from_broker(big[:5000]))
    out += to_client(conn.receive_from_client(api_versions_too_new(2)))
    out += to_client(conn.receive_from_broker(big[5000:]))
    assert out[: len(big)] == big, "the proxy's own answer was written into a streamed response"
    assert correlation_ids(out) == [1, 2]


def test_local_answer_behind_a_throttled_response_is_not_stranded() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, "c"): {QuotaType.FETCH: 10.0}})
    conn = ProxyConnection(advertise, policy=engine)
    conn.receive_from_client(fetch_request(1) + api_versions_too_new(2) + fetch_request(3), now_ms=0)
    first = conn.receive_from_broker(frame(fetch_response(1, b"x" * 1000)), now_ms=1)
    assert any(isinstance(a, Mute) for a in first), "the fetch was not throttled"
    assert correlation_ids(to_client(first)) == [1, 2]
    third = conn.receive_from_broker(frame(fetch_response(3, b"y")), now_ms=2)
    assert conn.closed is None
    assert correlation_ids(to_client(third)) == [3]


def test_partial_copies_at_most_eight_bytes() -> None:
    from protocol.frames import FrameSplitter

    splitter = FrameSplitter(2**31 - 1)
    splitter.feed((10_000_000).to_bytes(4, "big") + b"abcdefgh" + b"z" * 1_000_000)
    size, buffered, first = splitter.partial()  # type: ignore[misc]
    assert (size, buffered, first) == (10_000_000, 1_000_008, b"abcdefgh")
    assert splitter.take_partial() == b"abcdefgh" + b"z" * 1_000_000
    assert splitter.partial() is None


def test_raw_sasl_v0_with_an_unfollowable_mechanism_is_refused() -> None:
    from kafka.protocol.sasl import SaslHandshakeRequest, SaslHandshakeResponse

    conn = ProxyConnection(advertise)
    body = bytes(SaslHandshakeRequest[0](mechanism="GSSAPI").encode())
    conn.receive_from_client(frame(encode_request_header(17, 0, 1, "c") + body))
    answer = bytes(SaslHandshakeResponse[0](error_code=0, mechanisms=["GSSAPI"]).encode())
    conn.receive_from_broker(frame(encode_response_header(1, 0) + answer))
    assert conn.closed is not None and "GSSAPI" in conn.closed
