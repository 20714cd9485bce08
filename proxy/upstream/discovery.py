"""Asking the cluster for its brokers at start-up, so every broker port is open before clients come.

Works on listeners that need no authentication, over TLS too (`[upstream_tls]`); on SASL
listeners the proxy learns the brokers from the first Metadata response a client receives instead.
"""

from __future__ import annotations

import ssl
import struct
import uuid
from collections.abc import Sequence
from typing import Any

from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from config.common import Address
from protocol.apis import ApiKey

from .one_request import UpstreamError, describe_error, request_once

#: Metadata v9 (first flexible version) is spoken by every Kafka since 2.4 and still by 4.x.
_VERSION = 9
#: Metadata v10 (Kafka 2.8+) is the first to give topic ids.
_TOPIC_ID_VERSION = 10


async def fetch_metadata(host: str, port: int, tls: ssl.SSLContext | None = None, timeout: float = 5.0,
                         client_id: str = "kthrottle-discovery", topics: Sequence[str] = ()) -> Any:
    """One Metadata v9 answer (no topics) from one upstream server, over TLS with `tls` (the
    broker's certificate checked against `host`, as for client connections); with `topics`, a v10
    answer about them (their ids). Raises UpstreamError naming the address and what happened."""
    version = _TOPIC_ID_VERSION if topics else _VERSION
    Request = MetadataRequest[version]
    wanted = [Request.MetadataRequestTopic(topic_id=uuid.UUID(int=0), name=name) for name in topics]
    body = Request(topics=wanted, allow_auto_topic_creation=False,
                   include_topic_authorized_operations=False).encode()
    response = await request_once(host, port, ApiKey.METADATA, version, bytes(body), tls=tls,
                                  timeout_s=timeout, client_id=client_id)
    # Response header v1: correlation id and an empty tagged-field section.
    try:
        return MetadataResponse.decode(memoryview(response)[5:], version=version)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:  # kafka-python on garbage bytes
        raise ValueError(f"not a Metadata v{version} answer: {exc}") from exc


async def fetch_brokers(host: str, port: int, tls: ssl.SSLContext | None = None,
                        timeout: float = 5.0) -> dict[int, Address]:
    """Brokers (node id -> address) listed by one upstream server."""
    metadata = await fetch_metadata(host, port, tls, timeout)
    return {broker.node_id: (broker.host, broker.port) for broker in metadata.brokers}


async def fetch_topic_ids(upstream: list[Address], topics: Sequence[str],
                          tls: ssl.SSLContext | None = None) -> dict[str, bytes]:
    """The ids of `topics` the cluster knows (name -> 16 bytes), from the first server that answers."""
    errors = []
    for host, port in upstream:
        try:
            metadata = await fetch_metadata(host, port, tls, client_id="kthrottle-topic-ids", topics=topics)
        except (OSError, ValueError) as exc:
            errors.append(_failure(host, port, exc))
            continue
        return {topic.name: topic.topic_id.bytes for topic in metadata.topics
                if topic.error_code == 0 and topic.topic_id is not None}
    raise UpstreamError("; ".join(errors))


async def discover_brokers(upstream: list[Address], tls: ssl.SSLContext | None = None,
                           timeout: float = 5.0) -> dict[int, Address]:
    """The brokers, from the first bootstrap server that answers Metadata; UpstreamError says why
    none did, server by server."""
    errors = []
    for host, port in upstream:
        try:
            return await fetch_brokers(host, port, tls, timeout)
        except (OSError, ValueError) as exc:
            errors.append(_failure(host, port, exc))
    raise UpstreamError("; ".join(errors))


def _failure(host: str, port: int, exc: BaseException) -> str:
    """One server's failure; UpstreamError's text already starts with the address."""
    return str(exc) if isinstance(exc, UpstreamError) else f"{host}:{port}: {describe_error(exc, 0)}"
