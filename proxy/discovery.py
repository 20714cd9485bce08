"""Asking the cluster for its brokers at start-up, so every broker port is open before clients come.

Only works on listeners that need no authentication; on SASL listeners the proxy learns the
brokers from the first Metadata response a client receives instead.
"""

from __future__ import annotations

import asyncio

from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from config.settings import Address
from protocol.apis import ApiKey
from protocol.frames import frame
from protocol.headers import encode_request_header

#: Metadata v9 (first flexible version) is spoken by every Kafka since 2.4 and still by 4.x.
_VERSION = 9


async def fetch_brokers(host: str, port: int, timeout: float = 5.0) -> dict[int, Address]:
    """Brokers (node id -> address) listed by one upstream server."""
    body = MetadataRequest[_VERSION](topics=[], allow_auto_topic_creation=False,
                                     include_topic_authorized_operations=False).encode()
    request = encode_request_header(ApiKey.METADATA, _VERSION, 1, "kthrottle-discovery") + bytes(body)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(frame(request))
        size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), timeout), "big")
        response = await asyncio.wait_for(reader.readexactly(size), timeout)
    finally:
        writer.close()
    # Response header v1: correlation id and an empty tagged-field section.
    metadata = MetadataResponse.decode(memoryview(response)[5:], version=_VERSION)
    return {broker.node_id: (broker.host, broker.port) for broker in metadata.brokers}


async def discover_brokers(upstream: list[Address]) -> dict[int, Address]:
    errors = []
    for host, port in upstream:
        try:
            return await fetch_brokers(host, port)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
    raise ConnectionError("; ".join(errors))
