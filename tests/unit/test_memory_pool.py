"""The request memory pool (queued.max.request.bytes): who may read, who waits, who goes next."""

from __future__ import annotations

from proxy.limits.memory_pool import RequestMemoryPool


class Holder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.granted = 0

    def grant(self) -> None:
        self.granted += 1


def test_requests_within_the_budget_are_granted_and_counted() -> None:
    pool = RequestMemoryPool(100)
    a, b = Holder("a"), Holder("b")
    assert pool.request(a, 60, 10, a.grant)
    assert pool.request(b, 40, 10, b.grant)
    assert pool.used == 100
    assert pool.request(a, 0, 0, a.grant)  # a's request went upstream
    assert pool.used == 40 and pool.held(a) == 0


def test_a_holder_over_the_budget_keeps_only_what_it_read_and_waits() -> None:
    pool = RequestMemoryPool(100)
    a, b = Holder("a"), Holder("b")
    assert pool.request(a, 80, 80, a.grant)
    assert not pool.request(b, 50, 7, b.grant)
    assert pool.used == 87 and pool.held(b) == 7 and pool.waiting == 1
    assert b.granted == 0
    pool.request(a, 0, 0, a.grant)
    assert b.granted == 1 and pool.waiting == 0
    assert pool.held(b) == 50 and pool.used == 50


def test_waiters_are_served_first_come_first_served() -> None:
    pool = RequestMemoryPool(100)
    big, small, late = Holder("big"), Holder("small"), Holder("late")
    first = Holder("first")
    assert pool.request(first, 90, 90, first.grant)
    assert not pool.request(big, 60, 1, big.grant)
    # a small request that would fit now still queues behind the waiting large one
    assert not pool.request(small, 5, 1, small.grant)
    assert pool.request(first, 30, 30, first.grant)  # shrinking: 30 + 1 + 1 used, big needs 60
    assert big.granted == 1 and small.granted == 1  # 30 + 60 + 5 <= 100: both fit, in order
    assert not pool.request(late, 20, 0, late.grant)
    pool.release(first)
    assert late.granted == 1


def test_a_lone_holder_may_exceed_the_budget_so_the_largest_request_always_fits() -> None:
    pool = RequestMemoryPool(100)
    a = Holder("a")
    assert pool.request(a, 150, 1, a.grant)
    assert pool.used == 150
    b = Holder("b")
    assert not pool.request(b, 1, 1, b.grant)
    pool.release(a)
    assert b.granted == 1 and pool.used == 1


def test_releasing_a_waiter_forgets_it() -> None:
    pool = RequestMemoryPool(10)
    a, b = Holder("a"), Holder("b")
    assert pool.request(a, 10, 10, a.grant)
    assert not pool.request(b, 10, 3, b.grant)
    pool.release(b)
    assert pool.waiting == 0 and pool.used == 10
    pool.release(a)
    assert pool.used == 0 and b.granted == 0
