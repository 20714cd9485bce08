"""The adaptive factor (AIMD) on the brokers' health, with hand-fed responses.

`feed` spreads responses over two tenants, as a strained broker is slow for everyone it serves;
the tests of one tenant alone say `tenants=1`."""

from __future__ import annotations

import re

import pytest

from quotas.adaptive_capacity import (
    CONCURRENCY,
    DEGRADED_TICKS,
    ERRORS,
    GRADIENT,
    HEALTHY,
    LATENCY,
    MIN_SAMPLES,
    MIN_STRAINED_TENANTS,
    REQUEST_TIMED_OUT,
    AdaptiveCapacity,
    AdaptiveConfig,
)
from quotas.capacity import CapacityConfig, CapacityManager
from quotas.types import QuotaType


def feed(controller: AdaptiveCapacity, latency_ms: float, n: int = 50, broker: int = 1,
         errors: list[int] | None = None, tenants: int = 2) -> None:
    for i in range(n):
        controller.observe(broker, 0, latency_ms, errors, tenant=f"tenant-{i % tenants}")


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
    assert change is not None and change.reason == HEALTHY and change.new == pytest.approx(0.3)
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
    capacity.configure(CapacityConfig(adaptive=AdaptiveConfig()))
    capacity.record(QuotaType.PRODUCE, "a", "c", 50_000, None, 0)
    capacity.refresh(1000)
    assert capacity.capacity(QuotaType.PRODUCE) is None  # healthy: no limit
    healthy = capacity.directions[QuotaType.PRODUCE].total_rate
    assert healthy > 0
    capacity.factor_state.controller = controller = AdaptiveCapacity()
    controller.factor = 0.7
    capacity.update_factor(1000)
    assert capacity.capacity(QuotaType.PRODUCE) == pytest.approx(0.7 * healthy)
    controller.factor = 1.0
    capacity.update_factor(2000)
    assert capacity.capacity(QuotaType.PRODUCE) is None


def test_light_is_judged_against_the_directions_given_a_capacity() -> None:
    capacity = CapacityManager()
    capacity.configure(CapacityConfig(produce_byte_rate=1_000_000, adaptive=AdaptiveConfig()))
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
    capacity.configure(CapacityConfig(adaptive=AdaptiveConfig()))
    capacity.record(QuotaType.PRODUCE, "a", "c", 100_000, None, 0)
    capacity.refresh(1000)
    assert not capacity.light()  # busy from the start: at its peak


#: Kafka's codes for a client's own mistakes: the broker answers them at once, whatever its load.
NOT_LEADER_OR_FOLLOWER = 6
UNKNOWN_TOPIC_OR_PARTITION = 3
TOPIC_AUTHORIZATION_FAILED = 29


@pytest.mark.parametrize("code", [NOT_LEADER_OR_FOLLOWER, UNKNOWN_TOPIC_OR_PARTITION,
                                  TOPIC_AUTHORIZATION_FAILED])
def test_a_clients_mistakes_are_not_strain(code: int) -> None:
    controller = AdaptiveCapacity()
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(10):  # every response an error, from many tenants, for 10 s
        feed(controller, 1.0, n=200, errors=[code, code], tenants=20)
        assert controller.tick(light=False) is None
    assert controller.factor == 1.0
    assert controller.baselines == {(1, 0): 10.0}, "answered without the work: not timed either"


def test_one_tenants_slowness_holds_the_factor_but_never_cuts_it() -> None:
    controller = AdaptiveCapacity()
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(5):
        feed(controller, 10.0, n=50)  # the others are served as fast as ever
        feed(controller, 900.0, n=50, tenants=1)  # one tenant's own huge requests
        assert controller.tick(light=False) is None
    assert controller.factor == 1.0
    for _ in range(DEGRADED_TICKS):  # the same slowness seen by a second tenant is the broker's
        feed(controller, 900.0, n=100, tenants=MIN_STRAINED_TENANTS)
        change = controller.tick(light=False)
    assert change is not None and change.reason == LATENCY


def test_one_tenants_strain_errors_alone_never_cut() -> None:
    controller = AdaptiveCapacity()
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(5):
        feed(controller, 10.0, n=100, errors=[REQUEST_TIMED_OUT], tenants=1)
        assert controller.tick(light=False) is None
    assert controller.factor == 1.0


def test_a_partial_error_is_timed() -> None:
    """A Produce with one partition misrouted and one written did the work for the second."""
    controller = AdaptiveCapacity()
    feed(controller, 10.0, errors=[NOT_LEADER_OR_FOLLOWER, 0])
    controller.tick(light=True)
    assert controller.baselines == {(1, 0): 10.0}


def test_a_broker_the_proxy_cannot_reach_cuts_the_factor() -> None:
    controller = AdaptiveCapacity()
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(DEGRADED_TICKS):
        for _ in range(3):
            controller.observe_unreachable(2)
        feed(controller, 10.0)
        change = controller.tick(light=False)
    assert change is not None and change.reason == ERRORS
    assert "broker 2 unreachable (3 connections failed)" in change.detail
    feed(controller, 10.0)  # a tick without failures: healthy again
    assert controller.tick(light=False) is not None and controller.factor > change.new
    controller.observe_unreachable(2)  # one failed second alone holds the factor: no cut
    feed(controller, 10.0)
    assert controller.tick(light=False) is None


def test_the_gradient_controller_scales_by_the_latency_ratio_every_tick() -> None:
    controller = AdaptiveCapacity(AdaptiveConfig(controller=GRADIENT))
    feed(controller, 10.0)
    controller.tick(light=True)  # baseline 10 ms: the limit is 2 x 10 + 5 = 25 ms
    feed(controller, 50.0)  # twice the limit: gradient 0.5, smoothed to 0.2 of the way
    change = controller.tick(light=False)
    assert change is not None and change.reason == LATENCY and "(gradient 0.50)" in change.detail
    assert change.new == pytest.approx(0.9)
    feed(controller, 31.25)  # 1.25 x the limit: gradient 0.8
    assert controller.tick(light=False).new == pytest.approx(0.9 * (1 - 0.2 * 0.2))  # type: ignore[union-attr]
    feed(controller, 900.0, tenants=1)  # one tenant alone: held, not cut
    assert controller.tick(light=False) is None
    feed(controller, 10.0)
    assert controller.tick(light=False).reason == HEALTHY  # type: ignore[union-attr]


def test_an_unknown_controller_is_refused_with_its_name() -> None:
    message = "capacity.controller = 'pid' must be \"aimd\", \"gradient\" or \"concurrency\""
    with pytest.raises(ValueError, match=re.escape(message)):
        CapacityConfig(adaptive=AdaptiveConfig(controller="pid"))


def test_under_the_concurrency_controller_latency_holds_the_factor_and_errors_still_cut() -> None:
    """Latency is answered by the brokers' request limits (broker_concurrency.py), not the factor."""
    controller = AdaptiveCapacity(AdaptiveConfig(controller=CONCURRENCY))
    feed(controller, 10.0)
    controller.tick(light=True)
    for _ in range(4):
        feed(controller, 900.0)
        assert controller.tick(light=False) is None
    assert controller.factor == 1.0
    changes = []
    for _ in range(3):
        feed(controller, 10.0, n=100, errors=[REQUEST_TIMED_OUT])
        changes.append(controller.tick(light=False))
    assert controller.factor == 0.7 and any(c is not None and c.reason == ERRORS for c in changes)
