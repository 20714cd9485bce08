"""What a client session needs from the listeners that made it: the narrow interface between
`server.py` and `session.py`.

The server creates sessions, and a session reads the shared state (settings, quota engine, limits,
metrics, TLS contexts, the broker directory) and reports back (new brokers seen, its own end). The
session depends on this protocol, not on `ProxyServer`, so the two modules do not import each other.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from config.common import Address
from config.settings import ProxySettings
from protocol.topic_names import TopicNames
from quotas.engine import QuotaEngine
from quotas.partition_throttle import PartitionThrottles

from .admin.quota_admin import QuotaAdminService
from .capacity.broker_health import BrokerHealth
from .capacity.broker_limits import BrokerLimits
from .limits.admission import ConnectionLimits
from .limits.memory_pool import RequestMemoryPool
from .observability.metrics import ProxyMetrics
from .tls import TlsContexts
from .upstream.directory import BrokerDirectory
from .upstream.health import UpstreamHealth


class SessionContext(Protocol):
    """The listeners' shared state, as one client session sees it (`ProxyServer` provides it)."""

    settings: ProxySettings
    engine: QuotaEngine
    metrics: ProxyMetrics
    limits: ConnectionLimits
    memory: RequestMemoryPool
    health: UpstreamHealth
    tls: TlsContexts | None
    directory: BrokerDirectory
    partition_throttles: PartitionThrottles
    topic_names: TopicNames
    quota_admin: QuotaAdminService
    #: adaptive capacity's broker-health signals (None: not adaptive)
    broker_health: BrokerHealth | None
    #: the brokers' concurrency limits (they hold nothing unless the controller is "concurrency")
    broker_limits: BrokerLimits
    #: tasks a session starts that must outlive its callback (kept so they are not collected)
    background: set[asyncio.Task[None]]
    #: the live sessions (typed loosely: the session class is the one that adds itself)
    sessions: set[Any]

    def advertise(self, node_id: int) -> Address:
        """The proxy address clients must use for a broker node."""
        ...

    def upstream_for(self, node_id: int | None) -> list[Address]:
        """Where to connect a session's upstream: the node, or the bootstrap list rotated."""
        ...

    def learn(self, addresses: dict[int, Address]) -> None:
        """Brokers seen in a response: open a listener for each new one."""
        ...
