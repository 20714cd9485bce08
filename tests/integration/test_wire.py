"""The proxy on the wire, with a raw socket: ApiVersions, pipelining, and bad input."""

from __future__ import annotations

import socket
import struct
import uuid

from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest, MetadataResponse

from protocol.api_versions import offered_range
from protocol.apis import KNOWN_APIS
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import acks0_produce_body, landed_on_partition_0, wait_for_topic_on_every_broker


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    return exactly(struct.unpack(">i", exactly(4))[0])


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _api_versions(sock: socket.socket, version: int, correlation_id: int) -> ApiVersionsResponse:
    body = ApiVersionsRequest[version](client_software_name="raw", client_software_version="1").encode() \
        if version >= 3 else ApiVersionsRequest[version]().encode()
    sock.sendall(frame(encode_request_header(18, version, correlation_id, "raw") + bytes(body)))
    response = _read_frame(sock)
    assert struct.unpack(">i", response[:4])[0] == correlation_id
    return ApiVersionsResponse.decode(response[4:], version=version)  # header v0 always


def test_api_versions_are_clamped_to_known_schemas_and_opaque_keys_pass(proxy, kafka_cluster):
    with socket.create_connection(kafka_cluster.bootstrap.split(",")[0].split(":"), timeout=15) as direct:
        broker = {a.api_key: (a.min_version, a.max_version) for a in _api_versions(direct, 3, 1).api_keys}
    with _connect(proxy.port) as sock:
        answer = _api_versions(sock, 3, 7)
    assert answer.error_code == 0
    proxied = {a.api_key: (a.min_version, a.max_version) for a in answer.api_keys}
    assert proxied, "empty ApiVersions answer"
    unknown = set(broker) - set(KNOWN_APIS)
    assert unknown, "the broker advertises no API the proxy lacks a schema for (test would prove nothing)"
    assert unknown <= set(proxied), f"opaque keys not advertised: {sorted(unknown - set(proxied))}"
    for key, (low, high) in proxied.items():
        offered = offered_range(key)
        if offered is None:  # forwarded opaque: the broker's own range
            assert (low, high) == broker[key]
            continue
        assert (low, high) == (max(broker[key][0], offered[0]), min(broker[key][1], offered[1]))
    # Fetch as far as the brokers go: v16+ responses stream too, their NodeEndpoints rewritten
    assert proxied[1][1] == broker[1][1] >= 16, (proxied[1], broker[1])


def test_api_versions_newer_than_proxy_gets_unsupported_version(proxy):
    newest = KNOWN_APIS[18].max_version
    with _connect(proxy.port) as sock:
        # A newer client: header v2 (flexible), a version the proxy has no schema for, a body it
        # cannot know. The proxy must answer without parsing that body.
        header = encode_request_header(18, newest, 1, "raw")
        future_body = bytes(ApiVersionsRequest[newest](client_software_name="raw",
                                                       client_software_version="9").encode())
        sock.sendall(frame(header[:2] + struct.pack(">h", newest + 1) + header[4:] + future_body))
        response = _read_frame(sock)
        refusal = ApiVersionsResponse.decode(response[4:], version=0)
        assert refusal.error_code == 35
        assert [(a.api_key, a.max_version) for a in refusal.api_keys] == [(18, newest)]
        # The client downgrades on the same connection, as Kafka clients do.
        assert _api_versions(sock, newest, 2).error_code == 0


def test_pipelined_requests_answered_in_order(proxy):
    version = 12
    with _connect(proxy.port) as sock:
        requests = b"".join(
            frame(encode_request_header(3, version, cid, "pipeline")
                  + bytes(MetadataRequest[version](topics=[], allow_auto_topic_creation=False,
                                                   include_topic_authorized_operations=False).encode()))
            for cid in range(100, 150)
        )
        sock.sendall(requests)
        ids = []
        for _ in range(50):
            response = _read_frame(sock)
            ids.append(struct.unpack(">i", response[:4])[0])
            metadata = MetadataResponse.decode(response[5:], version=version)
            assert all(b.port == proxy.port + 1 + b.node_id for b in metadata.brokers)
    assert ids == list(range(100, 150))


BAD_INPUTS = {
    "garbage": b"\x00\x00\x00\x10" + b"\xde\xad\xbe\xef" * 4,  # api key -8531
    "oversized": struct.pack(">i", 200 * 1024 * 1024) + b"x" * 100,
    "negative size": struct.pack(">i", -5),
    "truncated header": struct.pack(">i", 6) + b"\x00\x03\x00\x0c\x00\x00",
    "client id past end": struct.pack(">i", 12) + b"\x00\x03\x00\x0c\x00\x00\x00\x01\x00\x40ab",
}

REASONS = {
    "oversized": "size 209715200",
    "negative size": "size -5",
    "truncated header": "at least 10 bytes",
    "client id past end": "runs past the end",
}


def test_bad_frames_close_only_that_connection(proxy):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    assert admin.list_topics(timeout=10).brokers
    with _connect(proxy.port) as healthy:
        assert _api_versions(healthy, 3, 1).error_code == 0
        for name, data in BAD_INPUTS.items():
            with _connect(proxy.port) as sock:
                sock.sendall(data)
                # Garbage with an unknown API key is forwarded as is (the proxy cannot judge it);
                # the broker closes that connection and the proxy follows. The rest it refuses itself.
                assert _closed_by_peer(sock), f"{name}: the proxy kept the connection open"
            if name in REASONS:
                proxy.wait_for_log(REASONS[name])
        # The other connection and new ones are untouched.
        assert _api_versions(healthy, 3, 2).error_code == 0
    assert admin.list_topics(timeout=10).brokers
    assert proxy.alive()


def test_oversized_frame_is_refused_before_it_is_buffered(proxy):
    """The size prefix alone is enough to refuse: the proxy does not wait for 200 MB."""
    with _connect(proxy.port) as sock:
        sock.sendall(struct.pack(">i", 200 * 1024 * 1024))
        assert _closed_by_peer(sock, timeout=10)


def test_acks0_sent_just_before_closing_is_not_lost(proxy):
    """A client may send an acks=0 Produce and leave before the proxy's broker connection is up:
    what it sent must still reach the broker (it has no other chance)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"acks0-close-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    wait_for_topic_on_every_broker(proxy.bootstrap, topic, 1)
    leader = admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    body = acks0_produce_body(topic, b"v" * 100)
    connections = 40
    for cid in range(connections):
        with _connect(proxy.node_port(leader)) as sock:
            sock.sendall(frame(encode_request_header(0, 9, cid, "acks0-close") + body))
    landed = landed_on_partition_0(proxy.bootstrap, topic, connections, 30)
    assert landed == connections, f"{connections - landed} of {connections} acks=0 records were lost"
