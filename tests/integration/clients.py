"""Shared helpers for the client tests: a known record set and the checks on what came back."""

from __future__ import annotations

import socket
import struct
import time
import uuid
from collections.abc import Iterable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

PARTITIONS = 6


def topic_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def expected_by_partition(count: int) -> dict[int, list[str]]:
    """Record i goes to partition i % 6 with value "v<i>": the exact per-partition order."""
    expected: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    for i in range(count):
        expected[i % PARTITIONS].append(f"v{i}")
    return expected


def records(count: int) -> Iterable[tuple[int, bytes, bytes]]:
    """(partition, key, value) in production order."""
    for i in range(count):
        yield i % PARTITIONS, f"k{i}".encode(), f"v{i}".encode()


def assert_exact(consumed: dict[int, list[str]], count: int) -> None:
    """Every record exactly once, and each partition in production order."""
    expected = expected_by_partition(count)
    for partition in range(PARTITIONS):
        got = consumed.get(partition, [])
        want = expected[partition]
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        assert got == want, (
            f"partition {partition}: {len(got)} records, expected {len(want)}; "
            f"first difference at {first_diff}"
        )


def assert_proxy_addresses(brokers: Iterable[tuple[int, str, int]], proxy_port: int,
                           node_ids: list[int], real_bootstrap: str) -> None:
    """Every (node id, host, port) a client learned is the proxy's port for that node."""
    seen = sorted(brokers)
    assert [node for node, _, _ in seen] == sorted(node_ids), f"client sees brokers {seen}"
    real = {tuple(item.rsplit(":", 1)) for item in real_bootstrap.split(",")}
    for node, host, port in seen:
        assert (host, port) == ("127.0.0.1", proxy_port + 1 + node), (
            f"broker {node} is known as {host}:{port}, not the proxy's port {proxy_port + 1 + node}"
        )
        assert (host, str(port)) not in real, f"a real broker address leaked: {host}:{port}"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def read_all(conf: dict[str, Any], topic: str, count: int) -> dict[int, list[str]]:
    """Every value of every partition from the beginning, assigned (no group), in partition order.

    Reads a little past `count`, so that a duplicate would show up.
    """
    consumer = Consumer({**conf, "group.id": topic_name("g"), "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    consumed: dict[int, list[str]] = {}
    total = 0

    def take(timeout: float) -> int:
        got = 0
        for message in consumer.consume(1000, timeout=timeout):
            if message.error():
                raise AssertionError(f"consumer error: {message.error()}")
            consumed.setdefault(message.partition(), []).append(message.value().decode())
            got += 1
        return got

    try:
        deadline = time.monotonic() + 60
        while total < count and time.monotonic() < deadline:
            total += take(1.0)
        take(1.5)
    finally:
        consumer.close()
    return consumed


def _drain_into(consumed: dict[int, list[str]], batches: dict[Any, list[Any]]) -> int:
    got = 0
    for tp, messages in batches.items():
        for message in messages:
            consumed.setdefault(tp.partition, []).append(message.value.decode())
            got += 1
    return got


def kafka_python_round_trip(bootstrap: str, topic: str, count: int, proxy_port: int, node_ids: list[int],
                            real_bootstrap: str, **config: Any) -> dict[int, list[str]]:
    """kafka-python: produce `records(count)`, check the producer's and the group coordinator's
    addresses are the proxy's, and consume with a group until one empty poll after the last record
    (a duplicate would show up there). Returns what was consumed, per partition."""
    from kafka import KafkaConsumer, KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, **config)
    try:
        futures = [producer.send(topic, key=k, value=v, partition=p) for p, k, v in records(count)]
        producer.flush(60)
        for future in futures:
            future.get(timeout=10)
        assert_proxy_addresses([(b.node_id, b.host, b.port) for b in producer._metadata.brokers()],
                               proxy_port, node_ids, real_bootstrap)
    finally:
        producer.close()
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=topic_name("g"),
                             auto_offset_reset="earliest", **config)
    consumed: dict[int, list[str]] = {}
    total = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            batches = consumer.poll(timeout_ms=1000)
            if not batches and total >= count:
                break
            total += _drain_into(consumed, batches)
        coordinator = consumer._coordinator.coordinator_id
        assert coordinator is not None, "the consumer found no group coordinator"
        broker = consumer._client.cluster.broker_metadata(coordinator)
        node = int(str(coordinator).rsplit("-", 1)[-1])  # kafka-python names it "coordinator-<id>"
        assert broker.port == proxy_port + 1 + node, f"coordinator known as {broker}"
    finally:
        consumer.close()
    return consumed


async def aiokafka_round_trip(bootstrap: str, topic: str, count: int, proxy_port: int, node_ids: list[int],
                              real_bootstrap: str, **config: Any) -> dict[int, list[str]]:
    """aiokafka, idempotent: the same round trip as `kafka_python_round_trip`."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, **config)
    await producer.start()
    try:
        sent = [await producer.send(topic, value=v, key=k, partition=p) for p, k, v in records(count)]
        await asyncio.gather(*sent)
        assert_proxy_addresses([(b.nodeId, b.host, b.port) for b in producer.client.cluster.brokers()],
                               proxy_port, node_ids, real_bootstrap)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=topic_name("g"),
                                auto_offset_reset="earliest", **config)
    await consumer.start()
    consumed: dict[int, list[str]] = {}
    total = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=1000)
            if not batches and total >= count:
                break
            total += _drain_into(consumed, batches)
    finally:
        await consumer.stop()
    return consumed


def _own_view_has_leaders(host: str, port: int, topic: str, partitions: int) -> bool:
    """Ask exactly this address (a broker, or the proxy port of one broker) for the topic's metadata."""
    import socket
    import struct

    from kafka.protocol.metadata import MetadataRequest, MetadataResponse

    from protocol.frames import frame
    from protocol.headers import encode_request_header

    v12 = MetadataRequest[12]
    request = v12(topics=[v12.MetadataRequestTopic(topic_id=None, name=topic)],
                  allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(frame(encode_request_header(3, 12, 1, "topic-check") + bytes(request.encode())))
        size = struct.unpack(">i", sock.recv(4, socket.MSG_WAITALL))[0]
        body = sock.recv(size, socket.MSG_WAITALL)
    response = MetadataResponse.decode(body[5:], version=12)  # correlation id + header tags
    (found,) = [t for t in response.topics if t.name == topic]
    return found.error_code == 0 and sum(1 for p in found.partitions if p.leader_id >= 0) == partitions


def wait_for_topic_on_every_broker(bootstrap: str, topic: str, partitions: int, timeout: float = 30) -> None:
    """CreateTopics returns before every broker has applied the new leaderships; an acks=0 record sent
    meanwhile to a leader that does not know it yet is dropped silently. Wait until each broker's own
    metadata shows every partition with a leader."""
    from confluent_kafka.admin import AdminClient

    brokers = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).brokers.values()
    for broker in brokers:
        wait_until(lambda b=broker: _own_view_has_leaders(b.host, b.port, topic, partitions), timeout,
                   f"broker {broker.id} to lead/know every partition of {topic}")


def produce_body(topic: str, value: bytes, acks: int = 1, timeout_ms: int = 30_000) -> bytes:
    """The body of a Produce v9 request with one record (key b"k") for partition 0 of `topic`."""
    from kafka.protocol.producer import ProduceRequest
    from kafka.record.memory_records import MemoryRecordsBuilder

    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=max(1 << 16, len(value) + 1024))
    builder.append(timestamp=1_700_000_000_000, key=b"k", value=value)
    builder.close()
    T = ProduceRequest.TopicProduceData
    data = [T(name=topic, partition_data=[T.PartitionProduceData(index=0, records=bytes(builder.buffer()))])]
    request = ProduceRequest[9](transactional_id=None, acks=acks, timeout_ms=timeout_ms, topic_data=data)
    return bytes(request.encode())


def acks0_produce_body(topic: str, value: bytes) -> bytes:
    """`produce_body` with acks=0: the broker sends no answer."""
    return produce_body(topic, value, acks=0)


#: what a broker answers about a partition it does not lead yet (a topic made a moment ago)
_NOT_YET = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.UNKNOWN_TOPIC_OR_PART)


def landed_on_partition_0(bootstrap: str, topic: str, count: int, timeout: float) -> int:
    """Partition 0's end offset once it reaches `count`, or what it is when `timeout` runs out."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic})
    try:
        deadline = time.monotonic() + timeout
        landed = -1
        while True:
            try:
                landed = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
            except KafkaException as exc:
                # a topic made a moment ago: the consumer's first metadata can name a broker that
                # does not lead it yet (NOT_LEADER_FOR_PARTITION, seen in a loaded run); retriable
                error = exc.args[0]
                if (error.code() not in _NOT_YET and not error.retriable()) or time.monotonic() > deadline:
                    raise
            if landed >= count or time.monotonic() > deadline:
                return int(landed)
            time.sleep(0.2)
    finally:
        consumer.close()


def produce_known_records(conf: dict[str, Any], topic: str, count: int) -> None:
    """`records(count)` with librdkafka, acks=all, each to its own partition; every one delivered."""
    from confluent_kafka import Producer

    producer = Producer({**conf, "acks": "all", "linger.ms": 5})
    failures: list[str] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(str(err))

    for partition, key, value in records(count):
        producer.produce(topic, value=value, key=key, partition=partition, on_delivery=delivered)
    assert producer.flush(60) == 0, "records still unsent after 60 s"
    assert failures == []


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes from `sock` (ConnectionError naming how many came if it closes first)."""
    data = bytearray()  # grown in place: a bytes += copies the whole of it per chunk
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def api_versions_v0(sock: socket.socket, correlation_id: int, client_id: bytes = b"kthrottle-test") -> int:
    """Send ApiVersions v0 on `sock`; the response's correlation id (ConnectionError if closed)."""
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    sock.sendall(struct.pack(">i", len(body)) + body)
    size, got = struct.unpack(">ii", recv_exact(sock, 8))
    recv_exact(sock, size - 4)
    return int(got)
