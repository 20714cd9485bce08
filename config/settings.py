"""Proxy settings: where to listen, which cluster to front, how to map broker ids to ports.

Read from the `[proxy]` table of the TOML config file, overridden by command-line flags.
"""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.frames import DEFAULT_MAX_REQUEST_BYTES
from quotas.token_bucket import KAFKA, QUOTA_SHAPES, SMOOTH, QuotaShape

from .client_addresses import CLIENT_ADDRESS_KEYS, ClientAddressSettings, parse_client_addresses
from .common import Address, SettingsError, parse_address, parse_address_list
from .control_plane import QUOTA_STORES, ControlPlaneSettings, parse_control_plane_table

if TYPE_CHECKING:
    from quotas.capacity import CapacityConfig

    from .fleet import FleetSettings
    from .tls import ListenerTls, UpstreamTls
    from .usage import UsageSettings


@dataclass(slots=True)
class ProxySettings:
    #: Bootstrap listener clients connect to first.
    listen: Address = ("127.0.0.1", 9192)
    #: Broker node N is served on `node_port_base + N`; None means `listen port + 1`.
    node_port_base: int | None = None
    #: Host put in every rewritten broker address; None means the listen host
    #: (or this machine's name when listening on a wildcard address).
    advertised_host: str | None = None
    #: The real cluster's bootstrap servers; empty means "start an embedded local cluster".
    upstream: list[Address] = field(default_factory=list)
    metrics_port: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    quota_file: Path | None = None
    #: "mute": answer at once with throttle_time_ms, then stop reading (KIP-219, Kafka >= 2.0);
    #: "delay": hold the response for the throttle (pre-2.0 brokers), for clients too old to back off.
    throttle_mode: str = "mute"
    #: Kafka's quota.window.num and quota.window.size.seconds.
    quota_window_num: int = 11
    quota_window_size_seconds: int = 1
    #: The KIP-936 draft's producer.id.quota.window.num / .size.seconds.
    producer_id_quota_window_num: int = 11
    producer_id_quota_window_size_seconds: int = 3600
    #: Kafka's controller.quota.window.num / .size.seconds: the controller mutation token bucket's
    #: burst is their product times the rate (KIP-599).
    controller_quota_window_num: int = 11
    controller_quota_window_size_seconds: int = 1
    #: At most this many (user, client-id) series per quota type in the metrics; the rest fold
    #: into one series labelled "__other__".
    metrics_max_entities: int = 1000
    #: Principals ("User:<name>") allowed to change quotas through the admin API; nobody by default.
    #: A plaintext client is "User:ANONYMOUS"; SASL clients are who the broker authenticated; TLS
    #: clients with a certificate are its subject mapped by tls.principal_mapping_rules.
    quota_admins: list[str] = field(default_factory=list)
    #: Who may describe quotas: "admins" (the quota admins) or "everyone".
    quota_describe: str = "admins"
    #: ZooKeeper connect string: quotas then live in ZooKeeper in Kafka's znode layout.
    zookeeper: str | None = None
    #: Path prefix of Kafka's znodes in ZooKeeper, e.g. "/kafka" ("" is the root).
    zookeeper_chroot: str = ""
    #: Where quotas live (config/control_plane.py): "file", "zookeeper" or "kafka"; None: "zookeeper"
    #: when proxy.zookeeper is set, else "file".
    quota_store: str | None = None
    #: The `[control_plane]` table: the quota topic and the proxy's own login for quota_store = "kafka"
    #: and fleet.membership = "kafka" (defaults when the table is absent).
    control_plane: ControlPlaneSettings = field(default_factory=ControlPlaneSettings)
    # -- what a client can make the proxy hold (see README "Limits a client cannot exceed") --------
    #: Kafka's max.connections: client connections open at once; None means what the file
    #: descriptor limit allows (each connection holds two descriptors: client and broker).
    max_connections: int | None = None
    #: Kafka's max.connections.per.ip; None means no limit below max_connections (Kafka's default).
    max_connections_per_ip: int | None = None
    #: Kafka's connections.max.idle.ms: a connection with no traffic either way for this long is
    #: closed (none while a request is in flight or held by a throttle).
    connections_max_idle_ms: int = 600_000
    #: Like the clients' socket.connection.setup.timeout.ms: a connection must send one complete
    #: request (and finish its SASL exchange, if it starts one) within this time of connecting.
    connection_setup_timeout_ms: int = 10_000
    #: Kafka's queued.max.request.bytes: request bytes all connections together may hold (read
    #: but not yet forwarded); past it, the proxy stops reading from clients instead of allocating.
    #: Must be at least max_request_bytes, so that one largest request always fits.
    queued_max_request_bytes: int = 256 * 1024 * 1024
    #: Bytes queued for one socket before the proxy stops reading the other side (backpressure end
    #: to end: a client that does not read stops its broker connection being read).
    connection_buffer_bytes: int = 256 * 1024
    #: Live quota buckets per quota type; past it, new entities share one overflow bucket.
    max_quota_buckets: int = 50_000
    #: The longest throttle the proxy gives (quota or capacity: throttle_time_ms, the KIP-219 mute,
    #: a held response), as Redpanda's max_kafka_throttle_delay_ms; None: no cap, as in Kafka.
    max_throttle_time_ms: int | None = None
    #: "kafka": Kafka's windowed rate decides (a new client bursts ~10 s of quota, then an 11 s
    #: sawtooth); "smooth": a token bucket with a one-second burst decides the byte-rate and
    #: request-time quotas (quotas/token_bucket.py).
    quota_shape: QuotaShape = KAFKA
    #: Shadow mode for the whole proxy (quotas/shadow.py): every throttle is computed and reported
    #: ("would throttle"), none is applied, `ip` quotas' included. Read at start; one entity's
    #: `shadow` setting switches live.
    shadow: bool = False
    #: The `[fleet]` table (config/fleet.py): one quota over several proxies; None: a lone proxy.
    fleet: FleetSettings | None = None
    #: Bind the client listeners with SO_REUSEPORT, so `kthrottle run --workers N` processes share them.
    reuse_port: bool = False
    #: The `[tls]` table (config/tls.py): TLS on every client listener; None: plaintext listeners.
    tls: ListenerTls | None = None
    #: The `[upstream_tls]` table: TLS on every broker connection; None: plaintext to the brokers.
    upstream_tls: UpstreamTls | None = None
    #: The `[usage]` table (config/usage.py): usage events written to the cluster; None: none written.
    usage: UsageSettings | None = None
    #: Connection-creation rates, per-IP overrides, the PROXY protocol (config/client_addresses.py).
    client_addresses: ClientAddressSettings = field(default_factory=ClientAddressSettings)
    #: The `[capacity]` table (config/capacity.py): cluster capacity shared by `share`; None: none.
    capacity: CapacityConfig | None = None

    @property
    def node_base(self) -> int:
        return self.listen[1] + 1 if self.node_port_base is None else self.node_port_base

    @property
    def advertised(self) -> str:
        if self.advertised_host:
            return self.advertised_host
        host = self.listen[0]
        return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host

    def check(self) -> None:
        """Settings that are valid one by one but not together."""
        if self.queued_max_request_bytes < self.max_request_bytes:
            raise SettingsError(
                f"proxy.queued_max_request_bytes = {self.queued_max_request_bytes} is below "
                f"proxy.max_request_bytes = {self.max_request_bytes}: the largest request could not be read")
        if (self.max_connections_per_ip is not None and self.max_connections is not None
                and self.max_connections_per_ip > self.max_connections):
            raise SettingsError(
                f"proxy.max_connections_per_ip = {self.max_connections_per_ip} is above "
                f"proxy.max_connections = {self.max_connections}")
        if self.fleet is not None:
            self.fleet.check(self.zookeeper, self.zookeeper_chroot)
        if self.quota_store is None:
            self.quota_store = "zookeeper" if self.zookeeper else "file"
        elif self.quota_store == "zookeeper" and not self.zookeeper:
            raise SettingsError('proxy.quota_store = "zookeeper" needs proxy.zookeeper (the connect string)')
        elif self.quota_store != "zookeeper" and self.zookeeper:
            raise SettingsError(f'proxy.quota_store = "{self.quota_store}" but proxy.zookeeper is set: '
                                "quotas live in one place; remove one of them")
        if self.quota_store == "kafka" and self.fleet is None:
            raise SettingsError('proxy.quota_store = "kafka" signs its records with the fleet secret: add a '
                                "[fleet] table (a fleet of one needs no peers) with secret_file or "
                                "$KTHROTTLE_FLEET_SECRET")

    def node_port(self, node_id: int) -> int:
        """The deterministic proxy port for a broker node id."""
        port = self.node_base + node_id
        if node_id < 0 or port > 65535:
            raise SettingsError(
                f"broker node id {node_id} maps to port {port}, outside 1..65535; "
                "choose a lower node_port_base"
            )
        return port


def load_settings(path: Path | None) -> ProxySettings:
    """Settings from the `[proxy]` table of a TOML file (all keys optional)."""
    settings = ProxySettings()
    if path is None:
        return settings
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from exc
    table = data.get("proxy", {})
    settings.quota_file = path
    client_addresses: dict[str, object] = {}
    for key, value in table.items():
        if key in CLIENT_ADDRESS_KEYS:
            client_addresses[key] = value
        elif key == "listen":
            settings.listen = parse_address(str(value), "proxy.listen")
        elif key == "upstream":
            text = ",".join(value) if isinstance(value, list) else str(value)
            settings.upstream = parse_address_list(text, "proxy.upstream")
        elif key == "advertised_host":
            settings.advertised_host = str(value)
        elif key == "throttle_mode":
            if value not in ("mute", "delay"):
                raise SettingsError(f"proxy.throttle_mode = {value!r} must be \"mute\" or \"delay\"")
            settings.throttle_mode = value
        elif key == "quota_admins":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SettingsError(
                    f"proxy.quota_admins = {value!r} must be a list of \"User:<name>\" strings")
            for principal in value:
                kind, sep, name = principal.partition(":")
                if kind != "User" or not sep or not name:
                    raise SettingsError(f"proxy.quota_admins entry {principal!r} is not \"User:<name>\"")
            settings.quota_admins = list(value)
        elif key == "shadow":
            if not isinstance(value, bool):
                raise SettingsError(f"proxy.shadow = {value!r} must be true or false")
            settings.shadow = value
        elif key == "quota_describe":
            if value not in ("admins", "everyone"):
                raise SettingsError(f"proxy.quota_describe = {value!r} must be \"admins\" or \"everyone\"")
            settings.quota_describe = value
        elif key == "quota_shape":
            if value not in QUOTA_SHAPES:
                raise SettingsError(
                    f"proxy.quota_shape = {value!r} must be " + " or ".join(f'"{v}"' for v in QUOTA_SHAPES))
            settings.quota_shape = KAFKA if value == KAFKA else SMOOTH
        elif key == "quota_store":
            if value not in QUOTA_STORES:
                raise SettingsError(f"proxy.quota_store = {value!r} must be "
                                    + ", ".join(f'"{v}"' for v in QUOTA_STORES))
            settings.quota_store = str(value)
        elif key == "zookeeper":
            if not isinstance(value, str) or not value.strip():
                raise SettingsError(f"proxy.zookeeper = {value!r} must be a connect string like \"zk1:2181\"")
            settings.zookeeper = value.strip()
        elif key == "zookeeper_chroot":
            if not isinstance(value, str) or (value and (not value.startswith("/") or value.endswith("/"))):
                raise SettingsError(
                    f"proxy.zookeeper_chroot = {value!r} must be \"\" or a path like \"/kafka\"")
            settings.zookeeper_chroot = value
        elif key in ("node_port_base", "metrics_port", "max_request_bytes", "quota_window_num",
                     "quota_window_size_seconds", "producer_id_quota_window_num",
                     "producer_id_quota_window_size_seconds", "controller_quota_window_num",
                     "controller_quota_window_size_seconds", "metrics_max_entities",
                     "max_connections", "max_connections_per_ip", "connections_max_idle_ms",
                     "connection_setup_timeout_ms", "queued_max_request_bytes",
                     "connection_buffer_bytes", "max_quota_buckets", "max_throttle_time_ms"):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SettingsError(f"proxy.{key} = {value!r} must be a positive integer")
            setattr(settings, key, value)
        else:
            raise SettingsError(f"unknown setting proxy.{key} in {path}")
    settings.client_addresses = parse_client_addresses(client_addresses)
    if "fleet" in data:
        from .fleet import parse_fleet_table

        settings.fleet = parse_fleet_table(data["fleet"], path)
    if "tls" in data or "upstream_tls" in data:
        from .tls import parse_tls_table, parse_upstream_tls_table

        if "tls" in data:
            settings.tls = parse_tls_table(data["tls"], path)
        if "upstream_tls" in data:
            settings.upstream_tls = parse_upstream_tls_table(data["upstream_tls"], path)
    if "capacity" in data:
        from .capacity import parse_capacity_table

        settings.capacity = parse_capacity_table(data["capacity"])
    if "control_plane" in data:
        settings.control_plane = parse_control_plane_table(data["control_plane"])
    if "usage" in data:
        from .usage import parse_usage_table

        settings.usage = parse_usage_table(data["usage"])
    settings.check()
    return settings
