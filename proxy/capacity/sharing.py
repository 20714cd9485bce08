"""The loop that keeps the capacity's allocations current and moves the adaptive factor.

Every REFRESH_INTERVAL_MS it re-shares the capacity (CapacityManager.refresh: fleet-wide demand,
water-filling); once a second, in adaptive mode, it judges the brokers' health
(AdaptiveCapacity.tick) and applies the factor, the lowest of this member's and its fresh peers'.
Every change of the factor in force is logged at INFO with the signal behind it, and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time

from quotas.adaptive_capacity import AdaptiveCapacity, FactorChange
from quotas.capacity import REFRESH_INTERVAL_MS, CapacityManager

from ..observability.capacity_metrics import CapacityMetrics

log = logging.getLogger("kthrottle.capacity")

#: How often the adaptive controller judges the brokers' health.
TICK_MS = 1000


class CapacitySharing:
    """Runs the refresh and the adaptive ticks for one process."""

    def __init__(self, capacity: CapacityManager, controller: AdaptiveCapacity | None,
                 metrics: CapacityMetrics | None) -> None:
        self.capacity = capacity
        self.controller = controller
        self.metrics = metrics
        self._next_tick_ms = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="capacity-sharing")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                self.step(int(time.monotonic() * 1000))
            except Exception:  # one bad refresh must not end sharing for good
                log.exception("capacity refresh failed")
            await asyncio.sleep(REFRESH_INTERVAL_MS / 1000.0)

    def step(self, now_ms: int) -> None:
        """One refresh, and the adaptive tick when one is due."""
        capacity = self.capacity
        controller = self.controller
        if controller is not None:
            change = None
            if now_ms >= self._next_tick_ms:
                self._next_tick_ms = now_ms + TICK_MS
                change = controller.tick(capacity.light())
                if change is not None:
                    self._log(change)
            before = capacity.factor
            after = capacity.update_factor(now_ms)
            if after != before:
                if self.metrics is not None:
                    self.metrics.factor_changed(before, after)
                if change is None or after != change.new:
                    log.info("capacity factor in force %.2f -> %.2f (fleet): the lowest of this member's "
                             "%.2f and its peers'", before, after, controller.factor)
        capacity.refresh(now_ms)

    def _log(self, change: FactorChange) -> None:
        log.info("capacity factor %.2f -> %.2f (%s): %s",
                 change.old, change.new, change.reason, change.detail)
        if self.metrics is not None:
            self.metrics.own_change(change)
