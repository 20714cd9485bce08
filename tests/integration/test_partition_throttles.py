"""KIP-73 partition throttles for consumers (issue 13 part 2), through `kthrottle run`.

One librdkafka consumer reads a throttled and an unthrottled topic at once. The throttled topic's
partitions come back emptied while their shared rate is over, so the consumer gets that topic at
the throttle's rate; the other topic's partitions in the same responses are untouched, so it comes
at full speed. Every record of both topics arrives exactly once, with its own value.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient

from harness.local_kafka import LocalKafka

from .clients import PARTITIONS, wait_until
from .proxies import QuotaProxy
from .quota_runs import RunResult, report
from .test_quotas import _topic

#: The throttled topic's shared rate. Against librdkafka's default 1 MiB per partition fetch, a
#: lower rate quantises (one partition's fetch is a large part of a second's allowance).
THROTTLE_RATE = 1_000_000
VALUE_SIZE = 1000
#: ~30 s of records at the throttle's rate, and as much again at full speed.
SLOW_RECORDS = 30_000
FAST_RECORDS = 20_000
#: The consumer gives up after this long (a throttled topic at its rate needs ~30 s).
DEADLINE_S = 150


@pytest.fixture(scope="module")
def throttle_proxy(kafka_cluster: LocalKafka,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("partition-throttle")) as running:
        yield running


_PADDING = bytes(48 + i % 74 for i in range(2 * VALUE_SIZE))


def value_of(topic: str, index: int) -> bytes:
    """Record `index` of `topic`: its topic and index, padded to VALUE_SIZE bytes that differ by index."""
    head = f"{topic}:{index}:".encode()
    start = index % 74
    return head + _PADDING[start : start + VALUE_SIZE - len(head)]


def fill(bootstrap: str, topic: str, count: int) -> None:
    """Small batches (16 KiB), so a fetch's partial last batch, which the client drops and fetches
    again, is a small part of what the throttle lets through."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "batch.size": 16_384})
    for index in range(count):
        while True:
            try:
                producer.produce(topic, value_of(topic, index), partition=index % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(120) == 0


def test_throttled_and_unthrottled_topics_in_one_consumer(throttle_proxy: QuotaProxy) -> None:
    slow = _topic(throttle_proxy.bootstrap, "pt-slow")
    fast = _topic(throttle_proxy.bootstrap, "pt-fast")
    fill(throttle_proxy.bootstrap, slow, SLOW_RECORDS)
    fill(throttle_proxy.bootstrap, fast, FAST_RECORDS)
    # Set before the consumer starts, so the proxy learns the topic ids from its Metadata responses.
    throttle_proxy.set_quotas(f'[[partition_throttle]]\nname = "backfill"\ntopic = "{slow}"\n'
                              f'partitions = "*"\nbyte_rate = {THROTTLE_RATE}\n'
                              'client_ids = ["pt-consumer"]\n')

    results = {slow: RunResult(time.monotonic()), fast: RunResult(time.monotonic())}
    seen: dict[str, list[int]] = {slow: [], fast: []}
    offsets: dict[tuple[str, int], list[int]] = {}
    wrong: list[str] = []
    consumer = Consumer({"bootstrap.servers": throttle_proxy.bootstrap, "group.id": f"{slow}-group",
                         "client.id": "pt-consumer", "auto.offset.reset": "earliest"})
    consumer.subscribe([slow, fast])
    started = time.monotonic()
    for result in results.values():
        result.started = started
    try:
        while (time.monotonic() - started < DEADLINE_S
               and (len(seen[slow]) < SLOW_RECORDS or len(seen[fast]) < FAST_RECORDS)):
            for message in consumer.consume(1000, timeout=0.5):
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        wrong.append(str(error))
                    continue
                topic, value = message.topic(), message.value()
                partition, offset = message.partition(), message.offset()
                assert topic is not None and value is not None
                assert partition is not None and offset is not None
                index = int(value.split(b":", 2)[1])
                if value != value_of(topic, index):
                    wrong.append(f"{topic} offset {offset}: value is not record {index}'s")
                seen[topic].append(index)
                offsets.setdefault((topic, partition), []).append(offset)
                results[topic].events.append((time.monotonic(), len(value)))
                results[topic].records += 1
    finally:
        consumer.close()

    assert not wrong, wrong[:5]
    for topic, count in ((slow, SLOW_RECORDS), (fast, FAST_RECORDS)):
        assert sorted(seen[topic]) == list(range(count)), f"{topic}: records missing or repeated"
    for (topic, partition), got in offsets.items():
        assert got == list(range(len(got))), f"{topic} partition {partition}: gaps or repeats"

    slow_span = results[slow].events[-1][0] - started
    slow_rate = results[slow].rate(5, slow_span - 1)
    fast_times = [at for at, _size in results[fast].events]
    fast_rate = FAST_RECORDS * VALUE_SIZE / max(fast_times[-1] - fast_times[0], 1e-3)
    metrics = throttle_proxy.metrics()
    labels = (("throttle", "backfill"), ("topic", slow))
    let_through = metrics.get(("kthrottle_partition_throttle_let_through_bytes_total", labels), 0.0)
    enforced = (("mode", "enforced"), *labels)
    withheld = metrics.get(("kthrottle_partition_throttle_withheld_bytes_total", enforced), 0.0)
    report(f"partition throttle {THROTTLE_RATE:,} B/s, librdkafka consumer of a throttled and an unthrottled "
           f"topic: throttled {slow_rate:,.0f} B/s of record values from 5 s to {slow_span - 1:.0f} s "
           f"({slow_rate / THROTTLE_RATE:.3f}x), unthrottled {fast_rate:,.0f} B/s "
           f"({fast_rate / THROTTLE_RATE:.1f}x the throttle); throttle let through {let_through:,.0f} B, "
           f"withheld {withheld:,.0f} B")
    assert 0.90 * THROTTLE_RATE <= slow_rate <= 1.05 * THROTTLE_RATE, slow_rate
    # Full speed: all of it long before the throttled topic, far above the throttle's rate.
    assert fast_times[-1] - started < slow_span / 2
    assert fast_rate > 5 * THROTTLE_RATE, fast_rate
    assert withheld > 0
    assert SLOW_RECORDS * VALUE_SIZE <= let_through <= 1.2 * SLOW_RECORDS * VALUE_SIZE
    assert metrics.get(("kthrottle_partition_throttle_limit_bytes_per_second", labels)) == THROTTLE_RATE


def test_throttled_topic_ids_are_read_from_the_cluster(kafka_cluster: LocalKafka,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """A throttle on a topic no client has asked about through the proxy knows the topic's id within
    a few seconds (the proxy asks the cluster itself), so Fetch v13+ consumers already running are
    held to it without waiting for their next metadata refresh; a topic the cluster does not have
    stays unknown, and asking about it does not create it."""
    topic = _topic(kafka_cluster.bootstrap, "pt-ids")  # straight to the brokers: the proxy never saw it
    missing = f"{topic}-absent"
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("partition-throttle-ids")) as proxy:
        proxy.set_quotas("\n".join(f'[[partition_throttle]]\ntopic = "{name}"\npartitions = "*"\n'
                                   f"byte_rate = {THROTTLE_RATE}\n" for name in (topic, missing)))

        def flags() -> dict[str, float]:
            return {dict(labels)["topic"]: value for (name, labels), value in proxy.metrics().items()
                    if name == "kthrottle_partition_throttle_topic_id_unknown"}

        wait_until(lambda: flags().get(topic) == 0.0, 20, f"the id of {topic} learned from the cluster")
        assert flags()[missing] == 1.0
        time.sleep(6)  # another lookup for the missing topic has run
        assert flags()[missing] == 1.0
        metadata = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap}).list_topics(timeout=10)
        assert topic in metadata.topics and missing not in metadata.topics
        assert "Traceback" not in proxy.log()
