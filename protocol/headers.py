"""Request and response headers, read by hand-written offset readers.

These run for every frame in both directions, so they avoid the generic decoders: a request
header is api key, version, correlation id and client id at fixed offsets; a response header
is the correlation id, plus tagged fields for flexible versions.
"""

from __future__ import annotations

from typing import NamedTuple

from .apis import KNOWN_APIS, OPAQUE_APIS, api_name
from .errors import MalformedHeader


class RequestHeader(NamedTuple):
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    #: Offset of the body in the frame, or -1 when no schema describes the API (its header format
    #: is then unknown: v1 and v2 differ only by the tagged fields after the client id, so
    #: everything above is read the same way in both).
    body_offset: int


def read_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """Kafka's unsigned varint at `pos`: (value, next position)."""
    if pos < len(buf) and buf[pos] < 0x80:  # one byte: nearly every length and count
        return buf[pos], pos + 1
    value = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise MalformedHeader("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise MalformedHeader("varint longer than 5 bytes")


def skip_tagged_fields(buf: bytes, pos: int) -> int:
    """Position after a tagged-field section starting at `pos`."""
    if pos < len(buf) and buf[pos] == 0:  # no tagged fields: nearly always
        return pos + 1
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
        if pos > len(buf):
            raise MalformedHeader("tagged field runs past the end of the frame")
    return pos


#: A request's api key and version: its first 4 bytes after the size prefix.
REQUEST_API_BYTES = 4


def check_request_api(head: bytes) -> tuple[int, int]:
    """The api key and version at the start of a request, refused when negative.

    Kafka has no negative api key or version (both are int16 counted from 0; a broker closes the
    connection on either). Checked on the first bytes of a request frame, so a huge frame with
    a garbage header is refused before its body is buffered.
    """
    api_key = int.from_bytes(head[0:2], "big", signed=True)
    api_version = int.from_bytes(head[2:4], "big", signed=True)
    if api_key < 0:
        raise MalformedHeader(f"api key {api_key} is negative")
    if api_version < 0:
        raise MalformedHeader(f"api version {api_version} is negative ({api_name(api_key)})")
    return api_key, api_version


def parse_request_header(frame: bytes) -> RequestHeader:
    """Read the header of a request frame (the bytes after the size prefix)."""
    if len(frame) < 10:
        raise MalformedHeader(f"request header needs at least 10 bytes, frame has {len(frame)}")
    api_key, api_version = check_request_api(frame)
    correlation_id = int.from_bytes(frame[4:8], "big", signed=True)
    client_len = int.from_bytes(frame[8:10], "big", signed=True)
    pos = 10
    client_id: str | None = None
    if client_len >= 0:
        end = pos + client_len
        if end > len(frame):
            raise MalformedHeader(
                f"client id of {client_len} bytes runs past the end of a {len(frame)}-byte frame"
            )
        # Lenient like the broker's own reader: a client id is a label, not worth a close.
        client_id = frame[pos:end].decode("utf-8", errors="replace")
        pos = end
    elif client_len != -1:
        raise MalformedHeader(f"client id length {client_len} is negative")
    spec = KNOWN_APIS.get(api_key) or OPAQUE_APIS.get(api_key)
    if spec is None:
        return RequestHeader(api_key, api_version, correlation_id, client_id, -1)
    if spec.request_header_version(api_version) >= 2:
        pos = skip_tagged_fields(frame, pos)
    return RequestHeader(api_key, api_version, correlation_id, client_id, pos)


def response_correlation_id(frame: bytes) -> int:
    if len(frame) < 4:
        raise MalformedHeader(f"response of {len(frame)} bytes has no correlation id")
    return int.from_bytes(frame[0:4], "big", signed=True)


def response_body_offset(frame: bytes, header_version: int) -> int:
    """Offset of the body in a response frame with header version 0 or 1."""
    if header_version == 0:
        return 4
    return skip_tagged_fields(frame, 4)


def encode_request_header(api_key: int, api_version: int, correlation_id: int,
                          client_id: str | None) -> bytes:
    """A request header for the proxy's own requests (v1, or v2 for flexible versions)."""
    spec = KNOWN_APIS[api_key]
    raw = b"" if client_id is None else client_id.encode()
    out = (api_key.to_bytes(2, "big") + api_version.to_bytes(2, "big")
           + correlation_id.to_bytes(4, "big", signed=True)
           + (len(raw) if client_id is not None else -1).to_bytes(2, "big", signed=True) + raw)
    if spec.request_header_version(api_version) >= 2:
        out += b"\x00"
    return out


def encode_response_header(correlation_id: int, header_version: int) -> bytes:
    out = correlation_id.to_bytes(4, "big", signed=True)
    return out + b"\x00" if header_version >= 1 else out
