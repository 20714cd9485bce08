"""Log lines that cannot flood: repeated lines are summarised once per interval with a count.

A proxy in front of a shared cluster logs what misbehaving clients do, so one client sending
garbage in a loop must not turn into tens of KB of near-identical lines a second. Lines are
"the same" when they come from the same logger at the same level with the same format string
(`record.msg`, before its arguments are filled in): "conn-%d from %s closed: %s" from a thousand
connections is one kind of line. Per kind, the first `burst` lines of an interval pass; the rest
are counted and one summary line reports them when the next line of any kind is logged after the
interval, or at the latest when `flush` runs (the proxy calls it once per interval).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

#: How long one interval lasts, and how many lines of one kind pass in it.
DEFAULT_INTERVAL_S = 10.0
DEFAULT_BURST = 5
#: Kinds remembered at most (the format strings are the program's own, so this is never reached
#: in practice; it bounds memory if a caller ever logs preformatted text).
MAX_KINDS = 1000

_Key = tuple[str, int, str]


class RepeatSummary(logging.Filter):
    """A filter for a handler: passes `burst` lines per kind per interval, summarises the rest."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, burst: int = DEFAULT_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._started = clock()
        #: per kind: lines passed this interval, lines suppressed, and one suppressed example
        self._passed: dict[_Key, int] = {}
        self._suppressed: dict[_Key, tuple[int, logging.LogRecord]] = {}
        self._summarising = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self._summarising:
            return True
        self.flush(self._clock())
        key = (record.name, record.levelno, str(record.msg))
        passed = self._passed.get(key, 0)
        if passed < self.burst:
            if len(self._passed) < MAX_KINDS or key in self._passed:
                self._passed[key] = passed + 1
            return True
        count, _ = self._suppressed.get(key, (0, record))
        self._suppressed[key] = (count + 1, record)
        return False

    def flush(self, now: float | None = None, *, force: bool = False) -> None:
        """End the interval if it is over (or `force`, at shutdown): one summary line per kind
        that was suppressed."""
        now = self._clock() if now is None else now
        if now - self._started < self.interval_s and not force:
            return
        elapsed = now - self._started
        self._started = now
        self._passed = {}
        suppressed, self._suppressed = self._suppressed, {}
        self._summarising = True
        try:
            for (name, level, _), (count, example) in suppressed.items():
                logging.getLogger(name).log(
                    level, "%d more line(s) like this in the last %.0f s, not shown: %s",
                    count, elapsed, example.getMessage())
        finally:
            self._summarising = False


def install(interval_s: float = DEFAULT_INTERVAL_S, burst: int = DEFAULT_BURST) -> RepeatSummary:
    """Put a `RepeatSummary` on every handler of the root logger; returns it (to `flush`)."""
    summary = RepeatSummary(interval_s, burst)
    for handler in logging.getLogger().handlers:
        handler.addFilter(summary)
    return summary
