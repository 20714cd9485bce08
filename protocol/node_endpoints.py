"""Broker addresses inside the bodies of APIs kafka-python has no class for, read by hand.

ShareFetch and ShareAcknowledge responses (KIP-932) end with NodeEndpoints, the (node id, host,
port, rack) of the new leaders of partitions answered NOT_LEADER_OR_FOLLOWER, exactly like the
KIP-951 NodeEndpoints of Produce and Fetch. The array comes after every topic and partition, so
the reader steps over those (records by their length, never copied) to find it; each entry has
the layout of a Metadata broker entry, so `broker_array.read_brokers` reads it and the caller
splices in proxy addresses. Most responses carry none: those go on as the very same bytes.

DescribeQuorum v2+ (KIP-853) ends with Nodes, each controller's listeners (name, host, port).
The proxy stands for brokers, not controllers, so there is no proxy address to put there: the
array is emptied instead, which is what a client sees from a node whose endpoints are unknown
(kafka-metadata-quorum then prints the voters without "endpoints"), and no controller address
ever reaches a client.

The field order follows Kafka 4.3.1's `ShareFetchResponse.json`, `ShareAcknowledgeResponse.json`
and `DescribeQuorumResponse.json`. All versions of the three are flexible: compact strings and
arrays, a tagged-field section after every struct. Anything that does not add up raises
`MalformedBody` naming the field and offset.
"""

from __future__ import annotations

from .apis import ApiKey
from .broker_array import (
    BrokerArray,
    FieldError,
    read_brokers,
    read_length,
    read_string,
    skip_tagged,
)
from .errors import MalformedBody

#: The versions whose layout these readers know (Kafka 4.3.1's validVersions; v0 was KIP-932's
#: early access in Kafka 4.0 and differs only in the fields noted below).
SHARE_FETCH_VERSIONS = (0, 2)
SHARE_ACKNOWLEDGE_VERSIONS = (0, 2)
DESCRIBE_QUORUM_VERSIONS = (0, 2)
#: The versions the proxy can read for addresses, by API: it offers no other (`api_versions.py`).
READABLE_VERSIONS: dict[int, tuple[int, int]] = {
    ApiKey.SHARE_FETCH: SHARE_FETCH_VERSIONS,
    ApiKey.SHARE_ACKNOWLEDGE: SHARE_ACKNOWLEDGE_VERSIONS,
    ApiKey.DESCRIBE_QUORUM: DESCRIBE_QUORUM_VERSIONS,
}
#: ShareFetchResponse: AcquisitionLockTimeoutMs from v1, Records nullable only in v0.
SHARE_FETCH_FIRST_LOCK_TIMEOUT = 1
#: ShareAcknowledgeResponse: AcquisitionLockTimeoutMs from v2 (KIP-1222).
SHARE_ACKNOWLEDGE_FIRST_LOCK_TIMEOUT = 2
#: DescribeQuorumResponse v1 adds two timestamps per replica (KIP-836); v2 the error messages, each
#: replica's directory id and the Nodes array (KIP-853).
DESCRIBE_QUORUM_FIRST_TIMESTAMPS = 1
DESCRIBE_QUORUM_FIRST_NODES = 2
_UUID = 16
#: An empty compact array: what replaces DescribeQuorum's Nodes.
EMPTY_COMPACT_ARRAY = b"\x01"


def _count(frame: bytes, pos: int, what: str) -> tuple[int, int]:
    """A non-nullable compact array's count, refused when null or larger than the bytes left.

    Kafka's generated readers refuse both ("non-nullable field X was serialized as null", "Tried
    to allocate a collection of size N, but there are only M bytes remaining").
    """
    count, after = read_length(frame, pos, True, 4, f"{what} count")
    if count < 0:
        raise FieldError(f"{what} is null at offset {pos} (the schema does not allow it)")
    if count > len(frame) - after:
        raise FieldError(f"{what} of {count} entries in the {len(frame) - after} bytes left")
    return count, after


def _skip(frame: bytes, pos: int, width: int, what: str) -> int:
    end = pos + width
    if end > len(frame):
        raise FieldError(f"{what} ({width} bytes at offset {pos}) runs past the end")
    return end


def _skip_share_partition(frame: bytes, pos: int, fetch: bool, version: int, what: str) -> int:
    pos = _skip(frame, pos, 4, f"{what} partition index")
    pos = _skip(frame, pos, 2, f"{what} error code")
    _span, pos = read_string(frame, pos, True, True, f"{what} error message")
    if fetch:
        pos = _skip(frame, pos, 2, f"{what} acknowledge error code")
        _span, pos = read_string(frame, pos, True, True, f"{what} acknowledge error message")
    pos = _skip(frame, pos, 8, f"{what} current leader")  # LeaderId, LeaderEpoch
    pos = skip_tagged(frame, pos, f"{what} current leader")
    if fetch:
        length, start = read_length(frame, pos, True, 4, f"{what} records length")
        if length < -1 or (length == -1 and version >= SHARE_FETCH_FIRST_LOCK_TIMEOUT):
            raise FieldError(f"{what} records have length {length} at offset {pos}")
        pos = _skip(frame, start, max(length, 0), f"{what} records")
        acquired, pos = _count(frame, pos, f"{what} acquired records")
        for index in range(acquired):
            entry = f"{what} acquired records {index}"
            pos = _skip(frame, pos, 8, f"{entry} first offset")
            pos = _skip(frame, pos, 8, f"{entry} last offset")
            pos = _skip(frame, pos, 2, f"{entry} delivery count")
            pos = skip_tagged(frame, pos, entry)
    return skip_tagged(frame, pos, what)


def _share_node_endpoints(frame: bytes, pos: int, fetch: bool, version: int) -> BrokerArray:
    pos = _skip(frame, pos, 4, "throttle time")
    pos = _skip(frame, pos, 2, "error code")
    _span, pos = read_string(frame, pos, True, True, "error message")
    first_lock_timeout = SHARE_FETCH_FIRST_LOCK_TIMEOUT if fetch else SHARE_ACKNOWLEDGE_FIRST_LOCK_TIMEOUT
    if version >= first_lock_timeout:
        pos = _skip(frame, pos, 4, "acquisition lock timeout")
    topics, pos = _count(frame, pos, "responses")
    for topic in range(topics):
        what = f"topic {topic} of {topics}"
        pos = _skip(frame, pos, _UUID, f"{what} topic id")
        partitions, pos = _count(frame, pos, f"{what} partitions")
        for partition in range(partitions):
            pos = _skip_share_partition(frame, pos, fetch, version, f"{what} partition {partition}")
        pos = skip_tagged(frame, pos, what)
    return read_brokers(frame, pos, True, rack=True, is_fenced=False, array="node endpoints",
                        entry="node endpoint")


def share_node_endpoints(api_key: int, frame: bytes, body_offset: int, version: int) -> BrokerArray:
    """The NodeEndpoints array of a ShareFetch or ShareAcknowledge response body at `body_offset`.

    Refuses (`MalformedBody`) a version this reader does not know, rather than guess its layout.
    """
    fetch = api_key == ApiKey.SHARE_FETCH
    name = "ShareFetch" if fetch else "ShareAcknowledge"
    low, high = SHARE_FETCH_VERSIONS if fetch else SHARE_ACKNOWLEDGE_VERSIONS
    if not low <= version <= high:
        raise MalformedBody(f"{name} v{version} response: the proxy reads v{low} to v{high} only")
    try:
        return _share_node_endpoints(frame, body_offset, fetch, version)
    except FieldError as exc:
        raise MalformedBody(f"{name} v{version} response of {len(frame)} bytes does not parse: {exc}") \
            from None


def _skip_replica(frame: bytes, pos: int, version: int, what: str) -> int:
    pos = _skip(frame, pos, 4, f"{what} replica id")
    if version >= DESCRIBE_QUORUM_FIRST_NODES:
        pos = _skip(frame, pos, _UUID, f"{what} replica directory id")
    pos = _skip(frame, pos, 8, f"{what} log end offset")
    if version >= DESCRIBE_QUORUM_FIRST_TIMESTAMPS:
        pos = _skip(frame, pos, 8, f"{what} last fetch timestamp")
        pos = _skip(frame, pos, 8, f"{what} last caught up timestamp")
    return skip_tagged(frame, pos, what)


def _quorum_nodes_span(frame: bytes, pos: int, version: int) -> tuple[int, int]:
    pos = _skip(frame, pos, 2, "error code")
    _span, pos = read_string(frame, pos, True, True, "error message")
    topics, pos = _count(frame, pos, "topics")
    for topic in range(topics):
        what = f"topic {topic} of {topics}"
        _span, pos = read_string(frame, pos, True, False, f"{what} name")
        partitions, pos = _count(frame, pos, f"{what} partitions")
        for partition in range(partitions):
            part = f"{what} partition {partition}"
            pos = _skip(frame, pos, 4, f"{part} index")
            pos = _skip(frame, pos, 2, f"{part} error code")
            _span, pos = read_string(frame, pos, True, True, f"{part} error message")
            pos = _skip(frame, pos, 8, f"{part} leader id and epoch")
            pos = _skip(frame, pos, 8, f"{part} high watermark")
            for role in ("current voters", "observers"):
                replicas, pos = _count(frame, pos, f"{part} {role}")
                for replica in range(replicas):
                    pos = _skip_replica(frame, pos, version, f"{part} {role} {replica}")
            pos = skip_tagged(frame, pos, part)
        pos = skip_tagged(frame, pos, what)
    start = pos
    nodes, pos = _count(frame, pos, "nodes")
    for node in range(nodes):
        what = f"node {node} of {nodes}"
        pos = _skip(frame, pos, 4, f"{what} id")
        listeners, pos = _count(frame, pos, f"{what} listeners")
        for listener in range(listeners):
            entry = f"{what} listener {listener}"
            _span, pos = read_string(frame, pos, True, False, f"{entry} name")
            _span, pos = read_string(frame, pos, True, False, f"{entry} host")
            pos = _skip(frame, pos, 2, f"{entry} port")
            pos = skip_tagged(frame, pos, entry)
        pos = skip_tagged(frame, pos, what)
    return start, pos


def strip_quorum_nodes(frame: bytes, body_offset: int, version: int) -> bytes:
    """A DescribeQuorum response with its Nodes array emptied (v2+; earlier versions have none).

    Everything else, unknown tagged fields included, stays byte for byte.
    """
    low, high = DESCRIBE_QUORUM_VERSIONS
    if not low <= version <= high:
        raise MalformedBody(f"DescribeQuorum v{version} response: the proxy reads v{low} to v{high} only")
    if version < DESCRIBE_QUORUM_FIRST_NODES:
        return frame
    try:
        start, end = _quorum_nodes_span(frame, body_offset, version)
    except FieldError as exc:
        raise MalformedBody(f"DescribeQuorum v{version} response of {len(frame)} bytes does not parse: "
                            f"{exc}") from None
    if frame[start:end] == EMPTY_COMPACT_ARRAY:
        return frame
    return frame[:start] + EMPTY_COMPACT_ARRAY + frame[end:]


__all__ = [
    "DESCRIBE_QUORUM_VERSIONS", "READABLE_VERSIONS", "SHARE_ACKNOWLEDGE_VERSIONS", "SHARE_FETCH_VERSIONS",
    "share_node_endpoints", "strip_quorum_nodes",
]
