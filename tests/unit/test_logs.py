"""Repeated log lines are summarised per interval with a count."""

from __future__ import annotations

import logging

import pytest

from proxy.observability.logs import RepeatSummary


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def captured() -> tuple[logging.Logger, list[str], RepeatSummary, Clock]:
    clock = Clock()
    summary = RepeatSummary(interval_s=10.0, burst=2, clock=clock)
    lines: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = ListHandler()
    handler.addFilter(summary)
    logger = logging.getLogger("kthrottle.test-logs")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, lines, summary, clock


def test_a_burst_passes_then_the_rest_is_counted_in_one_line(captured) -> None:  # type: ignore[no-untyped-def]
    logger, lines, summary, clock = captured
    for n in range(50):
        logger.warning("conn-%d closed: %s", n, "bad size")
    assert lines == ["conn-0 closed: bad size", "conn-1 closed: bad size"]
    clock.now = 10.5
    summary.flush()
    assert lines[2] == ("48 more line(s) like this in the last 10 s, not shown: conn-49 closed: bad size")
    logger.warning("conn-%d closed: %s", 99, "x")  # a new interval: passes again
    assert lines[-1] == "conn-99 closed: x"


def test_different_kinds_have_their_own_budget(captured) -> None:  # type: ignore[no-untyped-def]
    logger, lines, summary, clock = captured
    for _ in range(3):
        logger.warning("one %s", "a")
        logger.info("two %s", "b")
    assert lines == ["one a", "two b", "one a", "two b"]
    clock.now = 5.0
    summary.flush()  # the interval is not over: nothing yet
    assert len(lines) == 4
    clock.now = 11.0
    logger.error("three")  # the next line after the interval brings the summaries first
    assert lines[4:6] == ["1 more line(s) like this in the last 11 s, not shown: one a",
                          "1 more line(s) like this in the last 11 s, not shown: two b"]
    assert lines[6] == "three"


def test_nothing_suppressed_means_no_summary(captured) -> None:  # type: ignore[no-untyped-def]
    logger, lines, summary, clock = captured
    logger.warning("once")
    clock.now = 20.0
    summary.flush()
    assert lines == ["once"]


def test_a_forced_flush_reports_a_partial_interval(captured) -> None:  # type: ignore[no-untyped-def]
    logger, lines, summary, clock = captured
    for _ in range(4):
        logger.warning("again")
    clock.now = 3.0
    summary.flush(force=True)  # at shutdown
    assert lines[-1] == "2 more line(s) like this in the last 3 s, not shown: again"
