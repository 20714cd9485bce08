"""Tests of the harness itself: the cluster really is 3 brokers, replicates, authenticates, and the Java
tools named in conftest.py exist and work. Every later integration test leans on these facts."""

from __future__ import annotations

import contextlib
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kafka import KafkaAdminClient

from harness.local_kafka import KAFKA_VERSION, SASL_USERS, LocalKafka, ensure_kafka_jars

from .clients import wait_until
from .conftest import (
    JAVA_CONFIG_COMMAND,
    JAVA_CONSOLE_CONSUMER,
    JAVA_CONSOLE_PRODUCER,
    JAVA_PRODUCER_PERF,
    JAVA_TOOL_CLASSES,
    JAVA_TOPIC_COMMAND,
    KafkaJava,
)

SCRAM = ("SCRAM-SHA-256", "SCRAM-SHA-512")


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _create_topic(bootstrap: str, name: str, partitions: int, replication: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, partitions, replication)], operation_timeout=30)
    futures[name].result(timeout=60)
    # CreateTopics returns once the controller has the topic; each broker learns it a little later from
    # the metadata log, so wait (bounded) until every broker lists all partitions with a leader.
    for node in bootstrap.split(","):
        view = AdminClient({"bootstrap.servers": node})
        wait_until(lambda v=view: _partitions_led(v, name) == partitions, 30, f"{name} on {node}")


def _partitions_led(admin: AdminClient, topic: str) -> int:
    meta = admin.list_topics(topic, timeout=10).topics[topic]
    if meta.error is not None:
        return -1
    return sum(1 for p in meta.partitions.values() if p.leader >= 0)


def _sasl_conf(cluster: LocalKafka, mechanism: str, user: str, password: str) -> dict[str, Any]:
    assert cluster.sasl_bootstrap is not None
    return {
        "bootstrap.servers": cluster.sasl_bootstrap,
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": password,
    }


def _produce_and_consume(conf: dict[str, Any], topic: str, values: list[bytes]) -> list[bytes]:
    """Produce values, wait for every delivery report, then read the topic back from the beginning."""
    delivered: list[KafkaError | None] = []
    producer = Producer({**conf, "acks": "all"})
    for value in values:
        producer.produce(topic, value, on_delivery=lambda err, _msg: delivered.append(err))
    assert producer.flush(30) == 0, "records still queued after 30 s"
    assert delivered == [None] * len(values)

    consumer = Consumer(
        {**conf, "group.id": _topic("g"), "auto.offset.reset": "earliest", "enable.auto.commit": False}
    )
    consumer.subscribe([topic])
    got: list[bytes] = []
    try:
        deadline = time.monotonic() + 60
        while len(got) < len(values) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            record = msg.value()
            assert isinstance(record, bytes)
            got.append(record)
    finally:
        consumer.close()
    return got


# ----------------------------------------------------------------------------------- cluster shape


def test_jars_are_the_pinned_version() -> None:
    libs = ensure_kafka_jars()
    assert (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file()
    assert (libs / f"kafka-clients-{KAFKA_VERSION}.jar").is_file()


def test_cluster_lists_exactly_its_brokers(kafka_cluster: LocalKafka) -> None:
    assert kafka_cluster.node_ids == [1, 2, 3]
    meta = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap}).list_topics(timeout=30)
    assert sorted(meta.brokers) == kafka_cluster.node_ids
    advertised = sorted(f"{b.host}:{b.port}" for b in meta.brokers.values())
    assert advertised == sorted(kafka_cluster.bootstrap.split(","))
    assert meta.cluster_id == kafka_cluster.cluster_id


def test_kafka_python_sees_the_same_cluster(kafka_cluster: LocalKafka) -> None:
    admin = KafkaAdminClient(bootstrap_servers=kafka_cluster.bootstrap, client_id="harness-test")
    try:
        described = admin.describe_cluster()
    finally:
        admin.close()
    assert sorted(b["broker_id"] for b in described["brokers"]) == kafka_cluster.node_ids
    assert described["cluster_id"] == kafka_cluster.cluster_id


def test_each_broker_answers_on_its_own_port(kafka_cluster: LocalKafka) -> None:
    for node_id in kafka_cluster.node_ids:
        host, port = kafka_cluster.broker_address(node_id)
        meta = AdminClient({"bootstrap.servers": f"{host}:{port}"}).list_topics(timeout=30)
        assert sorted(meta.brokers) == kafka_cluster.node_ids


def test_logs_are_written_per_node(kafka_cluster: LocalKafka) -> None:
    for node_id in kafka_cluster.node_ids:
        assert "Kafka Server started" in kafka_cluster.log_path(node_id).read_text(errors="replace")


# ----------------------------------------------------------------------------------- data path


def test_replicated_topic_round_trip(kafka_cluster: LocalKafka) -> None:
    topic = _topic("rf3")
    _create_topic(kafka_cluster.bootstrap, topic, partitions=6, replication=3)
    meta = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap}).list_topics(topic, timeout=30)
    partitions = meta.topics[topic].partitions
    assert sorted(partitions) == list(range(6))
    for p in partitions.values():
        assert sorted(p.replicas) == [1, 2, 3]
        assert sorted(p.isrs) == [1, 2, 3]
    leaders = {p.leader for p in partitions.values()}
    assert len(leaders) == 3, f"leaders should spread over all brokers, got {leaders}"

    values = [f"record-{i}".encode() for i in range(12)]
    got = _produce_and_consume({"bootstrap.servers": kafka_cluster.bootstrap}, topic, values)
    assert sorted(got) == sorted(values)


def test_topics_are_not_auto_created(kafka_cluster: LocalKafka) -> None:
    topic = _topic("never-created")
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    meta = admin.list_topics(topic, timeout=30)
    error = meta.topics[topic].error
    assert error is not None
    assert error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART


# ----------------------------------------------------------------------------------- SASL


@pytest.mark.parametrize("mechanism", ["PLAIN", *SCRAM])
def test_sasl_right_password_round_trip(kafka_cluster: LocalKafka, mechanism: str) -> None:
    topic = _topic(f"sasl-{mechanism.lower()}")
    _create_topic(kafka_cluster.bootstrap, topic, partitions=1, replication=3)
    conf = _sasl_conf(kafka_cluster, mechanism, "alice", SASL_USERS["alice"])
    got = _produce_and_consume(conf, topic, [b"over-sasl"])
    assert got == [b"over-sasl"]


def _authentication_errors(conf: dict[str, Any]) -> list[KafkaError]:
    """Connect with ``conf`` and collect librdkafka's errors until an authentication failure shows up."""
    errors: list[KafkaError] = []
    admin = AdminClient({**conf, "error_cb": errors.append})  # type: ignore[dict-item]
    with contextlib.suppress(KafkaException):  # no metadata: the reason arrives through error_cb
        admin.list_topics(timeout=1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any(e.code() == KafkaError._AUTHENTICATION for e in errors):
        admin.poll(0.2)
    return errors


@pytest.mark.parametrize(
    ("mechanism", "user", "password"),
    [
        ("PLAIN", "alice", "not-the-password"),
        ("SCRAM-SHA-256", "alice", "not-the-password"),
        ("SCRAM-SHA-512", "alice", "not-the-password"),
        ("PLAIN", "mallory", "alice-secret"),
        ("SCRAM-SHA-256", "mallory", "alice-secret"),
    ],
)
def test_sasl_bad_credentials_are_an_authentication_error(
    kafka_cluster: LocalKafka, mechanism: str, user: str, password: str
) -> None:
    errors = _authentication_errors(_sasl_conf(kafka_cluster, mechanism, user, password))
    assert KafkaError._AUTHENTICATION in {e.code() for e in errors}, errors


def test_every_sasl_user_can_log_in(kafka_cluster: LocalKafka) -> None:
    for user, password in SASL_USERS.items():
        for mechanism in ("PLAIN", *SCRAM):
            conf = _sasl_conf(kafka_cluster, mechanism, user, password)
            meta = AdminClient(conf).list_topics(timeout=30)
            assert sorted(meta.brokers) == kafka_cluster.node_ids, (user, mechanism)


# ----------------------------------------------------------------------------------- failures


def test_start_failure_raises_with_the_log_tail_and_leaks_nothing() -> None:
    cluster = LocalKafka(brokers=1, heap_mb=1)  # the JVM refuses a 1 MiB heap and exits at once
    with pytest.raises(RuntimeError) as failure:
        cluster.start(timeout=60)
    message = str(failure.value)
    assert "exited with code" in message
    assert "server.log" in message and "heap" in message.lower(), message
    assert cluster.workdir is None
    assert not cluster.alive()


# ----------------------------------------------------------------------------------- Java tools


def test_java_tool_classes_exist_in_the_jars() -> None:
    names: set[str] = set()
    for jar in Path(ensure_kafka_jars()).glob("kafka*.jar"):
        with zipfile.ZipFile(jar) as zf:
            names.update(zf.namelist())
    missing = [c for c in JAVA_TOOL_CLASSES if c.replace(".", "/") + ".class" not in names]
    assert not missing, f"not in the Kafka {KAFKA_VERSION} jars: {missing}"


def test_java_console_tools_round_trip(kafka_java: KafkaJava) -> None:
    topic = _topic("java-console")
    created = kafka_java.run(
        JAVA_TOPIC_COMMAND, "--bootstrap-server", kafka_java.bootstrap, "--create", "--topic", topic,
        "--partitions", "3", "--replication-factor", "3",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr.decode()

    lines = [f"line-{i}" for i in range(5)]
    produced = kafka_java.run(
        JAVA_CONSOLE_PRODUCER, "--bootstrap-server", kafka_java.bootstrap, "--topic", topic,
        "--command-property", "acks=all",
        input=("\n".join(lines) + "\n").encode(),
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr.decode()

    consumed = kafka_java.run(
        JAVA_CONSOLE_CONSUMER, "--bootstrap-server", kafka_java.bootstrap, "--topic", topic,
        "--from-beginning", "--max-messages", str(len(lines)), "--timeout-ms", "60000",
    )  # fmt: skip
    assert consumed.returncode == 0, consumed.stderr.decode()
    assert sorted(consumed.stdout.decode().split()) == lines


def test_java_config_command_sets_a_client_quota(kafka_java: KafkaJava) -> None:
    user = _topic("quota-user")
    altered = kafka_java.run(
        JAVA_CONFIG_COMMAND, "--bootstrap-server", kafka_java.bootstrap, "--alter",
        "--add-config", "producer_byte_rate=1048576", "--entity-type", "users", "--entity-name", user,
    )  # fmt: skip
    assert altered.returncode == 0, altered.stderr.decode()
    described = kafka_java.run(
        JAVA_CONFIG_COMMAND, "--bootstrap-server", kafka_java.bootstrap, "--describe",
        "--entity-type", "users", "--entity-name", user,
    )  # fmt: skip
    assert described.returncode == 0, described.stderr.decode()
    assert "producer_byte_rate=1048576" in described.stdout.decode()


def test_java_producer_perf_runs(kafka_java: KafkaJava) -> None:
    topic = _topic("java-perf")
    _create_topic(kafka_java.bootstrap, topic, partitions=3, replication=3)
    perf = kafka_java.run(
        JAVA_PRODUCER_PERF, "--topic", topic, "--num-records", "1000", "--record-size", "100",
        "--throughput", "-1", "--producer-props", f"bootstrap.servers={kafka_java.bootstrap}", "acks=all",
    )  # fmt: skip
    assert perf.returncode == 0, perf.stderr.decode()
    assert "1000 records sent" in perf.stdout.decode()
