"""`/connections` on the metrics port: who is connected, busiest first, as bounded JSON.

Prometheus metrics are per entity, never per connection (a series per connection would grow
without bound and churn with every reconnect); the question "which client is that, and what does
it run" needs the connections themselves. Each open connection is one row: the client's address
(after a PROXY header: the one IP quotas use), listener, principal, client id, the software it
named in its ApiVersions request (KIP-511), its age, its bytes in and out per second over the last
few seconds (quotas/recent_traffic.py) and its throttle.

Bounded: at most `limit` rows (`?limit=`, DEFAULT_LIMIT unless given, never above MAX_LIMIT),
the busiest by bytes in + out per second; the answer says how many were left off. Reading the
sessions happens on the event loop that owns them, in slices between which other connections
are served (as the metrics scrape reads the quota buckets); the JSON is encoded on a worker thread
from that finished snapshot. With `run --workers N` each worker answers for its own connections
on its own metrics port, as /metrics does (`worker` in the answer says which).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol
from urllib.parse import parse_qs

from quotas.recent_traffic import RECENT_SECONDS

from .connection_row import ConnectionRow

#: Rows unless `?limit=` says otherwise: Prometheus's metrics_max_entities default, and a few
#: hundred KB of JSON.
DEFAULT_LIMIT = 1000
#: The most rows one answer holds (a few MB), whatever `?limit=` asks: a proxy may hold far more
#: connections than anyone reads, and the answer is built while the proxy serves traffic.
MAX_LIMIT = 10_000
#: Sessions read per loop turn before yielding to the other connections.
SLICE = 2000


class DescribedConnection(Protocol):
    """A live session that can describe itself (proxy/session.py's ClientSession)."""

    def describe(self, now_ms: float) -> ConnectionRow: ...


class LimitError(ValueError):
    """A `?limit=` that is not a whole number from 0 to MAX_LIMIT (the message names it)."""


def parse_limit(query: str) -> int:
    """The row limit a query string asks for (DEFAULT_LIMIT when it names none)."""
    values = parse_qs(query, keep_blank_values=True).get("limit")
    if not values:
        return DEFAULT_LIMIT
    text = values[-1]
    try:
        limit = int(text)
    except ValueError:
        raise LimitError(f"limit must be a whole number from 0 to {MAX_LIMIT}, not {text[:40]!r}") from None
    if not 0 <= limit <= MAX_LIMIT:
        raise LimitError(f"limit must be from 0 to {MAX_LIMIT}, not {limit}")
    return limit


def busiest(rows: Iterable[ConnectionRow], limit: int) -> tuple[list[ConnectionRow], int]:
    """The `limit` rows with the most bytes in + out per second, busiest first (ties keep their
    order), and how many were left off. O(n log limit)."""
    rows = list(rows)
    shown = heapq.nlargest(limit, rows, key=lambda row: row.throughput)
    return shown, len(rows) - len(shown)


def encode(shown: Sequence[ConnectionRow], left_off: int, limit: int, worker: int | None) -> bytes:
    """The JSON answer. json.dumps escapes every control and non-ASCII character, so a client id
    or software name reaches a reader as data, never as markup or terminal control."""
    return json.dumps({
        "connections": [row.to_json() for row in shown],
        "open": len(shown) + left_off,
        "shown": len(shown),
        "left_off": left_off,
        "limit": limit,
        "rate_seconds": RECENT_SECONDS,
        "worker": worker,
    }, ensure_ascii=True).encode("ascii") + b"\n"


class ConnectionsView:
    """Answers `/connections` from the live sessions of one proxy process."""

    def __init__(self, sessions: Iterable[DescribedConnection], worker: int | None = None,
                 clock: Callable[[], float] = lambda: time.monotonic() * 1000.0) -> None:
        self._sessions = sessions
        self._worker = worker
        self._clock = clock

    async def rows(self) -> list[ConnectionRow]:
        """Every open connection's row, read on the loop in slices of SLICE sessions."""
        sessions = list(self._sessions)
        rows: list[ConnectionRow] = []
        now = self._clock()
        for index, session in enumerate(sessions):
            if index and index % SLICE == 0:
                await asyncio.sleep(0)
                now = self._clock()
            rows.append(session.describe(now))
        return rows

    async def answer(self, query: str) -> tuple[int, bytes]:
        """(HTTP status, body) for a request with this query string."""
        try:
            limit = parse_limit(query)
        except LimitError as exc:
            return 400, f"{exc}\n".encode()
        shown, left_off = busiest(await self.rows(), limit)
        body = await asyncio.get_running_loop().run_in_executor(None, encode, shown, left_off, limit,
                                                                self._worker)
        return 200, body


__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "ConnectionRow", "ConnectionsView", "DescribedConnection",
           "LimitError", "busiest", "encode", "parse_limit"]
