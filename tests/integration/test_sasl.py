"""SASL through the proxy, in front of the cluster's SASL_PLAINTEXT listener: PLAIN, SCRAM-SHA-256 and
SCRAM-SHA-512 from librdkafka, kafka-python, aiokafka and the Java client.

The proxy passes the exchange through untouched and names the principal only once the broker accepted
it; a wrong password must fail exactly as it does without the proxy, and never be logged as a login.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from harness.local_kafka import SASL_USERS

from .clients import (
    aiokafka_round_trip,
    assert_exact,
    assert_proxy_addresses,
    kafka_python_round_trip,
    read_all,
    records,
    topic_name,
    wait_until,
)
from .conftest import JAVA_PRODUCER_PERF

JAVA_BROKER_API_VERSIONS = "org.apache.kafka.tools.BrokerApiVersionsCommand"
COUNT = 60
PARTITIONS = 6


def _conf(bootstrap: str, mechanism: str, user: str, password: str | None = None) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": SASL_USERS[user] if password is None else password,
    }


def _create_topic(conf: dict[str, Any], name: str) -> None:
    admin = AdminClient(conf)
    admin.create_topics([NewTopic(name, PARTITIONS, 3)])[name].result(30)
    wait_until(lambda: len(admin.list_topics(name, timeout=10).topics[name].partitions) == PARTITIONS,
               30, f"topic {name} metadata")


def _new_log(proxy, start: int) -> str:  # type: ignore[no-untyped-def]
    """What the proxy logged since ``start`` (a length of its log taken earlier)."""
    return proxy.log()[start:]


def _wait_for_new_log(proxy, start: int, text: str, timeout: float = 10.0) -> str:  # type: ignore[no-untyped-def]
    return wait_until(lambda: (log := _new_log(proxy, start)) and text in log and log, timeout,
                      f"{text!r} in the proxy log") or ""


def _login(user: str, mechanism: str) -> str:
    return f"authenticated as principal '{user}' ({mechanism})"


# -- right credentials ----------------------------------------------------------------------------


def test_confluent_plain_alice(kafka_cluster, sasl_proxy):
    topic = topic_name("sasl-plain")
    conf = _conf(sasl_proxy.bootstrap, "PLAIN", "alice")
    _create_topic(conf, topic)
    start = len(sasl_proxy.log())
    producer = Producer({**conf, "acks": "all", "linger.ms": 5})
    errors: list[str] = []
    for partition, key, value in records(COUNT):
        producer.produce(topic, value, key, partition=partition,
                         on_delivery=lambda err, _msg: err is None or errors.append(str(err)))
    assert producer.flush(30) == 0, "records still queued after 30 s"
    assert not errors, errors[:5]
    assert_exact(read_all(conf, topic, COUNT), COUNT)
    _wait_for_new_log(sasl_proxy, start, _login("alice", "PLAIN"))


def test_kafka_python_scram_sha256_bob(kafka_cluster, sasl_proxy):
    sasl = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_plain_username": "bob", "sasl_plain_password": SASL_USERS["bob"]}
    topic = topic_name("sasl-scram256")
    _create_topic(_conf(sasl_proxy.bootstrap, "PLAIN", "admin"), topic)
    start = len(sasl_proxy.log())
    consumed = kafka_python_round_trip(sasl_proxy.bootstrap, topic, COUNT, sasl_proxy.port,
                                       kafka_cluster.node_ids, kafka_cluster.sasl_bootstrap, **sasl)
    assert_exact(consumed, COUNT)
    _wait_for_new_log(sasl_proxy, start, _login("bob", "SCRAM-SHA-256"))


def test_java_scram_sha512_admin(kafka_cluster, kafka_java, sasl_proxy, tmp_path):
    topic = topic_name("sasl-scram512")
    count = 2000
    _create_topic(_conf(sasl_proxy.bootstrap, "PLAIN", "alice"), topic)
    config = tmp_path / "scram512.properties"
    config.write_text(
        "security.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=SCRAM-SHA-512\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="admin" password="{SASL_USERS["admin"]}";\n'
    )
    start = len(sasl_proxy.log())
    perf = kafka_java.run(
        JAVA_PRODUCER_PERF, "--bootstrap-server", sasl_proxy.bootstrap, "--topic", topic,
        "--num-records", str(count), "--payload-monotonic", "--throughput", "-1",
        "--command-config", str(config), "--command-property", "acks=all",
        "partitioner.class=org.apache.kafka.clients.producer.RoundRobinPartitioner",
    )  # fmt: skip
    assert perf.returncode == 0, perf.stderr.decode(errors="replace")[-4000:]
    assert f"{count} records sent" in perf.stdout.decode()
    # The bootstrap connection and at least one connection to a leader's own port both logged in.
    login = _login("admin", "SCRAM-SHA-512")
    wait_until(lambda: _new_log(sasl_proxy, start).count(login) >= 2, 10, f"two connections to log {login!r}")

    consumed = read_all(_conf(sasl_proxy.bootstrap, "PLAIN", "bob"), topic, count)
    values = sorted(int(v) for vs in consumed.values() for v in vs)
    assert values == list(range(count)), f"{len(values)} records read back, expected {count} distinct"

    # The Java admin client's view of the brokers through the SASL proxy.
    versions = kafka_java.run(JAVA_BROKER_API_VERSIONS, "--bootstrap-server", sasl_proxy.bootstrap,
                              "--command-config", str(config))
    assert versions.returncode == 0, versions.stderr.decode(errors="replace")[-4000:]
    out = versions.stdout.decode()
    headers = re.findall(r"^(\S+):(\d+) \(id: (\d+) rack: [^)]*\) -> \(", out, re.MULTILINE)
    assert_proxy_addresses([(int(node), host, int(port)) for host, port, node in headers], sasl_proxy.port,
                           kafka_cluster.node_ids, kafka_cluster.sasl_bootstrap)


def test_aiokafka_plain_bob(kafka_cluster, sasl_proxy):
    sasl = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
            "sasl_plain_username": "bob", "sasl_plain_password": SASL_USERS["bob"]}
    topic = topic_name("sasl-aio")
    _create_topic(_conf(sasl_proxy.bootstrap, "PLAIN", "alice"), topic)
    start = len(sasl_proxy.log())

    consumed = asyncio.run(aiokafka_round_trip(sasl_proxy.bootstrap, topic, COUNT, sasl_proxy.port,
                                               kafka_cluster.node_ids, kafka_cluster.sasl_bootstrap, **sasl))
    assert_exact(consumed, COUNT)
    _wait_for_new_log(sasl_proxy, start, _login("bob", "PLAIN"))


# -- wrong credentials ----------------------------------------------------------------------------


def _authentication_failures(conf: dict[str, Any]) -> set[str]:
    """librdkafka's _AUTHENTICATION errors for ``conf``, without the broker's name and the timing."""
    errors: list[KafkaError] = []
    admin = AdminClient({**conf, "error_cb": errors.append})
    with contextlib.suppress(KafkaException):  # no metadata: the reason arrives through error_cb
        admin.list_topics(timeout=0.5)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any(e.code() == KafkaError._AUTHENTICATION for e in errors):
        admin.poll(0.1)
    return {
        re.sub(r"\s*\(after \d+ms in state \w+\)$", "", e.str().split(": ", 1)[-1])
        for e in errors
        if e.code() == KafkaError._AUTHENTICATION
    }


@pytest.mark.parametrize(
    ("mechanism", "user"),
    [("PLAIN", "alice"), ("PLAIN", "mallory"), ("SCRAM-SHA-256", "alice"), ("SCRAM-SHA-256", "mallory")],
)
def test_wrong_password_fails_as_without_proxy(kafka_cluster, sasl_proxy, mechanism, user):
    wrong = "not-the-password"
    direct = _authentication_failures(_conf(kafka_cluster.sasl_bootstrap, mechanism, user, wrong))
    assert direct, "the broker itself did not report an authentication failure"
    start = len(sasl_proxy.log())
    proxied = _authentication_failures(_conf(sasl_proxy.bootstrap, mechanism, user, wrong))
    assert proxied == direct, f"through the proxy: {proxied}; directly: {direct}"
    log = _new_log(sasl_proxy, start)
    assert "authenticated as principal" not in log, f"a failed login was logged as a success:\n{log}"
    assert "principal 'mallory'" not in sasl_proxy.log()
    assert sasl_proxy.alive()


# -- the client's view of the brokers -------------------------------------------------------------


def test_sasl_clients_see_only_proxy_addresses(kafka_cluster, sasl_proxy):
    admin = AdminClient(_conf(sasl_proxy.bootstrap, "SCRAM-SHA-512", "alice"))
    metadata = admin.list_topics(timeout=10)
    assert_proxy_addresses([(b.id, b.host, b.port) for b in metadata.brokers.values()], sasl_proxy.port,
                           kafka_cluster.node_ids, kafka_cluster.sasl_bootstrap)
    described = admin.describe_cluster().result(10)
    assert_proxy_addresses([(n.id, n.host, n.port) for n in described.nodes], sasl_proxy.port,
                           kafka_cluster.node_ids, kafka_cluster.sasl_bootstrap)
    assert described.controller.port == sasl_proxy.port + 1 + described.controller.id
