"""One row of `/connections`: the wire schema both its writer (the proxy) and its reader
(`kthrottle top`, over a whole fleet) use, so that a field is named and checked in one place.

Pure: no I/O. The reader takes JSON from any proxy it is pointed at, so `from_json` checks every
field's type and names the one that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ConnectionRow:
    """One open client connection."""

    connection: str
    address: str
    port: int
    listener: str
    principal: str
    client_id: str | None
    software_name: str | None
    software_version: str | None
    age_seconds: float
    bytes_in_per_second: float
    bytes_out_per_second: float
    #: how long from now the connection stays muted (not read) by a throttle; 0: served normally
    throttle_ms: int
    #: the throttle time the proxy last decided for it (what its response's throttle_time_ms said)
    last_throttle_ms: int
    #: whose answer held it, set by a reader of several proxies (its metrics URL); "" at the proxy
    proxy: str = ""

    @property
    def throughput(self) -> float:
        return self.bytes_in_per_second + self.bytes_out_per_second

    @property
    def software(self) -> str:
        """name/version as the client sent them (KIP-511), or "-" when it sent none."""
        if self.software_name is None:
            return "-"
        version = self.software_version
        return f"{self.software_name}/{version}" if version else self.software_name

    def to_json(self) -> dict[str, Any]:
        return {
            "connection": self.connection, "address": self.address, "port": self.port,
            "listener": self.listener, "principal": self.principal, "client_id": self.client_id,
            "client_software_name": self.software_name, "client_software_version": self.software_version,
            "age_seconds": round(self.age_seconds, 3),
            "bytes_in_per_second": round(self.bytes_in_per_second, 1),
            "bytes_out_per_second": round(self.bytes_out_per_second, 1),
            "throttle_ms": self.throttle_ms, "last_throttle_ms": self.last_throttle_ms,
        }

    @classmethod
    def from_json(cls, item: object, proxy: str) -> ConnectionRow:
        """A row as `to_json` wrote it; ValueError naming the field that is not what it must be."""
        if not isinstance(item, dict):
            raise ValueError("a connection is not an object")
        return cls(
            connection=_text(item, "connection") or "", address=_text(item, "address") or "",
            port=int(_number(item, "port")), listener=_text(item, "listener") or "",
            principal=_text(item, "principal") or "", client_id=_text(item, "client_id"),
            software_name=_text(item, "client_software_name"),
            software_version=_text(item, "client_software_version"),
            age_seconds=_number(item, "age_seconds"),
            bytes_in_per_second=_number(item, "bytes_in_per_second"),
            bytes_out_per_second=_number(item, "bytes_out_per_second"),
            throttle_ms=int(_number(item, "throttle_ms")),
            last_throttle_ms=int(_number(item, "last_throttle_ms")),
            proxy=proxy,
        )


def _text(item: dict[str, Any], key: str) -> str | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{key} is {type(value).__name__}, not a string")
    return value


def _number(item: dict[str, Any], key: str) -> float:
    value = item.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} is {type(value).__name__}, not a number")
    return float(value)
