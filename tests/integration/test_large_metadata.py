"""A Metadata answer naming thousands of topics, through the proxy: the broker's own bytes, only the
broker addresses changed (issue 10, item 6: the proxy rewrites the brokers array and copies the rest).

The same broker is asked directly and through the proxy's port for it, with the same correlation id,
so the two answers can be compared byte for byte. Everything after the brokers array must be identical;
the brokers must be the same node ids and racks at the proxy's addresses.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
from kafka import KafkaAdminClient
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from harness.local_kafka import LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import topic_name, wait_until
from .proxies import RunningProxy

TOPICS = 2_000
#: Topics per CreateTopics request: 500 took about 1.5 s on a busy 2-core machine.
CREATE_BATCH = 500
ADMIN_TIMEOUT_MS = 60_000
#: v4 is the oldest Metadata version Kafka 4 still answers (KIP-896), v9 the first flexible one,
#: v12 the newest kafka-python clients use, v13 adds the top-level error code.
VERSIONS = (4, 9, 12, 13)
#: Attempts at a direct, proxied, direct triple whose two direct answers agree (no topic came or went
#: between them, e.g. a deletion of an earlier test still being applied).
STABLE_ATTEMPTS = 5
CORRELATION_ID = 4242
SOCKET_TIMEOUT_S = 30.0


def _metadata_frame(address: tuple[str, int], version: int) -> bytes:
    """The whole response frame (header and body, no size prefix) to a Metadata request for all topics."""
    request = MetadataRequest[version](topics=None, allow_auto_topic_creation=False,
                                       include_cluster_authorized_operations=False,
                                       include_topic_authorized_operations=False)
    payload = encode_request_header(3, version, CORRELATION_ID, "large-metadata") + bytes(request.encode())
    with socket.create_connection(address, timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(frame(payload))
        size = struct.unpack(">i", _recv_exact(sock, 4))[0]
        return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes (MSG_WAITALL may return fewer on a socket with a timeout)."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} response bytes")
        data += chunk
    return bytes(data)


def _header_size(version: int) -> int:
    return 5 if version >= 9 else 4  # correlation id, then (flexible versions) empty header tags


def _decode(data: bytes, version: int) -> MetadataResponse:
    return MetadataResponse.decode(data[_header_size(version):], version=version)


def _encode(message: MetadataResponse) -> bytes:
    return bytes(message.encode())


def _without_controller(data: bytes, version: int) -> bytes:
    """The answer with its controller id set to -1: a KRaft broker names a random live broker as the
    "controller" in each Metadata answer, so two answers of one broker differ there and only there."""
    message = _decode(data, version)
    message.controller_id = -1
    return data[: _header_size(version)] + _encode(message)


@pytest.fixture(scope="module")
def many_topics(kafka_cluster: LocalKafka) -> Iterator[list[str]]:
    """TOPICS topics of one partition and one replica, created through the brokers directly."""
    prefix = topic_name("large-metadata")
    names = [f"{prefix}-{i:05d}" for i in range(TOPICS)]
    admin = KafkaAdminClient(bootstrap_servers=kafka_cluster.bootstrap, client_id="large-metadata-admin")
    try:
        for start in range(0, TOPICS, CREATE_BATCH):
            batch = names[start : start + CREATE_BATCH]
            admin.create_topics({name: {"num_partitions": 1, "replication_factor": 1} for name in batch},
                                timeout_ms=ADMIN_TIMEOUT_MS)
        yield names
    finally:
        for start in range(0, TOPICS, CREATE_BATCH):
            admin.delete_topics(names[start : start + CREATE_BATCH], timeout_ms=ADMIN_TIMEOUT_MS,
                                raise_errors=False)
        admin.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_all_topic_metadata_is_the_brokers_answer_with_proxy_addresses(
        version: int, kafka_cluster: LocalKafka, proxy: RunningProxy, many_topics: list[str]) -> None:
    broker = kafka_cluster.broker_address(1)
    through_proxy = ("127.0.0.1", proxy.node_port(1))
    wanted = set(many_topics)

    def knows_every_topic() -> bool:
        return wanted <= {t.name for t in _decode(_metadata_frame(broker, version), version).topics}

    wait_until(knows_every_topic, 60, f"broker 1 to list all {TOPICS} topics")
    for _ in range(STABLE_ATTEMPTS):
        direct = _metadata_frame(broker, version)
        proxied = _metadata_frame(through_proxy, version)
        again = _metadata_frame(broker, version)
        if _without_controller(again, version) == _without_controller(direct, version):
            break
    else:
        pytest.fail(f"broker 1's metadata changed between every pair of {STABLE_ATTEMPTS} requests")

    header = _header_size(version)
    answer = _decode(direct, version)
    rewritten = _decode(proxied, version)
    # kafka-python re-encodes the broker's answer exactly, so it can say what the bytes must be.
    assert direct[header:] == _encode(answer)
    assert len(answer.topics) >= TOPICS
    # The brokers: same node ids and racks, in the same order, each at the proxy's port for it.
    assert [(b.node_id, b.rack) for b in rewritten.brokers] == [(b.node_id, b.rack) for b in answer.brokers]
    assert sorted(b.node_id for b in answer.brokers) == kafka_cluster.node_ids
    real = {(b.host, b.port) for b in answer.brokers}
    for b in rewritten.brokers:
        assert (b.host, b.port) == ("127.0.0.1", proxy.node_port(b.node_id))
        assert (b.host, b.port) not in real

    # Everything else byte for byte: the correlation id and throttle time before the array, and after
    # it cluster id, every topic and the tagged fields; the controller id is the proxied answer's own
    # (see _without_controller). The direct answer encoded with no brokers gives the tail.
    assert rewritten.controller_id in kafka_cluster.node_ids
    answer.brokers = []
    answer.controller_id = rewritten.controller_id
    before = header + (4 if version >= 3 else 0)
    empty_array = 1 if version >= 9 else 4
    tail = _encode(answer)[before - header + empty_array :]
    assert direct[:before] == proxied[:before]
    assert proxied.endswith(tail)
    # Nothing else slipped in: the proxied answer is its header, its brokers array and that tail.
    assert proxied[header:] == _encode(rewritten)
