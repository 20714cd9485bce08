"""`quota_shape = "smooth"` (issue 13 part 5): greedy librdkafka clients through `kthrottle run`.

Under Kafka's windowed rate (the default) a producer at full speed sends ~10 s of quota in its
first seconds, then moves in an 11 s sawtooth whose 5-second rates swing between ~0.3x and
~2.2x the quota. With the smooth shape the burst is one second of quota: a producer's every
5-second rate after the first 5 s stays within 0.85-1.15x, its rate from 5 s on within
0.95-1.02x, and the throttles it sees are KIP-219 signals (throttle_time_ms, then muted) of at
most about one second plus one request's worth. A consumer's bytes come a response at a time
(the cap of one second of quota and the batch crossing it): it stays within the burst plus one
response of the quota's line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from harness.local_kafka import LocalKafka
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import RunResult, consume_for, produce_for, report
from tests.integration.test_quotas import _end_offsets, _fill, _topic

#: Rates over 5-second spans against Kafka's formula.
pytestmark = pytest.mark.quiet

QUOTA = 1_500_000  # bytes per second, the producer_byte_rate
RUN_S = 25
SPAN_S = 5


@pytest.fixture(scope="module")
def smooth_proxy(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    workdir = tmp_path_factory.mktemp("smooth")
    with QuotaProxy(kafka_cluster.bootstrap, workdir, 'quota_shape = "smooth"') as running:
        yield running


def _span_rates(result: RunResult) -> list[float]:
    """Acknowledged payload per 5-second span after the first 5 s, as a fraction of the quota."""
    return [sum(size for at, size in result.events
                if start <= at - result.started < start + SPAN_S) / SPAN_S / QUOTA
            for start in range(SPAN_S, RUN_S - SPAN_S + 1, SPAN_S)]


def test_smooth_greedy_producer_librdkafka(smooth_proxy: QuotaProxy) -> None:
    smooth_proxy.set_quotas(f'[[quota]]\nclient_id = "smooth-producer"\nproducer_byte_rate = {QUOTA}')
    topic = _topic(smooth_proxy.bootstrap, "q-smooth")
    throttles: list[int] = []

    def on_stats(text: str) -> None:
        for broker in json.loads(text).get("brokers", {}).values():
            if broker.get("nodeid", -1) >= 0:
                throttles.append(int(broker.get("throttle", {}).get("max", 0)))

    result = produce_for(smooth_proxy.bootstrap, topic, RUN_S, **{
        "client.id": "smooth-producer", "statistics.interval.ms": 1000, "stats_cb": on_stats})
    rates = _span_rates(result)
    steady = sum(size for at, size in result.events
                 if SPAN_S <= at - result.started < RUN_S) / (RUN_S - SPAN_S) / QUOTA
    whole = sum(size for at, size in result.events if at - result.started < RUN_S) / RUN_S / QUOTA
    report(f"librdkafka producer, quota_shape smooth, {QUOTA:,} B/s: 5-second rates after 5 s "
           f"{', '.join(f'{r:.3f}' for r in rates)}x; 5-{RUN_S} s {steady:.3f}x; 0-{RUN_S} s {whole:.3f}x; "
           f"largest throttle seen by the client {max(throttles, default=0)} ms")
    assert all(0.85 <= rate <= 1.15 for rate in rates), rates
    assert 0.95 <= steady <= 1.02, steady
    assert _end_offsets(smooth_proxy.bootstrap, topic) == result.records, "records lost or duplicated"
    # KIP-219 signals: the client saw throttles, none longer than the burst plus one request (<= 1 MB)
    assert 0 < max(throttles) <= 1000 + 1_000_000 * 1000 // QUOTA
    assert smooth_proxy.metric("kthrottle_throttles_total", quota="producer_byte_rate", user="",
                               client_id="smooth-producer") > 0


def test_smooth_greedy_consumer_librdkafka(smooth_proxy: QuotaProxy) -> None:
    """A consumer's bytes come a fetch response at a time, each up to the cap of one second
    of quota and the batch crossing it, so its 5-second rates step by 0.2-0.3x as a response
    lands inside a span or just outside it. What the shape promises is a bound: over any span
    after the first 5 s the consumer is never more than the burst (one second of quota) plus
    one response ahead of the quota's line, and over 5-25 s it gets its quota."""
    topic = _topic(smooth_proxy.bootstrap, "q-smooth-fetch")
    total = _fill(smooth_proxy.bootstrap, topic, 60)  # 60 MB: more than 25 s of quota
    smooth_proxy.set_quotas(f'[[quota]]\nclient_id = "smooth-consumer"\nconsumer_byte_rate = {QUOTA}')
    result, offsets = consume_for(smooth_proxy.bootstrap, topic, RUN_S, **{"client.id": "smooth-consumer"})
    rates = [result.received_rate(start, start + SPAN_S) / QUOTA
             for start in range(SPAN_S, RUN_S - SPAN_S + 1, SPAN_S)]
    steady = result.received_rate(SPAN_S, RUN_S) / QUOTA
    ahead, behind = result.received_lead(QUOTA, SPAN_S, RUN_S)
    response_s = result.largest_receipt() / QUOTA
    # the burst, one response, and 0.2 s for the 100 ms between the client's samples and latency
    bound_s = 1.0 + response_s + 0.2
    report(f"librdkafka consumer, quota_shape smooth, {QUOTA:,} B/s: 5-second rates after 5 s "
           f"{', '.join(f'{r:.3f}' for r in rates)}x; 5-{RUN_S} s {steady:.3f}x (bytes received); "
           f"at most {ahead:.2f} s of quota ahead of the quota's line (bound {bound_s:.2f} s: "
           f"largest response {response_s:.2f} s) and {behind:.2f} s behind it")
    assert ahead <= bound_s, (ahead, result.received_timeline(1, RUN_S))
    assert 0.95 <= steady <= 1 + bound_s / (RUN_S - SPAN_S), steady
    assert offsets and result.records < total
    for partition, seen in offsets.items():
        assert seen == list(range(len(seen))), f"partition {partition}: gaps or repeats"
    assert smooth_proxy.metric("kthrottle_throttles_total", quota="consumer_byte_rate", user="",
                               client_id="smooth-consumer") > 0
