"""Request and response header readers, and the API table that decides header versions."""

from __future__ import annotations

import pytest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest
from kafka.protocol.producer import ProduceRequest

from protocol.apis import KNOWN_APIS, ApiKey, api_name
from protocol.errors import MalformedHeader, ProtocolError
from protocol.headers import (
    check_request_api,
    encode_request_header,
    encode_response_header,
    parse_request_header,
    read_uvarint,
    response_body_offset,
    response_correlation_id,
    skip_tagged_fields,
)

from .wire import body, request, tagged_section, uvarint

# -- the API table ------------------------------------------------------------------------------


def test_known_apis_come_from_kafka_python_schemas() -> None:
    metadata = KNOWN_APIS[ApiKey.METADATA]
    assert metadata.name == "Metadata"
    assert metadata.request_class is MetadataRequest
    assert (metadata.min_version, metadata.max_version) == MetadataRequest.valid_versions
    assert metadata.first_flexible_version == 9
    assert KNOWN_APIS[ApiKey.SASL_HANDSHAKE].first_flexible_version is None
    assert api_name(ApiKey.PRODUCE) == "Produce"
    assert api_name(9999) == "Unknown(9999)"
    assert 9999 not in KNOWN_APIS


@pytest.mark.parametrize(("key", "version", "request_header", "response_header"), [
    (ApiKey.METADATA, 8, 1, 0),
    (ApiKey.METADATA, 9, 2, 1),
    (ApiKey.PRODUCE, 8, 1, 0),
    (ApiKey.PRODUCE, 9, 2, 1),
    (ApiKey.SASL_HANDSHAKE, 1, 1, 0),
    (ApiKey.API_VERSIONS, 2, 1, 0),
    (ApiKey.API_VERSIONS, 3, 2, 0),  # KIP-511: ApiVersions responses keep header v0
    (ApiKey.DESCRIBE_CLUSTER, 0, 2, 1),
])
def test_header_versions(key: int, version: int, request_header: int, response_header: int) -> None:
    spec = KNOWN_APIS[key]
    assert spec.request_header_version(version) == request_header
    assert spec.response_header_version(version) == response_header


# -- varints and tagged fields ----------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2**28 - 1, 2**31 - 1])
def test_read_uvarint_round_trip(value: int) -> None:
    data = b"\xaa" + uvarint(value) + b"\xbb"
    assert read_uvarint(data, 1) == (value, len(data) - 1)


def test_read_uvarint_truncated() -> None:
    with pytest.raises(MalformedHeader, match="truncated varint"):
        read_uvarint(b"\x80\x80", 0)


def test_read_uvarint_too_long() -> None:
    with pytest.raises(MalformedHeader, match="longer than 5 bytes"):
        read_uvarint(b"\x80\x80\x80\x80\x80\x01", 0)


def test_skip_tagged_fields() -> None:
    section = tagged_section({0: b"abc", 5: b"x" * 200})
    data = b"\x07" + section + b"BODY"
    assert data[skip_tagged_fields(data, 1):] == b"BODY"
    assert skip_tagged_fields(b"\x00", 0) == 1


def test_skip_tagged_fields_past_end() -> None:
    with pytest.raises(MalformedHeader, match="past the end"):
        skip_tagged_fields(b"\x01\x00\x05ab", 0)


# -- request headers --------------------------------------------------------------------------


def test_v1_header_fields_and_body_offset() -> None:
    req = request(MetadataRequest, 1, 1234, "my-client", topics=None)
    header = parse_request_header(req)
    assert header.api_key == ApiKey.METADATA
    assert header.api_version == 1
    assert header.correlation_id == 1234
    assert header.client_id == "my-client"
    assert req[header.body_offset:] == body(MetadataRequest, 1, topics=None)
    assert header.body_offset == 10 + len("my-client")


def test_negative_correlation_id_is_read_signed() -> None:
    header = parse_request_header(request(MetadataRequest, 1, -5, "c", topics=None))
    assert header.correlation_id == -5


def test_null_client_id() -> None:
    req = request(MetadataRequest, 1, 7, None, topics=[])
    assert req[8:10] == b"\xff\xff"
    header = parse_request_header(req)
    assert header.client_id is None
    assert header.body_offset == 10


def test_empty_client_id_is_not_null() -> None:
    header = parse_request_header(request(MetadataRequest, 1, 7, "", topics=[]))
    assert header.client_id == ""
    assert header.body_offset == 10


def test_utf8_client_id() -> None:
    header = parse_request_header(request(MetadataRequest, 1, 7, "klient-\u00e9\u4e2d", topics=[]))
    assert header.client_id == "klient-\u00e9\u4e2d"


def test_flexible_v2_header_with_empty_tagged_fields() -> None:
    req = request(MetadataRequest, 12, 99, "flex", topics=None, allow_auto_topic_creation=False,
                  include_topic_authorized_operations=False)
    header = parse_request_header(req)
    assert (header.api_version, header.correlation_id, header.client_id) == (12, 99, "flex")
    assert req[header.body_offset - 1] == 0  # the empty tagged-field section
    assert header.body_offset == 10 + 4 + 1


def test_flexible_v2_header_with_tagged_fields() -> None:
    msg_body = body(ApiVersionsRequest, 3, client_software_name="sw", client_software_version="1.0")
    plain = encode_request_header(ApiKey.API_VERSIONS, 3, 42, "tagged")
    assert plain.endswith(b"\x00")
    tags = tagged_section({0: b"trace-id-123", 3: b"\x01" * 150})
    req = plain[:-1] + tags + msg_body
    header = parse_request_header(req)
    assert header.client_id == "tagged"
    assert header.correlation_id == 42
    assert header.body_offset == len(plain) - 1 + len(tags)
    assert req[header.body_offset:] == msg_body


def test_non_flexible_version_of_flexible_api_has_no_tagged_section() -> None:
    # Produce v8 uses header v1: the byte after the client id is already body.
    req = request(ProduceRequest, 8, 1, "p", transactional_id=None, acks=1, timeout_ms=10, topic_data=[])
    header = parse_request_header(req)
    assert header.body_offset == 10 + 1
    assert req[header.body_offset:header.body_offset + 2] == b"\xff\xff"  # null transactional id


def test_unknown_api_key_gives_body_offset_minus_one() -> None:
    raw = (9999).to_bytes(2, "big") + (3).to_bytes(2, "big") + (77).to_bytes(4, "big") + b"\x00\x02id" + b"??"
    header = parse_request_header(raw)
    assert header.api_key == 9999
    assert header.api_version == 3
    assert header.correlation_id == 77
    assert header.client_id == "id"
    assert header.body_offset == -1


@pytest.mark.parametrize("length", range(10))
def test_truncated_fixed_part(length: int) -> None:
    req = request(MetadataRequest, 1, 1, "c", topics=[])
    with pytest.raises(MalformedHeader, match=f"frame has {length}"):
        parse_request_header(req[:length])


def test_client_id_runs_past_end() -> None:
    req = request(MetadataRequest, 1, 1, "client-id", topics=[])
    with pytest.raises(MalformedHeader, match=r"client id of 9 bytes runs past the end of a 15-byte frame"):
        parse_request_header(req[:15])


@pytest.mark.parametrize("length", [-2, -100, -32768])
def test_bad_negative_client_id_length(length: int) -> None:
    raw = bytearray(request(MetadataRequest, 1, 1, None, topics=[]))
    raw[8:10] = length.to_bytes(2, "big", signed=True)
    with pytest.raises(MalformedHeader, match=f"client id length {length} is negative"):
        parse_request_header(bytes(raw))


def test_client_id_not_utf8_is_read_leniently() -> None:
    """Like the broker: invalid UTF-8 in a client id becomes replacement characters, not a close."""
    raw = encode_request_header(ApiKey.METADATA, 1, 1, "ab")
    raw = raw[:10] + b"\xff\xfe"
    header = parse_request_header(raw)
    assert header.client_id == "\ufffd\ufffd"
    assert header.body_offset == 12


def test_flexible_header_truncated_in_tagged_section() -> None:
    plain = encode_request_header(ApiKey.API_VERSIONS, 3, 1, "c")
    with pytest.raises(MalformedHeader, match="truncated varint"):
        parse_request_header(plain[:-1])
    with pytest.raises(MalformedHeader, match="past the end"):
        parse_request_header(plain[:-1] + b"\x01\x00\x09short")


def test_negative_api_version_of_known_api() -> None:
    raw = bytearray(request(MetadataRequest, 1, 1, "c", topics=[]))
    raw[2:4] = (-1).to_bytes(2, "big", signed=True)
    with pytest.raises(MalformedHeader, match="api version -1 is negative"):
        parse_request_header(bytes(raw))


def test_negative_api_version_of_unknown_api() -> None:
    """Forwarded opaque otherwise, but no Kafka API has a negative version."""
    raw = (9999).to_bytes(2, "big") + (-3).to_bytes(2, "big", signed=True) + b"\x00\x00\x00\x01\xff\xff"
    with pytest.raises(MalformedHeader, match=r"api version -3 is negative \(Unknown\(9999\)\)"):
        parse_request_header(raw)


@pytest.mark.parametrize(("head", "message"), [
    (b"\xff\xff\x00\x00", "api key -1 is negative"),
    (b"\x80\x00\x00\x00", "api key -32768 is negative"),
    (b"\x00\x03\x80\x00", r"api version -32768 is negative \(Metadata\)"),
])
def test_check_request_api_refuses_negatives(head: bytes, message: str) -> None:
    with pytest.raises(MalformedHeader, match=message):
        check_request_api(head)


def test_check_request_api_reads_key_and_version() -> None:
    assert check_request_api(b"\x00\x12\x00\x04rest") == (ApiKey.API_VERSIONS, 4)
    assert check_request_api(b"\x7f\xff\x7f\xff") == (32767, 32767)  # unknown, forwarded opaque


def test_version_above_max_still_parsed_with_flexible_header() -> None:
    # A too-new version of a flexible API is read with header v2, so the proxy can answer it.
    raw = encode_request_header(ApiKey.API_VERSIONS, 99, 5, "new")
    header = parse_request_header(raw + b"body")
    assert header.api_version == 99
    assert header.body_offset == len(raw)


def test_malformed_header_is_protocol_error() -> None:
    assert issubclass(MalformedHeader, ProtocolError)


# -- encoders ---------------------------------------------------------------------------------


def test_encode_request_header_matches_kafka_python() -> None:
    msg = FetchRequest[12](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=1000, isolation_level=0,
                           session_id=0, session_epoch=-1, topics=[], forgotten_topics_data=[], rack_id="")
    msg.with_header(correlation_id=31, client_id="kp")
    expected = bytes(msg.encode(header=True))
    assert encode_request_header(ApiKey.FETCH, 12, 31, "kp") + bytes(msg.encode()) == expected


def test_encode_request_header_null_client_id() -> None:
    assert encode_request_header(ApiKey.METADATA, 1, 2, None) == b"\x00\x03\x00\x01\x00\x00\x00\x02\xff\xff"


# -- response headers -------------------------------------------------------------------------


def test_response_header_encoding() -> None:
    assert encode_response_header(7, 0) == b"\x00\x00\x00\x07"
    assert encode_response_header(-2, 1) == b"\xff\xff\xff\xfe\x00"


def test_response_correlation_id() -> None:
    assert response_correlation_id(encode_response_header(123456, 1) + b"rest") == 123456
    assert response_correlation_id(b"\xff\xff\xff\xff") == -1


def test_response_correlation_id_truncated() -> None:
    with pytest.raises(MalformedHeader, match="response of 3 bytes"):
        response_correlation_id(b"\x00\x00\x01")


def test_response_body_offset() -> None:
    assert response_body_offset(encode_response_header(1, 0) + b"B", 0) == 4
    assert response_body_offset(encode_response_header(1, 1) + b"B", 1) == 5
    tagged = encode_response_header(1, 0) + tagged_section({1: b"zz", 2: b""}) + b"B"
    assert tagged[response_body_offset(tagged, 1):] == b"B"
