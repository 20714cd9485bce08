"""Fetch v16+ through `kthrottle run`: large responses stream, and their NodeEndpoints name the proxy.

The session's 3 brokers (Kafka 4.3.1) answer Fetch up to v18, and the proxy now offers it: the
Java consumer from the fetched jars reads records large enough that every response streams
(above STREAM_MIN_BYTES), and a raw Fetch v17 sent to a broker that just lost a partition's
leadership gets, through the proxy, a streamed response whose KIP-951 NodeEndpoints name only
proxy listeners, while the same request sent to the broker directly names the real one.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka.protocol.consumer import FetchRequest, FetchResponse
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from harness.local_kafka import LocalKafka
from protocol.connection import STREAM_MIN_BYTES
from protocol.fetch_stream import FETCH_STREAM_VERSIONS
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import recv_exact, topic_name, wait_for_topic_on_every_broker, wait_until
from .conftest import JAVA_CONSOLE_CONSUMER, KafkaJava
from .proxies import RunningProxy
from .test_kafka4_apis import (
    JAVA_LEADER_ELECTION,
    JAVA_REASSIGN_PARTITIONS,
    assert_connections_through_proxy,
    assert_no_real_address,
    debug_java,
    ok,
    real_ports,
    sent_requests,
)

__all__ = ["debug_java", "real_ports"]  # fixtures shared with test_kafka4_apis

#: Records this large make every non-empty Fetch response stream (above STREAM_MIN_BYTES).
VALUE_BYTES = 100_000
COUNT = 240
#: NOT_LEADER_OR_FOLLOWER, FENCED_LEADER_EPOCH: the errors KIP-951 answers with NodeEndpoints.
LEADER_MOVED = (6, 74)
FETCH_VERSION = 17


def produce_large(bootstrap: str, topic: str, count: int, partitions: list[int]) -> None:
    """`count` records of VALUE_BYTES, record i to partitions[i % len], value `i:` then filler."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                         "compression.type": "none"})
    for i in range(count):
        value = f"{i}:".encode() + b"v" * (VALUE_BYTES - len(f"{i}:"))
        producer.produce(topic, value=value, partition=partitions[i % len(partitions)])
    assert producer.flush(60) == 0, "records still unsent after 60 s"


def test_java_consumer_reads_large_records_with_fetch_v16_plus(debug_java: KafkaJava, proxy: RunningProxy,
                                                               kafka_cluster: LocalKafka,
                                                               real_ports: set[int]) -> None:
    topic = topic_name("fetch-v16-java")
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(30)
    wait_for_topic_on_every_broker(kafka_cluster.bootstrap, topic, 3)
    produce_large(kafka_cluster.bootstrap, topic, COUNT, [0, 1, 2])
    out, log = ok(debug_java.run(
        JAVA_CONSOLE_CONSUMER, "--bootstrap-server", proxy.bootstrap, "--topic", topic, "--from-beginning",
        "--max-messages", str(COUNT), "--timeout-ms", "60000", timeout=180))
    lines = [line for line in out.splitlines() if line]
    got = sorted(int(line.split(":", 1)[0]) for line in lines)
    assert got == list(range(COUNT)), "each record exactly once"
    assert all(len(line) == VALUE_BYTES for line in lines), "a record came back cut or padded"
    versions = {int(v) for v in re.findall(r"apiKey=FETCH, apiVersion=(\d+)", log)}
    assert versions, "the client log names no Fetch request (is DEBUG logging on?)"
    assert min(versions) >= FETCH_STREAM_VERSIONS[0], f"the consumer fetched with v{sorted(versions)}"
    assert "FETCH" in sent_requests(log)
    assert_connections_through_proxy(log, proxy, kafka_cluster.node_ids)
    assert_no_real_address(log, real_ports, "the Java consumer")


# -- a leader change seen through a streamed Fetch v17 ---------------------------------------------------


def exchange(address: tuple[str, int], request: bytes) -> bytes:
    """One request on a fresh connection; the response frame (without its size prefix)."""
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(frame(request))
        (size,) = struct.unpack(">i", recv_exact(sock, 4))
        return recv_exact(sock, size)


def topic_metadata(address: tuple[str, int], topic: str) -> tuple[uuid.UUID, dict[int, int]]:
    """The topic's id and each partition's leader epoch, as the broker at `address` sees them."""
    v12 = MetadataRequest[12]
    request = v12(topics=[v12.MetadataRequestTopic(topic_id=None, name=topic)],
                  allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    body = exchange(address, encode_request_header(3, 12, 1, "fetch-v16") + bytes(request.encode()))
    (found,) = MetadataResponse.decode(body[5:], version=12).topics
    assert found.error_code == 0, found
    return uuid.UUID(str(found.topic_id)), {p.partition_index: p.leader_epoch for p in found.partitions}


def fetch_request(topic: uuid.UUID, epochs: dict[int, int], correlation_id: int) -> bytes:
    """Every partition of `epochs` from offset 0, with the leader epoch the client believes current."""
    R = FetchRequest[FETCH_VERSION]
    T = R.FetchTopic
    wanted = [T.FetchPartition(partition=p, current_leader_epoch=epoch, fetch_offset=0, last_fetched_epoch=-1,
                               log_start_offset=-1, partition_max_bytes=1_048_576)
              for p, epoch in epochs.items()]
    body = R(max_wait_ms=500, min_bytes=1, max_bytes=50_000_000, isolation_level=0, session_id=0,
             session_epoch=-1, topics=[T(topic_id=topic, partitions=wanted)], forgotten_topics_data=[],
             rack_id="")
    return encode_request_header(1, FETCH_VERSION, correlation_id, "fetch-v16") + bytes(body.encode())


def decode_exact(response: bytes) -> Any:
    """kafka-python's reading of a Fetch v17 response frame, refusing a byte left over."""
    R = FetchResponse[FETCH_VERSION]
    decode = R._struct.compiled_decode_from(FETCH_VERSION, compact=True, tagged=True, data_class=R[None])
    message, pos = decode(memoryview(response), 5)  # correlation id, header tagged fields
    assert pos == len(response), f"{len(response) - pos} bytes left after the response"
    return message


def partitions_of(message: Any) -> dict[int, Any]:
    return {p.partition_index: p for t in message.responses for p in t.partitions}


def leader_of(bootstrap: str, topic: str, partition: int) -> int:
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return int(metadata.topics[topic].partitions[partition].leader)


def test_leader_change_gives_a_streamed_fetch_only_proxy_addresses(
        debug_java: KafkaJava, proxy: RunningProxy, kafka_cluster: LocalKafka, real_ports: set[int],
        tmp_path: Path) -> None:
    old, new, *others = kafka_cluster.node_ids
    topic = topic_name("fetch-v16-move")
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    admin.create_topics([NewTopic(topic, 2, replica_assignment=[[old, new, *others], [old, new, *others]])])[
        topic].result(30)
    wait_for_topic_on_every_broker(kafka_cluster.bootstrap, topic, 2)
    produce_large(kafka_cluster.bootstrap, topic, 20, [0, 1])
    real = {b.id: (b.host, b.port) for b in admin.list_topics(timeout=10).brokers.values()}
    ident, epochs = topic_metadata(real[old], topic)
    # Partition 1's leadership moves from `old` to `new`, by Kafka's own tools and not through the proxy.
    plan = tmp_path / "reassign.json"
    plan.write_text(json.dumps({"version": 1, "partitions": [
        {"topic": topic, "partition": 1, "replicas": [new, old, *others]}]}))
    ok(debug_java.run(JAVA_REASSIGN_PARTITIONS, "--bootstrap-server", kafka_cluster.bootstrap,
                      "--reassignment-json-file", str(plan), "--execute"))
    ok(debug_java.run(JAVA_LEADER_ELECTION, "--bootstrap-server", kafka_cluster.bootstrap, "--election-type",
                      "PREFERRED", "--topic", topic, "--partition", "1"))
    wait_until(lambda: leader_of(kafka_cluster.bootstrap, topic, 1) == new, 30,
               f"broker {new} to lead {topic}-1")


    def moved_answer(address: tuple[str, int]) -> bytes:
        """The old leader's answer to a client that still believes it leads partition 1 (the epoch
        from before the move): partition 0's records, partition 1 refused with the new leader (it
        may take the old leader a moment to apply the election)."""
        answer = b""

        def answered() -> bool:
            nonlocal answer
            answer = exchange(address, fetch_request(ident, epochs, 7))
            return partitions_of(decode_exact(answer))[1].error_code in LEADER_MOVED

        wait_until(answered, 30, f"broker {old} to refuse {topic}-1 as no longer its leader")
        return answer

    direct = moved_answer(real[old])
    direct_message = decode_exact(direct)
    assert [(e.node_id, e.host, e.port) for e in direct_message.node_endpoints] == [(new, *real[new])], \
        "the broker sent no NodeEndpoints for the new leader (the test would prove nothing)"
    assert len(direct) >= STREAM_MIN_BYTES, "the response is too small to be streamed by the proxy"

    through = moved_answer(("127.0.0.1", proxy.node_port(old)))
    message = decode_exact(through)
    assert [(e.node_id, e.host, e.port) for e in message.node_endpoints] == \
        [(new, "127.0.0.1", proxy.node_port(new))]
    moved = partitions_of(message)[1]
    assert moved.current_leader.leader_id == new
    assert bytes(partitions_of(message)[0].records) == bytes(partitions_of(direct_message)[0].records)
    assert len(through) >= STREAM_MIN_BYTES, "the answer through the proxy was not streamed"
    assert_no_real_address(str(message.node_endpoints), real_ports, "the streamed response's NodeEndpoints")
    assert proxy.alive()
