"""Joining a fleet at start-up: its name (the cluster id by default), membership, the exchange.

Kept apart from the exchange (fleet.py), which only moves datagrams once the member is in.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import TYPE_CHECKING

from config.fleet import FleetSettings, check_name
from config.settings import Address, ProxySettings, SettingsError
from proxy.upstream.discovery import fetch_metadata
from proxy.upstream.one_request import UpstreamError

from .exchange import FleetExchange, FleetMetrics
from .membership import Membership, StaticMembership, ZooKeeperMembership

if TYPE_CHECKING:
    from proxy.server import ProxyServer

#: How long start-up tries to read the cluster id (the default fleet name) before giving up.
CLUSTER_ID_TIMEOUT_S = 15.0


async def fetch_cluster_id(upstream: list[Address], tls: ssl.SSLContext | None = None,
                           timeout: float = 5.0) -> str:
    """The cluster id, from a Metadata answer of the first bootstrap server that gives one."""
    errors = []
    for host, port in upstream:
        try:
            metadata = await fetch_metadata(host, port, tls, timeout, client_id="kthrottle-fleet")
            if metadata.cluster_id:
                return str(metadata.cluster_id)
            errors.append(f"{host}:{port}: no cluster id")
        except UpstreamError as exc:  # its text names the address and what happened
            errors.append(str(exc))
        except ValueError as exc:
            errors.append(f"{host}:{port}: {exc}")
    raise ConnectionError("; ".join(errors))


async def _fleet_name(settings: ProxySettings, fleet: FleetSettings, tls: ssl.SSLContext | None) -> str:
    if fleet.name is not None:
        return fleet.name
    deadline = time.monotonic() + CLUSTER_ID_TIMEOUT_S
    while True:
        try:
            return check_name(await fetch_cluster_id(settings.upstream, tls), "the cluster id")
        except ConnectionError as exc:
            if time.monotonic() > deadline:
                raise SettingsError(f"fleet.name is not set and the cluster id (its default) could not be "
                                    f"read within {CLUSTER_ID_TIMEOUT_S:g} s: {exc}; set fleet.name") from exc
            await asyncio.sleep(1.0)


async def start_fleet(settings: ProxySettings, server: ProxyServer) -> FleetExchange:
    """Join the fleet of `settings.fleet`: membership, exchange, and the peers' state before clients."""
    fleet = settings.fleet
    assert fleet is not None
    upstream_tls = server.tls.upstream if server.tls is not None else None
    name = await _fleet_name(settings, fleet, upstream_tls.current if upstream_tls is not None else None)
    membership: Membership
    if fleet.membership == "zookeeper":
        assert fleet.zookeeper is not None
        membership = ZooKeeperMembership(fleet.zookeeper, fleet.zookeeper_chroot or "", name,
                                         fleet.advertised)
    elif fleet.membership == "kafka":
        from config.cluster_login import client_configs

        from .kafka_group import KafkaMembership, group_id

        login = settings.control_plane.login
        configs = client_configs(settings.upstream, server.upstream_tls_context(), login, "kthrottle-fleet",
                                 request_timeout_ms=30_000, bootstrap_timeout_ms=10_000)
        membership = KafkaMembership(configs, group_id(name), fleet.advertised)
    else:
        membership = StaticMembership(fleet.peers, {fleet.advertised, fleet.listen})
    exchange = FleetExchange(server.engine, fleet, name, membership, FleetMetrics(server.metrics.registry))
    await exchange.start()
    await exchange.wait_for_peers()
    return exchange
