"""Rewriting broker addresses in responses so that clients only ever learn proxy addresses.

Node ids are kept as they are, so leader routing and coordinator lookups stay consistent; only
(host, port) change, to the proxy listener that stands for that node id. The real addresses seen
on the way are returned, so the proxy knows where each node id lives.

Metadata and DescribeCluster responses can be large (every topic and partition of the cluster), so
only their brokers array is read (`broker_array.py`) and each (host, port) pair is replaced in
place: the cost does not grow with the topics, and the rest goes on byte for byte. A Fetch v16+
response's NodeEndpoints are found by stepping over its records and spliced the same way
(`fetch_stream.py`, which also rewrites them in responses streamed before they are complete).
FindCoordinator answers are small and Produce NodeEndpoints rare, so those are decoded and
re-encoded.
ShareFetch and ShareAcknowledge (no kafka-python class) have their NodeEndpoints found by a
hand-written reader and spliced like a brokers array; DescribeQuorum's controller listeners are
removed, since no proxy listener stands for a controller (`node_endpoints.py`).

Every other response of Kafka 4.3.1 that names a host is left alone because the host is not a
broker's: ClientHost in DescribeGroups, ConsumerGroupDescribe, ShareGroupDescribe and
StreamsGroupDescribe is the client's (as the broker saw it: the proxy's), Host in DescribeAcls and
DeleteAcls is an ACL pattern, and StreamsGroupHeartbeat/StreamsGroupDescribe Endpoints are the
Kafka Streams instances' own `application.server` addresses. Vote, BeginQuorumEpoch,
EndQuorumEpoch, FetchSnapshot and UpdateRaftVoter do carry controller addresses, but only
controllers serve them (their schemas' "listeners" lack "broker"), so they never come through a
broker connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .apis import KNOWN_APIS, ApiKey, api_name
from .broker_array import (
    Address,
    Advertise,
    BrokerArray,
    describe_cluster_brokers,
    encode_address,
    metadata_brokers,
)
from .errors import MalformedBody, MalformedHeader
from .fetch_stream import FETCH_STREAM_VERSIONS, rewrite_fetch_response
from .headers import response_body_offset
from .node_endpoints import share_node_endpoints, strip_quorum_nodes
from .skim import produce_response_has_tags

#: APIs whose responses carry broker (or controller) addresses, with the first version that may
#: carry them: KIP-951 NodeEndpoints appear in Produce v10+ and Fetch v16+, KIP-932's in every
#: ShareFetch and ShareAcknowledge version, KIP-853's controller Nodes in DescribeQuorum v2+.
ADDRESS_BEARING: dict[int, int] = {
    ApiKey.METADATA: 0,
    ApiKey.FIND_COORDINATOR: 0,
    ApiKey.DESCRIBE_CLUSTER: 0,
    ApiKey.PRODUCE: 10,
    ApiKey.FETCH: 16,
    ApiKey.DESCRIBE_QUORUM: 2,
    ApiKey.SHARE_FETCH: 0,
    ApiKey.SHARE_ACKNOWLEDGE: 0,
}


@dataclass(slots=True)
class RewriteResult:
    frame: bytes
    #: real addresses learned from this response, by node id
    discovered: dict[int, Address] = field(default_factory=dict)


def needs_rewrite(api_key: int, api_version: int) -> bool:
    first = ADDRESS_BEARING.get(api_key)
    return first is not None and api_version >= first


def _swap(node: Any, node_id: int, advertise: Advertise, seen: dict[int, Address]) -> bool:
    """Point one (host, port) pair at the proxy; False when the node is a placeholder."""
    if node_id < 0 or not node.host:
        return False  # "no coordinator" / unknown leader: nothing to rewrite
    seen[node_id] = (node.host, node.port)
    node.host, node.port = advertise(node_id)
    return True


def _splice_brokers(frame: bytes, array: BrokerArray, advertise: Advertise) -> RewriteResult:
    """Replace each real broker's (host, port) bytes; copy everything else as it is."""
    seen: dict[int, Address] = {}
    view = memoryview(frame)
    pieces: list[bytes | memoryview] = []
    copied = 0
    for broker in array.brokers:
        if broker.node_id < 0 or not broker.host:
            continue  # a placeholder entry: nothing to rewrite
        seen[broker.node_id] = (broker.host, broker.port)
        host, port = advertise(broker.node_id)
        pieces.append(view[copied : broker.address_start])
        pieces.append(encode_address(host, port, array.flexible))
        copied = broker.address_end
    if not pieces:
        return RewriteResult(frame, seen)
    pieces.append(view[copied:])
    return RewriteResult(b"".join(pieces), seen)


def rewrite_addresses(api_key: int, api_version: int, frame: bytes, header_version: int,
                      advertise: Advertise) -> RewriteResult:
    """Rewrite every broker address in a response frame (header included, size prefix not).

    Responses without addresses (most Produce, Fetch and ShareFetch responses) come back as the
    very same bytes, so nothing is re-encoded on the hot path unless it must be.
    """
    try:
        start = response_body_offset(frame, header_version)
    except MalformedHeader as exc:
        raise MalformedHeader(f"{api_name(api_key)} v{api_version} response header: {exc}") from None
    if api_key == ApiKey.METADATA:
        return _splice_brokers(frame, metadata_brokers(frame, start, api_version), advertise)
    if api_key == ApiKey.DESCRIBE_CLUSTER:
        return _splice_brokers(frame, describe_cluster_brokers(frame, start, api_version), advertise)
    if api_key in (ApiKey.SHARE_FETCH, ApiKey.SHARE_ACKNOWLEDGE):
        return _splice_brokers(frame, share_node_endpoints(api_key, frame, start, api_version), advertise)
    if api_key == ApiKey.DESCRIBE_QUORUM:
        # Controllers' addresses: removed, not reported (the proxy opens no listener for them).
        return RewriteResult(strip_quorum_nodes(frame, start, api_version))
    spec = KNOWN_APIS[api_key]
    if api_key == ApiKey.FETCH:
        # Found by stepping over the records, and spliced: the records are never decoded.
        low, high = FETCH_STREAM_VERSIONS
        if not low <= api_version <= high:
            raise MalformedBody(f"Fetch v{api_version} response: the proxy reads v{low} to v{high} only")
        return RewriteResult(*rewrite_fetch_response(frame, advertise))
    # NodeEndpoints is a top-level tagged field: a Produce response without any (the broker adds
    # them only when a leader moved) goes on untouched, skimmed but not decoded.
    if api_key == ApiKey.PRODUCE and not produce_response_has_tags(frame, start, api_version):
        return RewriteResult(frame)
    try:
        message = spec.response_class.decode(memoryview(frame)[start:], version=api_version)
    except Exception as exc:  # kafka-python raises several types for bad bytes
        raise MalformedBody(
            f"{spec.name} v{api_version} response of {len(frame)} bytes does not parse: {exc}"
        ) from exc
    seen: dict[int, Address] = {}
    changed = False
    if api_key == ApiKey.FIND_COORDINATOR:
        if api_version < 4:
            changed |= _swap(message, message.node_id, advertise, seen)
        else:
            for coordinator in message.coordinators:
                changed |= _swap(coordinator, coordinator.node_id, advertise, seen)
    else:  # Produce: the KIP-951 NodeEndpoints tagged field
        for endpoint in message.node_endpoints or ():
            changed |= _swap(endpoint, endpoint.node_id, advertise, seen)
    if not changed:
        return RewriteResult(frame, seen)
    body = message.encode()  # decoded messages keep their version
    return RewriteResult(frame[:start] + bytes(body), seen)
