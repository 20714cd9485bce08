"""Builders for Kafka request and response bytes in unit tests.

Bodies come from kafka-python's schema-generated message classes, headers from the proxy's own
header encoders, so no test depends on a captured byte string.
"""

from __future__ import annotations

from typing import Any

from protocol.apis import KNOWN_APIS
from protocol.connection import Action, BrokersSeen, Close, ToBroker, ToClient
from protocol.errors import ProtocolError
from protocol.frames import FrameSplitter, frame
from protocol.headers import encode_request_header, encode_response_header

Address = tuple[str, int]


def advertise(node_id: int) -> Address:
    """The proxy listener that stands for `node_id` in these tests.

    Like the proxy's own (which refuses a node its port range cannot hold), a node id whose port
    would not fit the int32 port field is a ProtocolError, so the connection closes naming it.
    """
    port = 19000 + node_id
    if not -(2**31) <= port < 2**31:
        raise ProtocolError(f"node id {node_id} has no listener port in these tests")
    return ("proxy.test", port)


def uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tagged_section(fields: dict[int, bytes]) -> bytes:
    """A tagged-field section: count, then (tag, size, data) for each field, tags ascending."""
    out = uvarint(len(fields))
    for tag in sorted(fields):
        out += uvarint(tag) + uvarint(len(fields[tag])) + fields[tag]
    return out


def body(cls: Any, version: int, **fields: Any) -> bytes:
    """The encoded body of message class `cls` at `version`."""
    return bytes(cls[version](**fields).encode())


def request(cls: Any, version: int, correlation_id: int, client_id: str | None = "test-client",
            **fields: Any) -> bytes:
    """A whole request frame (header and body, without the size prefix)."""
    header = encode_request_header(cls.API_KEY, version, correlation_id, client_id)
    return header + body(cls, version, **fields)


def response_header(api_key: int, version: int, correlation_id: int) -> bytes:
    return encode_response_header(correlation_id, KNOWN_APIS[api_key].response_header_version(version))


def response(cls: Any, version: int, correlation_id: int, **fields: Any) -> bytes:
    """A whole response frame (header and body, without the size prefix)."""
    return response_header(cls.API_KEY, version, correlation_id) + body(cls, version, **fields)


def framed(*payloads: bytes) -> bytes:
    """Size-prefixed frames, concatenated as they would travel on one TCP stream."""
    return b"".join(frame(p) for p in payloads)


def of_type(actions: list[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def to_broker(actions: list[Action]) -> bytes:
    """Every byte the actions write to the broker, in order."""
    return b"".join(b"".join(a.chunks) for a in of_type(actions, ToBroker))


def to_client(actions: list[Action]) -> bytes:
    """Every byte the actions write to the client, in order."""
    return b"".join(b"".join(a.chunks) for a in of_type(actions, ToClient))


def client_frames(actions: list[Action]) -> list[bytes]:
    """The frames (without size prefixes) the actions send to the client."""
    return FrameSplitter(2**31 - 1).feed(to_client(actions))


def broker_frames(actions: list[Action]) -> list[bytes]:
    """The frames (without size prefixes) the actions send to the broker."""
    return FrameSplitter(2**31 - 1).feed(to_broker(actions))


def close_reasons(actions: list[Action]) -> list[str]:
    return [a.reason for a in of_type(actions, Close)]


def brokers_seen(actions: list[Action]) -> dict[int, Address]:
    seen: dict[int, Address] = {}
    for action in of_type(actions, BrokersSeen):
        seen.update(action.addresses)
    return seen


def correlation_id(frame_bytes: bytes) -> int:
    return int.from_bytes(frame_bytes[0:4], "big", signed=True)
