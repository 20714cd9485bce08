"""The "would throttle" log lines of shadow mode (quotas/shadow.py), a few every SHADOW_LOG_SECONDS.

The engine gathers each entity's would-be throttles between two takes; this writes the largest
ones, one line an entity, so an operator reading the log of a proxy in shadow sees who would have
been throttled, how long and by which quota, without one line per request.
"""

from __future__ import annotations

import logging

from quotas.shadow import ShadowLog, WouldThrottle
from quotas.types import QuotaType

#: Kafka's principal of a client that did not authenticate: left out of the lines, as it says nothing.
ANONYMOUS = "ANONYMOUS"
#: An ip quota's entries carry the ip bucket as their `user` (see acceptor.py).
IP_QUOTA = QuotaType.CONNECTION_CREATION.value

#: How often the would-be throttles are written (the RepeatSummary interval: its burst then never
#: swallows a take's lines).
SHADOW_LOG_SECONDS = 10.0
#: Lines per take, largest throttle first; the rest are counted in one more line.
SHADOW_LOG_LINES = 5

log = logging.getLogger("kthrottle.shadow")


def describe(entry: WouldThrottle) -> str:
    """Who, in Kafka's entity words: `user=alice, client-id=etl`, `client-id=etl` for an anonymous
    client, or `ip=10.0.0.0/8`."""
    if entry.what == IP_QUOTA:
        return f"ip={entry.user}"
    parts = []
    if entry.user and entry.user != ANONYMOUS:
        parts.append(f"user={entry.user}")
    if entry.client_id or not parts:
        parts.append(f"client-id={entry.client_id}")
    return ", ".join(parts)


def write_shadow_log(shadow_log: ShadowLog, seconds: float = SHADOW_LOG_SECONDS) -> int:
    """Log the would-be throttles since the last call; returns how many entries there were."""
    entries, dropped = shadow_log.take()
    for entry in entries[:SHADOW_LOG_LINES]:
        log.warning("shadow: would throttle %s %d ms (%s), the largest of %d in the last %.0f s",
                    describe(entry), entry.largest_ms, entry.what, entry.decisions, seconds)
    rest = len(entries) - SHADOW_LOG_LINES
    if rest > 0 or dropped:
        log.warning("shadow: and %d more entities would have been throttled (%d decisions not listed)",
                    max(rest, 0), dropped + sum(entry.decisions for entry in entries[SHADOW_LOG_LINES:]))
    return len(entries)


__all__ = ["SHADOW_LOG_LINES", "SHADOW_LOG_SECONDS", "describe", "write_shadow_log"]
