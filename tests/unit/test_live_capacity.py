"""A capacity changed while the proxy runs (proxy/capacity/live.py): what each change brings along."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.capacity.live import LiveCapacity
from quotas.adaptive_capacity import AdaptiveConfig
from quotas.capacity import CapacityConfig, CapacityManager
from quotas.types import QuotaType


def _live(may_change: bool = True) -> tuple[LiveCapacity, CapacityManager]:
    manager = CapacityManager()
    return LiveCapacity(manager, CollectorRegistry(), 100, may_change=may_change), manager


def test_a_capacity_arriving_later_brings_its_metrics_and_loop() -> None:
    live, manager = _live()
    assert live.health is not None and live.metrics is None and live.sharing is None
    observe = live.health.observer(1)
    observe(0, 5.0, [], "alice", "etl")  # no controller yet: dropped, no error
    live.apply(CapacityConfig(produce_byte_rate=500_000.0))
    assert manager.config == CapacityConfig(produce_byte_rate=500_000.0)
    assert tuple(manager.directions) == (QuotaType.PRODUCE,)
    assert live.metrics is not None and live.sharing is not None and live.controller is None
    metrics, sharing = live.metrics, live.sharing
    live.apply(CapacityConfig(produce_byte_rate=1_000_000.0, fetch_byte_rate=2_000_000.0))
    assert live.metrics is metrics and live.sharing is sharing  # made once
    assert set(manager.directions) == {QuotaType.PRODUCE, QuotaType.FETCH}


def test_adaptive_on_feeds_the_controller_from_sessions_made_before_it() -> None:
    live, _ = _live()
    assert live.health is not None
    observe = live.health.observer(2)  # a session that connected before adaptive was on
    live.apply(CapacityConfig(produce_byte_rate=500_000.0, adaptive=AdaptiveConfig()))
    controller = live.controller
    assert controller is not None and live.sharing is not None and live.sharing.controller is controller
    observe(0, 5.0, [], "alice", "etl")
    assert controller._responses == 1, "the old session's observation reached the new controller"
    live.apply(CapacityConfig(produce_byte_rate=600_000.0, adaptive=AdaptiveConfig()))
    assert live.controller is controller  # the same tuning keeps its baselines
    live.apply(CapacityConfig(produce_byte_rate=600_000.0, adaptive=AdaptiveConfig(decrease_factor=0.5)))
    assert live.controller is not controller  # new tuning, new controller


def test_adaptive_off_puts_the_factor_back_and_none_removes_the_capacity() -> None:
    live, manager = _live()
    live.apply(CapacityConfig(produce_byte_rate=500_000.0, adaptive=AdaptiveConfig()))
    assert live.controller is not None and manager.factor_state.controller is live.controller
    live.controller.factor = 0.5
    assert manager.update_factor(0) == 0.5
    live.apply(CapacityConfig(produce_byte_rate=500_000.0))
    assert live.controller is None and manager.factor == 1.0
    assert live.health is not None and live.health.controller is None
    live.apply(None)
    assert manager.config is None and manager.directions == {}


def test_a_proxy_whose_capacity_cannot_change_reports_no_health_without_adaptive() -> None:
    live, _ = _live(may_change=False)
    live.apply(CapacityConfig(produce_byte_rate=500_000.0))
    assert live.health is None  # no observer on the hot path for nothing
    fixed, _ = _live(may_change=False)
    fixed.apply(CapacityConfig(produce_byte_rate=500_000.0, adaptive=AdaptiveConfig()))
    assert fixed.health is not None and fixed.health.controller is fixed.controller


def test_the_concurrency_limit_follows_the_controller_and_frees_its_waiters() -> None:
    """Turned on live, sessions made before it are limited; turned off, whoever waited goes on, and a
    slot taken before is not given back into the new limit (no miscount)."""
    import asyncio
    from collections.abc import Hashable

    from proxy.capacity.broker_limits import UNCOUNTED

    async def run() -> None:
        live, _ = _live()
        woken: list[Hashable] = []
        first = live.broker_limits.for_session(1, woken.append)
        second = live.broker_limits.for_session(1, woken.append)
        assert first.admit("alice", "etl") is UNCOUNTED  # off: nothing counted
        live.apply(CapacityConfig(produce_byte_rate=500_000.0,
                                  adaptive=AdaptiveConfig(controller="concurrency")))
        slots = live.broker_limits.concurrency.slots(1)
        slots.limit = 1.0
        ticket = first.admit("alice", "etl")
        assert ticket is not None and ticket is not UNCOUNTED
        assert second.admit("bob", "etl") is None and slots.waiting == 1
        live.apply(CapacityConfig(produce_byte_rate=500_000.0, adaptive=AdaptiveConfig()))  # AIMD now
        await asyncio.sleep(0)
        assert woken == [UNCOUNTED]  # the waiter went on
        first.done(ticket, 3.0)  # a slot of the old limit: given back to nobody
        assert live.broker_limits.concurrency.brokers == {}
        assert second.admit("bob", "etl") is UNCOUNTED

    asyncio.run(run())


def test_a_counted_fetch_asks_for_less_only_while_the_limit_is_engaged_and_applied() -> None:
    """`limited` (protocol/broker_admission.py): below its maximum, for clients not in shadow; in
    shadow the limit is reported, never applied, so no Fetch of theirs asks for less."""
    from proxy.capacity.broker_limits import BrokerLimits, SessionSlots
    from quotas.adaptive_capacity import AdaptiveCapacity
    from quotas.broker_concurrency import MAX_LIMIT
    from quotas.shadow import ShadowPolicy

    def session(shadow: ShadowPolicy, controller: str = "concurrency") -> tuple[BrokerLimits, SessionSlots]:
        limits = BrokerLimits(CapacityManager(), CollectorRegistry(), shadow)
        limits.set_controller(AdaptiveCapacity(AdaptiveConfig(controller=controller)))
        return limits, limits.for_session(1, lambda _ticket: None)

    limits, one = session(ShadowPolicy())
    assert not one.limited("alice", "etl")  # at MAX_LIMIT: nothing waits
    limits.concurrency.slots(1).limit = MAX_LIMIT / 2
    assert one.limited("alice", "etl")
    limits, one = session(ShadowPolicy(everything=True))
    limits.concurrency.slots(1).limit = 1.0
    assert not one.limited("alice", "etl")
    limits, one = session(ShadowPolicy(), controller="aimd")
    limits.concurrency.slots(1).limit = 1.0
    assert not one.limited("alice", "etl")
