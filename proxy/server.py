"""The asyncio side: listeners, one upstream connection per client connection, flow control.

It only moves bytes and carries out what `protocol.connection.ProxyConnection` decides; each client
connection is a `ClientSession` (session.py). This module holds the listeners and what every
session shares: the quota engine, the broker directory, limits, metrics and TLS contexts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import ssl

from config.common import BindError
from config.settings import Address, ProxySettings, SettingsError
from protocol.errors import ProtocolError
from protocol.topic_names import TopicNames
from quotas.engine import EngineConfig, QuotaEngine
from quotas.partition_throttle import PartitionThrottles
from quotas.rate import WindowConfig

from .acceptor import Acceptor, DelayedClose, listener_name
from .admin.quota_admin import QuotaAdminService
from .capacity.broker_health import BrokerHealth
from .capacity.broker_limits import BrokerLimits
from .capacity.live import LiveCapacity
from .limits.admission import ConnectionLimits, connections_for_descriptors, raise_descriptor_limit
from .limits.memory_pool import RequestMemoryPool
from .observability.capacity_metrics import CapacityMetrics
from .observability.connection_metrics import ConnectionMetrics
from .observability.metrics import ProxyMetrics
from .observability.partition_throttle_metrics import register_partition_throttle_metrics
from .session import ClientSession
from .tls import TlsContexts
from .upstream.directory import BrokerDirectory
from .upstream.discovery import discover_brokers
from .upstream.health import UpstreamHealth, describe_error
from .upstream.topic_ids import TopicIdResolver

log = logging.getLogger("kthrottle.proxy")


class ProxyServer:
    """The bootstrap listener plus one listener per broker node id."""

    def __init__(self, settings: ProxySettings) -> None:
        if not settings.upstream:
            raise SettingsError("no upstream bootstrap servers configured")
        self.settings = settings
        self.engine = QuotaEngine(EngineConfig(
            window=WindowConfig(settings.quota_window_num, settings.quota_window_size_seconds * 1000),
            pid_window=WindowConfig(settings.producer_id_quota_window_num,
                                    settings.producer_id_quota_window_size_seconds * 1000),
            max_buckets=settings.max_quota_buckets,
            quota_shape=settings.quota_shape,
            controller_window=WindowConfig(settings.controller_quota_window_num,
                                           settings.controller_quota_window_size_seconds * 1000),
            max_throttle_ms=settings.max_throttle_time_ms,
            shadow=settings.shadow,
        ))
        self.metrics = ProxyMetrics(self.engine, settings.metrics_max_entities)
        #: KIP-73 partition throttles for consumers (the quota file's [[partition_throttle]]) and
        #: the topic ids they need, one map per process: a client fetches on other connections
        #: than the one its Metadata came on
        self.partition_throttles = PartitionThrottles(shadow=settings.shadow)
        self.topic_names = TopicNames()
        self.partition_throttle_metrics = register_partition_throttle_metrics(
            self.metrics.registry, self.partition_throttles, self.topic_names)
        descriptors = raise_descriptor_limit()
        fits = connections_for_descriptors(descriptors)
        max_connections = settings.max_connections or fits
        if max_connections > fits:
            log.warning("max_connections = %d needs %d file descriptors, but the limit is %d: "
                        "new connections may fail once descriptors run out (raise ulimit -n)",
                        max_connections, max_connections * 2, descriptors)
        #: KIP-612 (quotas/connection_quotas.py): the engine holds them, so the fleet exchanges their
        #: IP buckets; the acceptors (acceptor.py) ask them before a connection is served
        self.connection_quotas = quotas = self.engine.connections
        self.shadow_log = self.engine.shadow_log
        client_addresses = settings.client_addresses
        quotas.set_broker_rate(client_addresses.max_connection_creation_rate)
        quotas.set_max_connections_per_ip(settings.max_connections_per_ip,
                                          client_addresses.max_connections_per_ip_overrides)
        self.limits = ConnectionLimits(max_connections, per_ip_counter=quotas)
        #: connections throttled by their address's quota, waiting to be closed (Kafka's throttledSockets,
        #: which it does not bound: here at most max_connections, sized to the descriptors)
        self._delayed_close = DelayedClose(max_connections)
        self.connection_metrics = ConnectionMetrics(self.metrics.registry, quotas, self.metrics.refused,
                                                    settings.metrics_max_entities,
                                                    throttled_sockets=self._delayed_close.sockets)
        self._acceptors: list[Acceptor] = []
        self.memory = RequestMemoryPool(settings.queued_max_request_bytes)
        self.metrics.queued_request_bytes.set_function(lambda: self.memory.used)
        self.metrics.memory_waiting.set_function(lambda: self.memory.waiting)
        self.health = UpstreamHealth(self._probe_candidates,
                                     on_change=lambda up: self.metrics.upstream_up.set(1 if up else 0),
                                     tls=self.upstream_tls_context)
        #: answers the admin quota APIs; `run` gives it the quota store
        self.quota_admin = QuotaAdminService(settings, None, lambda: self.engine.configured,
                                             self.engine.set_quotas)
        self.background: set[asyncio.Task[None]] = set()
        self.directory = BrokerDirectory()
        self.sessions: set[ClientSession] = set()
        self._listeners: dict[int | None, socket.socket] = {}
        self._rotation = itertools.count()
        self._probing: asyncio.Task[None] | None = None
        #: TLS contexts for either side, kept current as their files rotate; None: plaintext both sides
        self.tls = (TlsContexts(settings.tls, settings.upstream_tls)
                    if settings.tls is not None or settings.upstream_tls is not None else None)
        self.topic_ids = TopicIdResolver(settings.upstream, self.upstream_tls_context,
                                         self.partition_throttles, self.topic_names)
        #: the cluster capacity (quotas/capacity.py) with its loop, metrics and, when adaptive, the
        #: brokers' health each session reports: from the [capacity] table, and changed while it
        #: runs from the quota topic (proxy/capacity/live.py)
        from_topic = settings.quota_store == "kafka"
        self.capacity = LiveCapacity(self.engine.capacity, self.metrics.registry,
                                     settings.metrics_max_entities, may_change=from_topic,
                                     shadow=self.engine.shadow)
        self.capacity.apply(settings.capacity)

    @property
    def capacity_metrics(self) -> CapacityMetrics | None:
        return self.capacity.metrics

    @property
    def broker_health(self) -> BrokerHealth | None:
        return self.capacity.health

    @property
    def broker_limits(self) -> BrokerLimits:
        return self.capacity.broker_limits

    def upstream_tls_context(self) -> ssl.SSLContext | None:
        """The TLS context for the proxy's own connections to brokers (None: plaintext)."""
        upstream = self.tls.upstream if self.tls is not None else None
        return upstream.current if upstream is not None else None

    # -- addresses ------------------------------------------------------------------------------

    def advertise(self, node_id: int) -> Address:
        try:
            return self.settings.advertised, self.settings.node_port(node_id)
        except SettingsError as exc:  # the broker named a node the port range cannot hold
            raise ProtocolError(str(exc)) from exc

    def upstream_for(self, node_id: int | None) -> list[Address]:
        """Candidates to connect to: the node's own address, or the bootstrap list rotated."""
        if node_id is not None:
            known = self.directory.addresses.get(node_id)
            return [known] if known else []
        servers = self.settings.upstream
        start = next(self._rotation) % len(servers)
        return servers[start:] + servers[:start]

    def _probe_candidates(self) -> list[Address]:
        """Where to check that the cluster is reachable: known brokers first, then the bootstrap list."""
        known = list(self.directory.addresses.values())
        return known + [address for address in self.settings.upstream if address not in known]

    def ready(self) -> tuple[bool, str]:
        """For /ready: at least one broker reachable."""
        return bool(self.health.up), self.health.reason

    @property
    def bootstrap_address(self) -> Address:
        host, port = self._listeners[None].getsockname()[:2]
        return self.settings.advertised if host in ("0.0.0.0", "::") else host, port

    def learn(self, addresses: dict[int, Address], at_start: bool = False) -> None:
        for node in self.directory.learn(addresses):
            self._open_node_listener(node, at_start)

    # -- listeners ------------------------------------------------------------------------------

    def _bind(self, port: int, setting: str) -> socket.socket:
        """Bind and listen synchronously, so a client that learns the port can connect at once.
        BindError names the address and the `setting` that chose the port."""
        host = self.settings.listen[0]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.settings.reuse_port:  # `run --workers N`: the kernel spreads connections over the workers
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise BindError((host, port), setting, exc) from exc
        sock.listen(512)
        sock.setblocking(False)
        return sock

    def _open_node_listener(self, node_id: int, at_start: bool = False) -> None:
        """At start a port that cannot be bound stops the proxy (BindError), as a broker stops;
        later (a broker joined) it is logged and the running proxy serves the other brokers."""
        if node_id in self._listeners:
            return
        try:
            sock = self._bind(self.settings.node_port(node_id),
                              f"node_port_base + {node_id}, for broker {node_id}")
        except (BindError, SettingsError) as exc:
            if at_start and isinstance(exc, BindError):
                raise
            log.error("cannot open the listener for broker %d: %s", node_id, exc)
            return
        self._listeners[node_id] = sock
        self._serve(node_id, sock)
        log.info("broker %d is served on %s:%d", node_id, self.settings.advertised, sock.getsockname()[1])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = self._bind(self.settings.listen[1], "listen")
        self._listeners[None] = sock
        self._serve(None, sock)
        reachable = await self.health.probe()
        if reachable:
            upstream_tls = self.tls.upstream if self.tls is not None else None
            try:
                brokers = await discover_brokers(self.settings.upstream,
                                                 upstream_tls.current if upstream_tls is not None else None)
            except Exception as exc:  # SASL-only listeners: learn brokers from client traffic instead
                log.info("broker discovery skipped (%s); brokers are learned from client metadata",
                         describe_error(exc, 5))
            else:
                self.learn(brokers, at_start=True)
        self._probing = loop.create_task(self.health.run())
        self.capacity.start()
        log.info("bootstrap listener on %s:%d%s, upstream %s%s", *self.bootstrap_address,
                 " (TLS)" if self.settings.tls is not None else "",
                 ",".join(f"{h}:{p}" for h, p in self.settings.upstream),
                 " (TLS)" if self.settings.upstream_tls is not None else "")

    def _serve(self, node_id: int | None, sock: socket.socket) -> None:
        """Start the listener's accept loop (acceptor.py) with its own connection-creation rate."""
        self.connection_quotas.set_listener_rate(
            listener_name(node_id), self.settings.client_addresses.listener_max_connection_creation_rate)
        acceptor = Acceptor(self, node_id, sock, lambda client: ClientSession(self, node_id, client),
                            self._delayed_close)
        self.connection_metrics.listener_started(acceptor.listener)
        acceptor.start()
        self._acceptors.append(acceptor)

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
        await self.capacity.close()
        await asyncio.gather(*(acceptor.stop() for acceptor in self._acceptors))
        self._delayed_close.close_all()
        for sock in self._listeners.values():
            sock.close()
        for session in list(self.sessions):
            session.close("proxy shutting down", kind="shutdown", level=logging.INFO)
