"""Client-address entities: KIP-612's `ip` quota entity, with CIDR prefixes beyond Kafka.

Kafka keys `connection_creation_rate` on an exact address (`/config/ips/1.2.3.4`) or its
`<default>`, and `max.connections.per.ip.overrides` on exact hosts. kthrottle also takes CIDR
prefixes ("10.1.0.0/16", "2001:db8::/32") for both. One precedence for every lookup:

1. the exact address,
2. the longest prefix that contains it,
3. `<default>`;

nothing set: unlimited (Kafka's `Int.MaxValue`).

Addresses are normalised as Java's `InetAddress.getByName` does: an IPv4-mapped IPv6 address
(`::ffff:10.0.0.1`, what a dual-stack socket reports for an IPv4 client) is the IPv4 address,
and an IPv6 zone (`fe80::1%eth0`) is dropped. A prefix inside `::ffff:0:0/96` becomes the IPv4
prefix it maps. A full-length prefix (/32, /128) is the exact address. Kafka also accepts host
names (resolved by DNS when the quota is applied); pure code resolves nothing, so only address
literals and prefixes are taken, and a host name is refused with its name in the message.

Values, as Kafka's KRaft controller validates an `ip` entity (ClientQuotaControlManager, the
AlterClientQuotas path): `connection_creation_rate` is an INT quota, refused when <= 0, when
fractional (a remainder above 1e-6) or above Int.MaxValue; the broker applies it with `toInt`.
A rate of exactly Int.MaxValue is Kafka's "unlimited" (`ConnectionQuotas` skips the IP sensor
when the rate equals `IP_CONNECTION_RATE_DEFAULT`), so an exact entity set to it exempts that
address from a prefix or default quota.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    ip_address,
    ip_network,
)
from typing import Generic, NamedTuple, TypeVar

from .entity import DEFAULT

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

#: The quota key (`kafka-configs --entity-type ips --add-config connection_creation_rate=N`).
CONNECTION_CREATION_RATE = "connection_creation_rate"

#: Kafka's `QuotaConfig.IP_CONNECTION_RATE_DEFAULT` (Int.MaxValue): no IP quota.
IP_CONNECTION_RATE_UNLIMITED = 2**31 - 1

#: Kafka's tolerance for an integral quota value (`getErrorForIntegralQuotaValue`).
_INTEGRAL_TOLERANCE = 1e-6

_MAPPED_V4 = IPv6Network("::ffff:0:0/96")


class IpEntityError(ValueError):
    """An `ip` entity name, a client address, or a value for one, that cannot be used."""


def normalize_address(address: str | IPAddress) -> IPAddress:
    """The address a quota applies to: IPv4-mapped IPv6 as IPv4, any IPv6 zone dropped."""
    if isinstance(address, str):
        text = address.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        try:
            parsed: IPAddress = ip_address(text)
        except ValueError:
            raise IpEntityError(f"{address!r} is not an IP address") from None
    else:
        parsed = address
    if isinstance(parsed, IPv6Address):
        if parsed.ipv4_mapped is not None:
            return parsed.ipv4_mapped
        if parsed.scope_id is not None:
            return IPv6Address(int(parsed))
    return parsed


def _normalize_network(network: IPNetwork) -> IPNetwork | IPAddress:
    if isinstance(network, IPv6Network) and network.prefixlen >= 96 and network.subnet_of(_MAPPED_V4):
        network = IPv4Network((int(network.network_address) & 0xFFFFFFFF, network.prefixlen - 96))
    if network.prefixlen == network.max_prefixlen:
        return network.network_address
    return network


def parse_ip_entity(name: str) -> str:
    """The canonical name of an `ip` entity: `<default>`, an address, or a prefix ("10.1.0.0/16").

    Raises IpEntityError naming `name` for anything else (a host name, a prefix with host bits set).
    """
    text = name.strip()
    if text == DEFAULT:
        return DEFAULT
    if "/" in text:
        try:
            network = ip_network(text, strict=True)
        except ValueError as exc:
            raise IpEntityError(f"ip entity {name!r} is not a valid CIDR prefix: {exc}") from None
        return str(_normalize_network(network))
    try:
        return str(normalize_address(text))
    except IpEntityError:
        raise IpEntityError(f"ip entity {name!r} is not an IP address, a CIDR prefix or {DEFAULT} "
                            "(host names are not resolved)") from None


def validate_connection_creation_rate(value: object, entity: str) -> int:
    """Kafka's checks for `connection_creation_rate` (an INT quota); returns the rate applied."""
    what = f"{CONNECTION_CREATION_RATE} for ip {entity}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise IpEntityError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise IpEntityError(f"{what} must be greater than 0, got {value!r}")
    if value > IP_CONNECTION_RATE_UNLIMITED:
        raise IpEntityError(f"{what} is too large for an INT: {value!r}")
    if abs(value % 1.0) > _INTEGRAL_TOLERANCE:
        raise IpEntityError(f"{what} cannot be a fractional value: {value!r}")
    return int(value)


V = TypeVar("V")


class Match(NamedTuple, Generic[V]):
    """What a lookup found: the entity's canonical name and its value."""

    entity: str
    value: V
    #: "ip" (the exact address), "cidr" (a prefix) or "default"
    level: str


class PrefixTable(Generic[V]):
    """Values by exact address, by prefix, and `<default>`; `lookup` applies the precedence.

    Prefixes are kept per IP version and prefix length, so a lookup costs one dict probe per
    distinct prefix length configured (longest first), however many prefixes there are.
    """

    __slots__ = ("_default", "_exact", "_lengths", "_prefixes")

    def __init__(self, entries: Mapping[str, V] | None = None) -> None:
        self._exact: dict[IPAddress, tuple[str, V]] = {}
        self._default: tuple[str, V] | None = None
        #: (version, prefix length) -> network address as int -> (canonical name, value)
        self._prefixes: dict[tuple[int, int], dict[int, tuple[str, V]]] = {}
        #: version -> prefix lengths present, longest first
        self._lengths: dict[int, list[int]] = {4: [], 6: []}
        seen: dict[str, str] = {}
        for name, value in (entries or {}).items():
            canonical = parse_ip_entity(name)
            if canonical in seen:
                raise IpEntityError(f"ip entities {seen[canonical]!r} and {name!r} are the same entity "
                                    f"({canonical})")
            seen[canonical] = name
            self._add(canonical, value)

    def _add(self, canonical: str, value: V) -> None:
        if canonical == DEFAULT:
            self._default = (canonical, value)
        elif "/" in canonical:
            network = ip_network(canonical)
            key = (network.version, network.prefixlen)
            if key not in self._prefixes:
                self._prefixes[key] = {}
                lengths = self._lengths[network.version]
                lengths.append(network.prefixlen)
                lengths.sort(reverse=True)
            self._prefixes[key][int(network.network_address)] = (canonical, value)
        else:
            self._exact[ip_address(canonical)] = (canonical, value)

    def lookup(self, address: IPAddress) -> Match[V] | None:
        """Exact address, then the longest prefix, then `<default>` (`address` normalised)."""
        found = self._exact.get(address)
        if found is not None:
            return Match(found[0], found[1], "ip")
        version = address.version
        lengths = self._lengths[version]
        if lengths:
            as_int = int(address)
            bits = address.max_prefixlen
            for length in lengths:
                mask = ((1 << length) - 1) << (bits - length)
                found = self._prefixes[(version, length)].get(as_int & mask)
                if found is not None:
                    return Match(found[0], found[1], "cidr")
        if self._default is not None:
            return Match(self._default[0], self._default[1], "default")
        return None

    @property
    def default(self) -> V | None:
        """The `<default>` value, if set."""
        return None if self._default is None else self._default[1]

    def entities(self) -> dict[str, V]:
        """Every entity by canonical name."""
        out = {name: value for name, value in self._exact.values()}
        for table in self._prefixes.values():
            out.update(table.values())
        if self._default is not None:
            out[self._default[0]] = self._default[1]
        return out

    def __len__(self) -> int:
        return len(self._exact) + sum(len(t) for t in self._prefixes.values()) + (self._default is not None)


class IpResolution(NamedTuple):
    """Where a connection from one address is charged, and at what bound."""

    #: the bucket key: the address itself (exact entity or `<default>`), or the prefix (shared)
    bucket: str
    bound: int
    #: the entity that matched (canonical name) and its level ("ip", "cidr", "default")
    entity: str
    level: str


class IpQuotas:
    """`connection_creation_rate` per `ip` entity (validated), resolved with the precedence above.

    Buckets: an exact entity and `<default>` charge one bucket per address, as Kafka's sensor
    per IP (`Connection-Accept-Rate-<ip>`); a prefix entity charges ONE bucket shared by every
    address it covers (and no nearer entity claims), so "10.1.2.0/24 = 20" holds the whole /24
    to 20 connections a second, as an operator limiting a NAT range or a noisy subnet means it.
    """

    __slots__ = ("_table",)

    def __init__(self, rates: Mapping[str, object] | None = None) -> None:
        checked: dict[str, int] = {}
        for name, value in (rates or {}).items():
            checked[name] = validate_connection_creation_rate(value, name)
        self._table: PrefixTable[int] = PrefixTable(checked)

    def resolve(self, address: IPAddress) -> IpResolution | None:
        """The bucket and bound for a normalised address; None: unlimited (nothing is recorded)."""
        match = self._table.lookup(address)
        if match is None or match.value == IP_CONNECTION_RATE_UNLIMITED:
            return None
        bucket = match.entity if match.level == "cidr" else str(address)
        return IpResolution(bucket, match.value, match.entity, match.level)

    def resolve_default(self) -> int | None:
        """The `<default>` rate; None when unset or unlimited."""
        match = self._table.default
        return None if match is None or match == IP_CONNECTION_RATE_UNLIMITED else match

    def rate_for(self, address: str | IPAddress) -> int:
        """Kafka's `connectionRateForIp`: the rate that applies, Int.MaxValue when none does."""
        match = self._table.lookup(normalize_address(address))
        return IP_CONNECTION_RATE_UNLIMITED if match is None else match.value

    def entities(self) -> dict[str, int]:
        """Every configured entity (canonical name) and its rate."""
        return self._table.entities()

    def updated(self, entity: str, rate: object | None) -> IpQuotas:
        """A copy with one entity set (or removed with None), as `updateIpConnectionRateQuota`."""
        canonical = parse_ip_entity(entity)
        rates: dict[str, object] = dict(self.entities())
        if rate is None:
            rates.pop(canonical, None)
        else:
            rates[canonical] = rate
        return IpQuotas(rates)

    def __len__(self) -> int:
        return len(self._table)


# -- max.connections.per.ip.overrides -----------------------------------------------------------


def parse_max_connections_per_ip_overrides(text: str) -> dict[str, int]:
    """Kafka's `max.connections.per.ip.overrides` ("host:count,ip:count", Csv.parseCsvMap).

    Entries are split on commas (whitespace around them ignored), each at its LAST colon (so
    "2001:db8::1:100" is 2001:db8::1 -> 100); a later entry for the same name wins. Names are
    addresses or CIDR prefixes (host names are not resolved); counts are integers >= 0.
    """
    out: dict[str, int] = {}
    if not text.strip():
        return out
    for raw in text.split(","):
        entry = raw.strip()
        host, sep, count = entry.rpartition(":")
        if not sep or not host.strip():
            raise IpEntityError(f"max.connections.per.ip.overrides entry {entry!r} is not host:count")
        name = parse_ip_entity(host.strip())
        if name == DEFAULT:
            raise IpEntityError(f"max.connections.per.ip.overrides entry {entry!r}: use "
                                "max.connections.per.ip for the default")
        try:
            value = int(count.strip())
        except ValueError:
            raise IpEntityError(f"max.connections.per.ip.overrides entry {entry!r}: "
                                f"count {count.strip()!r} is not an integer") from None
        if value < 0:
            raise IpEntityError(f"max.connections.per.ip.overrides entry {entry!r}: count must be >= 0")
        out[name] = value
    return out


__all__ = [
    "CONNECTION_CREATION_RATE", "IP_CONNECTION_RATE_UNLIMITED", "IPAddress", "IPNetwork", "IpEntityError",
    "IpQuotas", "IpResolution", "Match", "PrefixTable", "normalize_address", "parse_ip_entity",
    "parse_max_connections_per_ip_overrides", "validate_connection_creation_rate",
]
