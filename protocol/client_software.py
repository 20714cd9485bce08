"""KIP-511's client software name and version, read from an ApiVersions request v3+ (pure).

Since ApiVersions v3 every client names its library and version in its first request on each
connection (Java's "apache-kafka-java" 3.9.0, librdkafka's "confluent-kafka-python" 2.6.0-rdkafka-...),
which is what an operator asks first about a misbehaving connection. The proxy reads it only from
that one request, once per connection, with kafka-python's schema class, so no other request pays.

Reading it is observation only: a body that does not parse yields None, and the request goes on to
the broker untouched, which answers INVALID_REQUEST as Kafka does (the proxy does not close a
connection for a field it merely reports).
"""

from __future__ import annotations

from typing import NamedTuple

from .apis import KNOWN_APIS, ApiKey
from .errors import MalformedBody
from .headers import RequestHeader
from .skim import decode_strict

#: ApiVersions v3 (KIP-511) added ClientSoftwareName and ClientSoftwareVersion.
FIRST_VERSION = 3


class ClientSoftware(NamedTuple):
    """What the client says it is: its library's name and version, as sent (not validated)."""

    name: str
    version: str


def read_client_software(frame: bytes, header: RequestHeader) -> ClientSoftware | None:
    """The client software an ApiVersions v3+ request names; None for any other request, an older
    version, a version above the schemas, or a body that does not parse."""
    if header.api_key != ApiKey.API_VERSIONS or header.api_version < FIRST_VERSION:
        return None
    spec = KNOWN_APIS[ApiKey.API_VERSIONS]
    if header.api_version > spec.max_version or header.body_offset < 0:
        return None
    try:
        message = decode_strict(spec.request_class, frame, header.body_offset, header.api_version,
                                f"ApiVersions v{header.api_version} request")
    except MalformedBody:
        return None
    name, version = message.client_software_name, message.client_software_version
    if not isinstance(name, str) or not isinstance(version, str):  # null: Kafka refuses it too
        return None
    return ClientSoftware(name, version)


__all__ = ["FIRST_VERSION", "ClientSoftware", "read_client_software"]
