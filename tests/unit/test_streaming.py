"""Large Fetch responses pass through as they arrive, unless something in them must change."""

from __future__ import annotations

import uuid

from kafka.protocol.consumer import FetchRequest, FetchResponse

from protocol.api_versions import clamp_api_versions
from protocol.connection import STREAM_MIN_BYTES, Mute, ProxyConnection
from protocol.frames import frame
from protocol.headers import encode_request_header, encode_response_header
from quotas.engine import QuotaEngine
from quotas.entity import QuotaEntity
from quotas.types import QuotaType

from .wire import advertise, to_client

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


def test_fetch_offered_up_to_v15() -> None:
    from kafka.protocol.metadata import ApiVersionsResponse

    R = ApiVersionsResponse[3]
    body = R(error_code=0, api_keys=[R.ApiVersion(api_key=1, min_version=4, max_version=18)],
             throttle_time_ms=0).encode()
    clamped, _ = clamp_api_versions(bytes(body), 3)
    fetch = [e for e in R.decode(clamped).api_keys if e.api_key == 1]
    assert [(e.min_version, e.max_version) for e in fetch] == [(4, 15)]


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
