"""The `[fleet]` table: several kthrottle processes enforcing one quota per entity (issue 11).

Without the table a proxy is alone, exactly as before. With it, the proxy exchanges its usage with
the other members over UDP (proxy/fleet/exchange.py) and finds them in a static list, in ZooKeeper
(proxy/fleet/membership.py) or through a group on the upstream cluster (proxy/fleet/kafka_group.py).
Every value is checked here, at start, and an error names the setting and the value, so a fleet
never half-starts with a typo:

```toml
[fleet]
name = "orders-cluster"           # default: the upstream cluster id (proxies in front of one cluster meet)
listen = "0.0.0.0:9190"           # UDP address the usage datagrams arrive on
advertise = "proxy-a.example:9190"  # what peers send to (default: listen; required for a wildcard listen)
secret_file = "/etc/kthrottle/fleet.secret"   # or $KTHROTTLE_FLEET_SECRET; at least 16 bytes
membership = "static"             # or "zookeeper", or "kafka" (a group on the upstream cluster)
peers = ["proxy-b.example:9190", "proxy-c.example:9190"]
sync_interval_ms = 100            # changed usage this often
full_sync_interval_ms = 1000      # all usage this often
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from quotas.fleet import MAX_FLEET_NAME_BYTES, MIN_SECRET_BYTES, URGENT_MIN_INTERVAL_MS

from .common import Address, SettingsError, parse_address

#: Where the fleet secret comes from when `secret_file` is not set (kept out of files and `ps`).
SECRET_ENV = "KTHROTTLE_FLEET_SECRET"

#: How often changed usage is sent. 100 ms is gubernator's GLOBAL-mode sync period; two of them
#: are well inside the smallest quota window Kafka allows (one sample of 1 s).
DEFAULT_SYNC_INTERVAL_MS = 100
#: How often all usage is sent, changed or not (Redpanda's quota balancer runs every 750 ms).
DEFAULT_FULL_SYNC_INTERVAL_MS = 1000
#: A delta sync more often than urgent reports may come would only add traffic.
MIN_SYNC_INTERVAL_MS = URGENT_MIN_INTERVAL_MS
#: A peer's usage counts fully for 3 full syncs after its last report (quotas/fleet.py), so a full
#: sync above 10 s would keep a dead member's usage for over 30 s: longer than any quota window
#: (Kafka's default quota.window.num x quota.window.size.seconds is 11 s).
MAX_FULL_SYNC_INTERVAL_MS = 10_000
#: How many full syncs a peer's usage stays at full weight after its last report.
STALE_AFTER_FULL_SYNCS = 3

MEMBERSHIPS = ("static", "zookeeper", "kafka")


@dataclass(slots=True)
class FleetSettings:
    """A checked `[fleet]` table (see the module docstring)."""

    #: UDP address usage datagrams arrive on.
    listen: Address
    #: The HMAC-SHA256 key every member shares (at least MIN_SECRET_BYTES).
    secret: bytes
    #: The fleet's name; None means the upstream cluster id, read at start.
    name: str | None = None
    #: What peers send to; None means `listen`.
    advertise: Address | None = None
    membership: str = "static"
    #: Static membership: every member's advertised address (this one's may be listed too).
    peers: list[Address] = field(default_factory=list)
    #: ZooKeeper membership: the connect string and chroot (default: proxy.zookeeper and its chroot).
    zookeeper: str | None = None
    zookeeper_chroot: str | None = None
    sync_interval_ms: int = DEFAULT_SYNC_INTERVAL_MS
    full_sync_interval_ms: int = DEFAULT_FULL_SYNC_INTERVAL_MS
    #: A UDP socket inherited from `kthrottle run --workers` (its descriptor), used instead of
    #: binding `listen`: the supervisor keeps it, so a restarted worker keeps its address.
    inherited_fd: int | None = None

    @property
    def advertised(self) -> Address:
        return self.advertise or self.listen

    @property
    def stale_after_ms(self) -> int:
        return STALE_AFTER_FULL_SYNCS * self.full_sync_interval_ms

    def check(self, proxy_zookeeper: str | None, proxy_zookeeper_chroot: str | None) -> None:
        """What needs the `[proxy]` table too: ZooKeeper membership needs an ensemble, by default
        the proxy's own (`proxy.zookeeper`, `proxy.zookeeper_chroot`)."""
        if self.membership != "zookeeper":
            return
        if self.zookeeper is None:
            self.zookeeper = proxy_zookeeper
        if self.zookeeper_chroot is None:
            self.zookeeper_chroot = proxy_zookeeper_chroot
        if not self.zookeeper:
            raise SettingsError('fleet.membership = "zookeeper" needs a connect string: set fleet.zookeeper '
                                "or proxy.zookeeper")
        if _wildcard(self.advertised[0]):
            raise SettingsError(f"fleet.advertise is needed: fleet.listen = {_show(self.listen)!r} is a "
                                "wildcard address, which peers cannot send to")


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def _positive_int(key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SettingsError(f"fleet.{key} = {value!r} must be a positive integer")
    return value


def _string(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"fleet.{key} = {value!r} must be a non-empty string")
    return value.strip()


def check_name(name: str, what: str = "fleet.name") -> str:
    """A fleet name travels in every datagram: at most MAX_FLEET_NAME_BYTES of UTF-8, not empty."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise SettingsError(f"{what} = {name!r} is not valid UTF-8: {exc}") from exc
    if size == 0 or size > MAX_FLEET_NAME_BYTES:
        raise SettingsError(f"{what} = {name!r} is {size} bytes of UTF-8; it must be "
                            f"1..{MAX_FLEET_NAME_BYTES}")
    return name


def read_secret(secret_file: Path | None, environ: Mapping[str, str]) -> bytes:
    """The fleet secret from its file (whitespace around it ignored) or from $KTHROTTLE_FLEET_SECRET."""
    from_env = environ.get(SECRET_ENV)
    if secret_file is not None:
        if from_env:
            raise SettingsError(f"fleet.secret_file = {str(secret_file)!r} and ${SECRET_ENV} are both set: "
                                "keep one, so it is clear which secret the fleet uses")
        try:
            secret = secret_file.read_bytes().strip()
        except OSError as exc:
            raise SettingsError(f"fleet.secret_file = {str(secret_file)!r} cannot be read: {exc}") from exc
        where = f"fleet.secret_file = {str(secret_file)!r}"
    elif from_env:
        secret = from_env.strip().encode("utf-8", "surrogateescape")
        where = f"${SECRET_ENV}"
    else:
        raise SettingsError(f"the fleet needs a secret: set fleet.secret_file or ${SECRET_ENV} "
                            "(the same on every member; e.g. `openssl rand -hex 32`)")
    if len(secret) < MIN_SECRET_BYTES:
        raise SettingsError(f"{where} holds a secret of {len(secret)} bytes; the fleet needs at least "
                            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return secret


def parse_fleet_table(table: object, config_path: Path | None = None,
                      environ: Mapping[str, str] | None = None) -> FleetSettings:
    """A `[fleet]` table, checked; `config_path` anchors a relative `secret_file`."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"fleet = {table!r} must be a table ([fleet])")
    environ = os.environ if environ is None else environ
    values = dict(table)
    if "listen" not in values:
        raise SettingsError('fleet.listen is required: the UDP address usage datagrams arrive on, e.g. '
                            '"0.0.0.0:9190"')
    listen = parse_address(_string("listen", values.pop("listen")), "fleet.listen")
    if listen[1] == 0:
        raise SettingsError(f"fleet.listen = {_show(listen)!r} needs a fixed port: peers must know it")
    fleet = FleetSettings(listen=listen, secret=b"")
    secret_file: Path | None = None
    for key, value in values.items():
        if key == "name":
            fleet.name = check_name(_string(key, value))
        elif key == "advertise":
            fleet.advertise = parse_address(_string(key, value), "fleet.advertise")
            if fleet.advertise[1] == 0 or _wildcard(fleet.advertise[0]):
                raise SettingsError(f"fleet.advertise = {value!r} must be an address peers can send to")
        elif key == "secret_file":
            secret_file = Path(_string(key, value)).expanduser()
            if not secret_file.is_absolute() and config_path is not None:
                secret_file = config_path.parent / secret_file
        elif key == "membership":
            if value not in MEMBERSHIPS:
                raise SettingsError(f'fleet.membership = {value!r} must be "static", "zookeeper" or "kafka"')
            fleet.membership = str(value)
        elif key == "peers":
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise SettingsError(f'fleet.peers = {value!r} must be a list of "host:port" strings')
            fleet.peers = [parse_address(item, "fleet.peers entry") for item in value]
            for item, address in zip(value, fleet.peers, strict=True):
                if address[1] == 0 or _wildcard(address[0]):
                    raise SettingsError(f"fleet.peers entry {item!r} is not an address one can send to")
        elif key == "zookeeper":
            fleet.zookeeper = _string(key, value)
        elif key == "zookeeper_chroot":
            if not isinstance(value, str) or (value and (not value.startswith("/") or value.endswith("/"))):
                raise SettingsError(f'fleet.zookeeper_chroot = {value!r} must be "" or a path like "/kafka"')
            fleet.zookeeper_chroot = value
        elif key == "sync_interval_ms":
            fleet.sync_interval_ms = _positive_int(key, value)
        elif key == "full_sync_interval_ms":
            fleet.full_sync_interval_ms = _positive_int(key, value)
        else:
            raise SettingsError(f"unknown setting fleet.{key}")
    if fleet.sync_interval_ms < MIN_SYNC_INTERVAL_MS:
        raise SettingsError(f"fleet.sync_interval_ms = {fleet.sync_interval_ms} is below "
                            f"{MIN_SYNC_INTERVAL_MS} ms, the shortest interval between two reports")
    if not fleet.sync_interval_ms <= fleet.full_sync_interval_ms <= MAX_FULL_SYNC_INTERVAL_MS:
        raise SettingsError(f"fleet.full_sync_interval_ms = {fleet.full_sync_interval_ms} must be "
                            f"between fleet.sync_interval_ms ({fleet.sync_interval_ms}) and "
                            f"{MAX_FULL_SYNC_INTERVAL_MS}")
    if fleet.membership == "static" and "zookeeper" in values:
        raise SettingsError('fleet.zookeeper is set but fleet.membership is "static": '
                            'set membership = "zookeeper" or remove it')
    if fleet.membership != "static" and fleet.peers:
        where = "ZooKeeper" if fleet.membership == "zookeeper" else "the cluster's group"
        raise SettingsError(f'fleet.peers is set but fleet.membership is "{fleet.membership}": members come '
                            f"from {where}; remove fleet.peers")
    fleet.secret = read_secret(secret_file, environ)
    return fleet


def offset_for_worker(fleet: FleetSettings, index: int) -> FleetSettings:
    """Worker `index` of `kthrottle run --workers N` in a configured fleet: the listen and advertised
    ports move up by `index`, so every worker is a member of its own."""
    if index == 0:
        return fleet
    listen = (fleet.listen[0], fleet.listen[1] + index)
    advertise = None if fleet.advertise is None else (fleet.advertise[0], fleet.advertise[1] + index)
    for port in (listen[1], (advertise or listen)[1]):
        if port > 65535:
            raise SettingsError(f"fleet.listen = {_show(fleet.listen)!r}: worker {index} would use UDP port "
                                f"{port}, outside 1..65535")
    return FleetSettings(listen=listen, secret=fleet.secret, name=fleet.name, advertise=advertise,
                         membership=fleet.membership, peers=list(fleet.peers), zookeeper=fleet.zookeeper,
                         zookeeper_chroot=fleet.zookeeper_chroot, sync_interval_ms=fleet.sync_interval_ms,
                         full_sync_interval_ms=fleet.full_sync_interval_ms)

