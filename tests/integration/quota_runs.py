"""Driving clients at full speed through a throttling proxy and measuring what got through."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Producer


@dataclass
class RunResult:
    """Acknowledged (or consumed) payload bytes over time, and what was sent."""

    started: float
    events: list[tuple[float, int]] = field(default_factory=list)
    records: int = 0
    errors: list[str] = field(default_factory=list)

    def rate(self, start_s: float, end_s: float) -> float:
        """Payload bytes per second between `start_s` and `end_s` after the start.

        Measured from the first to the last event inside the span (the bytes of the first one
        excluded), so that one large acknowledgement landing on either side of an edge does not
        swing the figure: at 1 MB/s over 20 s one 1 MB request would be 5%.
        """
        lo, hi = self.started + start_s, self.started + end_s
        inside = sorted((at, size) for at, size in self.events if lo <= at < hi)
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < (end_s - start_s) / 2:
            return sum(size for _, size in inside) / (end_s - start_s)
        return sum(size for _, size in inside[1:]) / (inside[-1][0] - inside[0][0])


def produce_for(bootstrap: str, topic: str, seconds: float, value_size: int = 10_000,
                offered_rate: float | None = None, **config: object) -> RunResult:
    """librdkafka for `seconds`, at full speed or at `offered_rate` bytes/s; every delivery is timed."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": 1,
                         "queue.buffering.max.kbytes": 4096, **config})
    result = RunResult(time.monotonic())
    value = b"x" * value_size
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
    """Consume at full speed for `seconds`; returns timing and offsets seen per partition."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-quota",
                         "auto.offset.reset": "earliest", **config})
    consumer.subscribe([topic])
    result = RunResult(time.monotonic())
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
