"""The smooth shape delivers a Fetch that overdraws its token bucket and throttles the client after,
instead of Kafka's empty answer (issue 13 part 4), buffered or streamed; Kafka's shape empties it."""

from __future__ import annotations

import math

from kafka.protocol.consumer import FetchResponse

from protocol.connection import STREAM_MIN_BYTES, Mute, ProxyConnection, Throttled
from protocol.frames import frame
from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import QuotaEntity
from quotas.types import QuotaType

from .test_streaming import VERSION, fetch_request, fetch_response
from .wire import advertise, to_client

QUOTA = 1_000.0  # bytes/s: 30 kB is over it at once, even in a new client's padded window


def _connection(shape: str) -> tuple[QuotaEngine, ProxyConnection]:
    engine = QuotaEngine(EngineConfig(quota_shape=shape))  # type: ignore[arg-type]
    engine.set_quotas({QuotaEntity(None, "c"): {QuotaType.FETCH: QUOTA}})
    return engine, ProxyConnection(advertise, policy=engine)


def _fetch_total(engine: QuotaEngine, now_ms: int) -> float:
    (bucket,) = engine.managers[QuotaType.FETCH].buckets.values()
    return bucket.rate.total(now_ms)


def test_a_buffered_fetch_over_quota_is_delivered_with_its_throttle() -> None:
    engine, conn = _connection("smooth")
    conn.receive_from_client(fetch_request(1), now_ms=0)
    response = frame(fetch_response(1, b"r" * 30_000))
    actions = conn.receive_from_broker(response, now_ms=5)
    payload = to_client(actions)
    decoded = FetchResponse.decode(payload[9:], version=VERSION)
    assert [p.records for t in decoded.responses for p in t.partitions] == [b"r" * 30_000]
    assert decoded.throttle_time_ms > 0
    assert [a.ms for a in actions if isinstance(a, Mute)] == [decoded.throttle_time_ms]
    assert [a.throttle_ms for a in actions if isinstance(a, Throttled)] == [decoded.throttle_time_ms]
    # The bytes count (Kafka would take them back, having sent none); the throttle pays them back.
    assert _fetch_total(engine, 5) == len(response) - 5
    assert decoded.throttle_time_ms == math.ceil((len(response) - 5 - QUOTA) / QUOTA * 1000)


def test_the_same_fetch_is_emptied_and_uncounted_by_default() -> None:
    engine, conn = _connection("kafka")
    conn.receive_from_client(fetch_request(1), now_ms=0)
    payload = to_client(conn.receive_from_broker(frame(fetch_response(1, b"r" * 30_000)), now_ms=5))
    decoded = FetchResponse.decode(payload[9:], version=VERSION)
    assert [p.records for t in decoded.responses for p in t.partitions] == [b""]
    assert decoded.throttle_time_ms > 0
    assert _fetch_total(engine, 5) == 0


def test_a_streamed_fetch_over_quota_streams_with_the_throttle_in_its_head() -> None:
    engine, conn = _connection("smooth")
    conn.receive_from_client(fetch_request(1), now_ms=0)
    big = frame(fetch_response(1, b"r" * (3 * STREAM_MIN_BYTES)))
    first = conn.receive_from_broker(big[:4000], now_ms=5)
    head = to_client(first)
    assert len(head) == 4000, "an over-quota fetch was held back instead of streamed"
    mutes = [a.ms for a in first if isinstance(a, Mute)]
    assert len(mutes) == 1 and mutes[0] > 0
    out = head + to_client(conn.receive_from_broker(big[4000:], now_ms=6))
    assert len(out) == len(big)
    decoded = FetchResponse.decode(out[9:], version=VERSION)
    assert decoded.throttle_time_ms == mutes[0]
    assert [p.records for t in decoded.responses for p in t.partitions] == [b"r" * (3 * STREAM_MIN_BYTES)]
    assert out[:9] + out[13:] == big[:9] + big[13:], "more than the throttle field changed"
    assert _fetch_total(engine, 6) == len(big) - 5
    assert conn.in_flight == 0 and conn.closed is None


def test_a_stream_waits_for_its_throttle_field() -> None:
    """A first chunk too short to hold the throttle field is kept until more arrives."""
    _, conn = _connection("smooth")
    conn.receive_from_client(fetch_request(1), now_ms=0)
    big = frame(fetch_response(1, b"r" * (3 * STREAM_MIN_BYTES)))
    assert to_client(conn.receive_from_broker(big[:10], now_ms=5)) == b""
    out = to_client(conn.receive_from_broker(big[10:4000], now_ms=5))
    assert len(out) == 4000
    assert FetchResponse.decode((out + big[4000:])[9:], version=VERSION).throttle_time_ms > 0


def test_a_fetch_finding_the_bucket_in_debt_is_emptied() -> None:
    """Sent on another connection while the client is throttled: emptied, and not counted."""
    engine, conn = _connection("smooth")
    other = ProxyConnection(advertise, policy=engine)
    conn.receive_from_client(fetch_request(1), now_ms=0)
    other.receive_from_client(fetch_request(1), now_ms=0)
    conn.receive_from_broker(frame(fetch_response(1, b"r" * 30_000)), now_ms=5)
    counted = _fetch_total(engine, 5)
    payload = to_client(other.receive_from_broker(frame(fetch_response(1, b"s" * 500)), now_ms=6))
    decoded = FetchResponse.decode(payload[9:], version=VERSION)
    assert [p.records for t in decoded.responses for p in t.partitions] == [b""]
    assert decoded.throttle_time_ms > 0
    assert _fetch_total(engine, 6) == counted
