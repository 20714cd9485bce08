"""Producer-id tracking (KIP-936 draft): Bloom filters, their time layers, and the memory bound."""

from __future__ import annotations

import math
import random

import pytest

from quotas.producer_ids import BloomFilter, ProducerIdTracker, TimedBloomFilter

N = 100_000
TARGET_FP = 0.01
#: realistic producer ids: Kafka hands them out in consecutive blocks from a large base
BASE = 7_000_000_000


def fp_rate(bloom: BloomFilter, probes: range | list[int]) -> float:
    return sum(1 for pid in probes if pid in bloom) / len(probes)


# -- the Bloom filter ---------------------------------------------------------------------------


def test_false_positive_rate_at_100k_sequential_pids() -> None:
    bloom = BloomFilter(N, TARGET_FP)
    for pid in range(BASE, BASE + N):
        bloom.add(pid)
    assert all(pid in bloom for pid in range(BASE, BASE + N)), "a Bloom filter has no false negatives"
    measured = fp_rate(bloom, range(BASE + N, BASE + 2 * N))
    print(f"\nBloom false-positive rate, {N} sequential PIDs, target {TARGET_FP:.2%}: {measured:.4%}")
    assert TARGET_FP / 2 <= measured <= TARGET_FP * 2


def test_false_positive_rate_at_100k_random_pids() -> None:
    rng = random.Random(936)
    pids = rng.sample(range(2**62), 2 * N)
    bloom = BloomFilter(N, TARGET_FP)
    for pid in pids[:N]:
        bloom.add(pid)
    measured = fp_rate(bloom, pids[N:])
    print(f"\nBloom false-positive rate, {N} random PIDs, target {TARGET_FP:.2%}: {measured:.4%}")
    assert TARGET_FP / 2 <= measured <= TARGET_FP * 2


def test_filter_size_is_fixed_by_capacity_and_rate() -> None:
    bloom = BloomFilter(N, TARGET_FP)
    expected_bits = math.ceil(-N * math.log(TARGET_FP) / math.log(2) ** 2)  # ~9.6 bits per id
    assert bloom.memory_bytes == (expected_bits + 7) // 8
    assert bloom.hashes == 7
    before = bloom.memory_bytes
    for pid in range(3 * N):  # three times the capacity: worse answers, not more memory
        bloom.add(pid)
    assert bloom.memory_bytes == before
    assert bloom.memory_bytes < 125_000


def test_overfilled_filter_errs_towards_already_seen() -> None:
    """Past its capacity a filter says "seen" more often: the quota gets lenient, never harsher."""
    bloom = BloomFilter(1000, TARGET_FP)
    for pid in range(10_000):
        bloom.add(pid)
    assert fp_rate(bloom, range(10_000, 20_000)) > 0.5


def test_negative_and_extreme_ids() -> None:
    bloom = BloomFilter(10, TARGET_FP)
    for pid in (-1, 0, 2**63 - 1, -(2**63)):
        assert pid not in bloom
        bloom.add(pid)
        assert pid in bloom


@pytest.mark.parametrize(("capacity", "rate"), [(0, 0.01), (10, 0.0), (10, 1.0), (10, -0.1)])
def test_bloom_rejects_bad_parameters(capacity: int, rate: float) -> None:
    with pytest.raises(ValueError):
        BloomFilter(capacity, rate)


# -- time layers ----------------------------------------------------------------------------------

W = 1000


def timed() -> TimedBloomFilter:
    return TimedBloomFilter(W, 1000, 0.0001)


def test_new_id_is_counted_once() -> None:
    bloom = timed()
    assert bloom.add_if_new(1, 0) is True
    assert bloom.add_if_new(1, 0) is False
    assert bloom.add_if_new(1, 400) is False
    assert bloom.add_if_new(2, 400) is True


def test_id_is_remembered_for_a_window_from_the_first_layer() -> None:
    bloom = timed()
    bloom.add_if_new(1, 0)
    assert bloom.add_if_new(1, W - 1) is False


@pytest.mark.parametrize("added_ms", [0, W // 4, W // 2 - 1, W // 2, 3 * W // 4, W - 1])
def test_id_is_remembered_for_at_least_one_window(added_ms: int) -> None:
    """Whenever in the layer cycle an id arrives, it is known for a full window afterwards."""
    bloom = timed()
    bloom.add_if_new(999_999, 0)  # traffic that opened the first layer at t=0
    assert bloom.add_if_new(7, added_ms) is True
    for t in range(added_ms, added_ms + W, 50):  # regular traffic keeps the layers turning
        bloom.add_if_new(10_000 + t, t)
    assert bloom.add_if_new(7, added_ms + W - 1) is False


@pytest.mark.parametrize("added_ms", [0, W // 4, W // 2 - 1, W // 2, 3 * W // 4])
def test_id_is_forgotten_after_one_and_a_half_windows(added_ms: int) -> None:
    bloom = timed()
    bloom.add_if_new(999_999, 0)
    bloom.add_if_new(7, added_ms)
    for t in range(added_ms, added_ms + 3 * W // 2, 50):
        bloom.add_if_new(10_000 + t, t)
    assert bloom.add_if_new(7, added_ms + 3 * W // 2) is True


def test_at_most_three_layers_whatever_the_traffic() -> None:
    """One filter per half window, each living 1.5 windows: never more than three at once."""
    bloom = timed()
    one_filter = BloomFilter(1000, 0.0001).memory_bytes
    rng = random.Random(1)
    t = 0
    for pid in range(20_000):
        t += rng.choice((0, 1, 7, 133, 499, 500, 501, 999))
        bloom.add_if_new(pid, t)
        assert bloom.memory_bytes <= 3 * one_filter
    assert t > 50 * W


# -- per-user tracker -------------------------------------------------------------------------------


def test_tracker_counts_per_user() -> None:
    tracker = ProducerIdTracker(window_ms=W, capacity=100, false_positive_rate=0.001)
    assert tracker.new_ids("alice", [1, 2, 3], 0) == 3
    assert tracker.new_ids("alice", [3, 4, 4], 0) == 1  # a repeated id in one request counts once
    assert tracker.new_ids("bob", [1, 2, 3], 0) == 3


def test_tracker_evicts_least_recently_used_users() -> None:
    tracker = ProducerIdTracker(window_ms=W, capacity=100, false_positive_rate=0.001, max_users=3)
    for user in ("a", "b", "c"):
        tracker.new_ids(user, [1], 0)
    tracker.new_ids("a", [2], 1)  # a is now the most recent; b the least
    tracker.new_ids("d", [1], 2)
    assert tracker.users == 3
    assert tracker.evictions == 1
    assert tracker.new_ids("a", [1], 3) == 0  # a kept its filter
    assert tracker.new_ids("c", [1], 3) == 0
    assert tracker.new_ids("b", [1], 3) == 1  # b was evicted: its id is new again (and c goes)
    assert tracker.evictions == 2
    assert tracker.users == 3


def test_tracker_memory_is_bounded_by_users_and_filter_size() -> None:
    tracker = ProducerIdTracker(window_ms=W, capacity=1000, false_positive_rate=0.01, max_users=50)
    one_filter = BloomFilter(1000, 0.01).memory_bytes
    for i in range(2000):
        tracker.new_ids(f"user-{i}", list(range(i, i + 20)), i)
    assert tracker.users == 50
    assert tracker.evictions == 1950
    assert tracker.memory_bytes <= 50 * 2 * one_filter


def test_tracker_false_positives_at_100k() -> None:
    tracker = ProducerIdTracker(window_ms=3_600_000, capacity=N, false_positive_rate=TARGET_FP)
    counted = tracker.new_ids("alice", list(range(BASE, BASE + N)), 0)
    probes = 5000  # few enough not to fill the filter much further while probing
    fresh = tracker.new_ids("alice", list(range(BASE + N, BASE + N + probes)), 1)
    measured = 1 - fresh / probes
    print(f"\nProducerIdTracker: {counted} of {N} counted while filling; "
          f"false-positive rate of the full filter {measured:.4%}")
    assert counted > N * (1 - TARGET_FP)
    assert measured <= 2 * TARGET_FP
