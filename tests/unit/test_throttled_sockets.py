"""Throttled connections held until the acceptor's next turn (quotas/throttled_sockets.py), pinned to Kafka.

Kafka's Acceptor (core/src/main/scala/kafka/network/SocketServer.scala): `run` loops over
`acceptNewConnections` (`nioSelector.select(500)`, then one `accept` per ready key, where
`ConnectionQuotas.inc` may throw `ConnectionThrottledException(ip, startThrottleTimeMs, throttleTimeMs)`
and the socket is queued as `DelayedCloseSocket(socket, startThrottleTimeMs + throttleTimeMs)`) and
`closeThrottledConnections` (closes every queued socket whose `endThrottleTimeMs < timeMs`). Clocks
here are integers of milliseconds.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest

from quotas.connection_quotas import ConnectionQuotas
from quotas.ip_entities import IpQuotas
from quotas.rate import DEFAULT_WINDOW
from quotas.throttled_sockets import ACCEPTOR_SELECT_TIMEOUT_MS, ThrottledSockets

L, M = "EXTERNAL", "INTERNAL"


def test_kafkas_select_timeout() -> None:
    assert ACCEPTOR_SELECT_TIMEOUT_MS == 500


def test_a_socket_is_closed_only_strictly_after_its_throttle_ends() -> None:
    """`endThrottleTimeMs < timeMs`: a turn at the very millisecond the throttle ends keeps it."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    assert held.throttle(L, "a", 1000, 50)
    assert held.turn(L, 1049) == []
    assert held.turn(L, 1050) == []
    assert held.turn(L, 1051) == ["a"]
    assert held.held() == 0


def test_with_no_other_connection_a_throttled_socket_waits_for_the_select_timeout() -> None:
    """The storm's case: a 50 ms throttle (1000 / 20 ms at 20/s), and the listener silent after it (every
    worker waits on a throttled connection): the socket is closed when select(500) returns empty, 500 ms
    after the turn that accepted it, not at 50 ms."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    assert held.throttle(L, "a", 1000, 50)
    assert held.turn(L, 1000) == []  # the end of the turn that accepted it
    assert held.next_turn_ms(L, 1000) == 1500
    assert held.select_timed_out(L, 1500)
    assert held.turn(L, 1500) == ["a"]
    assert held.next_turn_ms(L, 1500) is None  # nothing held: no timer needed


def test_a_throttle_of_exactly_one_select_timeout_waits_for_the_next() -> None:
    """A throttle of 500 ms ends at the select timeout's millisecond: held a whole second. Throttles of
    up to 1000 ms (one quota window, Kafka's cap) are held 500 or 1000 ms (1500 for exactly 1000)."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    for name, throttle in (("a", 499), ("b", 500), ("c", 999), ("d", 1000)):
        assert held.throttle(L, name, 0, throttle)
    assert held.turn(L, 0) == []
    closed = {}
    now = 0
    while held.held():
        due = held.next_turn_ms(L, now)
        assert due is not None
        now = due
        for name in held.turn(L, now):
            closed[name] = now
    assert closed == {"a": 500, "b": 1000, "c": 1000, "d": 1500}


def test_a_busy_listener_closes_a_socket_at_the_first_accepted_connection_after_its_end() -> None:
    """Each accepted connection is a turn of the loop: on a busy listener the hold is the throttle to
    within the gap between two connections."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    assert held.throttle(L, "a", 0, 50)
    assert held.throttle(L, "b", 10, 45)  # ends at 55
    closed = {t: held.turn(L, t) for t in (0, 10, 30, 50, 52, 56, 90)}
    assert closed == {0: [], 10: [], 30: [], 50: [], 52: ["a"], 56: ["b"], 90: []}


def test_a_connection_accepted_restarts_the_select_timeout() -> None:
    """select(500) starts after each turn: a connection at 300 moves the timeout from 500 to 800. The
    proxy's timer, armed for 500, finds the loop turned since, and waits for 800."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    held.throttle(L, "a", 0, 50)
    held.turn(L, 0)
    assert held.next_turn_ms(L, 0) == 500
    assert held.turn(L, 300) == ["a"]
    held.throttle(L, "b", 300, 600)
    assert not held.select_timed_out(L, 500)
    assert held.next_turn_ms(L, 500) == 800
    assert held.select_timed_out(L, 800)
    assert held.turn(L, 800) == []
    assert held.next_turn_ms(L, 800) == 1300
    assert held.turn(L, 1300) == ["b"]


def test_idle_turns_keep_their_phase() -> None:
    """A socket queued away from a turn (the proxy throttles after a PROXY header was read) is closed
    at one of the idle loop's timeouts: every 500 ms after its last turn."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    held.turn(L, 0)
    held.throttle(L, "a", 1200, 50)
    assert held.next_turn_ms(L, 1200) == 1500
    assert held.next_turn_ms(L, 1500) == 1500
    assert held.turn(L, 1500) == ["a"]
    fresh: ThrottledSockets[str] = ThrottledSockets(10)
    fresh.throttle(L, "a", 70, 50)
    assert fresh.next_turn_ms(L, 70) == 570  # no turn seen yet: a select started now


def test_each_listener_has_its_own_queue_and_loop() -> None:
    """One Acceptor per listener: a connection on another listener closes nothing here."""
    held: ThrottledSockets[str] = ThrottledSockets(10)
    held.throttle(L, "a", 0, 50)
    held.throttle(M, "b", 0, 50)
    held.turn(L, 0)
    held.turn(M, 0)
    assert held.turn(M, 100) == ["b"]
    assert held.held(L) == 1 and held.held(M) == 0 and held.held() == 1
    assert held.next_turn_ms(L, 100) == 500
    assert held.next_turn_ms(M, 100) is None


def test_the_queues_are_bounded_and_past_the_bound_a_socket_is_closed_at_once() -> None:
    """Kafka's queue has no bound; here every listener together holds max_throttled_connections, and
    a throttled connection past it is closed at once, counted."""
    held: ThrottledSockets[str] = ThrottledSockets(2)
    assert held.throttle(L, "a", 0, 50)
    assert held.throttle(M, "b", 0, 50)
    assert not held.throttle(L, "c", 0, 50)
    assert held.closed_early == 1 and held.held() == 2
    assert held.turn(L, 51) == ["a"]
    assert held.throttle(L, "c", 51, 50)
    assert held.closed_early == 1
    nothing: ThrottledSockets[str] = ThrottledSockets(0)
    assert not nothing.throttle(L, "a", 0, 50) and nothing.closed_early == 1


def test_ties_close_in_arrival_order_and_drain_empties_everything() -> None:
    held: ThrottledSockets[str] = ThrottledSockets(10)
    for name in "abc":
        held.throttle(L, name, 0, 50)
    held.throttle(M, "d", 0, 50)
    assert held.turn(L, 51) == ["a", "b", "c"]
    held.throttle(L, "e", 51, 1000)
    assert sorted(held.drain()) == ["d", "e"]
    assert held.held() == 0 and held.turn(L, 5000) == [] and held.turn(M, 5000) == []


def test_invalid_bounds_name_the_value() -> None:
    with pytest.raises(ValueError, match="-1"):
        ThrottledSockets(-1)
    with pytest.raises(ValueError, match="select_timeout_ms"):
        ThrottledSockets(1, select_timeout_ms=0)


# -- a storm: Kafka's throttle times, then the acceptor's turns ---------------------------------------------


def test_a_storms_throttle_sweeps_a_window_between_bursts() -> None:
    """Kafka's defaults (11 samples of 1 s), one address at 20/s, a connection every 5 ms. A throttled
    connection is un-recorded, so the count N stays put between bursts while each second's first
    record opens a new sample and the window W (since the oldest sample's start, padded to 10 s)
    grows through the second: the throttle (N + 1) x 1000 / 20 - W sweeps from the 1000 ms cap down
    by a half second every half second. Hence a storm's holds are about half a turn (500 ms) and
    half two turns (1000 ms)."""
    quotas = ConnectionQuotas(DEFAULT_WINDOW, ip_quotas=IpQuotas({"127.0.0.2": 20}))
    throttles = {t: quotas.check_ip("L", "127.0.0.2", t).throttle_ms for t in range(0, 15_000, 5)}
    rate = quotas.buckets["127.0.0.2"].rate
    # the fresh address: 200 fit its padded 10 s window, the 201st is (20.1 - 20) / 20 x 10 s
    assert [throttles[t] for t in (0, 500, 1000)] == [0, 0, 50]
    # after the first burst (219 recorded): W = 10 s at each second's start, 10.5 s half way
    assert [throttles[t] for t in (2000, 2500, 3000, 10_500)] == [1000, 500, 1000, 500]
    # after the sample holding the burst expired (239 recorded, W 11 s to 12 s)
    assert [throttles[t] for t in (14_000, 14_500)] == [1000, 500]
    assert rate.total(14_995) == 239.0


@dataclass
class StormRun:
    served: int
    holds: list[int]

    @property
    def closed(self) -> int:
        return len(self.holds)

    @property
    def p50(self) -> int:
        return sorted(self.holds)[len(self.holds) // 2]


def simulate_storm(*, acceptor_turns: bool, seconds: int = 60, workers: int = 32, seed: int = 1) -> StormRun:
    """The issue's storm on one clock: `workers` clients from one address over a 20/s quota, each
    connecting again 1-9 ms after its connection is answered (2-6 ms) or closed. `acceptor_turns`:
    a throttled connection is closed at Kafka's acceptor turns (this module); else at its throttle's
    end (what the proxy did before)."""
    rng = random.Random(seed)
    quotas = ConnectionQuotas(DEFAULT_WINDOW, ip_quotas=IpQuotas({"127.0.0.2": 20}))
    held: ThrottledSockets[int] = ThrottledSockets(workers)
    arrivals = [(rng.randint(1, 9), worker) for worker in range(workers)]
    heapq.heapify(arrivals)
    throttled_at: dict[int, int] = {}
    run = StormRun(0, [])
    end = seconds * 1000

    def close(sockets: list[int], now: int) -> None:
        for worker in sockets:
            run.holds.append(now - throttled_at.pop(worker))
            heapq.heappush(arrivals, (now + rng.randint(1, 9), worker))

    now = 0
    while arrivals or held.held():
        timeout = held.next_turn_ms(L, now)
        if timeout is not None and (not arrivals or timeout < arrivals[0][0]):
            assert held.select_timed_out(L, timeout)
            now = timeout
            close(held.turn(L, now), now)
            continue
        now, worker = heapq.heappop(arrivals)
        if now >= end:
            continue
        decision = quotas.check_ip(L, "127.0.0.2", now)
        if decision.accepted:
            run.served += 1
            heapq.heappush(arrivals, (now + rng.randint(2, 6), worker))
        elif acceptor_turns:
            throttled_at[worker] = now
            assert held.throttle(L, worker, now, decision.throttle_ms)
        else:
            run.holds.append(decision.throttle_ms)
            heapq.heappush(arrivals, (now + decision.throttle_ms + rng.randint(1, 9), worker))
        if acceptor_turns:
            close(held.turn(L, now), now)
    return run


def test_a_storm_retries_as_often_as_against_a_broker() -> None:
    """Issue 27's figures, 60 s of 32 workers at 20/s: a broker served 1,302 and 1,313 and closed
    2,641 (p50 hold 519 ms, mean 721 ms; in this repository's side-by-side test 1,310 and 2,532,
    578 ms and 737 ms); closed at their throttles' end, the proxy closed 10,292 (p50 50 ms). Simulated
    here with the same quota arithmetic: as many served either way, but closed at Kafka's acceptor
    turns a throttled connection is held one select timeout or two (its throttle sweeps 0-1000 ms
    between bursts, above) and the client retries as often as against the broker; closed at the
    throttle's end it is held ~50 ms and retries over three times as often. (The median of such a
    two-peaked spread sits between the peaks and moves with a few per cent of the holds: the test
    pins the peaks and the mean.)"""
    for seed in (1, 2, 3):
        kafka = simulate_storm(acceptor_turns=True, seed=seed)
        early = simulate_storm(acceptor_turns=False, seed=seed)
        assert 1250 <= kafka.served <= 1350 and 1250 <= early.served <= 1350, (kafka.served, early.served)
        assert 2000 <= kafka.closed <= 3000, kafka.closed
        assert early.closed > 3 * kafka.closed, (early.closed, kafka.closed)
        assert early.p50 <= 60
        # one turn (~500 ms) or two (~1000 ms), about half each; a few closed sooner by a busy listener
        one_or_two = sum(500 <= hold <= 1010 for hold in kafka.holds) / kafka.closed
        one = sum(500 <= hold <= 600 for hold in kafka.holds) / kafka.closed
        assert one_or_two >= 0.95 and 0.3 <= one <= 0.7, (one_or_two, one)
        assert 650 <= sum(kafka.holds) / kafka.closed <= 900
