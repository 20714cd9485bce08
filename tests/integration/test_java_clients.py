"""The Java client and Kafka's own tools (from the 4.3.1 jars) through the proxy, against 3 real brokers.

The Java client is the reference implementation of the protocol: if its admin, producer (idempotent,
transactional, acks=0) and group consumer work through the proxy and never learn a real broker address,
the proxy speaks Kafka the way Kafka does.
"""

from __future__ import annotations

import re
import subprocess

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kafka.partitioner.default import murmur2

from .clients import (
    PARTITIONS,
    assert_exact,
    assert_proxy_addresses,
    read_all,
    topic_name,
    wait_for_topic_on_every_broker,
    wait_until,
)
from .conftest import (
    JAVA_CONSOLE_CONSUMER,
    JAVA_CONSOLE_PRODUCER,
    JAVA_CONSUMER_GROUP_COMMAND,
    JAVA_PRODUCER_PERF,
    JAVA_TOPIC_COMMAND,
)

JAVA_GET_OFFSET_SHELL = "org.apache.kafka.tools.GetOffsetShell"
JAVA_BROKER_API_VERSIONS = "org.apache.kafka.tools.BrokerApiVersionsCommand"

CONSOLE_COUNT = 600
PERF_COUNT = 10_000
# Spreads ProducerPerformance's records over all six partitions, hence all three leaders; the default
# sticky partitioner would fill one batch at a time and might never touch some brokers.
ROUND_ROBIN = "partitioner.class=org.apache.kafka.clients.producer.RoundRobinPartitioner"


def _ok(done: subprocess.CompletedProcess[bytes]) -> str:
    """The tool's stdout, after checking it exited cleanly (its stderr is the failure message)."""
    assert done.returncode == 0, (
        f"{done.args[-12:]} exited with {done.returncode}:\n{done.stderr.decode(errors='replace')[-4000:]}"
    )
    return done.stdout.decode(errors="replace")


def _create_topic(bootstrap: str, name: str, partitions: int = PARTITIONS, replication: int = 3) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, replication)])[name].result(30)
    wait_for_topic_on_every_broker(bootstrap, name, partitions)  # acks=0 runs lose nothing then


def _key_for_partition(index: int) -> str:
    """A key that Kafka's default partitioner (murmur2, Java's) puts in partition index % 6."""
    want = index % PARTITIONS
    suffix = 0
    while True:
        key = f"k{index}-{suffix}"
        if (murmur2(key.encode()) & 0x7FFFFFFF) % PARTITIONS == want:
            return key
        suffix += 1


def _end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic_name("offsets")})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(PARTITIONS)}
    finally:
        consumer.close()


def _assert_monotonic_exact(consumed: dict[int, list[str]], count: int) -> None:
    """ProducerPerformance's --payload-monotonic values: 0..count-1 exactly once, ascending per partition."""
    values = [int(v) for vs in consumed.values() for v in vs]
    assert len(values) == count, f"read {len(values)} records, expected {count}"
    assert sorted(values) == list(range(count)), "records lost or duplicated"
    for partition, vs in consumed.items():
        ints = [int(v) for v in vs]
        assert ints == sorted(ints), f"partition {partition} is out of production order"


def _perf(kafka_java, proxy, topic: str, count: int, *props: str, throughput: int = -1,  # type: ignore[no-untyped-def]
          extra: tuple[str, ...] = ()) -> str:
    out = _ok(kafka_java.run(
        JAVA_PRODUCER_PERF, "--bootstrap-server", proxy.bootstrap, "--topic", topic,
        "--num-records", str(count), "--payload-monotonic", "--throughput", str(throughput), *extra,
        "--command-property", ROUND_ROBIN, *props,
    ))  # fmt: skip
    assert f"{count} records sent" in out, out
    return out


# -- admin: TopicCommand ---------------------------------------------------------------------------


def _describe_partitions(out: str, topic: str) -> dict[int, tuple[int, list[int], list[int]]]:
    """TopicCommand --describe lines -> {partition: (leader, replicas, isr)}."""
    found: dict[int, tuple[int, list[int], list[int]]] = {}
    pattern = re.compile(rf"Topic: {re.escape(topic)}\tPartition: (\d+)\tLeader: (-?\d+|none)\t"
                         r"Replicas: ([\d,]*)\tIsr: ([\d,]*)")
    for match in pattern.finditer(out):
        leader = -1 if match[2] == "none" else int(match[2])
        found[int(match[1])] = (leader, [int(r) for r in match[3].split(",") if r],
                                [int(r) for r in match[4].split(",") if r])
    return found


def test_topic_command_create_describe_delete(kafka_cluster, kafka_java, proxy):
    kept, doomed = topic_name("java-topic"), topic_name("java-doomed")
    for name, partitions in ((kept, 6), (doomed, 2)):
        out = _ok(kafka_java.run(
            JAVA_TOPIC_COMMAND, "--bootstrap-server", proxy.bootstrap, "--create", "--topic", name,
            "--partitions", str(partitions), "--replication-factor", "3",
        ))  # fmt: skip
        assert f"Created topic {name}." in out, out

    described = _ok(kafka_java.run(JAVA_TOPIC_COMMAND, "--bootstrap-server", proxy.bootstrap,
                                   "--describe", "--topic", kept))
    assert re.search(rf"Topic: {re.escape(kept)}\tTopicId: \S+\tPartitionCount: 6\tReplicationFactor: 3",
                     described), described
    partitions = _describe_partitions(described, kept)
    assert sorted(partitions) == list(range(6)), described
    for partition, (leader, replicas, isr) in partitions.items():
        assert leader in kafka_cluster.node_ids, f"partition {partition} has leader {leader}:\n{described}"
        assert sorted(replicas) == kafka_cluster.node_ids, described
        assert leader in isr, described

    def listed() -> set[str]:
        out = _ok(kafka_java.run(JAVA_TOPIC_COMMAND, "--bootstrap-server", proxy.bootstrap, "--list"))
        return set(out.split())

    assert {kept, doomed} <= listed()
    _ok(kafka_java.run(JAVA_TOPIC_COMMAND, "--bootstrap-server", proxy.bootstrap, "--delete",
                       "--topic", doomed))
    remaining: list[set[str]] = []

    def doomed_gone() -> bool:
        remaining.append(listed())
        return doomed not in remaining[-1]

    wait_until(doomed_gone, 30, f"{doomed} to leave --list")
    assert kept in remaining[-1], f"{kept} vanished along with {doomed}"


# -- console producer and group consumer -----------------------------------------------------------


def _group_rows(out: str, group: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[:1] == [group]]


def test_console_producer_and_group_consumer_exact(kafka_cluster, kafka_java, proxy):
    topic, group = topic_name("java-console"), topic_name("java-group")
    _create_topic(proxy.bootstrap, topic)
    keys = [_key_for_partition(i) for i in range(CONSOLE_COUNT)]
    lines = "".join(f"{keys[i]}:v{i}\n" for i in range(CONSOLE_COUNT))
    _ok(kafka_java.run(
        JAVA_CONSOLE_PRODUCER, "--bootstrap-server", proxy.bootstrap, "--topic", topic,
        "--command-property", "acks=all", "--reader-property", "parse.key=true",
        "--reader-property", "key.separator=:", input=lines.encode(),
    ))  # fmt: skip

    out = _ok(kafka_java.run(
        JAVA_CONSOLE_CONSUMER, "--bootstrap-server", proxy.bootstrap, "--topic", topic, "--group", group,
        "--from-beginning", "--max-messages", str(CONSOLE_COUNT), "--timeout-ms", "60000",
        "--formatter-property", "print.partition=true", "--formatter-property", "print.offset=true",
        "--formatter-property", "print.key=true",
    ))  # fmt: skip
    consumed: dict[int, list[str]] = {}
    for line in out.splitlines():
        partition_field, offset_field, key, value = line.split("\t")
        partition = int(partition_field.removeprefix("Partition:"))
        offset = int(offset_field.removeprefix("Offset:"))
        index = int(value.removeprefix("v"))
        assert key == keys[index], f"record {value} came back with key {key}, sent with {keys[index]}"
        assert partition == index % PARTITIONS, f"record {value} in partition {partition}"
        assert offset == len(consumed.setdefault(partition, [])), f"partition {partition}: gap at {line}"
        consumed[partition].append(value)
    assert_exact(consumed, CONSOLE_COUNT)

    # The group's committed offsets, as the Java admin client sees them through the proxy.
    described = _ok(kafka_java.run(JAVA_CONSUMER_GROUP_COMMAND, "--bootstrap-server", proxy.bootstrap,
                                   "--describe", "--group", group))
    rows = _group_rows(described, group)
    assert sorted(int(r[2]) for r in rows) == list(range(PARTITIONS)), described
    for row in rows:
        partition, current, end, lag = int(row[2]), int(row[3]), int(row[4]), int(row[5])
        assert row[1] == topic, described
        assert (current, end, lag) == (len(consumed[partition]),) * 2 + (0,), f"partition {partition}: {row}"

    # ...and the coordinator it found with FindCoordinator is the proxy's port for that broker.
    state = _ok(kafka_java.run(JAVA_CONSUMER_GROUP_COMMAND, "--bootstrap-server", proxy.bootstrap,
                               "--describe", "--group", group, "--state"))
    match = re.search(rf"^{re.escape(group)}\s+(\S+):(\d+)\s+\((\d+)\)", state, re.MULTILINE)
    assert match, state
    host, port, node = match[1], int(match[2]), int(match[3])
    assert node in kafka_cluster.node_ids, state
    assert (host, port) == ("127.0.0.1", proxy.port + 1 + node), f"coordinator known as {host}:{port}"


# -- ProducerPerformance: idempotent, transactional, acks=0 ----------------------------------------


def test_idempotent_producer_perf_exact_count(kafka_java, proxy):
    topic = topic_name("java-idem")
    _create_topic(proxy.bootstrap, topic)
    _perf(kafka_java, proxy, topic, PERF_COUNT, "enable.idempotence=true", "acks=all")

    # End offsets as the Java client's ListOffsets sees them through the proxy: topic:partition:offset.
    out = _ok(kafka_java.run(JAVA_GET_OFFSET_SHELL, "--bootstrap-server", proxy.bootstrap, "--topic", topic))
    ends = {int(p): int(o) for t, p, o in (line.rsplit(":", 2) for line in out.split()) if t == topic}
    assert sorted(ends) == list(range(PARTITIONS)), out
    assert sum(ends.values()) == PERF_COUNT, f"end offsets {ends} do not add up to {PERF_COUNT}"
    assert all(ends.values()), f"some partition got nothing: {ends}"
    _assert_monotonic_exact(read_all({"bootstrap.servers": proxy.bootstrap}, topic, PERF_COUNT), PERF_COUNT)


def test_transactional_producer_perf_read_committed(kafka_java, proxy):
    """InitProducerId, AddPartitionsToTxn and EndTxn reach the transaction coordinator through the proxy."""
    topic = topic_name("java-txn")
    count = 6000
    _create_topic(proxy.bootstrap, topic)
    # ~1.5 s at 4000 records/s with a commit every 250 ms: several transactions, each over all partitions.
    _perf(kafka_java, proxy, topic, count, "acks=all", throughput=4000,
          extra=("--transactional-id", topic_name("java-tx"), "--transaction-duration-ms", "250"))
    committed = {"bootstrap.servers": proxy.bootstrap, "isolation.level": "read_committed"}
    consumed = read_all(committed, topic, count)
    _assert_monotonic_exact(consumed, count)
    # Every commit leaves one marker per partition it touched: more offsets than records proves EndTxn ran.
    markers = sum(_end_offsets(proxy.bootstrap, topic).values()) - count
    assert markers >= PARTITIONS, f"only {markers} transaction markers for {count} committed records"


def test_acks0_producer_perf_all_land(kafka_java, proxy):
    topic = topic_name("java-acks0")
    _create_topic(proxy.bootstrap, topic)
    _perf(kafka_java, proxy, topic, PERF_COUNT, "acks=0")
    wait_until(lambda: sum(_end_offsets(proxy.bootstrap, topic).values()) == PERF_COUNT, 30,
               f"{PERF_COUNT} acks=0 records to land")
    _assert_monotonic_exact(read_all({"bootstrap.servers": proxy.bootstrap}, topic, PERF_COUNT), PERF_COUNT)
    assert proxy.alive()


# -- the Java client's view of the brokers ---------------------------------------------------------


def test_broker_api_versions_shows_only_proxy_addresses(kafka_cluster, kafka_java, proxy):
    out = _ok(kafka_java.run(JAVA_BROKER_API_VERSIONS, "--bootstrap-server", proxy.bootstrap))
    headers = re.findall(r"^(\S+):(\d+) \(id: (\d+) rack: [^)]*\) -> \(", out, re.MULTILINE)
    assert headers, out
    assert_proxy_addresses([(int(node), host, int(port)) for host, port, node in headers], proxy.port,
                           kafka_cluster.node_ids, kafka_cluster.bootstrap)
    for real in kafka_cluster.bootstrap.split(","):
        assert real not in out, f"a real broker address {real} appears:\n{out}"
    # Each broker's listing names the APIs transactions and groups need, with a usable version.
    blocks = out.split(" -> (")[1:]
    assert len(blocks) == len(kafka_cluster.node_ids)
    for block in blocks:
        for api in ("Produce(0)", "Fetch(1)", "FindCoordinator(10)", "InitProducerId(22)", "EndTxn(26)"):
            assert re.search(rf"{re.escape(api)}: \d+ to \d+ \[usable: \d+\]", block), f"{api}:\n{block}"
