"""The adaptive factor (AIMD) on the brokers' health, with hand-fed responses."""

from __future__ import annotations

import pytest

from quotas.adaptive_capacity import (
    DEGRADED_TICKS,
    ERRORS,
    HEALTHY,
    LATENCY,
    MIN_SAMPLES,
    REQUEST_TIMED_OUT,
    AdaptiveCapacity,
    AdaptiveConfig,
)
from quotas.capacity import CapacityConfig, CapacityManager
from quotas.types import QuotaType


def feed(controller: AdaptiveCapacity, latency_ms: float, n: int = 50, broker: int = 1,
         errors: list[int] | None = None) -> None:
    for _ in range(n):
        controller.observe(broker, 0, latency_ms, errors)


def test_a_baseline_is_learned_only_while_light() -> None:
    controller = AdaptiveCapacity()
    feed(controller, 100.0)
    assert controller.tick(light=False) is None
    assert controller.baselines == {}
    feed(controller, 10.0)
    controller.tick(light=True)
    assert controller.baselines == {(1, 0): 10.0}


def test_latency_cuts_multiplicatively_then_healthy_ticks_add_back() -> None:
    controller = AdaptiveCapacity(AdaptiveConfig(min_fraction=0.2))
    feed(controller, 10.0)
    controller.tick(light=True)
    feed(controller, 80.0, broker=2)  # a new broker: no baseline yet, never judged
    feed(controller, 80.0)
    assert controller.tick(light=False) is None  # one bad second only holds the factor
    feed(controller, 80.0)
    change = controller.tick(light=False)
    assert change is not None and change.reason == LATENCY
    assert change.new == pytest.approx(0.7)
    assert "broker 1 Produce p99 80 ms > 2 x baseline 10 ms" in change.detail
    feed(controller, 80.0)
    assert controller.tick(light=False) is None  # one tick for the cut to show
    feed(controller, 80.0)
    assert controller.tick(light=False).new == pytest.approx(0.49)  # type: ignore[union-attr]
    for _ in range(8):
        feed(controller, 80.0)
        controller.tick(light=False)
    assert controller.factor == pytest.approx(0.2)  # never below min_fraction
    feed(controller, 10.0)
    change = controller.tick(light=False)
    assert change is not None and change.reason == HEALTHY and change.new == pytest.approx(0.25)
    for _ in range(30):
        controller.tick(light=False)
    assert controller.factor == 1.0
    # the busy ticks taught the baseline nothing
    assert controller.baselines[(1, 0)] == 10.0


def test_strain_errors_cut_the_factor_and_are_named() -> None:
    controller = AdaptiveCapacity()
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(DEGRADED_TICKS):
        feed(controller, 10.0, n=100, errors=[REQUEST_TIMED_OUT])
        change = controller.tick(light=False)
    assert change is not None and change.reason == ERRORS
    assert "REQUEST_TIMED_OUT from broker 1" in change.detail


def test_a_stalled_broker_answering_little_still_counts() -> None:
    controller = AdaptiveCapacity()
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(DEGRADED_TICKS):
        feed(controller, 500.0, n=MIN_SAMPLES - 1)  # few, all slow: degraded
        change = controller.tick(light=False)
    assert change is not None and change.reason == LATENCY and "9 responses, median 500 ms" in change.detail
    feed(controller, 10.0, n=2)
    feed(controller, 500.0, n=1)  # too few to judge, one slow: the factor holds
    assert controller.tick(light=False) is None
    feed(controller, 500.0, n=2)  # fewer than 3: never a cut
    assert controller.tick(light=False) is None
    assert controller.factor == pytest.approx(0.7)


def test_without_a_static_capacity_the_last_healthy_throughput_is_scaled() -> None:
    capacity = CapacityManager()
    capacity.configure(CapacityConfig(adaptive=True))
    capacity.record(QuotaType.PRODUCE, "a", "c", 50_000, None, 0)
    capacity.refresh(1000)
    assert capacity.capacity(QuotaType.PRODUCE) is None  # healthy: no limit
    healthy = capacity.directions[QuotaType.PRODUCE].total_rate
    assert healthy > 0
    capacity.update_factor(0.7, 1000)
    assert capacity.capacity(QuotaType.PRODUCE) == pytest.approx(0.7 * healthy)
    capacity.update_factor(1.0, 2000)
    assert capacity.capacity(QuotaType.PRODUCE) is None


def test_light_is_judged_against_the_directions_given_a_capacity() -> None:
    capacity = CapacityManager()
    capacity.configure(CapacityConfig(produce_byte_rate=1_000_000, adaptive=True))
    # request time runs at its peak (no capacity of its own): it must not make the load heavy
    capacity.record(QuotaType.REQUEST, "a", "c", 50.0, None, 0)
    capacity.record(QuotaType.PRODUCE, "a", "c", 100_000, None, 0)
    capacity.refresh(1000)
    assert capacity.light()
    capacity.record(QuotaType.PRODUCE, "a", "c", 6_000_000, None, 1000)
    capacity.refresh(1200)
    assert not capacity.light()


def test_adaptive_alone_judges_every_direction_by_its_peak() -> None:
    capacity = CapacityManager()
    capacity.configure(CapacityConfig(adaptive=True))
    capacity.record(QuotaType.PRODUCE, "a", "c", 100_000, None, 0)
    capacity.refresh(1000)
    assert not capacity.light()  # busy from the start: at its peak
