"""Hand-written readers that skim a Produce or Fetch body for one fact without decoding it.

A Produce request's `acks` and producer ids; a Produce response's partition errors; whether a
Produce or Fetch response carries KIP-951 NodeEndpoints; and, before a body is decoded at all,
whether its length prefixes are ones Kafka's own readers accept (`decode_strict`).

The bench showed the generic decoders on the per-request path: decoding every Produce request
to read its producer ids, and every Produce v10+ / Fetch v16+ response to learn that it carries
no KIP-951 NodeEndpoints, cost more than the proxy's whole forwarding work for a small record.
These readers step over the fields by their sizes (records are skipped by length, never
copied) and follow the field order of Kafka's JSON schemas (`ProduceRequest.json`,
`ProduceResponse.json`, `FetchResponse.json`). Anything that does not add up raises
`MalformedBody`, as a failed decode would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import MalformedBody, MalformedHeader
from .headers import RequestHeader, read_uvarint, skip_tagged_fields

#: Offset of `producerId` in a v2 record batch header (base offset 8, length 4, leader epoch 4,
#: magic 1, crc 4, attributes 2, last offset delta 4, first and max timestamps 8 + 8).
BATCH_PRODUCER_ID = 43
BATCH_MAGIC = 16
BATCH_HEADER = 61
#: Produce v9 is the first flexible version (compact strings, tagged fields). The response skims
#: serve only versions that can carry NodeEndpoints (Produce v10+, Fetch v16+), all flexible.
PRODUCE_FIRST_FLEXIBLE = 9
#: From these versions topics are named by id (a 16-byte uuid), not by name.
PRODUCE_FIRST_TOPIC_ID = 13
FETCH_FIRST_TOPIC_ID = 13
_UUID = 16


def _length(buf: bytes, pos: int, flexible: bool, width: int) -> tuple[int, int]:
    """A length prefix: compact (uvarint of length + 1, 0 is null) or a signed int of `width` bytes.

    Null comes back as -1, as in the classic encoding.
    """
    if flexible:
        value, pos = read_uvarint(buf, pos)
        return value - 1, pos
    end = pos + width
    if end > len(buf):
        raise MalformedHeader("length prefix runs past the end")
    return int.from_bytes(buf[pos:end], "big", signed=True), end


def _skip_string(buf: bytes, pos: int, flexible: bool) -> int:
    length, pos = _length(buf, pos, flexible, 2)
    return pos + max(length, 0)


def _count(buf: bytes, pos: int, flexible: bool) -> tuple[int, int]:
    """An array's element count (null arrays count as empty); bounded by the bytes left."""
    count, pos = _length(buf, pos, flexible, 4)
    if count > len(buf) - pos:  # every element takes at least one byte
        raise MalformedHeader(f"array of {count} elements in {len(buf) - pos} bytes")
    return max(count, 0), pos


def _batch_producer_ids(buf: bytes, pos: int, end: int, found: list[int]) -> None:
    """Producer ids of the v2 batches in buf[pos:end] (idempotent or transactional ones only)."""
    while pos + BATCH_HEADER <= end:
        length = int.from_bytes(buf[pos + 8 : pos + 12], "big", signed=True)
        if buf[pos + BATCH_MAGIC] == 2:
            pid = int.from_bytes(buf[pos + BATCH_PRODUCER_ID : pos + BATCH_PRODUCER_ID + 8], "big",
                                 signed=True)
            if pid >= 0:
                found.append(pid)
        if length <= 0:
            break
        pos += 12 + length


def _skip_topics(frame: bytes, pos: int, flexible: bool, topic_id: bool,
                 skip_partition: Callable[[bytes, int], int]) -> int:
    """Position after a topics array: each a name (or a 16-byte id), then partitions, each
    stepped over by `skip_partition`; tagged fields close partitions and topics when flexible."""
    topics, pos = _count(frame, pos, flexible)
    for _ in range(topics):
        pos = pos + _UUID if topic_id else _skip_string(frame, pos, flexible)
        partitions, pos = _count(frame, pos, flexible)
        for _ in range(partitions):
            pos = skip_partition(frame, pos)
            if flexible:
                pos = skip_tagged_fields(frame, pos)
        if flexible:
            pos = skip_tagged_fields(frame, pos)
    return pos


def produce_acks(frame: bytes, header: RequestHeader) -> int:
    """The `acks` of a Produce request: it follows the transactional id (v3+)."""
    version = header.api_version
    pos = header.body_offset
    try:
        if version >= 3:
            pos = _skip_string(frame, pos, version >= PRODUCE_FIRST_FLEXIBLE)
    except MalformedHeader as exc:
        raise MalformedBody(f"Produce v{version} request: {exc}") from exc
    if pos + 2 > len(frame):
        raise MalformedBody(f"Produce v{version} request is truncated before acks")
    return int.from_bytes(frame[pos : pos + 2], "big", signed=True)


def produce_producer_ids(frame: bytes, header: RequestHeader) -> list[int]:
    """Producer ids of the v2 record batches in a Produce request (idempotent/transactional only)."""
    version = header.api_version
    if version < 3:  # before v3 batches may be magic 0/1, which have no producer id
        return []
    flexible = version >= PRODUCE_FIRST_FLEXIBLE
    found: list[int] = []

    def partition(frame: bytes, pos: int) -> int:
        size, pos = _length(frame, pos + 4, flexible, 4)  # after the partition index
        if size <= 0:
            return pos
        end = pos + size
        if end > len(frame):
            raise MalformedHeader(f"records of {size} bytes run past the end")
        _batch_producer_ids(frame, pos, end, found)
        return end

    try:
        pos = _skip_string(frame, header.body_offset, flexible) + 6  # transactional id, acks, timeout
        pos = _skip_topics(frame, pos, flexible, version >= PRODUCE_FIRST_TOPIC_ID, partition)
        if flexible:
            pos = skip_tagged_fields(frame, pos)
        if pos > len(frame):
            raise MalformedHeader("fields run past the end")
    except MalformedHeader as exc:
        raise MalformedBody(f"Produce v{version} request does not parse: {exc}") from exc
    return found


def _top_level_tags(frame: bytes, pos: int, what: str) -> bool:
    """Whether the tagged-field section at `pos` closes the frame and holds any field."""
    count, end = read_uvarint(frame, pos)
    if count == 0 and end != len(frame):
        raise MalformedHeader(f"{len(frame) - end} bytes after the end of the {what}")
    return count > 0


def _produce_partition(frame: bytes, pos: int) -> int:
    """Index, error code, base offset, log append time, log start offset, record errors, message."""
    errors, pos = _count(frame, pos + 30, True)
    for _ in range(errors):
        pos = skip_tagged_fields(frame, _skip_string(frame, pos + 4, True))
    return _skip_string(frame, pos, True)


def _fetch_partition(frame: bytes, pos: int) -> int:
    """Index, error code, high watermark, last stable offset, log start offset, aborted
    transactions, preferred read replica, records."""
    aborted, pos = _count(frame, pos + 30, True)
    for _ in range(aborted):
        pos = skip_tagged_fields(frame, pos + 16)
    size, pos = _length(frame, pos + 4, True, 4)
    return pos + max(size, 0)


def produce_response_has_tags(frame: bytes, body_offset: int, version: int) -> bool:
    """Whether a flexible Produce response carries top-level tagged fields (NodeEndpoints, v10+)."""
    try:
        pos = _skip_topics(frame, body_offset, True, version >= PRODUCE_FIRST_TOPIC_ID, _produce_partition)
        return _top_level_tags(frame, pos + 4, "response")  # after throttle_time_ms
    except MalformedHeader as exc:
        raise MalformedBody(f"Produce v{version} response does not parse: {exc}") from exc


def fetch_response_has_tags(frame: bytes, body_offset: int, version: int) -> bool:
    """Whether a flexible Fetch response carries top-level tagged fields (NodeEndpoints, v16+)."""
    try:
        pos = body_offset + 10  # throttle time, error code, session id
        pos = _skip_topics(frame, pos, True, version >= FETCH_FIRST_TOPIC_ID, _fetch_partition)
        return _top_level_tags(frame, pos, "response")
    except MalformedHeader as exc:
        raise MalformedBody(f"Fetch v{version} response does not parse: {exc}") from exc


def produce_response_errors(frame: bytes, body_offset: int, version: int) -> list[int]:
    """The non-zero partition error codes of a Produce response (any version), in order.

    Adaptive capacity counts the brokers' REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS and
    NOT_LEADER answers; decoding every Produce response would cost more than forwarding it.
    """
    flexible = version >= PRODUCE_FIRST_FLEXIBLE
    # index, error code, base offset; log append time (v2+); log start offset (v5+)
    fixed = 14 + (8 if version >= 2 else 0) + (8 if version >= 5 else 0)
    found: list[int] = []

    def partition(buf: bytes, pos: int) -> int:
        if pos + fixed > len(buf):
            raise MalformedHeader("partition runs past the end")
        code = int.from_bytes(buf[pos + 4 : pos + 6], "big", signed=True)
        if code:
            found.append(code)
        pos += fixed
        if version >= 8:  # record errors (batch index, message), then the error message
            errors, pos = _count(buf, pos, flexible)
            for _ in range(errors):
                pos = _skip_string(buf, pos + 4, flexible)
                if flexible:
                    pos = skip_tagged_fields(buf, pos)
            pos = _skip_string(buf, pos, flexible)
        return pos

    try:
        end = _skip_topics(frame, body_offset, flexible, version >= PRODUCE_FIRST_TOPIC_ID, partition)
    except MalformedHeader as exc:
        raise MalformedBody(f"Produce v{version} response does not parse: {exc}") from exc
    if end > len(frame):
        raise MalformedBody(f"Produce v{version} response does not parse: it runs past the end")
    return found


# -- strict decoding -----------------------------------------------------------------------------

#: Widths of the fixed-size schema types (as in Kafka's `Type` classes; bitfield is kafka-python's
#: int32 of authorized operations).
_FIXED_WIDTH = {"int8": 1, "bool": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
                "float64": 8, "uuid": 16, "bitfield": 4}
#: Width of a non-flexible length prefix: strings have an int16 length, bytes/records/arrays int32.
_PREFIX_WIDTH = {"string": 2, "bytes": 4, "records": 4}


def _check_length(buf: bytes, pos: int, flexible: bool, width: int, field: Any, version: int,
                  name: str) -> tuple[int, int]:
    """A length prefix as Kafka's generated readers take it: -1 only where the schema allows
    null, never another negative, never more than the bytes left."""
    length, pos = _length(buf, pos, flexible, width)
    if length < 0:
        if length != -1:
            raise MalformedBody(f"{name} has length {length}")
        if not field.nullable_for_version_q(version):
            raise MalformedBody(f"{name} is null (length -1), which the schema does not allow")
    elif length > len(buf) - pos:
        raise MalformedBody(f"{name} has length {length} but only {len(buf) - pos} bytes are left")
    return length, pos


def _check_value(field: Any, buf: bytes, pos: int, version: int, flexible: bool, name: str) -> int:
    kind = field.type_str
    width = _FIXED_WIDTH.get(kind)
    if width is not None:
        if pos + width > len(buf):
            raise MalformedBody(f"{name} ({kind}) runs past the end of the body")
        return pos + width
    prefix = _PREFIX_WIDTH.get(kind)
    if prefix is None:
        raise MalformedBody(f"{name} has schema type {kind}, which the proxy cannot check")
    length, pos = _check_length(buf, pos, flexible, prefix, field, version, name)
    return pos + max(length, 0)


def _check_array(field: Any, buf: bytes, pos: int, version: int, flexible: bool) -> int:
    count, pos = _check_length(buf, pos, flexible, 4, field, version, field.name)
    element = field.array_of
    width = _FIXED_WIDTH.get(element.type_str)
    if width is not None and not field.is_struct_array():  # e.g. partition indexes: one check
        if pos + count * width > len(buf):
            raise MalformedBody(f"{field.name} of {count} {element.type_str} runs past the end of the body")
        return pos + count * width
    structs = field.is_struct_array()
    for index in range(count):
        # The element's place goes into the message only when it is wrong (a try costs nothing
        # in Python 3.11+ until something raises), so a long array costs no formatting.
        try:
            if structs:
                pos = _check_struct(element, buf, pos, version, flexible)
            else:
                pos = _check_value(element, buf, pos, version, flexible, "")
        except MalformedBody as exc:
            joint = "." if structs else ""  # a value's own message starts " has ..."
            raise MalformedBody(f"{field.name}[{index}]{joint}{exc}") from None
    return pos


def _check_struct(struct: Any, buf: bytes, pos: int, version: int, flexible: bool) -> int:
    """Position after a struct's fields; tagged fields are stepped over by their sizes."""
    for field in struct.untagged_fields(version):
        if field.is_array():
            pos = _check_array(field, buf, pos, version, flexible)
        elif field.is_struct():
            if field.nullable_for_version_q(version):  # KIP-893: a one-byte marker, -1 for null
                if pos >= len(buf):
                    raise MalformedBody(f"{field.name} runs past the end of the body")
                pos += 1
                if buf[pos - 1] == 0xFF:
                    continue
            try:
                pos = _check_struct(field, buf, pos, version, flexible)
            except MalformedBody as exc:
                raise MalformedBody(f"{field.name}.{exc}") from None
        else:
            pos = _check_value(field, buf, pos, version, flexible, field.name)
    if flexible:
        pos = skip_tagged_fields(buf, pos)
    return pos


def decode_strict(cls: Any, frame: bytes, start: int, version: int, what: str) -> Any:
    """Decode the body at `frame[start:]` with its schema class, refusing what Kafka refuses.

    `what` names the body in errors ("SaslAuthenticate v2 request").

    kafka-python's decoders are lenient where a broker is not: a null (length -1) where the schema
    forbids it decodes as None, which later code then fails to iterate (issue 10's TypeError); a
    length of -5 reads as empty; a string longer than the bytes left comes back cut short. Every
    length prefix is checked first, so a bad one closes the connection with a `MalformedBody`
    naming the field and the value, as Kafka's readers throw naming them.
    """
    flexible = cls.flexible_version_q(version)
    try:
        _check_struct(cls._struct, frame, start, version, flexible)
    except MalformedHeader as exc:  # a varint or a tagged field that does not add up
        raise MalformedBody(f"{what} does not parse: {exc}") from exc
    except MalformedBody as exc:
        raise MalformedBody(f"{what}: {exc}") from exc
    try:
        return cls.decode(memoryview(frame)[start:], version=version)
    except Exception as exc:
        raise MalformedBody(f"{what} does not parse: {exc}") from exc
