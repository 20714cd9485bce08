"""Reading the brokers array of a Metadata or DescribeCluster response, and nothing after it.

Why by hand: decoding a whole Metadata response with the generic decoders, to change a few
(host, port) pairs, costs time in proportion to its topics (a 10,000-topic answer took about
150 ms, during which the event loop served no other connection). The brokers array sits near
the start of the body, so reading it alone and copying everything after it as bytes costs the
same for ten topics or ten thousand, and keeps whatever follows (topics, tagged fields this
proxy has no schema for) exactly as the broker sent it.

The field order follows Kafka's `MetadataResponse.json` and `DescribeClusterResponse.json`.
Anything that does not add up raises `MalformedBody` naming the field and offset. The field readers
(`read_int`, `read_string`, `skip_tagged`, `read_brokers`...) serve the other hand-written body
readers too (`node_endpoints.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import MalformedBody, MalformedHeader, ProtocolError
from .headers import read_uvarint

#: a broker's (host, port)
Address = tuple[str, int]
#: node id -> the proxy address clients must use for it (what every address rewrite takes)
Advertise = Callable[[int], Address]

#: Metadata: v1 adds each broker's rack (and the controller id), v3 puts throttle_time_ms first,
#: v9 is the first flexible version (compact arrays and strings, tagged fields per broker).
METADATA_FIRST_RACK = 1
METADATA_FIRST_THROTTLE = 3
METADATA_FIRST_FLEXIBLE = 9
#: DescribeCluster is flexible from v0; v1 adds EndpointType (KIP-919), v2 each broker's IsFenced.
DESCRIBE_CLUSTER_FIRST_ENDPOINT_TYPE = 1
DESCRIBE_CLUSTER_FIRST_IS_FENCED = 2
#: The fewest bytes one broker entry can take in any version (v0: node id 4, an empty string's
#: 2-byte length, port 4). A count that cannot fit in the bytes left is refused before looping,
#: as Kafka's readers refuse one ("Tried to allocate a collection of size N, but there are only
#: M bytes remaining").
MIN_BROKER_BYTES = 10


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """One broker entry's id and address, and where its (host, port) pair lies in the frame."""

    node_id: int
    host: str
    port: int
    #: frame[address_start:address_end] is the host (with its length) followed by the port:
    #: the only bytes of the entry a rewrite replaces.
    address_start: int
    address_end: int


@dataclass(frozen=True, slots=True)
class BrokerArray:
    """The brokers array of one response: its entries and whether its strings are compact."""

    brokers: list[BrokerAddress]
    flexible: bool
    #: frame[start:end] is the whole array, count included.
    start: int
    end: int


class FieldError(Exception):
    """A reader's complaint naming the field and offset; callers add the API, version and frame size
    when they turn it into `MalformedBody`."""


def field_error(field: str, offset: int, problem: str = "runs past the end") -> FieldError:
    """The usual complaint: `field` at `offset` and what is wrong with it."""
    return FieldError(f"{field} at offset {offset} {problem}")


def read_int(frame: bytes, pos: int, width: int, what: str) -> tuple[int, int]:
    end = pos + width
    if end > len(frame):
        raise FieldError(f"{what} ({width} bytes at offset {pos}) runs past the end")
    return int.from_bytes(frame[pos:end], "big", signed=True), end


def read_uvarint_field(frame: bytes, pos: int, what: str) -> tuple[int, int]:
    try:
        return read_uvarint(frame, pos)
    except MalformedHeader as exc:
        raise FieldError(f"{what} at offset {pos}: {exc}") from None


def read_length(frame: bytes, pos: int, flexible: bool, width: int, what: str) -> tuple[int, int]:
    """A length or count: compact (uvarint of length + 1, 0 is null) or a signed `width`-byte int.

    Null comes back as -1, as in the classic encoding.
    """
    if flexible:
        value, end = read_uvarint_field(frame, pos, what)
        return value - 1, end
    return read_int(frame, pos, width, what)


def read_string(frame: bytes, pos: int, flexible: bool, nullable: bool, what: str) -> tuple[int, int]:
    """Where a string's bytes start and end; a null (where allowed) is an empty span."""
    length, start = read_length(frame, pos, flexible, 2, f"{what} length")
    if length < 0:
        if length == -1 and nullable:
            return start, start
        raise FieldError(f"{what} has length {length} at offset {pos}")
    end = start + length
    if end > len(frame):
        raise FieldError(f"{what} of {length} bytes at offset {start} runs past the end")
    return start, end


def read_host(frame: bytes, pos: int, flexible: bool, what: str) -> tuple[str, int]:
    start, end = read_string(frame, pos, flexible, False, what)
    try:
        return frame[start:end].decode("utf-8"), end
    except UnicodeDecodeError as exc:
        raise FieldError(f"{what} at offset {start} is not UTF-8: {exc.reason}") from None


def skip_tagged(frame: bytes, pos: int, what: str) -> int:
    count, pos = read_uvarint_field(frame, pos, f"{what} tagged field count")
    for _ in range(count):
        _tag, pos = read_uvarint_field(frame, pos, f"{what} tag")
        size, pos = read_uvarint_field(frame, pos, f"{what} tagged field size")
        pos += size
        if pos > len(frame):
            raise FieldError(f"{what} tagged field of {size} bytes runs past the end")
    return pos


def read_brokers(frame: bytes, pos: int, flexible: bool, rack: bool, is_fenced: bool,
                 array: str = "brokers", entry: str = "broker") -> BrokerArray:
    """The brokers array at `pos`: node id, host, port, then rack, IsFenced and tagged fields where
    the version has them (every one of those is stepped over, never rewritten). `array` and `entry`
    name them in errors (NodeEndpoints have the same layout)."""
    start = pos
    count, pos = read_length(frame, pos, flexible, 4, f"{array} array count")
    if count < 0:
        # Kafka's schemas do not let Brokers be null: its readers fail such a response too.
        raise FieldError(f"{array} array count {count} at offset {start}")
    if count * MIN_BROKER_BYTES > len(frame) - pos:
        raise FieldError(f"{array} array of {count} entries in the {len(frame) - pos} bytes left")
    brokers: list[BrokerAddress] = []
    for index in range(count):
        what = f"{entry} {index} of {count}"
        node_id, address_start = read_int(frame, pos, 4, f"{what} node id")
        host, pos = read_host(frame, address_start, flexible, f"{what} host")
        port, pos = read_int(frame, pos, 4, f"{what} port")
        brokers.append(BrokerAddress(node_id, host, port, address_start, pos))
        if rack:
            _rack, pos = read_string(frame, pos, flexible, True, f"{what} rack")
        if is_fenced:
            _fenced, pos = read_int(frame, pos, 1, f"{what} IsFenced")
        if flexible:
            pos = skip_tagged(frame, pos, what)
    return BrokerArray(brokers, flexible, start, pos)


def metadata_brokers(frame: bytes, body_offset: int, version: int) -> BrokerArray:
    """The brokers array of a Metadata response body at `body_offset` (any version, 0 to 13).

    Throttle time (v3+) is the only field before it.
    """
    pos = body_offset + (4 if version >= METADATA_FIRST_THROTTLE else 0)
    try:
        if pos > len(frame):
            raise FieldError("the body ends before the brokers array")
        return read_brokers(frame, pos, version >= METADATA_FIRST_FLEXIBLE,
                            rack=version >= METADATA_FIRST_RACK, is_fenced=False)
    except FieldError as exc:
        raise MalformedBody(f"Metadata v{version} response of {len(frame)} bytes does not parse: {exc}") \
            from None


def describe_cluster_brokers(frame: bytes, body_offset: int, version: int) -> BrokerArray:
    """The brokers array of a DescribeCluster response body at `body_offset` (versions 0 to 2).

    Before it: throttle time, error code, error message, endpoint type (v1+), cluster id and
    controller id.
    """
    try:
        pos = body_offset + 6  # throttle time, error code
        _message, pos = read_string(frame, pos, True, True, "error message")
        if version >= DESCRIBE_CLUSTER_FIRST_ENDPOINT_TYPE:
            pos += 1
        _cluster_id, pos = read_string(frame, pos, True, False, "cluster id")
        pos += 4  # controller id
        if pos > len(frame):
            raise FieldError("the body ends before the brokers array")
        return read_brokers(frame, pos, True, rack=True,
                            is_fenced=version >= DESCRIBE_CLUSTER_FIRST_IS_FENCED)
    except FieldError as exc:
        raise MalformedBody(
            f"DescribeCluster v{version} response of {len(frame)} bytes does not parse: {exc}") from None


def _uvarint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_address(host: str, port: int, flexible: bool) -> bytes:
    """A (host, port) pair as it stands in a broker entry: what replaces frame[address_start:address_end]."""
    raw = host.encode("utf-8")
    if not -(2**31) <= port < 2**31 or (not flexible and len(raw) > 32767):
        raise ProtocolError(f"address {host}:{port} cannot be written in a broker entry")
    prefix = _uvarint_bytes(len(raw) + 1) if flexible else len(raw).to_bytes(2, "big")
    return prefix + raw + port.to_bytes(4, "big", signed=True)
