"""Emptying some partitions' records in a Fetch response, the rest kept byte for byte.

KIP-73's leader answers a throttled partition with empty records while the throttle is over; a
proxy does the same to a response it holds whole. Each partition with records is offered, in
response order, to a decision (topic, partition, record bytes) -> let through?; a refused one gets
empty records, as a broker sends for a partition with nothing to return (non-null, length 0).
Everything else stays exactly as the broker sent it: offsets, high watermark, last stable offset,
log start offset, aborted transactions, preferred read replica, errors, the partitions' tagged
fields (diverging epoch, current leader, snapshot id), the fetch session id, and the KIP-951
NodeEndpoints tagged field of v16+. The client then asks for the same offsets again, whether or
not it uses an incremental fetch session.

By hand, not with kafka-python's `FetchResponse` class: decoding copies every record batch and
re-encoding drops nothing but costs time in proportion to the records, on the one path that
carries them. This reader steps over the fields by their sizes (records by their length, never
copied) in the order of Kafka's `FetchResponse.json`, and copies the response once, only when a
partition is emptied; when none is, the very same bytes object comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .broker_array import FieldError, field_error, read_length, skip_tagged
from .errors import MalformedBody
from .topic_names import TopicNames

#: The versions this reader knows (kafka-python's FetchResponse range; the proxy offers no other).
FETCH_FIRST_READABLE = 4
FETCH_LAST_READABLE = 18
#: FetchResponse.json: LogStartOffset from v5, ErrorCode and SessionId from v7, PreferredReadReplica
#: from v11, flexible (compact lengths, tagged fields, response header v1) from v12, TopicId
#: (a 16-byte uuid) instead of the topic name from v13.
FETCH_FIRST_LOG_START_OFFSET = 5
FETCH_FIRST_SESSION = 7
FETCH_FIRST_PREFERRED_READ_REPLICA = 11
FETCH_FIRST_FLEXIBLE = 12
FETCH_FIRST_TOPIC_ID = 13
_UUID = 16
#: An aborted transaction: producer id and first offset.
_ABORTED_TRANSACTION = 16

#: (topic name, partition index, record bytes) -> True to let the records through.
PartitionDecision = Callable[[str, int, int], bool]
#: A topic id (16 bytes) -> its name, None when not known (its partitions are then let through).
TopicNameOf = Callable[[bytes], "str | None"]

_EMPTY = b"\x00\x00\x00\x00"  # records of length 0
_EMPTY_COMPACT = b"\x01"  # compact records of length 0 (uvarint of length + 1)


class PartitionThrottlePolicy(Protocol):
    """What the connection asks the partition throttles (`quotas.partition_throttle.PartitionThrottles`)."""

    @property
    def topics(self) -> frozenset[str]: ...

    def applies_to(self, user: str, client_id: str) -> bool: ...

    def decide(self, user: str, client_id: str, topic: str, partition: int, record_bytes: int,
               now_ms: int) -> bool: ...

    def wait_ms(self, user: str, client_id: str, topic: str, partition: int, now_ms: int) -> int: ...


@dataclass(frozen=True, slots=True)
class ThrottledFetch:
    """A Fetch response under the partition throttles, and how long the client may wait for it."""

    frame: bytes
    #: > 0 only when partitions were emptied and nothing is left in the response for the client
    #: (no records, no partition error, no partition tagged field such as a new leader): answered
    #: at once, the client would fetch the same offsets again at once and the broker read the same
    #: records again, for nothing. Holding it this long (the time until a throttle that emptied a
    #: partition is under its rate again), within the fetch's own `max_wait_ms`, is what a broker
    #: does with a fetch that has no data yet.
    hold_ms: int = 0


def throttle_fetch_response(policy: PartitionThrottlePolicy, topic_names: TopicNames, user: str,
                            client_id: str, frame: bytes, api_version: int, now_ms: int) -> bytes:
    """A Fetch response frame as the client must get it under the partition throttles.

    The very same bytes when no throttle concerns this client (nothing is read) or none refused
    a partition; see `empty_refused_partitions`.
    """
    return throttle_fetch(policy, topic_names, user, client_id, frame, api_version, now_ms).frame


def throttle_fetch(policy: PartitionThrottlePolicy, topic_names: TopicNames, user: str, client_id: str,
                   frame: bytes, api_version: int, now_ms: int) -> ThrottledFetch:
    """`throttle_fetch_response`, with how long the emptied response may be held (see ThrottledFetch)."""
    if not policy.applies_to(user, client_id):
        return ThrottledFetch(frame)

    def decide(topic: str, partition: int, record_bytes: int) -> bool:
        return policy.decide(user, client_id, topic, partition, record_bytes, now_ms)

    _check_version(api_version, topic_names.name)
    try:
        result, refused, kept = _empty(frame, api_version, decide, topic_names.name)
    except FieldError as exc:
        raise MalformedBody(f"Fetch v{api_version} response of {len(frame)} bytes does not parse: "
                            f"{exc}") from None
    if not refused or kept:
        return ThrottledFetch(result)
    hold = min(policy.wait_ms(user, client_id, topic, partition, now_ms) for topic, partition in refused)
    return ThrottledFetch(result, max(hold, 0))


def _response_body_offset(frame: bytes, flexible: bool) -> int:
    """After the correlation id, and the header's tagged fields for flexible versions (header v1)."""
    if len(frame) < 4:
        raise field_error("correlation id", 0)
    return skip_tagged(frame, 4, "response header") if flexible else 4


def empty_refused_partitions(frame: bytes, api_version: int, decide: PartitionDecision,
                             topic_name: TopicNameOf | None = None) -> bytes:
    """The Fetch response `frame` (header included, no size prefix) with refused partitions emptied.

    `decide` is asked once per partition whose records are not empty, in response order, with the
    topic's name: v4 to v12 carry it; v13+ carry the topic id, turned into a name by `topic_name`
    (a partition of a topic it does not know is let through without asking). Returns `frame`
    itself when every partition is let through. Raises `MalformedBody` naming the field and its
    offset when the bytes do not add up, and ValueError for a version outside v4 to v18.
    """
    _check_version(api_version, topic_name)
    try:
        return _empty(frame, api_version, decide, topic_name)[0]
    except FieldError as exc:
        raise MalformedBody(f"Fetch v{api_version} response of {len(frame)} bytes does not parse: "
                            f"{exc}") from None


def _check_version(api_version: int, topic_name: TopicNameOf | None) -> None:
    if not FETCH_FIRST_READABLE <= api_version <= FETCH_LAST_READABLE:
        raise ValueError(f"Fetch v{api_version} is outside v{FETCH_FIRST_READABLE} to "
                         f"v{FETCH_LAST_READABLE}, the versions this reader knows")
    if api_version >= FETCH_FIRST_TOPIC_ID and topic_name is None:
        raise ValueError(f"Fetch v{api_version} names topics by id: a topic_name lookup is needed")


def _empty(frame: bytes, version: int, decide: PartitionDecision,
           topic_name: TopicNameOf | None) -> tuple[bytes, list[tuple[str, int]], int]:
    """The frame with refused partitions emptied, those partitions, and how many partitions the
    client must get at once: with records let through, an error code or tagged fields."""
    flexible = version >= FETCH_FIRST_FLEXIBLE
    by_id = version >= FETCH_FIRST_TOPIC_ID
    size = len(frame)
    pos = _response_body_offset(frame, flexible)
    pos += 10 if version >= FETCH_FIRST_SESSION else 4  # throttle time (error code, session id)
    # Partition index, error code, high watermark, last stable offset (v4+), log start offset (v5+).
    fixed = 30 if version >= FETCH_FIRST_LOG_START_OFFSET else 22
    replica = 4 if version >= FETCH_FIRST_PREFERRED_READ_REPLICA else 0
    empty = _EMPTY_COMPACT if flexible else _EMPTY
    view: memoryview | None = None
    pieces: list[bytes | memoryview] = []
    copied = 0
    refused: list[tuple[str, int]] = []
    kept = 0
    if pos > size:
        raise field_error("the fields before the topics", pos)
    topics, pos = read_length(frame, pos, flexible, 4, "topics count")
    if topics > size - pos:  # every topic takes more than a byte
        raise field_error("topics count", pos, f"{topics} is more than the bytes left")
    for _ in range(topics):
        name: str | None
        if by_id:
            end = pos + _UUID
            if end > size:
                raise field_error("topic id", pos)
            assert topic_name is not None
            name = topic_name(frame[pos:end])
        else:
            length, start = read_length(frame, pos, flexible, 2, "topic name length")
            end = start + length
            if length < 0 or end > size:
                raise field_error("topic name", pos, f"of length {length} does not fit")
            name = frame[start:end].decode("utf-8", errors="replace")
        pos = end
        partitions, pos = read_length(frame, pos, flexible, 4, "partitions count")
        if partitions > size - pos:
            raise field_error("partitions count", pos, f"{partitions} is more than the bytes left")
        for _ in range(partitions):
            if pos + fixed > size:
                raise field_error("partition", pos)
            index = int.from_bytes(frame[pos : pos + 4], "big", signed=True)
            if frame[pos + 4] or frame[pos + 5]:  # an error code: news the client must get at once
                kept += 1
            pos += fixed
            # Counts, lengths and empty tag sections are read inline: this loop runs per
            # partition, and a call per field doubled its cost.
            aborted_at = pos
            if not flexible:
                if pos + 4 > size:
                    raise field_error("aborted transactions count", pos)
                aborted = int.from_bytes(frame[pos : pos + 4], "big", signed=True)
                pos += 4
            elif pos < size and frame[pos] < 0x80:
                aborted = frame[pos] - 1
                pos += 1
            else:
                aborted, pos = read_length(frame, pos, True, 4, "aborted transactions count")
            if aborted > 0:
                if flexible:
                    for _ in range(aborted):
                        pos = skip_tagged(frame, pos + _ABORTED_TRANSACTION, "aborted transaction")
                else:
                    pos += aborted * _ABORTED_TRANSACTION
                if pos > size:
                    raise field_error("aborted transactions", pos)
            elif aborted < -1:
                raise field_error("aborted transactions count", aborted_at, f"is {aborted}")
            pos += replica
            records_at = pos
            if not flexible:
                if pos + 4 > size:
                    raise field_error("records length", pos)
                length = int.from_bytes(frame[pos : pos + 4], "big", signed=True)
                pos += 4
            elif pos < size and frame[pos] < 0x80:
                length = frame[pos] - 1
                pos += 1
            else:
                length, pos = read_length(frame, pos, True, 4, "records length")
            if length > 0:
                end = pos + length
                if end > size:
                    raise field_error("records", pos, f"of {length} bytes run past the end")
                if name is not None and not decide(name, index, length):
                    if view is None:
                        view = memoryview(frame)
                    pieces.append(view[copied:records_at])
                    pieces.append(empty)
                    copied = end
                    refused.append((name, index))
                else:
                    kept += 1
                pos = end
            elif length < -1:
                raise field_error("records length", records_at, f"is {length}")
            if flexible:
                if pos < size and frame[pos] == 0:
                    pos += 1
                else:  # diverging epoch, current leader, snapshot id: news too
                    pos = skip_tagged(frame, pos, "partition")
                    kept += 1
        if flexible:
            pos = skip_tagged(frame, pos, "topic")
    if flexible:
        pos = skip_tagged(frame, pos, "response")  # NodeEndpoints (v16+) among them
    if pos != size:
        raise field_error("the end of the response", pos, f"is followed by {size - pos} more bytes"
                          if pos < size else "runs past the end")
    if view is None:
        return frame, refused, kept
    pieces.append(view[copied:])
    return b"".join(pieces), refused, kept


__all__ = ["FETCH_FIRST_READABLE", "FETCH_LAST_READABLE", "PartitionDecision", "PartitionThrottlePolicy",
           "ThrottledFetch", "TopicNameOf", "empty_refused_partitions", "throttle_fetch",
           "throttle_fetch_response"]
