"""Topics and records for the Spark tests, made and checked with librdkafka (confluent-kafka).

The records are made by a client other than Spark, so a Spark pipeline is compared against what Kafka
acknowledged: each record's partition and offset come from its delivery report.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.integration.clients import wait_until

Header = tuple[str, bytes | None]


@dataclass(frozen=True, order=True)
class Record:
    """What a Kafka record is, as both librdkafka and Spark's Kafka source see it."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]
    timestamp_ms: int


def create_topic(bootstrap: str, prefix: str, partitions: int, **config: str) -> str:
    """A fresh topic, returned once metadata lists all its partitions with a leader.

    The controller answers CreateTopics before the brokers have all learned the topic; the wait is
    bounded, and Spark's own offset reader retries a partition it does not know yet.
    """
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name].result(30)

    def listed() -> bool:
        found = admin.list_topics(name, timeout=10).topics[name].partitions.values()
        return len(found) == partitions and all(p.leader >= 0 for p in found)

    wait_until(listed, 30, f"{name} in metadata")
    return name


def leaders(bootstrap: str, topic: str) -> dict[int, int]:
    """Partition -> the node id of its leader."""
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return {p.id: p.leader for p in metadata.topics[topic].partitions.values()}


def produce(bootstrap: str, topic: str, records: Iterable[tuple[int, bytes | None, bytes | None,
                                                                  list[Header], int | None]],
            client_id: str = "spark-tests-loader") -> list[Record]:
    """Produce (partition, key, value, headers, timestamp ms or None) records; return them as stored.

    Record batches are kept small (32 KiB): a consumer fetches whole batches, so librdkafka's default
    of up to 1 MB per batch would make every fetch of a throttled Spark query one second of its quota.
    """
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "linger.ms": 5,
                         "batch.size": 32768, "enable.idempotence": True,
                         "queue.buffering.max.kbytes": 16384})
    stored: list[Record] = []
    errors: list[str] = []

    def reporter(key: bytes | None, value: bytes | None, headers: tuple[Header, ...]):  # type: ignore[no-untyped-def]
        # A delivery report carries no headers: the record as stored is what was sent, where Kafka put it.
        def report(err: KafkaError | None, msg) -> None:  # type: ignore[no-untyped-def]
            if err is not None:
                errors.append(str(err))
            else:
                stored.append(Record(msg.partition(), msg.offset(), key, value, headers, msg.timestamp()[1]))
        return report

    sent = 0
    for partition, key, value, headers, timestamp in records:
        kwargs = {"timestamp": timestamp} if timestamp is not None else {}
        while True:
            try:
                producer.produce(topic, value, key, partition=partition, headers=headers or None,
                                 on_delivery=reporter(key, value, tuple(headers)), **kwargs)
                break
            except BufferError:
                producer.poll(0.05)
        sent += 1
        producer.poll(0)
    remaining = producer.flush(120)
    assert remaining == 0 and not errors, f"{remaining} records undelivered, errors {errors[:3]}"
    assert len(stored) == sent
    return sorted(stored)


def read_all(bootstrap: str, topic: str, partitions: int, expected: int,
             timeout: float = 120) -> list[Record]:
    """Every record of the topic, read with librdkafka from the beginning (bounded by `timeout`)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "client.id": "spark-tests-checker"})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    got: list[Record] = []
    deadline = time.monotonic() + timeout
    try:
        # Past `expected`, one idle second ends the read: a duplicate would have come by then.
        while time.monotonic() < deadline:
            messages = consumer.consume(1000, timeout=1.0)
            if not messages and len(got) >= expected:
                break
            for msg in messages:
                if msg.error():
                    raise AssertionError(f"reading {topic} back failed: {msg.error()}")
                headers = tuple((name, value) for name, value in (msg.headers() or []))
                got.append(Record(msg.partition(), msg.offset(), msg.key(), msg.value(), headers,
                                  msg.timestamp()[1]))
    finally:
        consumer.close()
    return sorted(got)


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "spark-tests-offsets"})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(partitions)}
    finally:
        consumer.close()
