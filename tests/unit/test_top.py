# ruff: noqa: E501  (the captured metrics text keeps its long lines)
"""`kthrottle top`'s pure half (top/view.py): parsing, rates, fleet sums, sorting, filtering,
keys, screens of every size, and the cluster capacity's columns. The metrics text is a real scrape of `kthrottle run` taken by
tests/integration/test_top.py (client ids ingest-a under its quota, ingest-b throttled), with the
histogram and the families `top` does not read left out.
"""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.observability.capacity_metrics import CapacityMetrics
from quotas.capacity import REFRESH_INTERVAL_MS, CapacityConfig
from quotas.engine import QuotaEngine
from quotas.entity import QuotaEntity
from quotas.types import EntitySetting, QuotaType
from top.app import fetch
from top.figures import (
    REQUESTS,
    SORT_KEYS,
    ProxyFigures,
    Scrape,
    TenantFigures,
    TenantRow,
    View,
    build_view,
    filter_rows,
    metrics_url,
    parse_metrics,
    scrape_from_text,
    sort_rows,
)
from top.view import (
    ENTER,
    ESCAPE,
    ViewState,
    bar,
    human_bytes,
    press,
    render,
)

CAPTURED = """\
# TYPE kthrottle_connections gauge
kthrottle_connections 6.0
# TYPE kthrottle_muted_connections gauge
kthrottle_muted_connections 3.0
# TYPE kthrottle_requests_total counter
kthrottle_requests_total{api="ApiVersions"} 8.0
kthrottle_requests_total{api="Metadata"} 2.0
kthrottle_requests_total{api="Produce"} 27.0
# TYPE kthrottle_request_bytes_total counter
kthrottle_request_bytes_total{api="ApiVersions"} 520.0
kthrottle_request_bytes_total{api="Metadata"} 106.0
kthrottle_request_bytes_total{api="Produce"} 3.747149e+06
# TYPE kthrottle_response_bytes_total counter
kthrottle_response_bytes_total{api="ApiVersions"} 5760.0
kthrottle_response_bytes_total{api="Metadata"} 590.0
kthrottle_response_bytes_total{api="Produce"} 1593.0
# TYPE kthrottle_throttled_responses_total counter
kthrottle_throttled_responses_total{api="Produce"} 3.0
# TYPE kthrottle_upstream_up gauge
kthrottle_upstream_up 1.0
# TYPE kthrottle_produce_byte_rate_bytes_per_second gauge
kthrottle_produce_byte_rate_bytes_per_second{client_id="ingest-a",quota="producer_byte_rate",user=""} 96675.11425010387
kthrottle_produce_byte_rate_bytes_per_second{client_id="ingest-b",quota="producer_byte_rate",user=""} 1.4803925863521483e+06
# TYPE kthrottle_fetch_byte_rate_bytes_per_second gauge
# TYPE kthrottle_request_time_percent gauge
# TYPE kthrottle_controller_mutation_rate_per_second gauge
# TYPE kthrottle_producer_id_rate_per_second gauge
# TYPE kthrottle_quota_limit gauge
kthrottle_quota_limit{client_id="ingest-a",quota="producer_byte_rate",user=""} 1e+07
kthrottle_quota_limit{client_id="ingest-b",quota="producer_byte_rate",user=""} 1e+06
# TYPE kthrottle_throttle_time_avg_seconds gauge
kthrottle_throttle_time_avg_seconds{client_id="ingest-a",quota="producer_byte_rate",user=""} 0.0
kthrottle_throttle_time_avg_seconds{client_id="ingest-b",quota="producer_byte_rate",user=""} 0.503
# TYPE kthrottle_throttle_time_max_seconds gauge
kthrottle_throttle_time_max_seconds{client_id="ingest-a",quota="producer_byte_rate",user=""} 0.0
kthrottle_throttle_time_max_seconds{client_id="ingest-b",quota="producer_byte_rate",user=""} 0.73
# TYPE kthrottle_throttle_time_seconds_total counter
kthrottle_throttle_time_seconds_total{client_id="ingest-a",quota="producer_byte_rate",user=""} 0.0
kthrottle_throttle_time_seconds_total{client_id="ingest-b",quota="producer_byte_rate",user=""} 1.509
# TYPE kthrottle_throttles_total counter
kthrottle_throttles_total{client_id="ingest-a",quota="producer_byte_rate",user=""} 0.0
kthrottle_throttles_total{client_id="ingest-b",quota="producer_byte_rate",user=""} 3.0
# TYPE kthrottle_quota_buckets gauge
kthrottle_quota_buckets{quota="producer_byte_rate"} 2.0
"""
A, B = "http://a:9100/metrics", "http://b:9100/metrics"
P = "producer_byte_rate"
F = "consumer_byte_rate"


def _later(text: str, **replacements: str) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text


def _figures(tenants: dict[tuple[str, str], TenantFigures], in_fleet: bool = False) -> ProxyFigures:
    return ProxyFigures(tenants=tenants, counters={REQUESTS: 10.0}, muted=1, connections=4, in_fleet=in_fleet)


def _row(user: str, client_id: str, produce: float = 0.0, fetch: float = 0.0, limit: float | None = None,
         throttle: float | None = 0.0) -> TenantRow:
    row = TenantRow(user, client_id, rates={P: produce, F: fetch}, throttle_rate=throttle,
                    throttles_rate=None if throttle is None else throttle * 2)
    if limit is not None:
        row.limits[P] = limit
    return row


# -- parsing ---------------------------------------------------------------------------------


def test_the_captured_scrape_parses_into_tenants_and_totals() -> None:
    figures = parse_metrics(CAPTURED)
    assert set(figures.tenants) == {("", "ingest-a"), ("", "ingest-b")}
    heavy = figures.tenants[("", "ingest-b")]
    assert heavy.rates == {P: pytest.approx(1_480_392.586, abs=0.01)}
    assert heavy.limits == {P: 1_000_000.0}
    assert heavy.throttle_seconds == pytest.approx(1.509) and heavy.throttles == 3.0
    light = figures.tenants[("", "ingest-a")]
    assert light.limits == {P: 10_000_000.0} and light.throttles == 0.0
    assert figures.muted == 3.0 and figures.connections == 6.0 and figures.upstream_up == 1.0
    assert figures.counters["kthrottle_requests_total"] == 37.0  # summed over the api label
    assert figures.counters["kthrottle_request_bytes_total"] == 520 + 106 + 3_747_149
    assert figures.counters["kthrottle_throttled_responses_total"] == 3.0
    assert not figures.in_fleet


def test_a_fleet_member_is_recognised() -> None:
    text = CAPTURED + "# TYPE kthrottle_fleet_members gauge\nkthrottle_fleet_members 3.0\n"
    assert parse_metrics(text).in_fleet


def test_text_that_is_not_prometheus_is_an_error_not_an_exception() -> None:
    scrape = scrape_from_text(A, 1.0, "<html>502 Bad Gateway</html>\n{{{")
    assert scrape.figures is None
    assert scrape.error is not None and "not Prometheus metrics text" in scrape.error


@pytest.mark.parametrize(("given", "url"), [
    ("127.0.0.1:9100", "http://127.0.0.1:9100/metrics"),
    ("http://proxy:9100", "http://proxy:9100/metrics"),
    ("http://proxy:9100/", "http://proxy:9100/metrics"),
    ("https://proxy/custom/path", "https://proxy/custom/path"),
])
def test_metrics_urls(given: str, url: str) -> None:
    assert metrics_url(given) == url


def test_a_metrics_url_without_a_host_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'http://:9100'"):
        metrics_url(":9100")


# -- rates between scrapes -------------------------------------------------------------------


def test_counters_become_rates_between_two_scrapes() -> None:
    first = scrape_from_text(A, 100.0, CAPTURED)
    # two seconds later: 1.0 s more throttle time over 2 more throttles; 20 more requests
    second = scrape_from_text(A, 102.0, _later(
        CAPTURED,
        **{'client_id="ingest-b",quota="producer_byte_rate",user=""} 1.509':
           'client_id="ingest-b",quota="producer_byte_rate",user=""} 2.509',
           'client_id="ingest-b",quota="producer_byte_rate",user=""} 3.0':
           'client_id="ingest-b",quota="producer_byte_rate",user=""} 5.0',
           '{api="Produce"} 27.0': '{api="Produce"} 47.0'}))
    assert build_view([first], {}).tenants[0].throttle_rate is None, "one scrape: no rate yet"
    view = build_view([second], {A: first})
    rows = {r.client_id: r for r in view.tenants}
    assert rows["ingest-b"].throttle_rate == pytest.approx(0.5)
    assert rows["ingest-b"].throttles_rate == pytest.approx(1.0)
    assert rows["ingest-b"].throttled and not rows["ingest-a"].throttled
    assert rows["ingest-a"].throttle_rate == 0.0
    assert view.proxies[0].rates[REQUESTS] == pytest.approx(10.0)
    assert view.total.muted == 3.0 and view.total.connections == 6.0


def test_a_counter_that_went_down_was_reset_and_counts_from_zero() -> None:
    before = Scrape(A, 10.0, _figures({("u", "c"): TenantFigures(throttle_seconds=50.0, throttles=9)}))
    after = Scrape(A, 11.0, _figures({("u", "c"): TenantFigures(throttle_seconds=0.25, throttles=1)}))
    row = build_view([after], {A: before}).tenants[0]
    assert row.throttle_rate == pytest.approx(0.25) and row.throttles_rate == pytest.approx(1.0)


def test_a_bucket_new_since_the_last_scrape_counts_from_zero() -> None:
    before = Scrape(A, 10.0, _figures({}))
    after = Scrape(A, 12.0, _figures({("u", "new"): TenantFigures(throttle_seconds=1.0, throttles=4)}))
    row = build_view([after], {A: before}).tenants[0]
    assert row.throttle_rate == pytest.approx(0.5) and row.throttles_rate == pytest.approx(2.0)


# -- fleets ----------------------------------------------------------------------------------


def _two(in_fleet: bool) -> View:
    tenant = ("alice", "etl")
    a = Scrape(A, 5.0, _figures({tenant: TenantFigures(rates={P: 300.0}, limits={P: 1000.0})}, in_fleet))
    b = Scrape(B, 5.0, _figures({tenant: TenantFigures(rates={P: 500.0}, limits={P: 1000.0}),
                                 ("bob", ""): TenantFigures(rates={F: 7.0})}, in_fleet))
    return build_view([a, b], {})


def test_lone_proxies_sum_rates_and_quotas() -> None:
    row = next(r for r in _two(in_fleet=False).tenants if r.user == "alice")
    assert row.produce == 800.0 and row.limits[P] == 2000.0 and row.usage == pytest.approx(0.4)
    assert row.proxies == 2


def test_fleet_members_sum_rates_against_their_one_quota() -> None:
    view = _two(in_fleet=True)
    row = next(r for r in view.tenants if r.user == "alice")
    assert row.produce == 800.0 and row.limits[P] == 1000.0 and row.usage == pytest.approx(0.8)
    bob = next(r for r in view.tenants if r.user == "bob")
    assert bob.proxies == 1 and bob.usage is None, "no quota, no share"
    assert view.total.connections == 8 and view.total.muted == 2


def test_an_unreachable_endpoint_is_a_line_and_the_others_still_show() -> None:
    good = Scrape(A, 5.0, parse_metrics(CAPTURED))
    dead = Scrape("http://c:9100/metrics", 5.0, error="[Errno 111] Connection refused")
    view = build_view([good, dead], {})
    assert [p.error for p in view.proxies] == [None, "[Errno 111] Connection refused"]
    assert len(view.tenants) == 2
    text = [line.text for line in render(view, ViewState(), 120, 20)]
    assert "2 proxies (1 unreachable)" in text[0]
    assert any("UNREACHABLE http://c:9100/metrics: [Errno 111] Connection refused" in t for t in text)
    assert sum(" ingest-" in t for t in text) == 2
    # every endpoint down: still a screen, saying so
    text = [line.text for line in render(build_view([dead], {}), ViewState(), 80, 10)]
    assert "UNREACHABLE" in "\n".join(text) and "no tenant" in "\n".join(text)


def test_fetch_of_a_closed_port_is_an_unreachable_scrape() -> None:
    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
        scrape = fetch(url, timeout=2.0)
    assert scrape.figures is None and scrape.error and "refused" in scrape.error.lower()


# -- sorting, filtering, keys ----------------------------------------------------------------


ROWS = [_row("alice", "etl", produce=100, fetch=5000, limit=150, throttle=0.0),
        _row("bob", "", produce=3000, fetch=0, limit=1000, throttle=0.8),
        _row("carol", "spark", produce=10, fetch=10, limit=None, throttle=None),
        _row("", "ingest", produce=3000, fetch=0, limit=6000, throttle=0.1)]


def _names(rows: list[TenantRow]) -> list[str]:
    return [r.user or r.client_id for r in rows]


@pytest.mark.parametrize(("key", "order"), [
    ("b", ["alice", "ingest", "bob", "carol"]),  # ties (3000 B/s each) by name: "" before "bob"
    ("p", ["ingest", "bob", "alice", "carol"]),
    ("f", ["alice", "carol", "ingest", "bob"]),
    ("u", ["bob", "alice", "ingest", "carol"]),  # carol has no quota: last
    ("t", ["bob", "ingest", "alice", "carol"]),  # carol not yet known: last
    ("n", ["ingest", "alice", "bob", "carol"]),
])
def test_sort_keys(key: str, order: list[str]) -> None:
    assert _names(sort_rows(ROWS, key)) == order


def test_reverse_keeps_unknowns_last_and_reverses_names() -> None:
    assert _names(sort_rows(ROWS, "t", reverse=True)) == ["alice", "ingest", "bob", "carol"]
    assert _names(sort_rows(ROWS, "n", reverse=True)) == ["carol", "bob", "alice", "ingest"]


def test_filter_matches_user_or_client_id_case_insensitively() -> None:
    assert _names(filter_rows(ROWS, "ETL")) == ["alice"]
    assert _names(filter_rows(ROWS, "in")) == ["ingest"]
    assert _names(filter_rows(ROWS, "a")) == ["alice", "carol"]
    assert filter_rows(ROWS, "nobody") == []


def test_keys() -> None:
    state = ViewState()
    assert state.sort == "b"
    state = press(state, "p")
    assert (state.sort, state.reverse) == ("p", False)
    state = press(state, "p")
    assert (state.sort, state.reverse) == ("p", True), "the same key again reverses"
    state = press(state, "t")
    assert (state.sort, state.reverse) == ("t", False)
    for key in "/bob":
        state = press(state, key)
    assert state.editing == "bob" and state.filter == "" and state.sort == "t", "keys are typed, not sorts"
    state = press(press(state, "\x7f"), "x")
    assert state.editing == "box"
    state = press(state, ENTER)
    assert state.filter == "box" and state.editing is None
    state = press(press(press(state, "/"), "z"), ESCAPE)
    assert state.filter == "box" and state.editing is None, "Esc while typing keeps the old filter"
    state = press(state, ESCAPE)
    assert state.filter == ""
    assert not press(state, "x").quit and press(state, "q").quit
    assert set(SORT_KEYS) >= {"p", "f", "t", "n"}


# -- the screen ------------------------------------------------------------------------------


def _view() -> View:
    first = scrape_from_text(A, 0.0, CAPTURED)
    second = scrape_from_text(A, 1.0, _later(CAPTURED, **{
        'client_id="ingest-b",quota="producer_byte_rate",user=""} 1.509':
        'client_id="ingest-b",quota="producer_byte_rate",user=""} 2.234'}))
    return build_view([second], {A: first})


def test_a_wide_screen() -> None:
    lines = render(_view(), ViewState(), 160, 12, "16:26:03")
    text = [line.text for line in lines]
    assert text[0] == "kthrottle top  1 proxy  2 tenants  sort: bytes desc  16:26:03"
    assert text[1].startswith("total  in ")
    # no tenant has a fetch quota: its two columns are left out
    assert text[2].split() == ["USER", "CLIENT-ID", "PRODUCE/s", "P-QUOTA", "P%", "FETCH/s", "REQ%", "USE",
                               "QUOTA-USE", "THROTTLE", "THR/s"]
    assert text[3].split() == ["!", "*", "ingest-b", "1.41MiB", "977KiB", "148%", "0B", "0.0", "148%",
                               "##########", "725ms/s", "0.0"]
    assert text[4].split() == ["*", "ingest-a", "94.4KiB", "9.54MiB", "1%", "0B", "0.0", "1%",
                               "#---------", "0ms/s", "0.0"]
    assert lines[3].style == "throttled" and lines[4].style == "normal"
    assert len(lines) == 12 and lines[-1].text.startswith("q quit"), "help on the last line"


def test_a_narrow_screen_drops_the_least_useful_columns_first() -> None:
    text = [line.text for line in render(_view(), ViewState(), 60, 10)]
    assert all(len(t) <= 60 for t in text)
    header = text[2].split()
    assert header[:3] == ["USER", "CLIENT-ID", "PRODUCE/s"]
    assert "THROTTLE" in header and "P-QUOTA" not in header and "REQ%" not in header
    assert "ingest-b" in text[3] and "725ms/s" in text[3]


def test_long_names_are_cut_with_a_mark() -> None:
    view = View([_row("a-very-long-user-principal-name-indeed", "and-an-even-longer-client-id-too", 5.0)],
                [], _view().total)
    line = render(view, ViewState(), 80, 10)[3].text
    assert "~" in line and len(line) <= 80


@pytest.mark.parametrize("editing", [None, "ing"])
def test_every_size_down_to_nothing(editing: str | None) -> None:
    view = build_view([scrape_from_text(A, 0.0, CAPTURED),
                       Scrape("http://dead:1/metrics", 0.0, error="timed out")], {})
    state = ViewState(editing=editing)
    for width in range(0, 45):
        for height in range(0, 12):
            lines = render(view, state, width, height)
            assert len(lines) <= height and all(len(line.text) <= width for line in lines), (width, height)
            if width >= 20 and height >= (2 if editing else 1):
                assert lines[0].text.startswith("kthrottle top")
            if height >= 2 and width >= 10 and editing:
                assert lines[-1].style == "prompt", "the filter being typed stays visible"
            if height >= 1 and width >= 45:
                assert "(1 unreachable)" in lines[0].text or (editing and height == 1)
            if height >= 4 and width >= 30 and not editing:  # the error line, above the table
                assert any("UNREACHABLE" in line.text for line in lines), (width, height)


def test_once_prints_every_tenant_and_no_help() -> None:
    rows = [_row(f"user{i:02}", "c", produce=i) for i in range(50)]
    text = [line.text for line in render(View(rows, [], _view().total), ViewState(), 100, None)]
    assert len(text) == 3 + 50 and text[3].split()[0] == "user49"
    assert not any(t.startswith("q quit") for t in text)


def test_filtered_to_nothing_says_so() -> None:
    text = [line.text for line in render(_view(), ViewState(filter="nobody"), 100, 10)]
    assert "filter: 'nobody'" in text[0] and "0 tenants" in text[0]
    assert any("(no tenant matches 'nobody')" in t for t in text)


def test_numbers() -> None:
    assert [human_bytes(v) for v in (0, 1023, 1024, 10 * 1024, 1_000_000, 1023.9 * 1024 ** 2)] == \
        ["0B", "1023B", "1.00KiB", "10.0KiB", "977KiB", "1024MiB"]
    assert bar(None, 10) == "-" and bar(0.0, 4) == "----" and bar(0.001, 4) == "#---"
    assert bar(0.5, 10) == "#####-----" and bar(2.5, 10) == "#" * 10 and bar(1.0, 0) == ""


def test_quota_columns_show_once_a_tenant_has_that_quota() -> None:
    fetching = _row("dave", "etl", fetch=500.0)
    fetching.limits[F] = 1000.0
    view = View([fetching, *ROWS], [], _view().total)
    header = render(view, ViewState(), 200, 10)[2].text.split()
    assert {"F-QUOTA", "F%", "P-QUOTA", "P%"} <= set(header)
    line = next(line.text for line in render(view, ViewState(), 200, 10) if " dave " in line.text)
    assert dict(zip(header, line.split(), strict=True))["F%"] == "50%"


def test_at_40_columns_rates_and_throttle_time_stay() -> None:
    text = [line.text for line in render(_view(), ViewState(), 40, 10)]
    assert text[2].split() == ["USER", "CLIENT-ID", "PRODUCE/s", "THROTTLE"]
    assert text[3].split() == ["!", "*", "ingest-b", "1.41MiB", "725ms/s"]


# -- the cluster capacity's columns ----------------------------------------------------------

#: What a proxy with a `[capacity]` table adds (the families of proxy/observability/capacity_metrics.py,
#: as it exports them): tenant "ingest-b" is also a capacity tenant (share 3, the same labels as its
#: quota bucket), user "gold" is a capacity tenant no quota covers (share 0.5, producing and
#: consuming, throttled by the capacity), and "ingest-a" has no capacity figures.
CAPACITY = """\
# TYPE kthrottle_capacity gauge
kthrottle_capacity{quota="producer_byte_rate"} 2e+06
kthrottle_capacity{quota="consumer_byte_rate"} 1e+06
# TYPE kthrottle_capacity_demand gauge
kthrottle_capacity_demand{client_id="ingest-b",quota="producer_byte_rate",user=""} 1e+06
kthrottle_capacity_demand{client_id="",quota="producer_byte_rate",user="gold"} 60000.0
kthrottle_capacity_demand{client_id="",quota="consumer_byte_rate",user="gold"} 40000.0
kthrottle_capacity_demand{client_id="",quota="request_percentage",user="gold"} 12.5
# TYPE kthrottle_capacity_tenant_rate gauge
kthrottle_capacity_tenant_rate{client_id="ingest-b",quota="producer_byte_rate",user=""} 1.4e+06
kthrottle_capacity_tenant_rate{client_id="",quota="producer_byte_rate",user="gold"} 50000.0
kthrottle_capacity_tenant_rate{client_id="",quota="consumer_byte_rate",user="gold"} 20000.0
# TYPE kthrottle_capacity_share gauge
kthrottle_capacity_share{client_id="ingest-b",quota="producer_byte_rate",user=""} 3.0
kthrottle_capacity_share{client_id="",quota="producer_byte_rate",user="gold"} 0.5
kthrottle_capacity_share{client_id="",quota="consumer_byte_rate",user="gold"} 0.5
kthrottle_capacity_share{client_id="",quota="request_percentage",user="gold"} 0.5
# TYPE kthrottle_capacity_throttle_time_seconds_total counter
kthrottle_capacity_throttle_time_seconds_total{client_id="ingest-b",quota="producer_byte_rate",user=""} 0.0
kthrottle_capacity_throttle_time_seconds_total{client_id="",quota="producer_byte_rate",user="gold"} 2.0
kthrottle_capacity_throttle_time_seconds_total{client_id="",quota="consumer_byte_rate",user="gold"} 0.0
# TYPE kthrottle_capacity_throttles_total counter
kthrottle_capacity_throttles_total{client_id="ingest-b",quota="producer_byte_rate",user=""} 0.0
kthrottle_capacity_throttles_total{client_id="",quota="producer_byte_rate",user="gold"} 4.0
kthrottle_capacity_throttles_total{client_id="",quota="consumer_byte_rate",user="gold"} 0.0
"""
GOLD_THROTTLE = 'kthrottle_capacity_throttle_time_seconds_total{client_id="",quota="producer_byte_rate",user="gold"} '
GOLD_THROTTLES = 'kthrottle_capacity_throttles_total{client_id="",quota="producer_byte_rate",user="gold"} '


def test_capacity_figures_join_the_tenants_rows() -> None:
    figures = parse_metrics(CAPTURED + CAPACITY)
    assert set(figures.tenants) == {("", "ingest-a"), ("", "ingest-b"), ("gold", "")}
    gold = figures.tenants[("gold", "")]
    assert gold.weight == 0.5
    assert gold.demands == {P: 60_000.0, F: 40_000.0, "request_percentage": 12.5}
    assert gold.capacity_rates == {P: 50_000.0, F: 20_000.0}
    assert gold.rates == {} and gold.limits == {}, "no quota covers gold: no quota bucket"
    assert (gold.throttle_seconds, gold.throttles) == (2.0, 4.0), "the capacity's throttles count"
    heavy = figures.tenants[("", "ingest-b")]
    assert heavy.weight == 3.0 and heavy.demands == {P: 1_000_000.0}
    assert heavy.throttle_seconds == pytest.approx(1.509) and heavy.throttles == 3.0, "quota's + capacity's 0"
    light = figures.tenants[("", "ingest-a")]
    assert light.weight is None and light.demands == {} and light.capacity_rates == {}


def _capacity_view() -> View:
    first = scrape_from_text(A, 0.0, CAPTURED + CAPACITY)
    second = scrape_from_text(A, 2.0, _later(CAPTURED + CAPACITY, **{
        GOLD_THROTTLE + "2.0": GOLD_THROTTLE + "3.0", GOLD_THROTTLES + "4.0": GOLD_THROTTLES + "8.0"}))
    return build_view([second], {A: first})


def test_rows_show_share_and_demand_and_rows_without_capacity_a_dash() -> None:
    view = _capacity_view()
    rows = {(r.user, r.client_id): r for r in view.tenants}
    gold, heavy, light = rows[("gold", "")], rows[("", "ingest-b")], rows[("", "ingest-a")]
    assert gold.weight == 0.5 and gold.demand == 100_000.0, "produce + fetch demand; request time left out"
    assert heavy.weight == 3.0 and heavy.demand == 1_000_000.0
    assert light.weight is None and light.demand is None
    # gold has no quota bucket: its rates are the capacity's; ingest-b keeps its quota bucket's rate
    assert (gold.produce, gold.fetch) == (50_000.0, 20_000.0)
    assert heavy.produce == pytest.approx(1_480_392.586, abs=0.01)
    assert gold.throttle_rate == pytest.approx(0.5) and gold.throttles_rate == pytest.approx(2.0)
    assert gold.throttled, "a tenant the capacity throttles is marked"

    lines = render(view, ViewState(), 200, 12)
    header = lines[2].text.split()
    assert header == ["USER", "CLIENT-ID", "PRODUCE/s", "P-QUOTA", "P%", "FETCH/s", "REQ%", "SHARE", "DEMAND/s",
                      "USE", "QUOTA-USE", "THROTTLE", "THR/s"]
    cells = {}
    for line in lines[3:6]:
        words = line.text.split()
        flagged = words[0] == "!"
        words = words[1:] if flagged else words
        cells[words[1] if words[0] == "*" else words[0]] = (flagged, dict(zip(header[2:], words[2:], strict=True)))
    assert cells["gold"][0] and cells["gold"][1]["SHARE"] == "0.5" and cells["gold"][1]["DEMAND/s"] == "97.7KiB"
    assert cells["gold"][1]["PRODUCE/s"] == "48.8KiB" and cells["gold"][1]["P-QUOTA"] == "-"
    assert cells["ingest-b"][1]["SHARE"] == "3" and cells["ingest-b"][1]["DEMAND/s"] == "977KiB"
    assert cells["ingest-a"][1]["SHARE"] == "-" and cells["ingest-a"][1]["DEMAND/s"] == "-"


def test_capacity_columns_only_show_with_capacity_figures() -> None:
    header = render(_view(), ViewState(), 200, 10)[2].text.split()
    assert "SHARE" not in header and "DEMAND/s" not in header, "no [capacity]: no capacity columns"
    filtered = render(_capacity_view(), ViewState(filter="ingest-a"), 200, 10)[2].text.split()
    assert "SHARE" not in filtered, "hidden while no tenant shown has capacity figures"
    narrow = render(_capacity_view(), ViewState(), 60, 10)[2].text.split()
    assert "SHARE" not in narrow and "THROTTLE" in narrow, "dropped before the rates and throttle time"


def _capacity_pair(in_fleet: bool) -> TenantRow:
    tenant = ("gold", "")
    a = Scrape(A, 5.0, _figures({tenant: TenantFigures(weight=2.0, demands={P: 300.0, F: 10.0},
                                                       capacity_rates={P: 250.0})}, in_fleet))
    b = Scrape(B, 5.0, _figures({tenant: TenantFigures(weight=2.0, demands={P: 500.0},
                                                       capacity_rates={P: 400.0})}, in_fleet))
    return build_view([a, b], {}).tenants[0]


def test_fleet_members_report_one_fleet_wide_demand_and_lone_proxies_add_up() -> None:
    fleet = _capacity_pair(in_fleet=True)  # each member's figure is already fleet-wide: the largest
    assert fleet.demands == {P: 500.0, F: 10.0} and fleet.demand == 510.0 and fleet.produce == 400.0
    lone = _capacity_pair(in_fleet=False)  # each proxy shares a capacity of its own: summed
    assert lone.demands == {P: 800.0, F: 10.0} and lone.demand == 810.0 and lone.produce == 650.0
    assert fleet.weight == lone.weight == 2.0 and fleet.proxies == 2


def test_the_proxys_own_capacity_metrics_parse() -> None:
    """The names and labels `top` reads are the ones the proxy exports (a real CapacityMetrics)."""
    engine = QuotaEngine()
    engine.capacity.configure(CapacityConfig(produce_byte_rate=10_000.0))
    engine.set_quotas({QuotaEntity("gold", None): {EntitySetting.SHARE: 3.0}})
    for now in range(0, 5_000, 50):  # 100 kB/s against 10 kB/s: the capacity binds and throttles
        if now % REFRESH_INTERVAL_MS == 0:
            engine.capacity.refresh(now)
        engine.charge("gold", "etl", now, produce_bytes=5_000)
    registry = CollectorRegistry()
    CapacityMetrics(registry, engine.capacity, None, 1000).refresh(5_000)
    gold = parse_metrics(generate_latest(registry).decode()).tenants[("gold", "")]
    flow = next(iter(engine.capacity.directions[QuotaType.PRODUCE].flows.values()))
    assert gold.weight == 3.0 and gold.demands == {P: flow.demand} and flow.demand > 0
    assert gold.capacity_rates[P] > 0
    assert gold.throttles == flow.throttle_count > 0
    assert gold.throttle_seconds == pytest.approx(flow.throttle_total_ms / 1000.0)


# -- shadow mode -------------------------------------------------------------------------------------

SHADOWED = CAPTURED.replace(
    'kthrottle_throttles_total{client_id="ingest-b",quota="producer_byte_rate",user=""} 3.0',
    'kthrottle_throttles_total{client_id="ingest-b",mode="enforced",quota="producer_byte_rate",user=""} 3.0\n'
    'kthrottle_throttles_total{client_id="ingest-a",mode="shadow",quota="producer_byte_rate",user=""} 4.0',
).replace(
    'kthrottle_throttle_time_seconds_total{client_id="ingest-b",quota="producer_byte_rate",user=""} 1.509',
    'kthrottle_throttle_time_seconds_total{client_id="ingest-b",mode="enforced",quota="producer_byte_rate",user=""} 1.509\n'
    'kthrottle_throttle_time_seconds_total{client_id="ingest-a",mode="shadow",quota="producer_byte_rate",user=""} 8.0',
)


def test_shadow_throttles_show_in_their_own_column_not_as_throttles() -> None:
    first = scrape_from_text(A, 100.0, SHADOWED)
    second = scrape_from_text(A, 102.0, SHADOWED.replace('user=""} 8.0', 'user=""} 12.0'))
    rows = {r.client_id: r for r in build_view([second], {A: first}).tenants}
    assert rows["ingest-a"].shadow_rate == pytest.approx(2.0), "4 s of would-be throttles in 2 s"
    assert rows["ingest-a"].throttle_rate == 0.0 and not rows["ingest-a"].throttled, "nothing applied"
    assert rows["ingest-b"].shadow_rate is None
    text = [line.text for line in render(build_view([second], {A: first}), ViewState(), 170, 12, "16:26:03")]
    header = text[2].split()
    assert header[-1] == "WOULD", header
    cells = {line.split()[1]: line.split() for line in text[3:5]}
    assert cells["ingest-a"][-1] == "2.0s/s" and cells["ingest-b"][-1] == "-"
    # no shadow series anywhere: the column is left out
    plain = render(build_view([scrape_from_text(A, 102.0, CAPTURED)], {A: scrape_from_text(A, 100.0, CAPTURED)}),
                   ViewState(), 170, 12, "16:26:03")
    assert "WOULD" not in plain[2].text
