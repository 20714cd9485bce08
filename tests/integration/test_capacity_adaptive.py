"""Adaptive capacity (issue 21) against the real 3-broker cluster, slowed from outside.

1. Overload. A "gold" tenant (share 10) sends a steady stream of small acks=all records while
   two best-effort tenants (share 1 each) produce flat out. Gold's produce latency (p50, p99)
   and the cluster's total throughput are measured quiet, then overloaded through a proxy with
   adaptive off, then through one with adaptive on, and reported against the issue's targets
   (gold's p99 with adaptive on within 2x its quiet p99, total throughput at least 80 % of
   adaptive-off). Asserted: gold, with the high share, is never throttled by the capacity. On this
   2-core machine the overload queues in the clients more than it slows the brokers' answers, so
   whether the factor moves here is reported, not asserted; part 2 asserts the mechanism.
2. A broker slowed by SIGSTOP/SIGCONT bursts (kill -STOP on its JVM, outside the product): the
   factor falls with a log line naming that broker, then recovers once the broker is healthy.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer

from harness.local_kafka import LocalKafka
from tests.integration.clients import wait_until
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import RunResult, produce_for, report
from tests.integration.test_quotas import _topic

#: Latency figures (gold's p50 and p99) and the factor that follows them.
pytestmark = pytest.mark.quiet

CAPACITY = 40_000_000  # bytes/s: above what this machine's cluster takes through a proxy
GOLD_RATE = 200  # records/s of 1 KB, acks=all
PHASE_S = 20
SHARES = '[[quota]]\nclient_id = "gold"\nshare = 10\n\n[[quota]]\nclient_id = "<default>"\nshare = 1\n'


def _capacity(adaptive: bool) -> str:
    return (f"\n[capacity]\nproduce_byte_rate = {CAPACITY}\nadaptive = {str(adaptive).lower()}\n"
            "min_fraction = 0.05\n")


class Gold:
    """acks=all, one 1 KB record every 1/GOLD_RATE s; each record's produce-to-ack latency."""

    def __init__(self, bootstrap: str, topic: str, seconds: float) -> None:
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._producer = Producer({"bootstrap.servers": bootstrap, "client.id": "gold", "acks": "all",
                                   "linger.ms": 0})
        self._topic = topic
        self._seconds = seconds
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        sent = 0
        value = b"g" * 1000
        while time.monotonic() - start < self._seconds:
            wait = start + sent / GOLD_RATE - time.monotonic()
            if wait > 0:
                self._producer.poll(min(wait, 0.01))  # never negative: librdkafka waits forever then
                continue
            at = time.monotonic()

            def done(err: KafkaError | None, _msg: object, at: float = at) -> None:
                if err is not None:
                    self.errors.append(str(err))
                else:
                    self.latencies.append((time.monotonic() - at) * 1000.0)

            self._producer.produce(self._topic, value, on_delivery=done)
            sent += 1
            self._producer.poll(0)
        self._producer.flush(60)

    def percentiles(self, skip: int) -> tuple[float, float]:
        self.thread.join(120)
        samples = sorted(self.latencies[skip:])
        assert len(samples) > 100 and not self.errors, (len(samples), self.errors[:3])
        return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def _overloaded(proxy: QuotaProxy, topic: str) -> tuple[float, float, float]:
    """Gold's p50, p99 (ms) and the total produced bytes/s over the phase's last 15 s."""
    gold = Gold(proxy.bootstrap, topic, PHASE_S)
    results: dict[str, RunResult] = {}
    threads = [threading.Thread(target=lambda name=name: results.__setitem__(name, produce_for(
        proxy.bootstrap, topic, PHASE_S, value_size=50_000, **{"client.id": name, "acks": "all"})))
        for name in ("best-effort-1", "best-effort-2", "best-effort-3")]
    for thread in threads:
        thread.start()
    p50, p99 = gold.percentiles(skip=len(gold.latencies) // 4)
    for thread in threads:
        thread.join(120)
    total = sum(r.rate(PHASE_S - 15, PHASE_S) for r in results.values()) + GOLD_RATE * 1000
    return p50, p99, total


@pytest.fixture(scope="module")
def topic(kafka_cluster: LocalKafka) -> str:
    return _topic(kafka_cluster.bootstrap, "adaptive")


def _settle(bootstrap: str, topic: str, quiet_p99: float) -> float:
    """Gold alone until its p99 is back within 3x the quiet one (the previous phase's backlog
    drained), at most 30 s; the last p99 seen."""
    p99 = float("inf")
    deadline = time.monotonic() + 30
    while p99 > 3 * quiet_p99 and time.monotonic() < deadline:
        p99 = Gold(bootstrap, topic, 4).percentiles(skip=0)[1]
    return p99


@pytest.mark.alone  # its figures are latencies: nothing else runs beside it (tests/quiet/)
def test_gold_latency_under_overload_adaptive_off_and_on(kafka_cluster: LocalKafka, topic: str,
                                                         tmp_path: Path) -> None:
    off_dir, on_dir = tmp_path / "off", tmp_path / "on"
    off_dir.mkdir()
    on_dir.mkdir()
    with QuotaProxy(kafka_cluster.bootstrap, off_dir, _capacity(False)) as off:
        off.set_quotas(SHARES)
        Gold(off.bootstrap, topic, 5).percentiles(skip=0)  # the new topic's leaders settle
        quiet = Gold(off.bootstrap, topic, 10)
        quiet_p50, quiet_p99 = quiet.percentiles(skip=200)
        off_p50, off_p99, off_total = _overloaded(off, topic)
    with QuotaProxy(kafka_cluster.bootstrap, on_dir, _capacity(True)) as on:
        on.set_quotas(SHARES)
        _settle(on.bootstrap, topic, quiet_p99)
        Gold(on.bootstrap, topic, 8).percentiles(skip=0)  # light: the baselines are learned
        on_p50, on_p99, on_total = _overloaded(on, topic)
        factor = on.metric("kthrottle_capacity_factor")
        cuts = on.metric("kthrottle_capacity_factor_changes_total", reason="latency")
        gold_throttles = on.metric("kthrottle_capacity_throttles_total", quota="producer_byte_rate",
                                   user="", client_id="gold")
        log = on.log()
    report(f"adaptive capacity, gold p50/p99 produce latency: quiet {quiet_p50:.1f}/{quiet_p99:.1f} ms; "
           f"overloaded, adaptive off {off_p50:.1f}/{off_p99:.1f} ms; "
           f"adaptive on {on_p50:.1f}/{on_p99:.1f} ms "
           f"(target p99 <= 2x quiet: {on_p99 / quiet_p99:.2f}x); total throughput off {off_total / 1e6:.1f} "
           f"MB/s, on {on_total / 1e6:.1f} MB/s ({on_total / off_total:.2f}x, target >= 0.80); factor at the "
           f"end {factor:.2f}, {cuts:.0f} cuts for latency")
    assert gold_throttles == 0, log[-3000:]  # the high share keeps gold's whole demand


@pytest.mark.alone  # the factor follows broker latency, which any neighbour moves (tests/quiet/)
def test_a_broker_slowed_by_sigstop_lowers_the_factor_and_it_recovers(
        kafka_cluster: LocalKafka, topic: str, tmp_path: Path) -> None:
    # one replica per partition: only broker 2's own partitions wait for it, so the signal
    # names that broker (with three replicas every leader would wait for it as a follower)
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path, _capacity(True)) as proxy:
        proxy.set_quotas(SHARES)
        gold = Gold(proxy.bootstrap, topic, 34)
        time.sleep(8)  # light traffic: baselines learned
        # healthy before the bursts (a stray cut from the machine's own noise has recovered)
        wait_until(lambda: proxy.metric("kthrottle_capacity_factor") == 1.0, 10,
                   "factor at 1.0 before the bursts")
        pid = kafka_cluster.pid(2)
        lowest = 1.0
        try:
            for _ in range(8):  # 0.6 s stopped of every second
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.6)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.4)
                lowest = min(lowest, proxy.metric("kthrottle_capacity_factor"))
        finally:
            os.kill(pid, signal.SIGCONT)
        log = proxy.wait_for_log("(latency): broker 2", timeout=5)
        deadline = time.monotonic() + 18
        recovered = lowest
        while time.monotonic() < deadline and recovered < 1.0:
            time.sleep(1)
            recovered = proxy.metric("kthrottle_capacity_factor")
        gold.thread.join(60)
    report(f"adaptive capacity, broker 2 stopped 0.6 s of every second for 8 s: factor fell to "
           f"{lowest:.2f}, back to {recovered:.2f} within 18 s of the broker running again")
    assert lowest < 1.0
    assert recovered > lowest
    assert "(healthy)" in proxy.log() and log


@pytest.fixture(autouse=True)
def _never_leave_a_broker_stopped(kafka_cluster: LocalKafka) -> Iterator[None]:
    yield
    for node_id in (1, 2, 3):
        with contextlib.suppress(KeyError, ProcessLookupError):
            os.kill(kafka_cluster.pid(node_id), signal.SIGCONT)
