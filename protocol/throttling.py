"""Body edits that throttling needs: the throttle field, Fetch sizes and records.

Where a response's `throttle_time_ms` is its first field (almost every API) it is read and
patched in place at the body offset. Produce, ApiVersions and OffsetDelete keep it further in,
so those are decoded and re-encoded, which only happens when there is a throttle to report.
"""

from __future__ import annotations

from enum import Enum
from functools import cache
from typing import Any

from kafka.protocol.schemas import BaseField

from .apis import KNOWN_APIS, ApiKey
from .errors import MalformedBody
from .fetch_stream import FETCH_STREAM_VERSIONS, fetch_tail
from .headers import RequestHeader, response_body_offset
from .skim import decode_strict

_INT32 = 2**31 - 1
#: FetchRequest.json: `MaxBytes` exists from v3 ("versions": "3+").
FETCH_FIRST_MAX_BYTES = 3


class ThrottleField(Enum):
    NONE = "none"  # no field in this version: muting is the only signal
    FIRST = "first"  # the first body field: patched in place
    INSIDE = "inside"  # further in: decode, set, re-encode


def throttle_field(api_key: int, api_version: int) -> ThrottleField:
    """Where `throttle_time_ms` sits in this response version, read from Kafka's schema.

    A version above the schemas (an opaque API a newer client uses) has no known layout: NONE,
    so muting is the only signal; it is not cached, so made-up versions cannot grow the cache.
    """
    spec = KNOWN_APIS.get(api_key)
    if spec is None or not 0 <= api_version <= spec.max_version:
        return ThrottleField.NONE
    return _schema_throttle_field(api_key, api_version)


@cache
def _schema_throttle_field(api_key: int, api_version: int) -> ThrottleField:
    spec = KNOWN_APIS[api_key]
    present = []
    for field in spec.response_class.json["fields"]:
        low, high = BaseField.parse_versions(field["versions"])
        if low <= api_version <= high and "tag" not in field:
            present.append(field["name"])
    if "ThrottleTimeMs" not in present:
        return ThrottleField.NONE
    return ThrottleField.FIRST if present[0] == "ThrottleTimeMs" else ThrottleField.INSIDE


def _decode(cls: Any, frame: bytes, start: int, version: int, what: str) -> Any:
    # Strict: a null array here (a broker's bug or a stranger's bytes) would fail the loops below.
    return decode_strict(cls, frame, start, version, f"{what} v{version}")


def read_throttle(api_key: int, api_version: int, frame: bytes, body_offset: int) -> int:
    """The broker's own throttle in a response (0 where the field is absent or not first).

    Produce's throttle sits at the end; the proxy reads it only when it decodes the body anyway.
    """
    if throttle_field(api_key, api_version) is ThrottleField.FIRST and len(frame) >= body_offset + 4:
        return int.from_bytes(frame[body_offset : body_offset + 4], "big", signed=True)
    return 0


def set_throttle(api_key: int, api_version: int, frame: bytes, body_offset: int, throttle_ms: int) -> bytes:
    """The response with `throttle_time_ms` set (no change where the version has no field)."""
    where = throttle_field(api_key, api_version)
    value = min(max(throttle_ms, 0), _INT32)
    if where is ThrottleField.FIRST:
        if len(frame) < body_offset + 4:  # patching would make up the bytes the broker left out
            raise MalformedBody(f"{KNOWN_APIS[api_key].name} v{api_version} response of {len(frame)} bytes "
                                "ends before its throttle_time_ms")
        return frame[:body_offset] + value.to_bytes(4, "big") + frame[body_offset + 4 :]
    if where is ThrottleField.INSIDE:
        spec = KNOWN_APIS[api_key]
        message = _decode(spec.response_class, frame, body_offset, api_version, f"{spec.name} response")
        message.throttle_time_ms = max(message.throttle_time_ms or 0, value)  # a broker's may be larger
        return frame[:body_offset] + bytes(message.encode())
    return frame


def throttle_stream_head(api_version: int, head: bytes, throttle_ms: int) -> bytes:
    """The first bytes of a streamed Fetch response (header included) with its throttle set: the
    larger of `throttle_ms` and the broker's own."""
    spec = KNOWN_APIS[ApiKey.FETCH]
    body_offset = response_body_offset(head, spec.response_header_version(api_version))
    combined = max(throttle_ms, read_throttle(ApiKey.FETCH, api_version, head, body_offset))
    return set_throttle(ApiKey.FETCH, api_version, head, body_offset, combined)


def empty_fetch_response(frame: bytes, body_offset: int, api_version: int, throttle_ms: int) -> bytes:
    """A throttled Fetch answer: every partition's records emptied, all else kept.

    Offsets, high watermarks, errors and the fetch session id stay, so the client simply asks
    for the same offsets again after the throttle, with or without an incremental session.
    From v16 the top-level tagged fields (NodeEndpoints, already pointing at the proxy, and any
    tag kafka-python does not know, which its encoder would drop) are kept byte for byte.
    """
    spec = KNOWN_APIS[ApiKey.FETCH]
    message = _decode(spec.response_class, frame, body_offset, api_version, "Fetch response")
    message.throttle_time_ms = min(max(throttle_ms, 0), _INT32)
    for topic in message.responses:
        for partition in topic.partitions:
            partition.records = b"" if partition.records is not None else None
    emptied = frame[:body_offset] + bytes(message.encode())
    if api_version < FETCH_STREAM_VERSIONS[0]:
        return emptied
    _offset, tail = fetch_tail(frame)
    offset, _tail = fetch_tail(emptied)
    return emptied[:offset] + tail


def _fetch_sizes_offset(header: RequestHeader) -> int:
    """Offset of `max_wait_ms` in a Fetch request: after `replica_id`, which v15 moved to a tag."""
    return header.body_offset + (0 if header.api_version >= 15 else 4)


def fetch_max_wait_ms(frame: bytes, header: RequestHeader) -> int:
    pos = _fetch_sizes_offset(header)
    if len(frame) < pos + 4:
        raise MalformedBody(f"Fetch v{header.api_version} request is truncated")
    return int.from_bytes(frame[pos : pos + 4], "big", signed=True)


def cap_fetch_bytes(frame: bytes, header: RequestHeader, cap: int) -> bytes:
    """Lower `max_bytes` to `cap` and `min_bytes` to at most that, as a broker does for quotas.

    Fetch before v3 has no `max_bytes` (a broker treats it as unlimited): it is left as it is,
    since the bytes where v3 keeps it are the topics array's count.
    """
    if header.api_version < FETCH_FIRST_MAX_BYTES:
        return frame
    pos = _fetch_sizes_offset(header)
    if len(frame) < pos + 12:
        raise MalformedBody(f"Fetch v{header.api_version} request is truncated")
    min_bytes = int.from_bytes(frame[pos + 4 : pos + 8], "big", signed=True)
    max_bytes = int.from_bytes(frame[pos + 8 : pos + 12], "big", signed=True)
    new_max = min(max_bytes, cap)
    new_min = min(min_bytes, new_max)
    if (new_min, new_max) == (min_bytes, max_bytes):
        return frame
    return (frame[: pos + 4] + new_min.to_bytes(4, "big", signed=True)
            + new_max.to_bytes(4, "big", signed=True) + frame[pos + 12 :])
