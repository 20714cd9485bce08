"""The pure parts of `/connections`: the recent-traffic meter, the row limit, the busiest-first bound
and the JSON (quotas/recent_traffic.py, proxy/observability/connections.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.observability.connection_row import ConnectionRow
from proxy.observability.connections import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    ConnectionsView,
    LimitError,
    busiest,
    encode,
    parse_limit,
)
from quotas.recent_traffic import MIN_SPAN_MS, RECENT_SECONDS, RecentTraffic

# -- the meter ---------------------------------------------------------------------------------


def test_a_steady_stream_reads_its_rate() -> None:
    meter = RecentTraffic(0.0)
    for ms in range(0, 20_000, 10):  # 1,000 bytes in and 100 out every 10 ms: 100 KB/s and 10 KB/s
        meter.received(1000, float(ms))
        meter.sent(100, float(ms))
    bytes_in, bytes_out = meter.rates(19_999.0)
    assert bytes_in == pytest.approx(100_000, rel=0.01)
    assert bytes_out == pytest.approx(10_000, rel=0.01)


def test_only_the_recent_seconds_count() -> None:
    meter = RecentTraffic(0.0)
    meter.received(1_000_000, 500.0)  # a burst long ago
    for second in range(10, 20):
        meter.received(2000, second * 1000.0 + 1)
    bytes_in, _ = meter.rates(19_999.0)
    assert bytes_in == pytest.approx(2000 * RECENT_SECONDS / ((RECENT_SECONDS - 1) + 0.999), rel=0.01)


def test_a_quiet_connection_reads_zero_and_a_young_one_is_not_a_burst() -> None:
    meter = RecentTraffic(1000.0)
    meter.received(5000, 1000.0)
    assert meter.rates(1010.0)[0] == pytest.approx(5000 * 1000 / MIN_SPAN_MS)
    assert meter.rates(1000.0 + RECENT_SECONDS * 1000 + 1000)[0] == 0.0


def test_a_slot_reused_seconds_later_forgets_its_old_bytes() -> None:
    meter = RecentTraffic(0.0)
    meter.received(7777, 0.0)
    meter.received(1, RECENT_SECONDS * 1000.0)  # the same slot, RECENT_SECONDS later
    assert meter.rates(RECENT_SECONDS * 1000.0)[0] == pytest.approx(1 / (RECENT_SECONDS - 1))


# -- the limit and the bound -------------------------------------------------------------------


def test_limit_from_the_query() -> None:
    assert parse_limit("") == DEFAULT_LIMIT
    assert parse_limit("limit=5") == 5
    assert parse_limit("other=1&limit=0") == 0
    assert parse_limit(f"limit={MAX_LIMIT}") == MAX_LIMIT


@pytest.mark.parametrize(("query", "named"), [("limit=abc", "'abc'"), ("limit=", "''"), ("limit=-1", "-1"),
                                              (f"limit={MAX_LIMIT + 1}", str(MAX_LIMIT + 1))])
def test_a_bad_limit_names_itself(query: str, named: str) -> None:
    with pytest.raises(LimitError, match=named):
        parse_limit(query)


def _row(name: str, bytes_in: float, bytes_out: float = 0.0, client_id: str | None = "c") -> ConnectionRow:
    return ConnectionRow(connection=name, address="10.0.0.1", port=5000, listener="bootstrap",
                         principal="ANONYMOUS", client_id=client_id, software_name=None,
                         software_version=None,
                         age_seconds=1.0, bytes_in_per_second=bytes_in, bytes_out_per_second=bytes_out,
                         throttle_ms=0, last_throttle_ms=0)


def test_busiest_first_by_bytes_in_plus_out_and_the_rest_counted() -> None:
    rows = [_row("a", 10), _row("b", 5, 20), _row("c", 0), _row("d", 30, 1)]
    shown, left_off = busiest(rows, 2)
    assert [r.connection for r in shown] == ["d", "b"]
    assert left_off == 2
    shown, left_off = busiest(rows, 10)
    assert [r.connection for r in shown] == ["d", "b", "a", "c"] and left_off == 0
    assert busiest(rows, 0) == ([], 4)


def test_the_json_escapes_what_clients_sent() -> None:
    hostile = _row("x", 1, client_id='a"}\x1b[2J\u202e\n')
    body = encode([hostile], 3, 1, None)
    assert b"\x1b" not in body and b"\n" not in body[:-1]
    answer = json.loads(body)
    assert answer["connections"][0]["client_id"] == 'a"}\x1b[2J\u202e\n'
    assert (answer["shown"], answer["left_off"], answer["open"], answer["limit"]) == (1, 3, 4, 1)
    assert answer["rate_seconds"] == RECENT_SECONDS


class _Session:
    def __init__(self, row: ConnectionRow) -> None:
        self.row = row

    def describe(self, now_ms: float) -> ConnectionRow:
        return self.row


def test_the_view_answers_bounded_and_refuses_a_bad_limit() -> None:
    sessions = {_Session(_row(f"conn-{i}", float(i))) for i in range(5000)}  # more than one slice
    view = ConnectionsView(sessions, worker=2, clock=lambda: 0.0)
    status, body = asyncio.run(view.answer("limit=3"))
    answer = json.loads(body)
    assert status == 200
    assert [r["connection"] for r in answer["connections"]] == ["conn-4999", "conn-4998", "conn-4997"]
    assert (answer["left_off"], answer["worker"]) == (4997, 2)
    status, body = asyncio.run(view.answer("limit=x"))
    assert status == 400 and b"'x'" in body
