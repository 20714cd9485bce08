"""The cluster capacity in force, changed while the proxy runs (issue 26).

Why a module: the capacity is more than a table. It comes with its sharing loop, its metrics and,
when adaptive, a controller fed by the brokers' health. A new `[capacity]` (from the quota topic,
fleet-wide) has to bring each of those along without a restart:
- rates change in place (`CapacityManager.configure` keeps tenants' histories);
- the first capacity makes the metrics and the loop, which then stay (they cost nothing idle);
- turning adaptive on makes a controller, and changing its tuning makes a new one (its latency
  baselines start again); turning it off drops the controller and puts the factor back at 1;
- the brokers' concurrency limits (controller "concurrency") follow the controller: a new
  one starts them again and lets every waiting request go;
- sessions report the brokers' health to `health`, which forwards to whichever controller is
  current, so connections made before adaptive was turned on count too.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry

from quotas.adaptive_capacity import AdaptiveCapacity, AdaptiveConfig
from quotas.capacity import CapacityConfig, CapacityManager
from quotas.shadow import ShadowPolicy

from ..observability.capacity_metrics import CapacityMetrics
from .broker_health import BrokerHealth
from .broker_limits import BrokerLimits
from .sharing import CapacitySharing

log = logging.getLogger("kthrottle.capacity")


class LiveCapacity:
    """Owns the capacity's loop, metrics, controller and health feed; `apply` swaps the table."""

    def __init__(self, capacity: CapacityManager, registry: CollectorRegistry, max_entities: int,
                 may_change: bool, shadow: ShadowPolicy | None = None) -> None:
        """`may_change`: a capacity may arrive later (from the quota topic), so sessions report
        the brokers' health from the start."""
        self.capacity = capacity
        self._registry = registry
        self._max_entities = max_entities
        self.config: CapacityConfig | None = None
        self.controller: AdaptiveCapacity | None = None
        self._tuning: AdaptiveConfig | None = None
        self.health: BrokerHealth | None = BrokerHealth(None, capacity) if may_change else None
        #: the brokers' concurrency limits (on with controller "concurrency"); every session
        #: asks it, so a limit turned on while the proxy runs covers connections made before
        self.broker_limits = BrokerLimits(capacity, registry, shadow)
        self.metrics: CapacityMetrics | None = None
        self.sharing: CapacitySharing | None = None
        self._running = False

    def apply(self, config: CapacityConfig | None) -> None:
        """Put `config` in force (None: no capacity), and what it needs with it."""
        if config == self.config:
            return
        before, self.config = self.config, config
        self.capacity.configure(config)
        tuning = config.adaptive if config is not None else None
        if tuning != self._tuning:
            self._tuning = tuning
            self.controller = AdaptiveCapacity(tuning) if tuning is not None else None
            self.capacity.factor_state.controller = self.controller
            if tuning is None:
                self.capacity.update_factor(int(time.monotonic() * 1000))
        if self.controller is not None and self.health is None:
            self.health = BrokerHealth(None, self.capacity)
        if self.health is not None:
            self.health.controller = self.controller
        self.broker_limits.set_controller(self.controller)
        if config is not None and self.metrics is None:
            self.metrics = CapacityMetrics(self._registry, self.capacity, self.controller, self._max_entities)
            self.sharing = CapacitySharing(self.capacity, self.controller, self.metrics)
            if self._running:
                self.sharing.start()
        if self.metrics is not None:
            self.metrics.controller = self.controller
        if self.sharing is not None:
            self.sharing.controller = self.controller
        if before is not None or self._running:
            log.info("capacity now %s (was %s)", _show(config), _show(before))

    def start(self) -> None:
        self._running = True
        if self.sharing is not None:
            self.sharing.start()

    async def close(self) -> None:
        if self.sharing is not None:
            await self.sharing.close()


def _show(config: CapacityConfig | None) -> str:
    if config is None:
        return "none"
    rates = ", ".join(f"{direction.value} {value:g}" for direction, value in config.static().items())
    return (rates or "learned") + (" (adaptive)" if config.adaptive is not None else "")


__all__ = ["LiveCapacity"]
