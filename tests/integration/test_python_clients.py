"""kafka-python, librdkafka (confluent-kafka) and aiokafka through the proxy, against 3 real brokers."""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from .clients import (
    PARTITIONS,
    aiokafka_round_trip,
    assert_exact,
    assert_proxy_addresses,
    kafka_python_round_trip,
    records,
    topic_name,
    wait_for_topic_on_every_broker,
    wait_until,
)

COUNT = 600


def _create_topic(bootstrap: str, name: str, partitions: int = PARTITIONS, replication: int = 3) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, partitions, replication)])
    futures[name].result(30)
    wait_for_topic_on_every_broker(bootstrap, name, partitions)


def _consume_confluent(bootstrap: str, topic: str, count: int, **config: object) -> dict[int, list[str]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic_name("g"),
                         "auto.offset.reset": "earliest", "enable.auto.commit": True, **config})
    consumer.subscribe([topic])
    consumed: dict[int, list[str]] = {}
    total = 0
    deadline = time.monotonic() + 90
    try:
        while total < count and time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=1.0):
                if message.error():
                    if message.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise AssertionError(f"consumer error: {message.error()}")
                consumed.setdefault(message.partition(), []).append(message.value().decode())
                total += 1
        # A little longer: a duplicate would show up here.
        for message in consumer.consume(500, timeout=2.0):
            if not message.error():
                consumed.setdefault(message.partition(), []).append(message.value().decode())
    finally:
        consumer.close()
    return consumed


def _produce_confluent(bootstrap: str, topic: str, count: int, **config: object) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **config})
    errors: list[str] = []

    def report(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    for partition, key, value in records(count):
        producer.produce(topic, value, key, partition=partition, on_delivery=report)
        producer.poll(0)
    assert producer.flush(60) == 0, "records still queued after 60 s"
    assert not errors, errors[:5]


# -- librdkafka ------------------------------------------------------------------------------------


def test_confluent_produce_consume_exact(kafka_cluster, proxy):
    topic = topic_name("rdkafka")
    _create_topic(proxy.bootstrap, topic)
    _produce_confluent(proxy.bootstrap, topic, COUNT, acks="all")
    assert_exact(_consume_confluent(proxy.bootstrap, topic, COUNT), COUNT)


def test_confluent_sees_only_proxy_addresses(kafka_cluster, proxy):
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    metadata = admin.list_topics(timeout=10)
    brokers = [(b.id, b.host, b.port) for b in metadata.brokers.values()]
    assert_proxy_addresses(brokers, proxy.port, kafka_cluster.node_ids, kafka_cluster.bootstrap)
    described = admin.describe_cluster().result(10)
    assert_proxy_addresses([(n.id, n.host, n.port) for n in described.nodes], proxy.port,
                           kafka_cluster.node_ids, kafka_cluster.bootstrap)
    assert described.controller.port == proxy.port + 1 + described.controller.id


def test_confluent_idempotent_producer(kafka_cluster, proxy):
    topic = topic_name("idem")
    _create_topic(proxy.bootstrap, topic)
    _produce_confluent(proxy.bootstrap, topic, COUNT, **{"enable.idempotence": True})
    assert_exact(_consume_confluent(proxy.bootstrap, topic, COUNT), COUNT)


def test_confluent_transaction_commit_and_abort(kafka_cluster, proxy):
    """InitProducerId, AddPartitionsToTxn and EndTxn reach the transaction coordinator via the proxy."""
    topic = topic_name("txn")
    _create_topic(proxy.bootstrap, topic)
    producer = Producer({"bootstrap.servers": proxy.bootstrap, "transactional.id": topic_name("tx")})
    producer.init_transactions(60)
    producer.begin_transaction()
    for partition, key, value in records(COUNT):
        producer.produce(topic, value, key, partition=partition)
    producer.commit_transaction(60)
    producer.begin_transaction()
    for partition in range(PARTITIONS):
        producer.produce(topic, b"aborted", partition=partition)
    # Delivered before the abort: librdkafka may send EndTxn before the coordinator has the
    # transaction's partitions, and the abort then fails fatally with INVALID_TXN_STATE
    # (librdkafka#4849, open; h49 hit it). Written and then aborted, the records also put
    # read_committed to the test below.
    assert producer.flush(60) == 0, "the records to abort were not all delivered"
    producer.abort_transaction(60)
    consumed = _consume_confluent(proxy.bootstrap, topic, COUNT, **{"isolation.level": "read_committed"})
    assert all("aborted" not in values for values in consumed.values()), "an aborted record was read"
    assert_exact(consumed, COUNT)


def test_confluent_acks0(kafka_cluster, proxy):
    """acks=0 has no response: the proxy must not wait for one, and nothing is lost on a healthy cluster."""
    topic = topic_name("acks0")
    _create_topic(proxy.bootstrap, topic)
    _produce_confluent(proxy.bootstrap, topic, COUNT, acks=0)
    consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": topic_name("g")})
    def end_offsets() -> int:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in range(PARTITIONS))
    try:
        wait_until(lambda: end_offsets() == COUNT, 30, f"{COUNT} acks=0 records to land")
    finally:
        consumer.close()
    assert_exact(_consume_confluent(proxy.bootstrap, topic, COUNT), COUNT)


def test_confluent_create_and_delete_topics(kafka_cluster, proxy):
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    names = [topic_name("ddl") for _ in range(3)]
    for future in admin.create_topics([NewTopic(n, 2, 2) for n in names]).values():
        future.result(30)
    wait_until(lambda: set(names) <= set(admin.list_topics(timeout=10).topics), 30, "topics to appear")
    for future in admin.delete_topics(names).values():
        future.result(30)
    wait_until(lambda: not set(names) & set(admin.list_topics(timeout=10).topics), 30, "topics to go")


# -- kafka-python ----------------------------------------------------------------------------------


def test_kafka_python_produce_consume_and_addresses(kafka_cluster, proxy):
    from kafka.admin import KafkaAdminClient
    from kafka.admin import NewTopic as KNewTopic

    topic = topic_name("kpy")
    admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap)
    try:
        admin.create_topics([KNewTopic(topic, PARTITIONS, 3)])
        cluster = admin.describe_cluster()
    finally:
        admin.close()
    assert_proxy_addresses([(b["broker_id"], b["host"], b["port"]) for b in cluster["brokers"]],
                           proxy.port, kafka_cluster.node_ids, kafka_cluster.bootstrap)

    consumed = kafka_python_round_trip(proxy.bootstrap, topic, COUNT, proxy.port, kafka_cluster.node_ids,
                                       kafka_cluster.bootstrap)
    assert_exact(consumed, COUNT)


# -- aiokafka --------------------------------------------------------------------------------------


def test_aiokafka_produce_consume_and_addresses(kafka_cluster, proxy):
    topic = topic_name("aio")
    _create_topic(proxy.bootstrap, topic)

    consumed = asyncio.run(aiokafka_round_trip(proxy.bootstrap, topic, COUNT, proxy.port,
                                               kafka_cluster.node_ids, kafka_cluster.bootstrap))
    assert_exact(consumed, COUNT)
