"""Throttled connections waiting to be closed: Kafka's Acceptor `throttledSockets`, time passed in.

A connection over its address's `connection_creation_rate` (KIP-612) is accepted and never read;
`ConnectionQuotas.inc` throws `ConnectionThrottledException(address, startThrottleTimeMs,
throttleTimeMs)` and the acceptor queues a `DelayedCloseSocket(socket, start + throttle)`
(core/src/main/scala/kafka/network/SocketServer.scala). Kafka does not close it at that instant:
the acceptor thread closes throttled sockets in `closeThrottledConnections`, once per turn of its
loop (`acceptNewConnections` then `closeThrottledConnections`), and a turn ends when
`nioSelector.select(500)` returns: at once when a connection is waiting on the listener, else 500 ms
after the previous turn. Each turn closes every socket whose `endThrottleTimeMs < timeMs`
(strictly). So a socket is closed at the first turn strictly after its throttle ends:

- a storm whose workers all wait on throttled connections leaves the listener silent, and each is
  held until the select times out, ~500 ms, though its throttle is ~1000 / quota ms (50 ms at
  20/s). Closing at the throttle's end made a storming client retry four times as often as against
  a broker (issue 27: 10,292 closed connections in 60 s against the broker's 2,641);
- a busy listener (new connections every few ms) closes them within a few ms of their end.

Reproduced here per listener: `throttle` queues a socket, `turn(listener, now_ms)` is one turn of
that listener's loop (the proxy calls it after each connection it accepts, and when
`next_turn_ms` comes with nothing accepted) and returns the sockets to close.

Bound: Kafka's queue has none (each throttled socket holds a descriptor until its close; it is not
counted in `max.connections` or `max.connections.per.ip`, since `inc` throws before counting). Here
every listener's queue together holds at most `max_throttled_connections` (the proxy gives it
`max_connections`, which is sized to its descriptors); past it a throttled connection is closed at
once and counted in `closed_early`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Generic, TypeVar

#: Kafka's Acceptor: `nioSelector.select(500)`, the longest a turn of its loop waits for a connection.
ACCEPTOR_SELECT_TIMEOUT_MS = 500

T = TypeVar("T")


class _Queue(Generic[T]):
    """One listener's throttled sockets, earliest end first, and when its loop last turned."""

    __slots__ = ("heap", "last_turn_ms")

    def __init__(self) -> None:
        #: (endThrottleTimeMs, arrival order, socket): ties close in arrival order
        self.heap: list[tuple[int, int, T]] = []
        self.last_turn_ms: int | None = None


class ThrottledSockets(Generic[T]):
    """Every listener's throttled connections (one queue each, as each Kafka Acceptor has), one bound."""

    def __init__(self, max_throttled_connections: int,
                 select_timeout_ms: int = ACCEPTOR_SELECT_TIMEOUT_MS) -> None:
        if max_throttled_connections < 0:
            raise ValueError(f"max_throttled_connections must be >= 0, got {max_throttled_connections}")
        if select_timeout_ms < 1:
            raise ValueError(f"select_timeout_ms must be at least 1, got {select_timeout_ms}")
        self.max_throttled_connections = max_throttled_connections
        self.select_timeout_ms = select_timeout_ms
        self._queues: dict[str, _Queue[T]] = {}
        self._order = itertools.count()
        self._held = 0
        #: throttled connections closed at once because the queues were full
        self.closed_early = 0

    def _queue(self, listener: str) -> _Queue[T]:
        queue = self._queues.get(listener)
        if queue is None:
            queue = self._queues[listener] = _Queue()
        return queue

    def throttle(self, listener: str, sock: T, start_ms: int, throttle_ms: int) -> bool:
        """Hold `sock` until the first turn after `start_ms + throttle_ms`; False: the queues are full,
        close it now (counted in `closed_early`)."""
        if self._held >= self.max_throttled_connections:
            self.closed_early += 1
            return False
        heapq.heappush(self._queue(listener).heap, (start_ms + throttle_ms, next(self._order), sock))
        self._held += 1
        return True

    def turn(self, listener: str, now_ms: int) -> list[T]:
        """One turn of `listener`'s acceptor loop at `now_ms`: the sockets to close now (ends < now)."""
        queue = self._queue(listener)
        queue.last_turn_ms = now_ms
        heap = queue.heap
        due: list[T] = []
        while heap and heap[0][0] < now_ms:
            due.append(heapq.heappop(heap)[2])
        self._held -= len(due)
        return due

    def next_turn_ms(self, listener: str, now_ms: int) -> int | None:
        """When `listener`'s select times out if no connection arrives before (the first multiple of
        the timeout after its last turn, not before `now_ms`); None when it holds nothing to close."""
        queue = self._queues.get(listener)
        if queue is None or not queue.heap:
            return None
        last = queue.last_turn_ms if queue.last_turn_ms is not None else now_ms
        timeout = self.select_timeout_ms
        turns = max(1, -(-(now_ms - last) // timeout))
        return last + turns * timeout

    def select_timed_out(self, listener: str, due_ms: int) -> bool:
        """Whether a select that `next_turn_ms` gave as `due_ms` timed out with no turn since it was
        asked for (else a connection turned the loop, and the next timeout is later)."""
        queue = self._queues.get(listener)
        last = None if queue is None else queue.last_turn_ms
        return last is None or last + self.select_timeout_ms <= due_ms

    def held(self, listener: str | None = None) -> int:
        """Throttled connections waiting to be closed, on one listener or all."""
        if listener is None:
            return self._held
        queue = self._queues.get(listener)
        return 0 if queue is None else len(queue.heap)

    def drain(self, listener: str | None = None) -> Iterator[T]:
        """Every held socket of one listener or all (shutdown: Kafka's `closeAll`), forgotten."""
        names = list(self._queues) if listener is None else [listener]
        for name in names:
            queue = self._queues.get(name)
            if queue is None:
                continue
            heap, queue.heap = queue.heap, []
            self._held -= len(heap)
            for _end, _order, sock in heap:
                yield sock


__all__ = ["ACCEPTOR_SELECT_TIMEOUT_MS", "ThrottledSockets"]
