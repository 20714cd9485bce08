"""The Kafka APIs the proxy knows, read from kafka-python's schema-generated message classes.

A new Kafka version is a kafka-python update, not new code here: the version ranges and the
flexible-version thresholds (which decide the header formats) all come from Kafka's JSON schemas.
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
    DESCRIBE_CLUSTER = 60


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


def api_name(key: int) -> str:
    spec = KNOWN_APIS.get(key)
    return spec.name if spec else f"Unknown({key})"
