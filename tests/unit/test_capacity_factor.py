"""The adaptive factor's fleet merge and learning (quotas/capacity_factor.py), without sharing."""

from __future__ import annotations

import pytest

from quotas.adaptive_capacity import AdaptiveCapacity
from quotas.capacity_factor import FACTOR_KEY, CapacityFactor
from quotas.fleet import PeerUsage, UsageEntry, UsageReport
from quotas.types import CapacityStream, QuotaType

P = QuotaType.PRODUCE


def _peer_reports(peers: PeerUsage, sender: int, factor: float, now_ms: int, seq: int = 1) -> None:
    entry = UsageEntry(CapacityStream.CAPACITY_FACTOR, *FACTOR_KEY, factor)
    peers.accept(UsageReport("f", sender, seq, 0, False, (entry,), ()), now_ms)


def test_the_factor_in_force_is_the_lowest_fresh_one_and_a_stale_peer_stops_counting() -> None:
    state = CapacityFactor()
    state.controller = controller = AdaptiveCapacity()
    state.peers = peers = PeerUsage(quota_window_ms=11_000, stale_after_ms=3000)
    assert state.usage() == [UsageEntry(CapacityStream.CAPACITY_FACTOR, "", "", 1.0)]
    _peer_reports(peers, 7, 0.6, now_ms=0)
    assert state.update({P: 100.0}, now_ms=1000) == pytest.approx(0.6)
    controller.factor = 0.5
    assert state.update({P: 100.0}, now_ms=2000) == 0.5
    assert state.usage()[0].rate == 0.5, "its own factor is sent, never the fleet's lowest"
    controller.factor = 1.0
    # a level does not fade: the peer's 0.6 holds at full value while fresh, then counts no more
    assert state.update({P: 100.0}, now_ms=3000) == pytest.approx(0.6)
    assert state.update({P: 100.0}, now_ms=3001) == 1.0


def test_the_capacity_learned_when_the_factor_drops_is_scaled_then_forgotten() -> None:
    state = CapacityFactor()
    state.controller = controller = AdaptiveCapacity()
    assert state.scale(P, None) is None and state.scale(P, 1000.0) == 1000.0
    controller.factor = 0.5
    state.update({P: 800.0, QuotaType.FETCH: 0.0}, now_ms=0)
    assert state.learned == {P: 800.0}
    assert state.scale(P, None) == 400.0 and state.scale(QuotaType.FETCH, None) is None
    state.update({P: 100.0}, now_ms=1000)  # still below 1: the healthy throughput stays
    assert state.scale(P, None) == 400.0
    controller.factor = 1.0
    state.update({P: 100.0}, now_ms=2000)
    assert state.learned == {} and state.scale(P, None) is None


def test_light_judges_directions_with_a_capacity_else_the_peak() -> None:
    state = CapacityFactor()
    assert state.light({P: 1000.0}, {P: 500.0, QuotaType.REQUEST: 90.0}, {P: 500.0, QuotaType.REQUEST: 90.0})
    assert not state.light({P: 1000.0}, {P: 501.0}, {P: 501.0})
    assert not state.light({}, {P: 100.0}, {P: 100.0}), "at its peak: busy"
    assert state.light({}, {P: 40.0}, {P: 100.0})
    # without a capacity anywhere, every direction is judged against its own peak, not the first alone
    assert not state.light({}, {P: 40.0, QuotaType.FETCH: 90.0}, {P: 100.0, QuotaType.FETCH: 100.0})
    assert state.light({}, {P: 40.0, QuotaType.FETCH: 30.0}, {P: 100.0, QuotaType.FETCH: 100.0})
