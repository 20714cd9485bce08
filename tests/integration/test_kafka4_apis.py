"""Kafka 4 APIs through `kthrottle run`: KIP-848 consumer groups, KIP-932 share groups, DescribeQuorum.

The proxy forwards every API it does not need to look into as opaque bytes and rewrites the few
whose bodies name brokers. Here real clients prove it against the session's 3 brokers (Kafka 4.3.1):
the Java consumer with `group.protocol=consumer` and the Java share consumer from the fetched jars,
librdkafka's, and kafka-metadata-quorum. Each consumes a known set of records exactly once, and its
whole DEBUG log is searched for every port the real cluster listens on: none may appear.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as RdConsumer
from confluent_kafka import ConsumerGroupType, Producer, ShareConsumer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from harness.local_kafka import LocalKafka, ensure_kafka_jars
from protocol.addresses import ADDRESS_BEARING
from protocol.api_versions import offered_range

from .clients import PARTITIONS, topic_name, wait_for_topic_on_every_broker
from .conftest import _TOOLS_LOG4J2, JAVA_CONSOLE_CONSUMER, JAVA_METADATA_QUORUM_COMMAND, KafkaJava
from .proxies import RunningProxy

JAVA_CONSOLE_SHARE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleShareConsumer"
JAVA_REASSIGN_PARTITIONS = "org.apache.kafka.tools.reassign.ReassignPartitionsCommand"
JAVA_LEADER_ELECTION = "org.apache.kafka.tools.LeaderElectionCommand"
JAVA_BROKER_API_VERSIONS = "org.apache.kafka.tools.BrokerApiVersionsCommand"

COUNT = 600
#: Kafka 4 API keys a client needs for KIP-848 (68, 69) and KIP-932 (76-79) groups.
KAFKA4_KEYS = {68: "ConsumerGroupHeartbeat", 69: "ConsumerGroupDescribe", 76: "ShareGroupHeartbeat",
               77: "ShareGroupDescribe", 78: "ShareFetch", 79: "ShareAcknowledge"}

#: Every field of a Kafka 4.3.1 response that names a host and port, by API key, and why the
#: proxy leaves it alone; any other such field must be rewritten (protocol.addresses.ADDRESS_BEARING).
NOT_BROKER_ADDRESSES = {
    88: "StreamsGroupHeartbeat Endpoint: a Kafka Streams instance's application.server",
    89: "StreamsGroupDescribe Endpoint: a Kafka Streams instance's application.server",
}
#: Responses with controller addresses that brokers never send: their requests' schemas list only
#: the "controller" listener.
CONTROLLER_ONLY = {"Vote", "BeginQuorumEpoch", "EndQuorumEpoch", "FetchSnapshot", "UpdateRaftVoter"}

# Client DEBUG logging (NetworkClient names every connection it opens and every request it sends).
_DEBUG_LOG4J2 = (_TOOLS_LOG4J2
                 + "logger.clients.name = org.apache.kafka.clients\nlogger.clients.level = debug\n")


# -- fixtures and helpers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def debug_java(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> KafkaJava:
    """Kafka's tools with the client's DEBUG log on stderr."""
    log4j2 = tmp_path_factory.mktemp("kafka4-java") / "log4j2-debug.properties"
    log4j2.write_text(_DEBUG_LOG4J2)
    return KafkaJava(log4j2, kafka_cluster.bootstrap, None)


@pytest.fixture(scope="module")
def real_ports(kafka_cluster: LocalKafka) -> set[int]:
    """Every port the real nodes listen on: client, inter-broker and controller listeners."""
    assert kafka_cluster.workdir is not None
    ports: set[int] = set()
    for node in kafka_cluster.node_ids:
        props = (kafka_cluster.workdir / f"node-{node}" / "server.properties").read_text()
        (listeners,) = re.findall(r"^listeners=(.*)$", props, re.MULTILINE)
        ports |= {int(port) for port in re.findall(r":(\d+)(?:,|$)", listeners)}
    assert len(ports) >= 3 * len(kafka_cluster.node_ids), ports
    return ports


def assert_no_real_address(text: str, real_ports: set[int], what: str) -> None:
    leaked = sorted(port for port in real_ports if re.search(rf"(?<![\d.])127\.0\.0\.1:{port}(?!\d)", text)
                    or re.search(rf"\blocalhost:{port}(?!\d)", text))
    assert not leaked, f"{what} learned real addresses (ports {leaked})"


def assert_connections_through_proxy(log: str, proxy: RunningProxy, node_ids: list[int]) -> set[int]:
    """Every node the Java client connected to is the proxy's listener for it; returns the node ids."""
    opened = re.findall(r"Initiating connection to node ([\w.]+):(\d+) \(id: (-?\d+)", log)
    assert opened, "the client log names no connection (is DEBUG logging on?)"
    nodes = set()
    for host, port, node in opened:
        node_id = int(node)
        if node_id in node_ids:
            assert (host, int(port)) == ("127.0.0.1", proxy.node_port(node_id)), (host, port, node)
            nodes.add(node_id)
        else:  # the bootstrap entry (-1) or a coordinator (2**31 - 1 - id): a proxy port too
            assert int(port) in {proxy.port, *(proxy.node_port(n) for n in node_ids)}, (host, port, node)
    return nodes


def create_topic(bootstrap: str, name: str, partitions: int = PARTITIONS,
                 replica_assignment: list[list[int]] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if replica_assignment:
        topic = NewTopic(name, len(replica_assignment), replica_assignment=replica_assignment)
    else:
        topic = NewTopic(name, partitions, 3)
    admin.create_topics([topic])[name].result(30)
    wait_for_topic_on_every_broker(bootstrap, name, len(replica_assignment or [None] * partitions))


def produce(bootstrap: str, topic: str, values: range) -> None:
    """Keyed records (spread over every partition), acks=all, through the proxy."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    for value in values:
        producer.produce(topic, key=f"k{value}", value=str(value))
    assert producer.flush(30) == 0


def share_from_earliest(bootstrap: str, group: str) -> None:
    """A share group starts at the log end by default; these tests read what was produced before."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[
        ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([resource])[resource].result(30)


def values(stdout: str) -> list[int]:
    return [int(line) for line in stdout.splitlines() if line.strip().isdigit()]


def ok(done: subprocess.CompletedProcess[bytes]) -> tuple[str, str]:
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 0, f"{done.args[-10:]} exited with {done.returncode}:\n{stderr[-4000:]}"
    return done.stdout.decode(errors="replace"), stderr


def sent_requests(log: str) -> set[str]:
    return set(re.findall(r"Sending ([A-Z_]+) request with header", log))


# -- what the proxy offers ------------------------------------------------------------------------


def _listed_ranges(out: str) -> list[dict[int, tuple[int, int]]]:
    """BrokerApiVersionsCommand's listing: per broker, each usable API's (min, max)."""
    return [{int(key): (int(low), int(high or low))
             for key, low, high in re.findall(r"\((\d+)\): (\d+)(?: to (\d+))? \[usable: \d+\]", block)}
            for block in out.split(" -> (")[1:]]


def test_every_kafka4_group_api_is_offered_as_the_brokers_offer_it(kafka_java: KafkaJava,
                                                                   kafka_cluster: LocalKafka,
                                                                   proxy: RunningProxy) -> None:
    direct = _listed_ranges(ok(kafka_java.run(JAVA_BROKER_API_VERSIONS, "--bootstrap-server",
                                              kafka_cluster.bootstrap))[0])
    proxied = _listed_ranges(ok(kafka_java.run(JAVA_BROKER_API_VERSIONS, "--bootstrap-server",
                                               proxy.bootstrap))[0])
    assert len(proxied) == len(direct) == len(kafka_cluster.node_ids)
    for broker, seen in zip(direct, proxied, strict=True):
        for key, name in KAFKA4_KEYS.items():
            assert key in broker, f"the brokers do not offer {name}: the test proves nothing"
            low, high = broker[key]
            offered = offered_range(key)
            if offered is not None:  # read by hand for addresses: only the versions the reader knows
                low, high = max(low, offered[0]), min(high, offered[1])
            assert seen.get(key) == (low, high), f"{name}({key}): {seen.get(key)} through the proxy"
        # every key the brokers offer is usable through the proxy (some in fewer versions)
        assert set(seen) == set(broker)


def _schema(zf: zipfile.ZipFile, name: str) -> dict[str, Any]:
    """One schema file (Kafka's JSON has // comment lines)."""
    text = re.sub(r"^\s*//.*$", "", zf.read(name).decode(), flags=re.MULTILINE)
    schema: dict[str, Any] = json.loads(text)
    return schema


def _fields_with_addresses(fields: list[dict[str, Any]], path: str = "") -> list[str]:
    found = []
    names = {f["name"] for f in fields}
    if {"Host", "Port"} <= names:
        found.append(path or "/")
    for f in fields:
        found += _fields_with_addresses(f.get("fields", []), f"{path}/{f['name']}")
    return found


def test_every_response_naming_a_broker_is_rewritten() -> None:
    """Read Kafka 4.3.1's own schemas: any response a broker sends that holds a Host and a Port is
    one the proxy rewrites (from the right version on), or one whose addresses are not brokers'."""
    (jar,) = [p for p in ensure_kafka_jars().glob("kafka-clients-*.jar")]
    with zipfile.ZipFile(jar) as zf:
        schemas = [_schema(zf, n) for n in zf.namelist()
                   if n.startswith("common/message/") and n.endswith(".json")]
    requests = {s["apiKey"]: s for s in schemas if s.get("type") == "request"}
    checked = []
    for response in (s for s in schemas if s.get("type") == "response"):
        key = response["apiKey"]
        structs = response.get("fields", []) + [
            {"name": c["name"], "fields": c["fields"]} for c in response.get("commonStructs", [])]
        paths = _fields_with_addresses(structs)
        if not paths:
            continue
        name = response["name"].removesuffix("Response")
        if "broker" not in (requests[key].get("listeners") or []):
            assert name in CONTROLLER_ONLY, f"{name} is served by brokers only now: rewrite its {paths}"
            continue
        checked.append(name)
        if key in NOT_BROKER_ADDRESSES:
            continue
        assert key in ADDRESS_BEARING, f"{name} ({key}) names hosts at {paths} and is not rewritten"
    assert {"Metadata", "FindCoordinator", "DescribeCluster", "Produce", "Fetch", "ShareFetch",
            "ShareAcknowledge", "DescribeQuorum"} <= set(checked), checked


# -- KIP-848 consumer groups -------------------------------------------------------------------------


def test_kip848_java_consumer_group_reads_every_record_once(debug_java: KafkaJava, proxy: RunningProxy,
                                                            kafka_cluster: LocalKafka,
                                                            real_ports: set[int]) -> None:
    topic = topic_name("k4-848-java")
    create_topic(proxy.bootstrap, topic)
    produce(proxy.bootstrap, topic, range(COUNT))
    out, log = ok(debug_java.run(
        JAVA_CONSOLE_CONSUMER, "--bootstrap-server", proxy.bootstrap, "--topic", topic,
        "--group", topic_name("k4-848-java"), "--from-beginning", "--max-messages", str(COUNT),
        "--timeout-ms", "30000", "--command-property", "group.protocol=consumer"))
    assert sorted(values(out)) == list(range(COUNT))
    assert "CONSUMER_GROUP_HEARTBEAT" in sent_requests(log), "the consumer did not use KIP-848"
    assert {"JOIN_GROUP", "SYNC_GROUP"}.isdisjoint(sent_requests(log))
    assert assert_connections_through_proxy(log, proxy, kafka_cluster.node_ids) == set(kafka_cluster.node_ids)
    assert_no_real_address(out + log, real_ports, "the Java KIP-848 consumer")


def test_kip848_librdkafka_consumer_group_reads_every_record_once(proxy: RunningProxy,
                                                                  kafka_cluster: LocalKafka,
                                                                  real_ports: set[int]) -> None:
    topic, group = topic_name("k4-848-rd"), topic_name("k4-848-rd")
    create_topic(proxy.bootstrap, topic)
    produce(proxy.bootstrap, topic, range(COUNT))
    consumer = RdConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": group,
                           "group.protocol": "consumer", "auto.offset.reset": "earliest"})
    seen: list[int] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(seen) < COUNT and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None:
                assert message.error() is None, message.error()
                seen.append(int(message.value() or b""))
        for _ in range(3):  # a little past the end: a duplicate would show
            message = consumer.poll(0.5)
            assert message is None or message.error() is not None, "a record came twice"
        brokers = consumer.list_topics(topic, timeout=10).brokers
    finally:
        consumer.close()
    assert sorted(seen) == list(range(COUNT))
    assert {(b.id, b.host, b.port) for b in brokers.values()} == {
        (n, "127.0.0.1", proxy.node_port(n)) for n in kafka_cluster.node_ids}
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    described = admin.describe_consumer_groups([group])[group].result(30)  # ConsumerGroupDescribe (69)
    assert described.type == ConsumerGroupType.CONSUMER
    assert_no_real_address(str(brokers), real_ports, "librdkafka")


# -- KIP-932 share groups ------------------------------------------------------------------------


@pytest.fixture
def share_consumer_run(debug_java: KafkaJava, tmp_path: Path) -> Iterator[list[Any]]:
    """Java share consumers started by a test, stopped (by their pid) at its end."""
    started: list[Any] = []
    yield started
    for process, *_files in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_share_group_java_reads_every_record_once_across_a_leader_move(
        debug_java: KafkaJava, proxy: RunningProxy, kafka_cluster: LocalKafka, real_ports: set[int],
        share_consumer_run: list[Any], tmp_path: Path) -> None:
    """The leader moves while the share consumer fetches: the old leader answers ShareFetch with
    NOT_LEADER_OR_FOLLOWER and the new leader's NodeEndpoints, which the proxy rewrites."""
    first, second = kafka_cluster.node_ids[0], kafka_cluster.node_ids[1]
    topic, group = topic_name("k4-share"), topic_name("k4-share")
    others = [n for n in kafka_cluster.node_ids if n not in (first, second)]
    create_topic(proxy.bootstrap, topic, replica_assignment=[[first, second, *others]])
    share_from_earliest(proxy.bootstrap, group)
    produce(proxy.bootstrap, topic, range(100))
    out_path, log_path = tmp_path / "share.out", tmp_path / "share.log"
    with out_path.open("wb") as out_file, log_path.open("wb") as log_file:
        process = subprocess.Popen(debug_java.command(
            JAVA_CONSOLE_SHARE_CONSUMER, "--bootstrap-server", proxy.bootstrap, "--topic", topic,
            "--group", group, "--max-messages", "200", "--timeout-ms", "60000"),
            stdout=out_file, stderr=log_file, stdin=subprocess.DEVNULL)
    share_consumer_run.append((process,))

    def consumed(count: int) -> None:
        deadline = time.monotonic() + 60
        while len(values(out_path.read_text())) < count:
            assert process.poll() is None or len(values(out_path.read_text())) >= count, (
                f"the share consumer exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"only {len(values(out_path.read_text()))} of {count} read"
            time.sleep(0.2)

    consumed(100)
    plan = tmp_path / "reassign.json"
    plan.write_text(json.dumps({"version": 1, "partitions": [
        {"topic": topic, "partition": 0, "replicas": [second, first, *others]}]}))
    ok(debug_java.run(JAVA_REASSIGN_PARTITIONS, "--bootstrap-server", proxy.bootstrap,
                      "--reassignment-json-file", str(plan), "--execute"))
    ok(debug_java.run(JAVA_LEADER_ELECTION, "--bootstrap-server", proxy.bootstrap, "--election-type",
                      "PREFERRED", "--topic", topic, "--partition", "0"))
    produce(proxy.bootstrap, topic, range(100, 200))
    consumed(200)
    assert process.wait(timeout=60) == 0
    got, log = values(out_path.read_text()), log_path.read_text(errors="replace")
    assert sorted(got) == list(range(200)), "each record exactly once"
    assert {"SHARE_GROUP_HEARTBEAT", "SHARE_FETCH"} <= sent_requests(log)
    moved = re.search(rf"{topic}-0, received error NOT_LEADER_OR_FOLLOWER, with leaderIdAndEpoch "
                      rf"LeaderIdAndEpoch\(leaderId={second},", log)
    assert moved, "the leader move never reached the share consumer (test proves nothing)"
    assert f"For {topic}-0 updating leader information" in log
    assert second in assert_connections_through_proxy(log, proxy, kafka_cluster.node_ids)
    assert_no_real_address(log, real_ports, "the Java share consumer")


def test_share_group_librdkafka_reads_every_record_once(proxy: RunningProxy) -> None:
    topic, group = topic_name("k4-share-rd"), topic_name("k4-share-rd")
    create_topic(proxy.bootstrap, topic)
    share_from_earliest(proxy.bootstrap, group)
    produce(proxy.bootstrap, topic, range(COUNT))
    consumer = ShareConsumer({"bootstrap.servers": proxy.bootstrap, "group.id": group})
    seen: list[int] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(seen) < COUNT and time.monotonic() < deadline:
            for message in consumer.poll(1.0) or []:
                assert message.error() is None, message.error()
                seen.append(int(message.value() or b""))
        assert not consumer.poll(1.0), "a record came twice"
    finally:
        consumer.close()
    assert sorted(seen) == list(range(COUNT))


# -- DescribeQuorum ------------------------------------------------------------------------------------


def test_metadata_quorum_tool_learns_no_controller_address(debug_java: KafkaJava, proxy: RunningProxy,
                                                           kafka_cluster: LocalKafka,
                                                           real_ports: set[int]) -> None:
    direct, _ = ok(debug_java.run(JAVA_METADATA_QUORUM_COMMAND, "--bootstrap-server", kafka_cluster.bootstrap,
                                  "describe", "--status"))
    controllers = {int(p) for p in re.findall(r"CONTROLLER://127\.0\.0\.1:(\d+)", direct)}
    assert len(controllers) == len(kafka_cluster.node_ids), f"the brokers name their controllers:\n{direct}"
    assert controllers <= real_ports

    status, log = ok(debug_java.run(JAVA_METADATA_QUORUM_COMMAND, "--bootstrap-server", proxy.bootstrap,
                                    "describe", "--status"))
    voters = re.search(r"^CurrentVoters:\s+(.*)$", status, re.MULTILINE)
    assert voters, status
    assert sorted(int(v) for v in re.findall(r'"id": (\d+)', voters[1])) == kafka_cluster.node_ids
    assert "endpoints" not in status
    assert "DESCRIBE_QUORUM" in sent_requests(log)
    replication, log2 = ok(debug_java.run(JAVA_METADATA_QUORUM_COMMAND, "--bootstrap-server", proxy.bootstrap,
                                          "describe", "--replication"))
    assert len(re.findall(r"^\d+\s", replication, re.MULTILINE)) == len(kafka_cluster.node_ids), replication
    assert_no_real_address(status + log + replication + log2, real_ports, "kafka-metadata-quorum")
    for port in controllers:
        assert str(port) not in status + replication
