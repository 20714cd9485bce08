"""Fetch sizing (issue 13 part 4): each Fetch's `max_bytes` lowered to what its bucket may still take.

A broker grants a fetch whole or empties it (and un-records it), so a consumer whose responses
are a large part of quota x window gets less than its quota. The proxy lowers `max_bytes` to the
bucket's headroom in the current window (never below MIN_FETCH_GRANT_BYTES), so responses shrink
instead. The simulations below drive the engine with a fake clock: three brokers, two partitions
each, librdkafka's defaults (`fetch.max.bytes` 50 MB, `max.partition.fetch.bytes` 1 MiB), a broker
that returns at most `max_bytes` but always the first record batch whole (KIP-74).
"""

from __future__ import annotations

import heapq

import pytest

from protocol.charging import prepare_fetch
from protocol.headers import parse_request_header
from protocol.in_flight import InFlight
from quotas.engine import MIN_FETCH_GRANT_BYTES, EngineConfig, QuotaEngine
from quotas.entity import QuotaEntity
from quotas.rate import WindowConfig
from quotas.token_bucket import BURST_MS
from quotas.types import QuotaType

from .test_throttling import decode_request, fetch_request

F = QuotaType.FETCH
QUOTA = 1_000_000  # bytes per second: the consumer_byte_rate
FETCH_MAX_BYTES = 52_428_800  # librdkafka's fetch.max.bytes
PARTITION_MAX_BYTES = 1_048_576  # librdkafka's max.partition.fetch.bytes
BROKERS = 3
PARTITIONS_PER_BROKER = 2  # 6 partitions
RTT_MS = 3
RUN_MS = 60_000


def engine(shape: str = "kafka", quotas: dict[QuotaType, float] | None = None,
           window: WindowConfig | None = None) -> QuotaEngine:
    built = QuotaEngine(EngineConfig(window=window or WindowConfig(), quota_shape=shape))  # type: ignore[arg-type]
    built.set_quotas({QuotaEntity(None, "app"): quotas if quotas is not None else {F: float(QUOTA)}})
    return built


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (ms, bytes so far), in bytes per second (as quota_runs.slope)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    return 1000.0 * (sum((t - mean_t) * (b - mean_b) for t, b in points)
                     / sum((t - mean_t) ** 2 for t, _ in points))


def simulate(quota_engine: QuotaEngine, batch: int, shrink: bool = True) -> tuple[float, list[int]]:
    """A greedy consumer on every broker for RUN_MS: (fitted received rate / quota, each max_bytes sent).

    Each connection fetches again as soon as its response is in, waits out a throttle it gets
    (KIP-219), and is held while the bucket is throttled on another connection (hold_ms), as
    the proxy does. Without `shrink` the proxy caps at Kafka's quota x window only.
    """
    pending = [(0, broker) for broker in range(BROKERS)]
    received = 0
    points = [(0, 0)]
    sent: list[int] = []
    while pending:
        now, broker = heapq.heappop(pending)
        if now >= RUN_MS:
            continue
        hold = quota_engine.hold_ms("u", "app", 1, now)
        if hold > 0:
            heapq.heappush(pending, (now + hold, broker))
            continue
        cap = quota_engine.fetch_max_bytes("u", "app", now if shrink else None)
        max_bytes = FETCH_MAX_BYTES if cap is None else min(FETCH_MAX_BYTES, cap)
        sent.append(max_bytes)
        # whole batches up to max_bytes, at least the first one (KIP-74), within the partition maxima
        size = min(PARTITIONS_PER_BROKER * PARTITION_MAX_BYTES, max(batch, max_bytes // batch * batch))
        arrived = now + RTT_MS
        verdict = quota_engine.charge("u", "app", arrived, fetch_bytes=size)
        if verdict.throttle_ms > 0:  # emptied: nothing delivered, the client waits
            heapq.heappush(pending, (arrived + verdict.throttle_ms, broker))
            continue
        if arrived < RUN_MS:
            received += size
            points.append((arrived, received))
        heapq.heappush(pending, (arrived, broker))
    return slope(points) / QUOTA, sent


@pytest.mark.parametrize("batch", [16_384, 262_144, 1_048_576])
def test_default_fetch_settings_get_their_quota(batch: int) -> None:
    """Kafka's 11 x 1 s windows, 1 MB/s, 60 s: 0.90-1.05x with sizing, below 0.90x without it."""
    rate, sent = simulate(engine(), batch)
    assert 0.90 <= rate <= 1.05, rate
    assert min(sent) >= MIN_FETCH_GRANT_BYTES
    assert min(sent) < PARTITION_MAX_BYTES  # the sizing did lower fetches
    whole, _ = simulate(engine(), batch, shrink=False)
    assert whole < 0.90, whole  # what a fetch granted whole or emptied gets (the complaint)


def test_smooth_shape_is_sized_to_its_tokens() -> None:
    rate, sent = simulate(engine("smooth"), 16_384)
    assert 0.95 <= rate <= 1.05, rate
    assert max(sent) <= QUOTA * BURST_MS // 1000  # never above the burst
    assert min(sent) == MIN_FETCH_GRANT_BYTES


def test_headroom_is_the_window_less_what_it_holds() -> None:
    quota_engine = engine()
    assert quota_engine.fetch_max_bytes("u", "app", 0) == 10 * QUOTA  # a new bucket: Kafka's cap
    assert quota_engine.charge("u", "app", 0, fetch_bytes=3_000_000).throttle_ms == 0
    # Kafka pads the window to 10 whole windows past the oldest sample's start: 10.5 s at 500 ms,
    # so 10.5 MB, 3 MB of it taken
    assert quota_engine.fetch_max_bytes("u", "app", 500) == 7_500_000
    assert quota_engine.fetch_max_bytes("u", "app") == 10 * QUOTA  # Kafka's own cap is unchanged


def test_a_fetch_of_the_grant_is_not_throttled_and_one_more_batch_is() -> None:
    for taken in (2_500_000, 9_990_000):  # at 200 ms the window is 10.2 s: 10.2 MB
        granted = engine()
        granted.charge("u", "app", 0, fetch_bytes=taken)
        grant = granted.fetch_max_bytes("u", "app", 200)
        assert grant is not None and abs(grant - (10_200_000 - taken)) <= 1
        assert granted.charge("u", "app", 200, fetch_bytes=grant).throttle_ms == 0
        over = engine()
        over.charge("u", "app", 0, fetch_bytes=taken)
        assert over.charge("u", "app", 200, fetch_bytes=grant + MIN_FETCH_GRANT_BYTES).throttle_ms > 0


def test_never_below_the_floor() -> None:
    quota_engine = engine()
    quota_engine.charge("u", "app", 0, fetch_bytes=30_000_000)  # far over: throttled, so un-recorded
    quota_engine.charge("u", "app", 0, fetch_bytes=10_000_000)  # exactly the window: not throttled
    assert quota_engine.fetch_max_bytes("u", "app", 1) == MIN_FETCH_GRANT_BYTES
    smooth = engine("smooth")
    smooth.charge("u", "app", 0, fetch_bytes=995_000)  # 5,000 tokens left of the 1 MB burst
    assert smooth.fetch_max_bytes("u", "app", 1) == MIN_FETCH_GRANT_BYTES
    # unless Kafka's own cap is lower: a 100 B/s quota never fetches more than 1,000 bytes
    tiny = engine(quotas={F: 100.0})
    assert tiny.fetch_max_bytes("u", "app", 0) == 1_000


def test_no_change_when_no_fetch_quota_applies() -> None:
    no_quotas = QuotaEngine()
    assert no_quotas.fetch_max_bytes("u", "app", 5) is None
    produce_only = engine(quotas={QuotaType.PRODUCE: 1000.0})
    assert produce_only.fetch_max_bytes("u", "app", 5) is None
    other_client = engine()
    assert other_client.fetch_max_bytes("u", "someone-else", 5) is None
    frame = fetch_request(12, min_bytes=1, max_bytes=FETCH_MAX_BYTES)
    header = parse_request_header(frame)
    entry = InFlight(header.correlation_id, 1, 12, "consumer-1", sent_ms=5.0)
    assert prepare_fetch(other_client, "u", entry, frame, header) == frame
    assert entry.max_wait_ms == 500


@pytest.mark.parametrize("version", [4, 12, 13, 17])
def test_prepare_fetch_forwards_the_grant(version: int) -> None:
    quota_engine = QuotaEngine()
    quota_engine.set_quotas({QuotaEntity(None, "consumer-1"): {F: float(QUOTA)}})
    quota_engine.charge("u", "consumer-1", 0, fetch_bytes=4_000_000)
    frame = fetch_request(version, min_bytes=1, max_bytes=FETCH_MAX_BYTES)
    header = parse_request_header(frame)
    entry = InFlight(header.correlation_id, 1, version, "consumer-1", sent_ms=1000.0)
    after = decode_request(prepare_fetch(quota_engine, "u", entry, frame, header))
    assert after.max_bytes == 6_000_000
    assert after.min_bytes == 1
    assert after.topics[0].partitions[0].partition_max_bytes == PARTITION_MAX_BYTES
