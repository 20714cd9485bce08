"""KIP-511's client software name and version from ApiVersions v3+ requests (protocol/client_software.py)."""

from __future__ import annotations

from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest

from protocol.apis import ApiKey
from protocol.client_software import ClientSoftware, read_client_software
from protocol.connection import ProxyConnection
from protocol.headers import encode_request_header, parse_request_header

from .wire import advertise, body, framed, request, tagged_section, to_broker


def _read(frame: bytes) -> ClientSoftware | None:
    return read_client_software(frame, parse_request_header(frame))


def test_v3_and_v4_name_and_version() -> None:
    for version in (3, 4):
        frame = request(ApiVersionsRequest, version, 1, "rdkafka",
                        client_software_name="confluent-kafka-python",
                        client_software_version="2.6.1-rdkafka-2.6.1")
        assert _read(frame) == ("confluent-kafka-python", "2.6.1-rdkafka-2.6.1")


def test_before_v3_there_is_none() -> None:
    for version in (0, 1, 2):
        assert _read(request(ApiVersionsRequest, version, 1)) is None


def test_other_apis_are_not_read() -> None:
    assert _read(request(MetadataRequest, 1, 7, topics=[])) is None


def test_header_tagged_fields_before_the_body() -> None:
    msg_body = body(ApiVersionsRequest, 3, client_software_name="apache-kafka-java",
                    client_software_version="4.3.1")
    plain = encode_request_header(ApiKey.API_VERSIONS, 3, 42, "java")
    frame = plain[:-1] + tagged_section({0: b"trace"}) + msg_body
    assert _read(frame) == ("apache-kafka-java", "4.3.1")


def test_control_characters_come_back_as_sent() -> None:
    """The parse reports what the client said; escaping is for whoever shows it (JSON, top)."""
    frame = request(ApiVersionsRequest, 3, 1, client_software_name="evil\x1b[2J",
                    client_software_version="1\n")
    assert _read(frame) == ("evil\x1b[2J", "1\n")


def test_a_body_that_does_not_parse_is_none() -> None:
    frame = request(ApiVersionsRequest, 3, 1, client_software_name="name", client_software_version="1.0")
    header = parse_request_header(frame)
    truncated = frame[:header.body_offset + 3]
    assert _read(truncated) is None
    # a compact string whose length runs past the frame
    assert _read(frame[:header.body_offset] + b"\x7fab") is None


def test_a_version_above_the_schemas_is_none() -> None:
    header = parse_request_header(request(ApiVersionsRequest, 3, 1, client_software_name="a",
                                          client_software_version="1"))
    assert read_client_software(b"", header._replace(api_version=99)) is None


def test_the_connection_keeps_what_its_client_named() -> None:
    conn = ProxyConnection(advertise, name="test")
    assert conn.client_software is None
    first = request(ApiVersionsRequest, 3, 1, "cli", client_software_name="apache-kafka-java",
                    client_software_version="4.3.1")
    actions = conn.receive_from_client(framed(first))
    assert to_broker(actions) == framed(first), "forwarded unchanged"
    assert conn.client_software == ClientSoftware("apache-kafka-java", "4.3.1")
    # a later v0 ApiVersions (no software) or a broken one does not forget it
    conn.receive_from_client(framed(request(ApiVersionsRequest, 0, 2, "cli")))
    assert conn.client_software == ClientSoftware("apache-kafka-java", "4.3.1")


def test_a_broken_body_is_forwarded_not_closed() -> None:
    """The broker, not the proxy, answers a bad ApiVersions body (INVALID_REQUEST)."""
    conn = ProxyConnection(advertise, name="test")
    frame = request(ApiVersionsRequest, 3, 1, client_software_name="name", client_software_version="1.0")
    broken = frame[:parse_request_header(frame).body_offset] + b"\x7fab"
    actions = conn.receive_from_client(framed(broken))
    assert to_broker(actions) == framed(broken)
    assert conn.closed is None and conn.client_software is None
