"""The controller mutation quota (KIP-599) through the proxy, against the real cluster.

The Java AdminClient and kafka-topics create topics in a loop under `controller_mutation_rate`;
raw requests (kafka-python's schema classes on a socket) check the strict split of a CreateTopics,
a permissive old-version request throttled afterwards, and DeleteTopics charged by partitions.

Each test uses its own client id, so each starts with a full bucket: burst = 11 windows of 1 s x
the rate (Kafka's controller.quota.window.num and .size.seconds defaults). The rate bound checked
is exact for a strict token bucket: a topic is accepted only while the bucket is not in debt, so
by the time the last topic was accepted at most burst + rate x elapsed + one topic can have been
charged.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from kafka.protocol.admin import (
    CreateTopicsRequest,
    CreateTopicsResponse,
    DeleteTopicsRequest,
    DeleteTopicsResponse,
)
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from harness.local_kafka import LocalKafka
from protocol.apis import KNOWN_APIS
from protocol.frames import frame
from protocol.headers import encode_request_header, response_body_offset

from .clients import recv_exact, wait_until
from .conftest import JAVA_CONFIG_COMMAND, JAVA_TOPIC_COMMAND, KafkaJava
from .proxies import QuotaProxy
from .quota_runs import report

THROTTLING_QUOTA_EXCEEDED = 89
#: Kafka's controller.quota.window.num x controller.quota.window.size.seconds
BURST_S = 11

JAVA_CREATE_LOOP = """\
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.NewTopic;

/** Creates topics one request at a time; the AdminClient retries THROTTLING_QUOTA_EXCEEDED itself. */
public class CreateTopicsLoop {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        props.put("client.id", args[1]);
        props.put("default.api.timeout.ms", "180000");
        int count = Integer.parseInt(args[3]);
        int partitions = Integer.parseInt(args[4]);
        try (Admin admin = Admin.create(props)) {
            long start = System.nanoTime();
            for (int i = 0; i < count; i++) {
                String name = args[2] + "-" + i;
                admin.createTopics(List.of(new NewTopic(name, partitions, (short) 1))).all().get();
                System.out.println("created " + name + " " + (System.nanoTime() - start) / 1_000_000);
            }
        }
    }
}
"""


@pytest.fixture(scope="module")
def quotas(quota_proxy: QuotaProxy) -> Iterator[QuotaProxy]:
    """The module's proxy with one controller mutation quota per test client id."""
    quota_proxy.set_quotas("\n".join(
        f'[[quota]]\nclient_id = "{client}"\ncontroller_mutation_rate = {rate}\n'
        for client, rate in RATES.items()))
    yield quota_proxy


RATES = {"cm-java": 5.0, "cm-tool": 1.0, "cm-strict": 1.0, "cm-permissive": 1.0, "cm-delete": 1.0}


def _delete_directly(kafka_cluster: LocalKafka, names: list[str]) -> None:
    """Clean up on the cluster itself; topics already gone (or never created) are fine."""
    if not names:
        return
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    for future in admin.delete_topics(names, operation_timeout=30).values():
        try:
            future.result(60)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


def _partitions(kafka_cluster: LocalKafka, prefix: str) -> dict[str, int]:
    """Topics starting with `prefix` and their partition counts, as the cluster itself reports them."""
    meta = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap}).list_topics(timeout=30)
    return {name: len(t.partitions) for name, t in meta.topics.items() if name.startswith(prefix)}


def _assert_held_to_quota(partitions: int, elapsed_s: float, rate: float, topic_partitions: int,
                          what: str) -> None:
    bound = BURST_S * rate + rate * elapsed_s + topic_partitions
    past_burst = (partitions - BURST_S * rate - topic_partitions) / elapsed_s
    report(f"{what}: {partitions} partitions in {elapsed_s:.1f} s under {rate}/s (at most {bound:.0f} "
           f"by the quota; {past_burst:.2f}/s past the burst and the last topic)")
    assert partitions <= bound, f"{what}: {partitions} partitions in {elapsed_s:.1f} s beat the quota"


def _java_loop(kafka_java: KafkaJava, bootstrap: str, client_id: str, names: list[str], partitions: int,
               source: Path) -> float:
    """Run the Java AdminClient loop; seconds from its first request to its last topic created."""
    source.write_text(JAVA_CREATE_LOOP)
    prefix = names[0].rsplit("-", 1)[0]
    # the JDK's single-file source launcher compiles it against the Kafka jars on the class path
    done = kafka_java.run(str(source), bootstrap, client_id, prefix, str(len(names)), str(partitions),
                          timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    lines = done.stdout.decode().split()
    assert [lines[i + 1] for i in range(0, len(lines), 3)] == names  # each once, in order, no error
    return int(lines[-1]) / 1000.0


def test_java_admin_client_creates_every_topic_once_at_the_quota_rate(
        quotas: QuotaProxy, kafka_java: KafkaJava, kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    rate, count, partitions = RATES["cm-java"], 24, 5
    prefix = f"cm-java-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{i}" for i in range(count)]
    labels = {"quota": "controller_mutation_rate", "user": "", "client_id": "cm-java"}
    throttled_before = quotas.metric("kthrottle_throttles_total", **labels)
    try:
        elapsed_s = _java_loop(kafka_java, quotas.bootstrap, "cm-java", names, partitions,
                               tmp_path / "CreateTopicsLoop.java")
        _wait_created(kafka_cluster, prefix, dict.fromkeys(names, partitions))
        throttles = quotas.metric("kthrottle_throttles_total", **labels) - throttled_before
        assert throttles >= 1, "the quota never refused a topic: the AdminClient never had to retry"
        _assert_held_to_quota(count * partitions, elapsed_s, rate, partitions,
                              "Java AdminClient via kthrottle")
    finally:
        _delete_directly(kafka_cluster, names)


def test_the_same_loop_against_the_brokers_own_quota(
        kafka_java: KafkaJava, kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """Side by side: the same loop straight at the cluster, with the quota set on the brokers
    (their controller enforces it); Kafka's own figures obey the bound the proxy is held to."""
    rate, count, partitions = RATES["cm-java"], 24, 5
    client = f"cm-direct-{uuid.uuid4().hex[:8]}"
    names = [f"{client}-{i}" for i in range(count)]
    entity = ("--entity-type", "clients", "--entity-name", client)
    config = kafka_java.run(JAVA_CONFIG_COMMAND, "--bootstrap-server", kafka_cluster.bootstrap, "--alter",
                            "--add-config", f"controller_mutation_rate={rate}", *entity)
    assert config.returncode == 0, config.stderr.decode(errors="replace")
    try:
        time.sleep(2)  # the controller applies the quota once the record reaches it
        elapsed_s = _java_loop(kafka_java, kafka_cluster.bootstrap, client, names, partitions,
                               tmp_path / "CreateTopicsLoop.java")
        _wait_created(kafka_cluster, client, dict.fromkeys(names, partitions))
        _assert_held_to_quota(count * partitions, elapsed_s, rate, partitions,
                              "Java AdminClient, brokers' own quota")
    finally:
        kafka_java.run(JAVA_CONFIG_COMMAND, "--bootstrap-server", kafka_cluster.bootstrap, "--alter",
                       "--delete-config", "controller_mutation_rate", *entity)
        _delete_directly(kafka_cluster, names)


def test_kafka_topics_in_a_loop_retried_on_throttling(
        quotas: QuotaProxy, kafka_java: KafkaJava, kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """kafka-topics does not retry a throttled create (retryOnQuotaViolation(false)): the loop does.

    Topics of 12 partitions at 1/s: each needs 12 s of refill, far more than one run of the tool
    takes, so after the burst (11) some runs must be refused whatever the machine's speed."""
    rate, count, partitions = RATES["cm-tool"], 4, 12
    prefix = f"cm-tool-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{i}" for i in range(count)]
    config = tmp_path / "tool.properties"
    config.write_text("client.id=cm-tool\n")
    refused = 0
    start = time.monotonic()
    try:
        for name in names:
            for _attempt in range(40):
                done = kafka_java.run(JAVA_TOPIC_COMMAND, "--bootstrap-server", quotas.bootstrap,
                                      "--command-config", str(config), "--create", "--topic", name,
                                      "--partitions", str(partitions), "--replication-factor", "1")
                output = (done.stdout + done.stderr).decode(errors="replace")
                if done.returncode == 0:
                    assert f"Created topic {name}." in output
                    break
                assert "throttling quota has been exceeded" in output.lower(), output[-2000:]
                refused += 1
            else:
                pytest.fail(f"{name} still throttled after 40 attempts")
        elapsed_s = time.monotonic() - start
        _wait_created(kafka_cluster, prefix, dict.fromkeys(names, partitions))
        assert refused >= 1, "kafka-topics was never throttled"
        report(f"kafka-topics: {refused} runs answered THROTTLING_QUOTA_EXCEEDED")
        _assert_held_to_quota(count * partitions, elapsed_s, rate, partitions, "kafka-topics loop")
    finally:
        _delete_directly(kafka_cluster, names)


# -- raw requests -------------------------------------------------------------------------------------


_RESPONSES = {CreateTopicsRequest: CreateTopicsResponse, DeleteTopicsRequest: DeleteTopicsResponse,
              MetadataRequest: MetadataResponse}


def _exchange(proxy: QuotaProxy | str, cls: Any, version: int, client_id: str,
              **fields: Any) -> tuple[Any, float]:
    """Send one request on a new connection to the proxy (or host:port); (its decoded response,
    round trip in ms)."""
    response_cls = _RESPONSES[cls]
    body = bytes(cls(**fields).encode(version=version))
    head = encode_request_header(cls.API_KEY, version, 7, client_id)
    address = proxy.bootstrap if isinstance(proxy, QuotaProxy) else proxy.split(",")[0]
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sent = time.monotonic()
        sock.sendall(frame(head + body))
        size = int.from_bytes(recv_exact(sock, 4), "big")
        answer = recv_exact(sock, size)
        rtt_ms = (time.monotonic() - sent) * 1000.0
    assert int.from_bytes(answer[:4], "big") == 7
    offset = response_body_offset(answer, KNOWN_APIS[cls.API_KEY].response_header_version(version))
    return response_cls.decode(memoryview(answer)[offset:], version=version), rtt_ms


def _create(proxy: QuotaProxy | str, version: int, client_id: str, names: list[str],
            partitions: int) -> tuple[Any, float]:
    topics = [CreateTopicsRequest.CreatableTopic(name=n, num_partitions=partitions, replication_factor=1,
                                                 assignments=[], configs=[]) for n in names]
    return _exchange(proxy, CreateTopicsRequest, version, client_id, topics=topics, timeout_ms=30_000,
                     validate_only=False)


def _wait_created(kafka_cluster: LocalKafka, prefix: str, expected: dict[str, int]) -> None:
    wait_until(lambda: _partitions(kafka_cluster, prefix) == expected, 30, f"topics {sorted(expected)}")


@contextlib.contextmanager
def _target(where: str, quotas: QuotaProxy, kafka_java: KafkaJava, kafka_cluster: LocalKafka,
            client: str) -> Iterator[tuple[str, str]]:
    """(address, client id) to send to: the proxy under its quota for `client`, or the brokers
    with the same controller_mutation_rate set on them for a client id of its own."""
    if where == "kthrottle":
        yield quotas.bootstrap, client
        return
    own = f"{client}-{uuid.uuid4().hex[:8]}"
    entity = ("--entity-type", "clients", "--entity-name", own)
    config = kafka_java.run(JAVA_CONFIG_COMMAND, "--bootstrap-server", kafka_cluster.bootstrap, "--alter",
                            "--add-config", f"controller_mutation_rate={RATES[client]}", *entity)
    assert config.returncode == 0, config.stderr.decode(errors="replace")
    time.sleep(2)  # the controller applies the quota once the record reaches it
    try:
        yield kafka_cluster.bootstrap, own
    finally:
        kafka_java.run(JAVA_CONFIG_COMMAND, "--bootstrap-server", kafka_cluster.bootstrap, "--alter",
                       "--delete-config", "controller_mutation_rate", *entity)


@pytest.mark.parametrize("where", ["kthrottle", "brokers"])
def test_strict_create_topics_is_split_and_merged_in_the_clients_order(
        where: str, quotas: QuotaProxy, kafka_java: KafkaJava, kafka_cluster: LocalKafka) -> None:
    """Rate 1/s, burst 11: 8 (tokens 3) and 8 (tokens -5) accepted, the next two refused for ~5 s;
    the brokers' own quota answers the same."""
    prefix = f"cm-strict-{where}-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{c}" for c in "abcd"]
    try:
        with _target(where, quotas, kafka_java, kafka_cluster, "cm-strict") as (address, client):
            response, rtt_ms = _create(address, 7, client, names, 8)
        refused = THROTTLING_QUOTA_EXCEEDED
        assert [(t.name, t.error_code) for t in response.topics] == [
            (names[0], 0), (names[1], 0), (names[2], refused), (names[3], refused)]
        assert response.topics[0].num_partitions == 8  # the broker's own result, merged in
        assert 5000 - rtt_ms - 1 <= response.throttle_time_ms <= 5000
        report(f"strict CreateTopics via {where}: throttle {response.throttle_time_ms} ms")
        _wait_created(kafka_cluster, prefix, {names[0]: 8, names[1]: 8})
    finally:
        _delete_directly(kafka_cluster, names)


@pytest.mark.parametrize("where", ["kthrottle", "brokers"])
def test_permissive_create_topics_goes_through_and_is_throttled_after(
        where: str, quotas: QuotaProxy, kafka_java: KafkaJava, kafka_cluster: LocalKafka) -> None:
    """CreateTopics v4 (before KIP-599's v6): all created; tokens 11 - 24 = -13, a 13 s throttle;
    the brokers' own quota answers the same."""
    prefix = f"cm-permissive-{where}-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{c}" for c in "abc"]
    try:
        with _target(where, quotas, kafka_java, kafka_cluster, "cm-permissive") as (address, client):
            response, rtt_ms = _create(address, 4, client, names, 8)
        assert [(t.name, t.error_code) for t in response.topics] == [(n, 0) for n in names]
        assert 13_000 - rtt_ms - 1 <= response.throttle_time_ms <= 13_000
        report(f"permissive CreateTopics v4 via {where}: throttle {response.throttle_time_ms} ms")
        _wait_created(kafka_cluster, prefix, dict.fromkeys(names, 8))
    finally:
        _delete_directly(kafka_cluster, names)


def _topic_id(kafka_cluster: LocalKafka, name: str) -> uuid.UUID:
    """The topic's id, asked of the cluster itself (Metadata v10 answers ids)."""
    answer, _ = _exchange(kafka_cluster.bootstrap, MetadataRequest, 10, "cm-test",
                          allow_auto_topic_creation=False, include_topic_authorized_operations=False,
                          topics=[MetadataRequest.MetadataRequestTopic(name=name, topic_id=uuid.UUID(int=0))])
    (topic,) = answer.topics
    assert topic.error_code == 0 and topic.name == name
    return topic.topic_id


def test_delete_topics_is_charged_by_partitions(quotas: QuotaProxy, kafka_cluster: LocalKafka) -> None:
    """Rate 1/s, burst 11: deleting two 8-partition topics leaves the bucket at -5, so a third
    topic, named by id, is refused (charged one per topic, it would have been deleted); once the
    throttle has passed it is deleted by id."""
    prefix = f"cm-delete-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{c}" for c in "abc"]
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    for future in admin.create_topics([NewTopic(n, 8, 1) for n in names]).values():
        future.result(60)
    _wait_created(kafka_cluster, prefix, dict.fromkeys(names, 8))
    third = _topic_id(kafka_cluster, names[2])
    by_id = [DeleteTopicsRequest.DeleteTopicState(name=None, topic_id=third)]
    try:
        first, _ = _exchange(quotas, DeleteTopicsRequest, 6, "cm-delete", timeout_ms=30_000, topics=[
            DeleteTopicsRequest.DeleteTopicState(name=n, topic_id=uuid.UUID(int=0)) for n in names[:2]])
        assert sorted((r.name, r.error_code) for r in first.responses) == [(names[0], 0), (names[1], 0)]
        second, _ = _exchange(quotas, DeleteTopicsRequest, 6, "cm-delete", timeout_ms=30_000, topics=by_id)
        assert [(r.name, r.topic_id, r.error_code) for r in second.responses] == [
            (names[2], third, THROTTLING_QUOTA_EXCEEDED)]  # named from the proxy's lookup
        assert 0 < second.throttle_time_ms <= 5000
        _wait_created(kafka_cluster, prefix, {names[2]: 8})
        time.sleep(second.throttle_time_ms / 1000.0)
        last, _ = _exchange(quotas, DeleteTopicsRequest, 6, "cm-delete", timeout_ms=30_000, topics=by_id)
        assert [(r.topic_id, r.error_code) for r in last.responses] == [(third, 0)]
        _wait_created(kafka_cluster, prefix, {})
    finally:
        _delete_directly(kafka_cluster, names)
