"""Settings of client addresses: connection-creation rates, per-IP overrides, the PROXY protocol.

Behind a proxy the brokers see one address, the proxy's, so what Kafka keys on the client's address
must be set here (docs/client-addresses.md). These are keys of the `[proxy]` table, named after
Kafka's broker settings:

    max_connection_creation_rate = 200            # max.connection.creation.rate: the whole proxy
    listener_max_connection_creation_rate = 50    # listener.name.L.max.connection.creation.rate:
                                                  # each listener (the bootstrap port and each
                                                  # broker's port, as each broker has its own)
    max_connections_per_ip_overrides = "10.0.0.7:500,10.2.0.0/16:20"   # or a table {"10.0.0.7" = 500}
    proxy_protocol = "v2"                         # "v1", "v2" or "v1,v2": a PROXY header is required
    proxy_protocol_trusted = ["10.0.0.0/8"]       # load balancers allowed to send it

Over a connection-creation rate, accepting waits (at most one quota window), as Kafka's acceptor
does; nothing is refused. A PROXY header is required of every connection on a listener with
`proxy_protocol`, and taken only from a peer in `proxy_protocol_trusted`: anything else is closed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from quotas.ip_entities import (
    IpEntityError,
    normalize_address,
    parse_ip_entity,
    parse_max_connections_per_ip_overrides,
)

from .common import SettingsError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The `[proxy]` keys this module reads.
CLIENT_ADDRESS_KEYS = frozenset({
    "max_connection_creation_rate", "listener_max_connection_creation_rate",
    "max_connections_per_ip_overrides", "proxy_protocol", "proxy_protocol_trusted",
})

#: Kafka's INT bound for a rate.
_INT_MAX = 2**31 - 1


@dataclass(slots=True)
class ClientAddressSettings:
    #: Kafka's max.connection.creation.rate: new connections per second, the whole proxy; None: unlimited
    max_connection_creation_rate: int | None = None
    #: Kafka's listener.name.L.max.connection.creation.rate, for each listener; None: unlimited
    listener_max_connection_creation_rate: int | None = None
    #: Kafka's max.connections.per.ip.overrides, by address or CIDR prefix
    max_connections_per_ip_overrides: dict[str, int] = field(default_factory=dict)
    #: PROXY protocol versions a header may use; empty: no header is read (the socket's address counts)
    proxy_protocol: frozenset[int] = frozenset()
    #: peers (load balancers) allowed to send a PROXY header
    proxy_protocol_trusted: tuple[IPNetwork, ...] = ()

    def trusts(self, address: str) -> bool:
        """Whether a peer may send a PROXY header (IPv4-mapped IPv6 peers count as IPv4)."""
        try:
            ip = normalize_address(address)
        except IpEntityError:
            return False
        return any(ip.version == net.version and ip in net for net in self.proxy_protocol_trusted)


def _rate(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _INT_MAX:
        raise SettingsError(f"proxy.{key} = {value!r} must be a whole number of connections per second, "
                            f"1 .. {_INT_MAX}")
    return value


def _overrides(value: Any) -> dict[str, int]:
    try:
        if isinstance(value, str):
            return parse_max_connections_per_ip_overrides(value)
        if isinstance(value, Mapping):
            table: dict[str, int] = {}
            for name, count in value.items():
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise SettingsError(f"proxy.max_connections_per_ip_overrides[{name!r}] = {count!r} "
                                        "must be an integer >= 0")
                table[parse_ip_entity(str(name))] = count
            return table
    except IpEntityError as exc:
        raise SettingsError(f"proxy.max_connections_per_ip_overrides: {exc}") from exc
    raise SettingsError(f"proxy.max_connections_per_ip_overrides = {value!r} must be \"ip:count,...\" "
                        "or a table of counts")


def _versions(value: Any) -> frozenset[int]:
    names = [part.strip() for part in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(n in ("v1", "v2") for n in names):
        raise SettingsError(f'proxy.proxy_protocol = {value!r} must be "v1", "v2" or "v1,v2"')
    return frozenset(int(n[1]) for n in names)


def _trusted(value: Any) -> tuple[IPNetwork, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SettingsError(f"proxy.proxy_protocol_trusted = {value!r} must be a list of addresses or CIDR "
                            'prefixes, like ["10.0.0.0/8"]')
    networks = []
    for text in value:
        try:
            networks.append(ipaddress.ip_network(text.strip(), strict=True))
        except ValueError as exc:
            raise SettingsError(f"proxy.proxy_protocol_trusted entry {text!r} is not an address or CIDR "
                                f"prefix: {exc}") from exc
    return tuple(networks)


def parse_client_addresses(values: Mapping[str, Any]) -> ClientAddressSettings:
    """The client-address keys of the `[proxy]` table; raises SettingsError naming key and value."""
    settings = ClientAddressSettings()
    for key, value in values.items():
        if key in ("max_connection_creation_rate", "listener_max_connection_creation_rate"):
            setattr(settings, key, _rate(key, value))
        elif key == "max_connections_per_ip_overrides":
            settings.max_connections_per_ip_overrides = _overrides(value)
        elif key == "proxy_protocol":
            settings.proxy_protocol = _versions(value)
        elif key == "proxy_protocol_trusted":
            settings.proxy_protocol_trusted = _trusted(value)
        else:
            raise SettingsError(f"unknown setting proxy.{key}")
    if settings.proxy_protocol and not settings.proxy_protocol_trusted:
        raise SettingsError("proxy.proxy_protocol is set but proxy.proxy_protocol_trusted is empty: name "
                            "the load balancers allowed to send PROXY headers (every connection would be "
                            "refused)")
    if settings.proxy_protocol_trusted and not settings.proxy_protocol:
        raise SettingsError("proxy.proxy_protocol_trusted is set but proxy.proxy_protocol is not: "
                            'set proxy_protocol = "v1", "v2" or "v1,v2"')
    return settings


__all__ = ["CLIENT_ADDRESS_KEYS", "ClientAddressSettings", "parse_client_addresses"]
