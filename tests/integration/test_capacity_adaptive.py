"""Adaptive capacity against the real 3-broker cluster, slowed from outside (issues 21 and 27).

1. A broker slowed by SIGSTOP/SIGCONT bursts (kill -STOP on its JVM, outside the product), while
   two tenants produce: the factor falls with a log line naming that broker, and is back at 1.0
   within RECOVERY_S of the broker running again.
2. The same over a fleet of two, traffic through one member only: the other member's own factor
   stays 1.0 while its factor in force follows the first's through the usage exchange.

The overload bed, where the protection is judged (gold's latency, goodput), is
test_overload_bed.py; what a client cannot fake is test_capacity_strain.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Producer

from harness.local_kafka import LocalKafka
from tests.integration.clients import wait_until
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import produce_for, report
from tests.integration.test_fleet import static_fleet
from tests.integration.test_quotas import _topic

#: Latency figures (gold's p50 and p99) and the factor that follows them.
pytestmark = pytest.mark.quiet

CAPACITY = 40_000_000  # bytes/s: above what this machine's cluster takes through a proxy
GOLD_RATE = 200  # records/s of 1 KB, acks=all
#: the issue's bound: the factor is back at 1.0 this long after the strain ends
RECOVERY_S = 20
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


@pytest.fixture(scope="module")
def topic(kafka_cluster: LocalKafka) -> str:
    return _topic(kafka_cluster.bootstrap, "adaptive")


def _steady(bootstrap: str, topic: str, seconds: float) -> threading.Thread:
    """A second tenant at 300 KB/s beside gold: a broker's strain is seen by more than one tenant
    (adaptive_capacity.MIN_STRAINED_TENANTS)."""
    thread = threading.Thread(target=produce_for, args=(bootstrap, topic, seconds), kwargs={
        "offered_rate": 300_000, "client.id": "steady", "acks": "all"}, daemon=True)
    thread.start()
    return thread


def wait_for_baselines(metric: Callable[..., float], brokers: tuple[int, ...] = (1, 2, 3)) -> None:
    """Until the proxy has learned a Produce latency baseline for every one of `brokers` (light
    traffic from two tenants teaches it; a cut before then has nothing to judge against)."""
    name = "kthrottle_capacity_latency_baseline_seconds"
    wait_until(lambda: all(metric(name, broker=str(b), api="Produce") > 0 for b in brokers), 30,
               f"Produce latency baselines for brokers {brokers}")


def _stop_and_go(kafka: LocalKafka, node_id: int, seconds: int, probe: Callable[[], float]) -> float:
    """SIGSTOP the broker 0.6 s of every second for `seconds`; the lowest `probe()` seen."""
    pid = kafka.pid(node_id)
    lowest = 1.0
    try:
        for _ in range(seconds):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.6)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.4)
            lowest = min(lowest, probe())
    finally:
        os.kill(pid, signal.SIGCONT)
    return lowest


def _back_at_one(read: Callable[[], float], within_s: float) -> float:
    """Seconds until `read()` is 1.0 again (inf: not within `within_s`)."""
    start = time.monotonic()
    while read() < 1.0:
        if time.monotonic() - start > within_s:
            return float("inf")
        time.sleep(0.5)
    return time.monotonic() - start


@pytest.mark.alone  # the factor follows broker latency, which any neighbour moves (tests/quiet/)
def test_a_broker_slowed_by_sigstop_lowers_the_factor_and_it_recovers(
        kafka_cluster: LocalKafka, topic: str, tmp_path: Path) -> None:
    # one replica per partition: only broker 2's own partitions wait for it, so the signal
    # names that broker (with three replicas every leader would wait for it as a follower)
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path, _capacity(True)) as proxy:
        proxy.set_quotas(SHARES)
        gold = Gold(proxy.bootstrap, topic, 40)
        steady = _steady(proxy.bootstrap, topic, 40)
        wait_for_baselines(proxy.metric)
        # healthy before the bursts (a stray cut from the machine's own noise has recovered)
        wait_until(lambda: proxy.metric("kthrottle_capacity_factor") == 1.0, 10,
                   "factor at 1.0 before the bursts")
        lowest = _stop_and_go(kafka_cluster, 2, 8, lambda: proxy.metric("kthrottle_capacity_factor"))
        log = proxy.wait_for_log("(latency): broker 2", timeout=5)
        back = _back_at_one(lambda: proxy.metric("kthrottle_capacity_factor"), RECOVERY_S)
        gold.thread.join(60)
        steady.join(60)
    report(f"adaptive capacity, broker 2 stopped 0.6 s of every second for 8 s: factor fell to "
           f"{lowest:.2f}, back at 1.0 {back:.1f} s after the broker ran again (at most {RECOVERY_S} s)")
    assert lowest < 1.0
    assert back <= RECOVERY_S, proxy.log()[-3000:]
    assert "(healthy)" in proxy.log() and log


@pytest.mark.alone  # the same bursts, and two members' factors (tests/quiet/)
def test_a_factor_cut_on_one_member_holds_the_other_and_both_recover(
        kafka_cluster: LocalKafka, topic: str, tmp_path: Path) -> None:
    """A fleet of two: only A carries traffic, so only A's controller sees broker 2 stall. B's own
    factor stays 1.0, and B's factor in force follows A's through the usage exchange."""
    with ExitStack() as stack:
        config = _capacity(True) + SHARES
        (a, b), _ports, _relay = static_fleet(stack, kafka_cluster, tmp_path, config, count=2)
        gold = Gold(a.bootstrap, topic, 40)
        steady = _steady(a.bootstrap, topic, 40)
        wait_for_baselines(a.metric)
        factor = "kthrottle_capacity_factor"
        wait_until(lambda: a.metric(factor) == 1.0 == b.metric(factor), 10,
                   "both factors at 1.0 before the bursts")
        seen: list[tuple[float, float, float]] = []  # (A's own, B's own, B's in force)

        def probe() -> float:
            seen.append((a.metric("kthrottle_capacity_factor_own"),
                         b.metric("kthrottle_capacity_factor_own"), b.metric("kthrottle_capacity_factor")))
            return seen[-1][2]

        lowest_b = _stop_and_go(kafka_cluster, 2, 8, probe)
        back = _back_at_one(lambda: min(a.metric("kthrottle_capacity_factor"),
                                        b.metric("kthrottle_capacity_factor")), RECOVERY_S)
        fleet_moves = b.metric("kthrottle_capacity_factor_changes_total", reason="fleet")
        gold.thread.join(60)
        steady.join(60)
        b_log = b.log()
    lowest_a = min(own_a for own_a, _, _ in seen)
    report(f"adaptive capacity over a fleet of two, broker 2 stalled, traffic on A only: A's own "
           f"factor fell to {lowest_a:.2f}; B's own stayed at {min(own_b for _, own_b, _ in seen):.2f} "
           f"and its factor in force fell to {lowest_b:.2f} ({fleet_moves:.0f} moves from the fleet); "
           f"both back at 1.0 {back:.1f} s after")
    assert lowest_a < 1.0
    assert all(own_b == 1.0 for _, own_b, _ in seen), "B carried no traffic: its own controller saw nothing"
    assert lowest_b < 1.0 and fleet_moves > 0, b_log[-3000:]
    assert lowest_b >= lowest_a - 0.01, "B follows A's factor, never below it"
    assert back <= RECOVERY_S, b_log[-3000:]


@pytest.fixture(autouse=True)
def _never_leave_a_broker_stopped(kafka_cluster: LocalKafka) -> Iterator[None]:
    yield
    for node_id in (1, 2, 3):
        with contextlib.suppress(KeyError, ProcessLookupError):
            os.kill(kafka_cluster.pid(node_id), signal.SIGCONT)
