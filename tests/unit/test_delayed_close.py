"""The acceptors' runtime of throttled connections (proxy/acceptor.py `DelayedClose`) on real sockets.

The arithmetic is quotas/throttled_sockets.py (test_throttled_sockets.py); here: its select timer
closes a held socket, and not before Kafka's acceptor would (a loop timer never fires early, so the
"still open" checks hold however busy the machine is; the "closed" waits are bounded, not timed).
"""

from __future__ import annotations

import asyncio
import socket
import time

from proxy.acceptor import DelayedClose

L = "bootstrap"
#: The longest a test waits for a close that must come (a bound, not a figure).
BOUND_S = 10.0


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


async def _closed(peer: socket.socket) -> float:
    """Wait until `peer` sees its other end closed (EOF or RST); when, monotonic seconds."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(BOUND_S):
        while True:
            try:
                if not await loop.sock_recv(peer, 1):
                    return time.monotonic()
            except ConnectionResetError:
                return time.monotonic()


def _pair() -> tuple[socket.socket, socket.socket]:
    held, peer = socket.socketpair()
    held.setblocking(False)
    peer.setblocking(False)
    return held, peer


def test_a_held_socket_is_closed_by_the_select_timeout_not_at_its_throttle() -> None:
    """Throttled 50 ms on a silent listener: closed when select(500) would time out, not before."""

    async def run() -> float:
        delayed = DelayedClose(10)
        held, peer = _pair()
        with peer:
            start = _now_ms()
            assert delayed.hold(L, held, start, 50)
            delayed.turn(L, start)  # the turn that accepted it
            assert len(delayed) == 1
            closed_at = await _closed(peer)
            assert len(delayed) == 0
            return closed_at * 1000 - start

    held_ms = asyncio.run(run())
    assert held_ms >= 499, held_ms


def test_a_turn_after_the_throttle_closes_at_once() -> None:
    """A connection accepted after the throttle's end is a turn: it closes the held socket then."""

    async def run() -> None:
        delayed = DelayedClose(10)
        held, peer = _pair()
        with peer:
            start = _now_ms()
            delayed.hold(L, held, start, 5)
            delayed.turn(L, start)
            await asyncio.sleep(0.02)
            delayed.turn(L, _now_ms())
            assert len(delayed) == 0
            await _closed(peer)

    asyncio.run(run())


def test_no_turn_while_the_accept_loop_waits_out_an_accept_delay() -> None:
    """Kafka's acceptor thread blocks in waitForConnectionSlot: its select does not time out then."""

    async def run() -> None:
        delayed = DelayedClose(10)
        held, peer = _pair()
        with peer:
            start = _now_ms()
            delayed.hold(L, held, start, 5)
            delayed.turn(L, start)
            delayed.waiting(L, True)
            await asyncio.sleep(0.7)  # past the select timeout
            assert len(delayed) == 1
            delayed.waiting(L, False)
            delayed.turn(L, _now_ms())  # the loop goes on: its turn
            assert len(delayed) == 0
            await _closed(peer)

    asyncio.run(run())


def test_past_the_bound_a_throttled_socket_is_closed_at_once_and_close_all_empties() -> None:
    async def run() -> None:
        delayed = DelayedClose(1)
        first, first_peer = _pair()
        second, second_peer = _pair()
        with first_peer, second_peer:
            now = _now_ms()
            assert delayed.hold(L, first, now, 1000)
            assert not delayed.hold(L, second, now, 1000)
            assert delayed.sockets.closed_early == 1
            await _closed(second_peer)
            delayed.close_all()
            assert len(delayed) == 0
            await _closed(first_peer)

    asyncio.run(run())
