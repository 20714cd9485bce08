"""The windowed rate and throttle arithmetic, pinned to Kafka's own numbers (QUOTA_SEMANTICS.md §1-2).

The vectors come from Kafka's ClientQuotaManagerTest, ClientRequestQuotaManagerTest and
QuotaUtilsTest; the clock is a plain integer of milliseconds.
"""

from __future__ import annotations

import pytest

from quotas.entity import DEFAULT, QuotaEntity
from quotas.manager import ClientQuotaManager
from quotas.rate import DEFAULT_WINDOW, WindowConfig, WindowedRate, WindowedStat
from quotas.throttle import bounded_throttle_time_ms, throttle_time_ms
from quotas.types import QuotaType

CLIENT_DEFAULT = QuotaEntity(None, DEFAULT)


def produce_manager(bound: float, window: WindowConfig = DEFAULT_WINDOW) -> ClientQuotaManager:
    manager = ClientQuotaManager(QuotaType.PRODUCE, window)
    manager.set_quotas({CLIENT_DEFAULT: bound})
    return manager


def request_manager(bound: float) -> ClientQuotaManager:
    manager = ClientQuotaManager(QuotaType.REQUEST, DEFAULT_WINDOW, max_throttle_ms=DEFAULT_WINDOW.window_ms)
    manager.set_quotas({QuotaEntity("ANONYMOUS", "test-client"): bound})
    return manager


def millis_to_percent(ms: float) -> float:
    """Kafka's request-time units: nanos x 100 / 1e9 per second, i.e. ms / 10."""
    return ms * 1000 * 1000 * 100 / 1e9


# -- Kafka's vectors ----------------------------------------------------------------------------


def test_produce_quota_violation_vector() -> None:
    """ClientQuotaManagerTest.testQuotaViolation: 500 B/s, 10 x 400 B, then 2300 B -> 2100 ms."""
    manager = produce_manager(500)
    now = 0
    for _ in range(10):
        assert manager.record("ANONYMOUS", "unknown", 400, now).throttle_ms == 0
        now += 1000
    now += 500
    charge = manager.record("ANONYMOUS", "unknown", 2300, now)
    # 400*10 + 2300 = 6300 B over 10.5 s = 600 B/s; (600-500)/500 * 10500 = 2100
    assert charge.observed == pytest.approx(600.0)
    assert charge.throttle_ms == 2100
    # Kafka goes on: after the throttle, 10 records of 400 B a second apart, then the burst is gone.
    now += charge.throttle_ms
    for _ in range(10):
        manager.record("ANONYMOUS", "unknown", 400, now)
        now += 1000
    assert manager.record("ANONYMOUS", "unknown", 0, now).throttle_ms == 0


def test_request_quota_violation_vector() -> None:
    """ClientRequestQuotaManagerTest.testRequestPercentageQuotaViolation, step for step."""
    manager = request_manager(1.0)
    now = 0

    def record(ms: float) -> int:
        return manager.record("ANONYMOUS", "test-client", millis_to_percent(ms), now).throttle_ms

    for _ in range(10):
        assert record(4) == 0
        now += 1000
    now += 500
    throttle = record(67.1)
    assert throttle == 210
    now += throttle
    for _ in range(11):
        record(4)
        now += 1000
    assert record(0) == 0, "the bursty sample has rolled over"

    # A spike that needs more than one window to bring back within quota is capped at one window.
    assert record(500) == 1000
    for _ in range(10):
        now += 1000
        assert record(0) == 1000
    now += 1000
    assert record(0) == 0


def test_request_quota_cap_measured_without_recording() -> None:
    """The same 500 ms spike, checked by measuring: over the bound for 10 s, then not."""
    manager = request_manager(1.0)
    assert manager.record("ANONYMOUS", "test-client", millis_to_percent(500), 0).throttle_ms == 1000
    bucket = next(iter(manager.buckets.values()))
    for t in range(1000, 11000, 1000):
        assert bucket.rate.measure(t) > 1.0
    assert bucket.rate.measure(11000) == 0.0


def test_quota_utils_vectors() -> None:
    """QuotaUtilsTest: windows are (samples - 1) whole seconds for a Rate with no samples."""
    window_3 = WindowedRate(WindowConfig(3, 1000)).window_ms(0)
    window_2 = WindowedRate(WindowConfig(2, 1000)).window_ms(0)
    window_10 = WindowedRate(WindowConfig(10, 1000)).window_ms(0)
    assert (window_3, window_2, window_10) == (2000, 1000, 9000)
    assert throttle_time_ms(100.0, 50.0, window_3) == 2000
    assert bounded_throttle_time_ms(55.0, 50.0, window_2, 500) == 100
    assert bounded_throttle_time_ms(100.0, 50.0, window_10, 500) == 500
    # equal to the bound: no throttle, whatever the window
    assert throttle_time_ms(16.5, 16.5, window_10) == 0
    assert throttle_time_ms(16.5, 16.5, WindowedRate(WindowConfig(11, 1000)).window_ms(0)) == 0
    assert bounded_throttle_time_ms(18.2, 18.2, window_10, 500) == 0
    # below the bound: Kafka's arithmetic goes negative; a throttle of 0 is what reaches a client
    assert throttle_time_ms(16.5, 20.4, window_10) == 0
    assert bounded_throttle_time_ms(16.5, 22.4, window_10, 500) == 0


@pytest.mark.parametrize(("observed", "expected"), [
    (1.5, 1),  # 0.5 ms -> 1 (banker's rounding would give 0)
    (2.5, 2),  # 1.5 ms -> 2
    (3.5, 3),  # 2.5 ms -> 3 (banker's rounding would give 2)
    (1.25, 0),  # 0.25 -> 0
    (1.75, 1),  # 0.75 -> 1
])
def test_throttle_rounds_half_up(observed: float, expected: int) -> None:
    assert throttle_time_ms(observed, 1.0, 1) == expected


def test_throttle_is_not_bounded_for_byte_rates() -> None:
    assert throttle_time_ms(1_000_000.0, 1.0, 10_000) == 9_999_990_000


# -- strictly greater than ----------------------------------------------------------------------


def test_rate_exactly_at_the_bound_is_not_throttled() -> None:
    manager = produce_manager(100)
    charge = manager.record("u", "c", 1000, 0)  # 1000 B over the padded 10 s = exactly 100 B/s
    assert charge.observed == pytest.approx(100.0)
    assert charge.throttle_ms == 0
    over = manager.record("u", "c", 1, 0)  # 100.1 B/s: (0.1 / 100) * 10000 = 10 ms
    assert over.throttle_ms == 10


# -- the padded window ---------------------------------------------------------------------------


def test_new_client_is_measured_over_ten_seconds() -> None:
    rate = WindowedRate()
    rate.record(1, 0)
    assert rate.window_ms(0) == 10_000
    # 3.5 s later: 3 whole windows elapsed, padded up to 10 whole ones plus the half of the current
    assert rate.window_ms(3500) == 10_500
    rate.record(1, 3500)
    assert rate.window_ms(3500) == 10_500
    # from 10 whole windows on, no padding
    rate.record(1, 10_700)
    assert rate.window_ms(10_700) == 10_700


def test_new_client_can_burst_ten_times_its_quota() -> None:
    manager = produce_manager(1000)
    assert manager.record("u", "c", 10_000, 0).throttle_ms == 0  # 10x the quota in one go
    fresh = produce_manager(1000)
    assert fresh.record("u", "c", 10_001, 0).throttle_ms == 1  # one byte more: (0.1/1000)*10000


def test_steady_state_keeps_samples_plus_one_slots() -> None:
    """One unit a second for 21 s: 12 slots are kept, the oldest is purged, 11 units over 10 s."""
    rate = WindowedRate()
    for t in range(0, 20_001, 1000):
        rate.record(1, t)
    assert rate.total(20_000) == 11
    assert rate.window_ms(20_000) == 10_000
    assert rate.measure(20_000) == pytest.approx(1.1)


def test_samples_purged_after_samples_times_window_of_silence() -> None:
    rate = WindowedRate()
    rate.record(700, 0)
    rate.record(300, 999)  # same sample (started at 0), last event at 999
    assert rate.total(10_999) == 1000
    # purged by its *last event*, not its start: still there 11 s after the sample started
    assert rate.total(11_500) == 1000
    assert rate.total(11_998) == 1000
    assert rate.total(11_999) == 0
    assert rate.measure(11_999) == 0.0


def test_silence_resets_the_padding() -> None:
    """After a long pause a client is new again: the window is padded from the fresh sample."""
    manager = produce_manager(100)
    manager.record("u", "c", 900, 0)
    charge = manager.record("u", "c", 1000, 60_000)
    assert charge.observed == pytest.approx(100.0)
    assert charge.throttle_ms == 0


def test_unrecord_takes_the_value_back() -> None:
    rate = WindowedRate()
    rate.record(500, 0)
    rate.record(200, 10)
    rate.unrecord(500, 20)
    assert rate.total(20) == 200
    assert rate.measure(20) == pytest.approx(200 * 1000 / 10_020)  # 10 padded windows + 20 ms


def test_average_and_maximum() -> None:
    """The throttle-time sensor's avg and max (only `WindowedStat` keeps what they need)."""
    rate = WindowedStat()
    assert rate.average(0) == 0.0
    assert rate.maximum(0) == 0.0
    rate.record(100, 0)
    rate.record(300, 1500)
    rate.record(200, 2500)
    assert rate.average(2500) == pytest.approx(200.0)
    assert rate.maximum(2500) == 300.0
    # the 100 at t=0 expires 11 s later, the 300 at 12.5 s
    assert rate.average(11_000) == pytest.approx(250.0)
    assert rate.maximum(12_500) == 200.0
    assert rate.maximum(13_500) == 0.0


@pytest.mark.parametrize(("samples", "window_ms"), [(1, 1000), (0, 1000), (11, 0), (11, -5)])
def test_window_config_rejects_nonsense(samples: int, window_ms: int) -> None:
    with pytest.raises(ValueError, match="quota window"):
        WindowConfig(samples, window_ms)


def test_defaults_are_kafkas() -> None:
    assert WindowConfig(11, 1000) == DEFAULT_WINDOW
