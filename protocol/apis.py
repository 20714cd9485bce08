"""The Kafka APIs the proxy knows, read from kafka-python's schema-generated message classes.

A new Kafka version is a kafka-python update, not new code here: the version ranges and the
flexible-version thresholds (which decide the header formats) all come from Kafka's JSON schemas.

APIs kafka-python has no class for still pass through, opaque: a request header gives the api
key, version, correlation id and client id whatever the API, and a response is matched by its
correlation id (its first 4 bytes). `OPAQUE_APIS` only adds what Kafka 4.3.1's schemas say about
the broker APIs kafka-python 3.0.12 lacks (their names, header formats and whether the throttle
is the first body field), so that metrics name them and a throttle can be reported in them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from kafka.protocol.api_message import ApiMessage

# Importing these modules registers every generated message class.
for _module in ("admin", "consumer", "metadata", "producer", "sasl"):
    importlib.import_module(f"kafka.protocol.{_module}")


class ApiKey(IntEnum):
    """The API keys the proxy treats specially (names as in Kafka's schemas)."""

    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    FIND_COORDINATOR = 10
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    SASL_AUTHENTICATE = 36
    DESCRIBE_CLIENT_QUOTAS = 48
    ALTER_CLIENT_QUOTAS = 49
    DESCRIBE_QUORUM = 55
    DESCRIBE_CLUSTER = 60
    SHARE_FETCH = 78
    SHARE_ACKNOWLEDGE = 79


@dataclass(frozen=True, slots=True)
class ApiSpec:
    """What the proxy knows about one API key."""

    key: int
    name: str
    min_version: int
    max_version: int
    first_flexible_version: int | None  # None: never flexible
    request_class: Any
    response_class: Any

    def is_flexible(self, version: int) -> bool:
        return self.first_flexible_version is not None and version >= self.first_flexible_version

    def request_header_version(self, version: int) -> int:
        """Request header v2 (tagged fields) for flexible versions, else v1."""
        return 2 if self.is_flexible(version) else 1

    def response_header_version(self, version: int) -> int:
        """Response header v1 for flexible versions, except ApiVersions which is always v0.

        ApiVersions keeps v0 so that a client can read the answer before it knows which
        versions the broker speaks (KIP-511).
        """
        if self.key == ApiKey.API_VERSIONS:
            return 0
        return 1 if self.is_flexible(version) else 0


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    sub: type
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


def _build_table() -> dict[int, ApiSpec]:
    requests: dict[int, Any] = {}
    responses: dict[int, Any] = {}
    for cls in _subclasses(ApiMessage):
        json = getattr(cls, "_json", None)
        if getattr(cls, "_class_version", None) is not None or not json:
            continue
        (requests if json["type"] == "request" else responses)[json["apiKey"]] = cls
    table: dict[int, ApiSpec] = {}
    for key, req in requests.items():
        resp = responses.get(key)
        if resp is None:
            continue
        low, high = req.valid_versions
        flex = req._flexible_versions
        first_flexible = None if flex is None or flex[0] < 0 else int(flex[0])
        table[key] = ApiSpec(key, req.name.removesuffix("Request"), int(low), int(high), first_flexible,
                             req, resp)
    return table


#: Every API key the proxy can frame and patch, by key.
KNOWN_APIS: dict[int, ApiSpec] = _build_table()


@dataclass(frozen=True, slots=True)
class OpaqueApi:
    """What Kafka's schema says about a broker API kafka-python has no class for.

    The proxy never decodes these bodies (except the NodeEndpoints of ShareFetch and
    ShareAcknowledge, read by hand in `node_endpoints.py`); it needs only the header formats, to
    find the body, and whether `ThrottleTimeMs` is the first body field, to report a throttle.
    """

    key: int
    name: str
    #: the newest version whose layout this entry describes (Kafka 4.3.1's validVersions)
    max_version: int
    first_flexible_version: int
    #: `ThrottleTimeMs` is the first body field in every version up to `max_version`
    throttle_first: bool

    def is_flexible(self, version: int) -> bool:
        return version >= self.first_flexible_version

    def request_header_version(self, version: int) -> int:
        return 2 if self.is_flexible(version) else 1

    def response_header_version(self, version: int) -> int:
        return 1 if self.is_flexible(version) else 0


def _opaque(key: int, name: str, max_version: int, first_flexible: int = 0,
            throttle_first: bool = True) -> tuple[int, OpaqueApi]:
    return key, OpaqueApi(key, name, max_version, first_flexible, throttle_first)


#: The broker-listener APIs of Kafka 4.3.1 (`"listeners"` includes "broker" in
#: clients/src/main/resources/common/message/*Request.json) that kafka-python 3.0.12 has no class for.
#: Every one is flexible from its first version (KIP-482) except the delegation-token APIs, whose
#: `ThrottleTimeMs` follows `ErrorCode`; the share-group state APIs (83-87) have no throttle field.
_OPAQUE_TABLE: dict[int, OpaqueApi] = dict([
    _opaque(38, "CreateDelegationToken", 3, 2, throttle_first=False),
    _opaque(39, "RenewDelegationToken", 2, 2, throttle_first=False),
    _opaque(40, "ExpireDelegationToken", 2, 2, throttle_first=False),
    _opaque(41, "DescribeDelegationToken", 3, 2, throttle_first=False),
    _opaque(64, "UnregisterBroker", 0),
    _opaque(68, "ConsumerGroupHeartbeat", 1),  # KIP-848
    _opaque(69, "ConsumerGroupDescribe", 1),
    _opaque(71, "GetTelemetrySubscriptions", 0),  # KIP-714
    _opaque(72, "PushTelemetry", 0),
    _opaque(76, "ShareGroupHeartbeat", 1),  # KIP-932
    _opaque(77, "ShareGroupDescribe", 1),
    _opaque(ApiKey.SHARE_FETCH, "ShareFetch", 2),
    _opaque(ApiKey.SHARE_ACKNOWLEDGE, "ShareAcknowledge", 2),
    _opaque(80, "AddRaftVoter", 1),  # KIP-853
    _opaque(81, "RemoveRaftVoter", 0),
    _opaque(83, "InitializeShareGroupState", 0, throttle_first=False),
    _opaque(84, "ReadShareGroupState", 0, throttle_first=False),
    _opaque(85, "WriteShareGroupState", 1, throttle_first=False),
    _opaque(86, "DeleteShareGroupState", 0, throttle_first=False),
    _opaque(87, "ReadShareGroupStateSummary", 1, throttle_first=False),
    _opaque(88, "StreamsGroupHeartbeat", 0),  # KIP-1071
    _opaque(89, "StreamsGroupDescribe", 0),
    _opaque(90, "DescribeShareGroupOffsets", 1),
    _opaque(91, "AlterShareGroupOffsets", 0),
    _opaque(92, "DeleteShareGroupOffsets", 0),
])

#: Opaque APIs described by Kafka's schemas; a kafka-python class, once it has one, wins.
OPAQUE_APIS: dict[int, OpaqueApi] = {k: v for k, v in _OPAQUE_TABLE.items() if k not in KNOWN_APIS}


def api_name(key: int) -> str:
    spec = KNOWN_APIS.get(key)
    if spec is not None:
        return spec.name
    opaque = OPAQUE_APIS.get(key)
    return opaque.name if opaque is not None else f"Unknown({key})"


def response_header_version(key: int, version: int) -> int | None:
    """The response header version (0 or 1) of an API at a version, None where it is not known.

    Not known: a key no schema describes. The correlation id is the first 4 bytes of either
    header version, so such a response is still matched to its request and forwarded as it is.
    """
    spec = KNOWN_APIS.get(key)
    if spec is not None:
        return spec.response_header_version(version)
    opaque = OPAQUE_APIS.get(key)
    return opaque.response_header_version(version) if opaque is not None else None
