"""`kthrottle top`'s connections view (top/connections.py): /connections answers in, lines out."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from proxy.observability.connection_row import ConnectionRow
from top.connections import (
    ConnectionsScrape,
    build_connections_view,
    connections_url,
    human_age,
    parse_connections,
    printable,
    render_connections,
)
from top.view import ViewState, press


def _row(connection: str, client_id: str | None, bytes_in: float, bytes_out: float = 0.0, **more: Any
         ) -> dict[str, Any]:
    return {"connection": connection, "address": "10.1.2.3", "port": 40000, "listener": "broker-1",
            "principal": "User:alice", "client_id": client_id, "client_software_name": "apache-kafka-java",
            "client_software_version": "4.3.1", "age_seconds": 75.5, "bytes_in_per_second": bytes_in,
            "bytes_out_per_second": bytes_out, "throttle_ms": 0, "last_throttle_ms": 0, **more}


def _answer(*rows: dict[str, Any], left_off: int = 0) -> str:
    return json.dumps({"connections": list(rows), "open": len(rows) + left_off, "shown": len(rows),
                       "left_off": left_off, "limit": 500, "rate_seconds": 5, "worker": None})


A, B = "http://10.0.0.1:9300/metrics", "http://10.0.0.2:9300/metrics"


def test_the_url_beside_the_metrics() -> None:
    assert connections_url(A) == "http://10.0.0.1:9300/connections?limit=500"
    assert connections_url(A, 3) == "http://10.0.0.1:9300/connections?limit=3"


def test_a_fleet_merges_busiest_first_and_counts_what_was_left_off() -> None:
    a = parse_connections(A, _answer(_row("conn-1", "etl", 100.0), _row("conn-2", "web", 10.0, 5.0),
                                     left_off=7))
    b = parse_connections(B, _answer(_row("conn-1", "spark", 50.0, 60.0)))
    view = build_connections_view([a, b, ConnectionsScrape("http://10.0.0.3:9300/metrics", error="refused")])
    assert [(r.client_id, r.proxy) for r in view.rows] == [("spark", B), ("etl", A), ("web", A)]
    assert view.open == 2 + 7 + 1
    lines = [line.text for line in render_connections(view, "", None, 200, None)]
    assert "3 proxies (1 unreachable)" in lines[0] and "10 open (7 left off by the proxies)" in lines[0]
    assert any("UNREACHABLE http://10.0.0.3:9300/metrics: refused" in line for line in lines)
    header = next(line for line in lines if "CLIENT-ID" in line)
    assert header.split() == ["CLIENT", "LISTENER", "PRINCIPAL", "CLIENT-ID", "SOFTWARE", "AGE", "IN/s",
                              "OUT/s", "THROTTLE", "LAST-THR", "PROXY"]
    table = lines[lines.index(header) + 1:]
    assert [line.split()[3] for line in table] == ["spark", "etl", "web"]
    assert table[0].split()[4:8] == ["apache-kafka-java/4.3.1", "1m15s", "50B", "60B"]
    assert table[0].split()[-1] == "10.0.0.2:9300"


def test_a_hostile_client_id_cannot_drive_the_terminal() -> None:
    hostile = "x\x1b[2J\x1b]0;owned\x07\r\n\u202eevil\x00"
    view = build_connections_view([parse_connections(A, _answer(
        _row("conn-1", hostile, 1.0, client_software_name="sw\x1b[31m", client_software_version="1\x9b2")))])
    for line in render_connections(view, "", None, 200, None):
        assert line.text.isprintable(), repr(line.text)
    assert printable(hostile) == "x?[2J?]0;owned????evil?"


def test_a_throttled_connection_is_marked_and_the_filter_matches_software() -> None:
    view = build_connections_view([parse_connections(A, _answer(
        _row("conn-1", "slow", 1.0, throttle_ms=420, last_throttle_ms=420),
        _row("conn-2", "fast", 9.0, client_software_name="confluent-kafka-python")))])
    lines = render_connections(view, "", None, 160, None)
    slow = next(line for line in lines if " slow " in line.text)
    assert slow.text.startswith("!") and slow.style == "throttled" and "420ms" in slow.text
    only = [line.text for line in render_connections(view, "confluent", None, 160, None)]
    assert any(" fast " in line for line in only) and not any(" slow " in line for line in only)


@pytest.mark.parametrize(("width", "height"), [(20, 4), (40, 10), (80, 24), (300, 50), (1, 1), (10, 2)])
def test_any_terminal_size_fits(width: int, height: int) -> None:
    rows = [_row(f"conn-{i}", f"client-{i}" * 5, float(i)) for i in range(100)]
    view = build_connections_view([parse_connections(A, _answer(*rows)), parse_connections(B, _answer())])
    lines = render_connections(view, "", None, width, height)
    assert len(lines) <= height
    assert all(len(line.text) <= width for line in lines)
    if height >= 3:
        assert lines[-1].style == "header" and lines[-1].text.startswith("q quit"[:width])


def test_malformed_answers_are_errors_for_the_screen() -> None:
    with pytest.raises(ValueError, match="no connections list"):
        parse_connections(A, '{"rows": []}')
    with pytest.raises(ValueError, match="client_id is int"):
        parse_connections(A, _answer(_row("conn-1", 5, 1.0)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes_in_per_second is str"):
        parse_connections(A, _answer(_row("conn-1", "etl", "1.0")))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a connection is not an object"):
        parse_connections(A, '{"connections": [7]}')


def test_a_row_reads_back_as_the_proxy_wrote_it() -> None:
    row = ConnectionRow(connection="conn-9", address="::1", port=5, listener="broker-2", principal="User:a",
                        client_id=None, software_name="librdkafka", software_version=None, age_seconds=1.5,
                        bytes_in_per_second=10.0, bytes_out_per_second=2.5, throttle_ms=30,
                        last_throttle_ms=40)
    answer = json.dumps({"connections": [row.to_json()], "open": 1, "left_off": 0})
    assert parse_connections(A, answer).rows == [replace(row, proxy=A)]


def test_ages() -> None:
    assert [human_age(s) for s in (0.4, 59, 60, 3599, 3600, 86400 + 7200)] == ["0s", "59s", "1m00s", "59m59s",
                                                                                 "1h00m", "1d02h"]


def test_c_switches_views_and_sort_keys_wait_in_the_connections_view() -> None:
    state = press(ViewState(), "c")
    assert state.connections
    assert press(state, "n") == state, "one order in the connections view"
    assert press(press(state, "/"), "c").editing == "c", "typed into the filter"
    assert not press(state, "c").connections
