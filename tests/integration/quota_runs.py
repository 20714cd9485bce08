"""Driving clients at full speed through a throttling proxy and measuring what got through."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Producer

#: Figures the rate runs measured, printed at the end of the test session (conftest.py), so a
#: `make test` log shows them without -s.
FIGURES: list[str] = []


def report(line: str) -> None:
    """Print a measured figure now (with -s) and in the session's summary."""
    print(line)
    FIGURES.append(line)


@dataclass
class RunResult:
    """Acknowledged (or consumed) payload bytes over time, and what was sent."""

    started: float
    events: list[tuple[float, int]] = field(default_factory=list)
    records: int = 0
    errors: list[str] = field(default_factory=list)
    #: (time, bytes received so far), for consumers: see `consume_for`
    received: list[tuple[float, int]] = field(default_factory=list)

    def rate(self, start_s: float, end_s: float) -> float:
        """Payload bytes per second between `start_s` and `end_s` after the start (see `slope`)."""
        lo, hi = self.started + start_s, self.started + end_s
        total = 0
        points: list[tuple[float, float]] = []
        for at, size in sorted((at, size) for at, size in self.events if lo <= at < hi):
            total += size
            points.append((at, total))
        fitted = _fitted_rate(points, end_s - start_s)
        # Too few events for a slope: all there is, over the span.
        return total / (end_s - start_s) if fitted is None else fitted

    def received_rate(self, start_s: float, end_s: float) -> float:
        """Bytes per second the consumer received between `start_s` and `end_s` after the start."""
        lo, hi = self.started + start_s, self.started + end_s
        inside = [(at, float(total)) for at, total in self.received if lo <= at <= hi]
        fitted = _fitted_rate(inside, end_s - start_s)
        if fitted is None:
            raise AssertionError(f"too few client statistics between {start_s} s and {end_s} s: {inside}")
        return fitted

    def received_lead(self, rate: float, start_s: float, end_s: float) -> tuple[float, float]:
        """How far the bytes received ran ahead of and fell behind `rate`, at most, over any span
        between `start_s` and `end_s`: (ahead, behind) in seconds of `rate`.

        A 5-second rate of a consumer moves by a whole fetch response (up to a second of quota in
        the smooth shape) as one lands inside or outside it; this reads the bound itself: over
        every pair of samples t1 < t2, received(t2) - received(t1) - rate * (t2 - t1).
        """
        lo, hi = self.started + start_s, self.started + end_s
        ahead = behind = 0.0
        lowest = highest = None
        for at, total in self.received:
            if not lo <= at <= hi:
                continue
            off = total - rate * at  # how far above the quota's line, from a common origin
            if lowest is not None and highest is not None:
                ahead, behind = max(ahead, off - lowest), max(behind, highest - off)
            lowest = off if lowest is None else min(lowest, off)
            highest = off if highest is None else max(highest, off)
        return ahead / rate, behind / rate

    def largest_receipt(self) -> int:
        """The most bytes that came between two statistics samples (100 ms): about one response."""
        totals = [total for _, total in self.received]
        return max((b - a for a, b in itertools.pairwise(totals)), default=0)

    def received_timeline(self, step_s: float, end_s: float) -> str:
        """The consumer's received kB/s per `step_s` from the start to `end_s`: a failure's shape."""
        marks: list[str] = []
        at = 0.0
        while at < end_s:
            before = [total for t, total in self.received if t <= self.started + at] or [0]
            after = [total for t, total in self.received if t <= self.started + at + step_s] or [0]
            marks.append(f"{(after[-1] - before[-1]) / step_s / 1000:.0f}")
            at += step_s
        return " ".join(marks)


def _fitted_rate(points: list[tuple[float, float]], span_s: float) -> float | None:
    """`slope` of (time, bytes so far) when the points cover at least half the span, else None."""
    if len(points) < 2 or points[-1][0] - points[0][0] < span_s / 2:
        return None
    return slope(points)


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (time, bytes so far): the rate over the span, from every point.

    A greedy client under Kafka's quota algorithm moves in a sawtooth with a period of about
    `quota_window_num` windows (3 s here), decaying over its first minute. The bytes between a
    span's first and last events depend on where in that sawtooth the two ends fall: replaying a
    greedy producer on three connections through the engine (tests/unit/test_quota_dynamics.py),
    the last 20 s of 30 s came out at 0.99-1.05x the quota that way (median 1.05x) and at
    0.96-1.02x as the slope of a line fitted to the whole cumulative curve, which does not hang on
    the ends.
    """
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    return (sum((t - mean_t) * (b - mean_b) for t, b in points)
            / sum((t - mean_t) ** 2 for t, _ in points))


def produce_for(bootstrap: str, topic: str, seconds: float, value_size: int = 10_000,
                offered_rate: float | None = None, value: bytes | None = None, **config: object) -> RunResult:
    """librdkafka for `seconds`, at full speed or at `offered_rate` bytes/s; every delivery is timed.
    `value`: every record's value (`value_size` bytes of "x" when not given)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": 1,
                         "queue.buffering.max.kbytes": 4096, **config})
    result = RunResult(time.monotonic())
    value = b"x" * value_size if value is None else value
    value_size = len(value)
    lock = threading.Lock()

    def report(err: KafkaError | None, msg: object) -> None:
        with lock:
            if err is not None:
                result.errors.append(str(err))
            else:
                result.events.append((time.monotonic(), value_size))
                result.records += 1

    deadline = result.started + seconds
    sent = 0
    while time.monotonic() < deadline:
        if offered_rate is not None:
            ahead = result.started + sent * value_size / offered_rate - time.monotonic()
            if ahead > 0:
                producer.poll(min(ahead, 0.05))
                continue
        try:
            producer.produce(topic, value, str(sent % 97).encode(), on_delivery=report)
            sent += 1
        except BufferError:
            producer.poll(0.05)
            continue
        producer.poll(0)
    producer.flush(120)
    assert result.records == sent, f"{sent} records sent, {result.records} acknowledged: {result.errors[:3]}"
    return result


def consume_for(bootstrap: str, topic: str, seconds: float, expected: int | None = None,
                **config: object) -> tuple[RunResult, dict[int, list[int]]]:
    """Consume at full speed for `seconds`; returns timing and offsets seen per partition.

    `RunResult.received` holds the bytes the consumer received from the proxy, every 100 ms, from
    librdkafka's own statistics (`rxbytes` summed over its broker connections): what a fetch byte
    quota limits. The records' values are in `events`; they are less, as a fetch response also
    carries framing and a partial batch at the end of each partition's data, which the client
    drops and fetches again.
    """
    result = RunResult(time.monotonic())

    def on_stats(text: str) -> None:
        stats = json.loads(text)
        brokers = stats.get("brokers", {}).values()
        # stamped with librdkafka's own clock (CLOCK_MONOTONIC, µs) when it took the figures, not
        # when the application got round to the callback
        at = stats["ts"] / 1e6
        result.received.append((at, sum(int(b.get("rxbytes", 0)) for b in brokers)))

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-quota",
                         "auto.offset.reset": "earliest", "statistics.interval.ms": 100,
                         "stats_cb": on_stats, **config})
    consumer.subscribe([topic])
    offsets: dict[int, list[int]] = {}
    deadline = result.started + seconds
    try:
        while time.monotonic() < deadline and (expected is None or result.records < expected):
            for message in consumer.consume(1000, timeout=0.5):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        result.errors.append(str(message.error()))
                    continue
                result.events.append((time.monotonic(), len(message.value())))
                result.records += 1
                offsets.setdefault(message.partition(), []).append(message.offset())
    finally:
        consumer.close()
    return result, offsets
