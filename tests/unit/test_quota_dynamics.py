"""Greedy clients replayed through the real engine with a fake clock: what a 20 s measurement sees.

The integration runs measure real clients for 30 s; these replays show, without a cluster, the
properties those runs rely on: over three connections sharing one bucket (the proxy's cluster-wide
scope, with its hold), a greedy producer is held to its quota, and the 20 s figure depends on how
it is measured (tests/integration/quota_runs.py fits a line); a greedy consumer gets its quota
when a fetch response is small against quota x window, and less when it is large (README "Limits").
"""

from __future__ import annotations

import heapq
import random

import pytest

from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import QuotaEntity
from quotas.rate import WindowConfig
from quotas.types import QuotaType
from tests.integration.quota_runs import slope

QUOTA = 2_500_000.0
CONNECTIONS = 3
PRODUCE, FETCH = 0, 1


def replay(seed: int, api: int, size: int, until_ms: float) -> list[tuple[float, int]]:
    """A client at full speed on three connections: (time delivered, bytes) for each request.

    Each connection sends its next request as soon as the previous answer is back and its throttle
    has passed, and waits while the bucket is throttled (`hold_ms`), as the proxy makes it.
    A throttled fetch delivers nothing (it is answered empty); a produce is delivered either way.
    """
    rng = random.Random(seed)
    quota_type = QuotaType.PRODUCE if api == PRODUCE else QuotaType.FETCH
    engine = QuotaEngine(EngineConfig(window=WindowConfig(3, 1000)))
    engine.set_quotas({QuotaEntity(None, "c"): {quota_type: QUOTA}})
    start = rng.uniform(0, 1000)
    ready = [(start + rng.uniform(0, 5), n) for n in range(CONNECTIONS)]
    delivered: list[tuple[float, int]] = []
    while ready:
        now, conn = heapq.heappop(ready)
        if now > start + until_ms:
            break
        hold = engine.hold_ms("", "c", api, int(now))
        if hold > 0:
            heapq.heappush(ready, (now + hold, conn))
            continue
        took = rng.uniform(2, 20)  # the upstream round trip
        amount = int(size * rng.uniform(0.3, 1.0)) if api == PRODUCE else size
        if api == PRODUCE:
            verdict = engine.charge("", "c", int(now), produce_bytes=amount)
        else:
            verdict = engine.charge("", "c", int(now + took), fetch_bytes=amount)
        if api == PRODUCE or verdict.throttle_ms == 0:
            delivered.append((now + took - start, amount))
        heapq.heappush(ready, (now + took + verdict.throttle_ms, conn))
    return delivered


def last_20_of_30(delivered: list[tuple[float, int]]) -> tuple[float, float]:
    """(bytes between 10 s and 30 s / 20 s, fitted slope) in units of the quota."""
    inside = [(at / 1000, size) for at, size in delivered if 10_000 <= at < 30_000]
    total = 0
    points = []
    for at, size in inside:
        total += size
        points.append((at, float(total)))
    return total / 20 / QUOTA, slope(points) / QUOTA


@pytest.mark.parametrize("size", [256_000, 1_000_000])
def test_a_greedy_producer_on_three_connections_is_held_to_its_quota(size: int) -> None:
    fitted = []
    for seed in range(20):
        delivered = replay(seed, PRODUCE, size, 90_000)
        late = sum(b for at, b in delivered if at >= 30_000) / 60 / QUOTA
        assert 0.97 <= late <= 1.03, f"seed {seed}: {late:.3f}x the quota over 30-90 s"
        fitted.append(last_20_of_30(delivered)[1])
    assert min(fitted) >= 0.95, f"fitted 20 s rates {min(fitted):.3f}..{max(fitted):.3f}"
    assert max(fitted) <= 1.05, f"fitted 20 s rates {min(fitted):.3f}..{max(fitted):.3f}"


def test_a_fitted_line_does_not_hang_on_the_ends_of_the_sawtooth() -> None:
    """Bytes over 20 s drift high while the first minute's sawtooth decays; the fitted slope less."""
    by_sum, by_slope = zip(*(last_20_of_30(replay(seed, PRODUCE, 256_000, 30_000)) for seed in range(20)),
                           strict=True)
    assert abs(sorted(by_slope)[10] - 1) < abs(sorted(by_sum)[10] - 1)


def test_a_greedy_consumer_gets_its_quota_when_responses_are_small() -> None:
    rates = [last_20_of_30(replay(seed, FETCH, 131_072, 30_000))[1] for seed in range(20)]
    assert min(rates) >= 0.9, f"{min(rates):.3f}..{max(rates):.3f}"
    assert max(rates) <= 1.05, f"{min(rates):.3f}..{max(rates):.3f}"


def test_a_greedy_consumer_gets_less_when_one_response_is_most_of_a_second_of_quota() -> None:
    """2 MB responses against 2.5 MB/s: a throttled response's bytes lengthen its throttle though
    they are not sent (Kafka's fetch handling), so the consumer stays well below its quota."""
    rates = [last_20_of_30(replay(seed, FETCH, 2_097_152, 30_000))[1] for seed in range(20)]
    assert max(rates) < 0.9, f"{min(rates):.3f}..{max(rates):.3f}"
