"""`kthrottle top`'s pure half: metrics text in, screen lines out.

Why pure: the screen is a function of two scrapes per proxy, the operator's sort and filter, and
the terminal's size, so every size, sort and failure can be tested without a terminal or a socket.
proxy/top.py only fetches the text, keeps time, reads keys and draws these lines with curses.

Where the figures come from (README "Metrics"): per (user, client-id) and quota type, the proxy's
own windowed rate gauges (the numbers its throttling decisions use, like a broker's `byte-rate`),
the quota in force (`kthrottle_quota_limit`) and the throttle counters, which are differentiated
between two scrapes; per proxy, the connection gauges and the request counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

from quotas.types import QuotaType

#: The rate gauge of each quota type, as proxy/metrics.py exports them (`quota` label = QuotaType.value).
RATE_FAMILIES: dict[str, str] = {
    QuotaType.PRODUCE.value: "kthrottle_produce_byte_rate_bytes_per_second",
    QuotaType.FETCH.value: "kthrottle_fetch_byte_rate_bytes_per_second",
    QuotaType.REQUEST.value: "kthrottle_request_time_percent",
    QuotaType.CONTROLLER_MUTATION.value: "kthrottle_controller_mutation_rate_per_second",
    QuotaType.PRODUCER_IDS.value: "kthrottle_producer_id_rate_per_second",
}
_RATE_SAMPLES = {name: quota for quota, name in RATE_FAMILIES.items()}
LIMIT = "kthrottle_quota_limit"
THROTTLE_TIME = "kthrottle_throttle_time_seconds_total"
THROTTLES = "kthrottle_throttles_total"
MUTED = "kthrottle_muted_connections"
CONNECTIONS = "kthrottle_connections"
UPSTREAM_UP = "kthrottle_upstream_up"
#: A proxy that exports this is a fleet member: its quotas bound the whole fleet, not itself alone.
FLEET_MEMBERS = "kthrottle_fleet_members"
#: The per-proxy counters shown as rates (summed over their `api` label).
REQUESTS = "kthrottle_requests_total"
REQUEST_BYTES = "kthrottle_request_bytes_total"
RESPONSE_BYTES = "kthrottle_response_bytes_total"
THROTTLED_RESPONSES = "kthrottle_throttled_responses_total"
_PROXY_COUNTERS = (REQUESTS, REQUEST_BYTES, RESPONSE_BYTES, THROTTLED_RESPONSES)

#: The label proxy/metrics.py gives to entities folded beyond `metrics_max_entities`.
OTHER = "__other__"

#: (user, client_id) as the proxy labels a quota bucket; "" where the bucket spans that dimension.
Tenant = tuple[str, str]


# -- one scrape --------------------------------------------------------------------------------


@dataclass
class TenantFigures:
    """One tenant's samples in one proxy's scrape."""

    rates: dict[str, float] = field(default_factory=dict)  # quota type -> rate gauge
    limits: dict[str, float] = field(default_factory=dict)  # quota type -> quota in force
    throttle_seconds: float = 0.0  # counter, summed over quota types
    throttles: float = 0.0  # counter, summed over quota types


@dataclass
class ProxyFigures:
    """Everything `top` uses from one proxy's metrics text."""

    tenants: dict[Tenant, TenantFigures] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # _PROXY_COUNTERS, summed over labels
    muted: float = 0.0
    connections: float = 0.0
    upstream_up: float | None = None
    in_fleet: bool = False


@dataclass(frozen=True)
class Scrape:
    """One fetch of one endpoint: its figures, or why there are none. `at` is monotonic seconds."""

    url: str
    at: float
    figures: ProxyFigures | None = None
    error: str | None = None


def parse_metrics(text: str) -> ProxyFigures:
    """The figures in a Prometheus text exposition; ValueError when it is not one."""
    figures = ProxyFigures()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if math.isnan(value):
                continue
            if name in _RATE_SAMPLES or name in (LIMIT, THROTTLE_TIME, THROTTLES):
                tenant = (labels.get("user", ""), labels.get("client_id", ""))
                entry = figures.tenants.setdefault(tenant, TenantFigures())
                if name in _RATE_SAMPLES:
                    entry.rates[_RATE_SAMPLES[name]] = value
                elif name == LIMIT:
                    entry.limits[labels.get("quota", "")] = value
                elif name == THROTTLE_TIME:
                    entry.throttle_seconds += value
                else:
                    entry.throttles += value
            elif name in _PROXY_COUNTERS:
                figures.counters[name] = figures.counters.get(name, 0.0) + value
            elif name == MUTED:
                figures.muted = value
            elif name == CONNECTIONS:
                figures.connections = value
            elif name == UPSTREAM_UP:
                figures.upstream_up = value
            elif name == FLEET_MEMBERS:
                figures.in_fleet = True
    return figures


def scrape_from_text(url: str, at: float, text: str) -> Scrape:
    """A Scrape of fetched text: text that is not Prometheus's is an error shown, not raised."""
    try:
        return Scrape(url, at, parse_metrics(text))
    except ValueError as exc:
        return Scrape(url, at, error=f"not Prometheus metrics text: {exc}")


def metrics_url(text: str) -> str:
    """`host:port`, `http://host:port` or a full URL; the path defaults to /metrics."""
    text = text.strip()
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if not parts.hostname:
        raise ValueError(f"not a metrics endpoint: {text!r} (expected host:port or http://host:port/metrics)")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


# -- from scrapes to rows --------------------------------------------------------------------


def _counter_rate(current: float, previous: float | None, seconds: float) -> float | None:
    """Per second between two readings; a counter that went down was reset (a restart) and counts
    from zero, as Prometheus's rate() does."""
    if previous is None or seconds <= 0:
        return None
    delta = current - previous if current >= previous else current
    return delta / seconds


@dataclass
class TenantRow:
    """One tenant over every proxy that answered."""

    user: str
    client_id: str
    rates: dict[str, float] = field(default_factory=dict)  # summed over proxies
    limits: dict[str, float] = field(default_factory=dict)  # the quota in force over those proxies
    throttle_rate: float | None = None  # throttle seconds decided per second, over the last refresh
    throttles_rate: float | None = None  # throttles per second, over the last refresh
    proxies: int = 0  # proxies that have a bucket for this tenant

    @property
    def produce(self) -> float:
        return self.rates.get(QuotaType.PRODUCE.value, 0.0)

    @property
    def fetch(self) -> float:
        return self.rates.get(QuotaType.FETCH.value, 0.0)

    @property
    def request(self) -> float:
        return self.rates.get(QuotaType.REQUEST.value, 0.0)

    def share(self, quota: str) -> float | None:
        """Rate / quota for one quota type; None without a quota."""
        limit = self.limits.get(quota)
        if limit is None or limit <= 0:
            return None
        return self.rates.get(quota, 0.0) / limit

    @property
    def usage(self) -> float | None:
        """The share of its most used quota: the one that throttles it first."""
        shares = [s for s in (self.share(q) for q in self.limits) if s is not None]
        return max(shares) if shares else None

    @property
    def throttled(self) -> bool:
        return bool(self.throttle_rate) or bool(self.throttles_rate)


@dataclass
class ProxyRow:
    """One endpoint's own totals (or the sum of all), or why it could not be read."""

    url: str
    error: str | None = None
    connections: float = 0.0
    muted: float = 0.0
    upstream_up: float | None = None
    in_fleet: bool = False
    rates: dict[str, float | None] = field(default_factory=dict)  # _PROXY_COUNTERS per second


@dataclass
class View:
    tenants: list[TenantRow]
    proxies: list[ProxyRow]
    total: ProxyRow


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def build_view(current: Sequence[Scrape], previous: Mapping[str, Scrape]) -> View:
    """Rows for the screen from this refresh's scrapes and the last good scrape of each endpoint.

    Rates of a fleet are summed over its proxies. A quota is summed too, since each lone proxy
    grants it in full, except among fleet members, which enforce one quota between them (their
    largest is taken).
    """
    proxies: list[ProxyRow] = []
    tenants: dict[Tenant, TenantRow] = {}
    fleet_limits: dict[Tenant, dict[str, float]] = {}
    throttle_rates: dict[Tenant, list[float | None]] = {}
    throttles_rates: dict[Tenant, list[float | None]] = {}
    for scrape in current:
        figures = scrape.figures
        if figures is None:
            proxies.append(ProxyRow(scrape.url, error=scrape.error or "no answer"))
            continue
        before = previous.get(scrape.url)
        old = before.figures if before is not None else None
        seconds = scrape.at - before.at if before is not None else 0.0
        proxies.append(ProxyRow(
            scrape.url, connections=figures.connections, muted=figures.muted,
            upstream_up=figures.upstream_up, in_fleet=figures.in_fleet,
            rates={name: _counter_rate(figures.counters.get(name, 0.0),
                                       None if old is None else old.counters.get(name, 0.0), seconds)
                   for name in _PROXY_COUNTERS}))
        for tenant, entry in figures.tenants.items():
            row = tenants.setdefault(tenant, TenantRow(*tenant))
            row.proxies += 1
            for quota, rate in entry.rates.items():
                row.rates[quota] = row.rates.get(quota, 0.0) + rate
            for quota, limit in entry.limits.items():
                if figures.in_fleet:
                    merged = fleet_limits.setdefault(tenant, {})
                    merged[quota] = max(merged.get(quota, 0.0), limit)
                else:
                    row.limits[quota] = row.limits.get(quota, 0.0) + limit
            # a bucket the last scrape did not have started from zero since
            prior = None if old is None else old.tenants.get(tenant, TenantFigures())
            throttle_rates.setdefault(tenant, []).append(_counter_rate(
                entry.throttle_seconds, None if prior is None else prior.throttle_seconds, seconds))
            throttles_rates.setdefault(tenant, []).append(_counter_rate(
                entry.throttles, None if prior is None else prior.throttles, seconds))
    for tenant, row in tenants.items():
        for quota, limit in fleet_limits.get(tenant, {}).items():
            row.limits[quota] = row.limits.get(quota, 0.0) + limit
        row.throttle_rate = _sum_known(throttle_rates.get(tenant, ()))
        row.throttles_rate = _sum_known(throttles_rates.get(tenant, ()))
    answered = [p for p in proxies if p.error is None]
    total = ProxyRow(
        "total", connections=sum(p.connections for p in answered), muted=sum(p.muted for p in answered),
        rates={name: _sum_known(p.rates.get(name) for p in answered) for name in _PROXY_COUNTERS})
    return View(list(tenants.values()), proxies, total)


# -- sorting and filtering -------------------------------------------------------------------


@dataclass(frozen=True)
class SortKey:
    title: str
    value: Callable[[TenantRow], float | None]  # larger first; None last


#: Keys that sort the table: pressing one sorts by it, pressing it again reverses the order.
SORT_KEYS: dict[str, SortKey] = {
    "b": SortKey("bytes", lambda r: r.produce + r.fetch),
    "p": SortKey("produce", lambda r: r.produce),
    "f": SortKey("fetch", lambda r: r.fetch),
    "r": SortKey("request time", lambda r: r.request),
    "u": SortKey("quota use", lambda r: r.usage),
    "t": SortKey("throttle time", lambda r: r.throttle_rate),
    "n": SortKey("name", lambda r: None),
}
DEFAULT_SORT = "b"
NAME_SORT = "n"


def sort_rows(rows: Iterable[TenantRow], key: str, reverse: bool = False) -> list[TenantRow]:
    """Largest first (names: alphabetical), ties and unknowns after, by name; `reverse` flips."""
    by_name = sorted(rows, key=lambda r: (r.user, r.client_id))
    if key == NAME_SORT:
        return by_name[::-1] if reverse else by_name
    value = SORT_KEYS[key].value
    known = [r for r in by_name if value(r) is not None]
    unknown = [r for r in by_name if value(r) is None]
    ordered = sorted(known, key=lambda r: value(r) or 0.0, reverse=not reverse)  # stable: ties by name
    return ordered + unknown


def filter_rows(rows: Iterable[TenantRow], text: str) -> list[TenantRow]:
    """Tenants whose user or client-id contains `text` (case-insensitive)."""
    needle = text.lower()
    return [r for r in rows if needle in r.user.lower() or needle in r.client_id.lower()]


# -- keys ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViewState:
    """What the operator chose: sort, filter, and the filter being typed (None when not typing)."""

    sort: str = DEFAULT_SORT
    reverse: bool = False
    filter: str = ""
    editing: str | None = None
    quit: bool = False


ENTER = "\n"
ESCAPE = "\x1b"
BACKSPACE = "\x7f"


def press(state: ViewState, key: str) -> ViewState:
    """The state after one key (the driver maps curses's codes to these strings)."""
    if state.editing is not None:
        if key in (ENTER, "\r"):
            return replace(state, filter=state.editing, editing=None)
        if key == ESCAPE:
            return replace(state, editing=None)
        if key in (BACKSPACE, "\b"):
            return replace(state, editing=state.editing[:-1])
        if len(key) == 1 and key.isprintable():
            return replace(state, editing=state.editing + key)
        return state
    if key in ("q", "Q"):
        return replace(state, quit=True)
    if key == "/":
        return replace(state, editing=state.filter)
    if key == ESCAPE:
        return replace(state, filter="")
    if key in SORT_KEYS:
        reverse = not state.reverse if key == state.sort else False
        return replace(state, sort=key, reverse=reverse)
    return state


# -- formatting ------------------------------------------------------------------------------


def human_bytes(value: float) -> str:
    """Bytes in binary units with 3 significant digits, at most 7 characters ("1023KiB"), no space
    (so a line splits into its cells)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f}B"
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:.{digits}f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _throttle_text(seconds_per_second: float | None) -> str:
    if seconds_per_second is None:
        return "-"
    if seconds_per_second < 1.0:
        return f"{seconds_per_second * 1000:.0f}ms/s"
    return f"{seconds_per_second:.1f}s/s"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def _optional(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def bar(share: float | None, width: int) -> str:
    """`share` of a quota as '#' over `width` cells ('-' for the rest); over 100% is all '#'."""
    if width <= 0:
        return ""
    if share is None:
        return "-"
    filled = min(width, round(min(share, 1.0) * width))
    if share > 0 and filled == 0:
        filled = 1
    return "#" * filled + "-" * (width - filled)


def fit(text: str, width: int) -> str:
    """`text` cut to `width` characters, with '~' marking a cut."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    return text[: width - 1] + "~" if width > 1 else text[:1]


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    priority: int  # the largest is dropped first when the terminal is too narrow
    cell: Callable[[TenantRow], str]
    left: bool = False
    quota: bool = False  # about quotas: hidden while no tenant shown has that quota ("-" in every cell)


BAR_WIDTH = 10
#: A name column is not cut below this while other columns can still be dropped.
MIN_NAME_WIDTH = 12
#: Nor wider than this (long client ids are cut with '~').
MAX_NAME_WIDTH = 24
P, F, R = QuotaType.PRODUCE.value, QuotaType.FETCH.value, QuotaType.REQUEST.value


def _limit_bytes(row: TenantRow, quota: str) -> str:
    limit = row.limits.get(quota)
    return "-" if limit is None else human_bytes(limit)


COLUMNS: tuple[Column, ...] = (
    Column("PRODUCE/s", 9, 1, lambda r: human_bytes(r.produce)),
    Column("P-QUOTA", 9, 6, lambda r: _limit_bytes(r, P), quota=True),
    Column("P%", 5, 3, lambda r: _percent(r.share(P)), quota=True),
    Column("FETCH/s", 9, 2, lambda r: human_bytes(r.fetch)),
    Column("F-QUOTA", 9, 6, lambda r: _limit_bytes(r, F), quota=True),
    Column("F%", 5, 3, lambda r: _percent(r.share(F)), quota=True),
    Column("REQ%", 6, 5, lambda r: f"{r.request:.1f}"),
    Column("USE", 5, 2, lambda r: _percent(r.usage), quota=True),
    Column("QUOTA-USE", BAR_WIDTH, 4, lambda r: bar(r.usage, BAR_WIDTH), left=True, quota=True),
    Column("THROTTLE", 8, 1, lambda r: _throttle_text(r.throttle_rate)),
    Column("THR/s", 6, 3, lambda r: _optional(r.throttles_rate)),
)
PROXIES_COLUMN = Column("PROXIES", 7, 7, lambda r: str(r.proxies))


def _layout(rows: Sequence[TenantRow], width: int, fleet: bool) -> tuple[int, int, list[Column]]:
    """User and client-id widths and the columns that fit `width` (least important dropped first)."""
    columns = [c for c in ([*COLUMNS, PROXIES_COLUMN] if fleet else COLUMNS)
               if not (c.quota and rows and all(c.cell(r) == "-" for r in rows))]
    need_user = max([len("USER"), *(len(_shown(r.user)) for r in rows)])
    need_client = max([len("CLIENT-ID"), *(len(_shown(r.client_id)) for r in rows)])
    user_w, client_w = min(need_user, MAX_NAME_WIDTH), min(need_client, MAX_NAME_WIDTH)

    def fixed(cols: list[Column]) -> int:
        return 2 + sum(c.width + 1 for c in cols)  # flag column and a space before each column

    least_names = min(user_w, MIN_NAME_WIDTH) + min(client_w, MIN_NAME_WIDTH) + 1
    while columns and fixed(columns) + least_names > width:
        columns.remove(max(reversed(columns), key=lambda c: c.priority))  # ties: the rightmost
    room = width - fixed(columns) - 1
    if user_w + client_w > room:  # share the room, giving the longer name what the shorter leaves
        user_w = max(min(user_w, room // 2), room - client_w, 1)
        client_w = max(room - user_w, 1)
    return user_w, client_w, columns


def _shown(name: str) -> str:
    """A bucket label as shown: "" means the bucket spans every user (or client-id)."""
    return name if name else "*"


@dataclass(frozen=True)
class Line:
    """One screen line and how to draw it: title, header, normal, throttled, error, prompt."""

    text: str
    style: str = "normal"


def _table(rows: Sequence[TenantRow], width: int, fleet: bool) -> tuple[Line, list[Line]]:
    user_w, client_w, columns = _layout(rows, width, fleet)

    def assemble(flag: str, user: str, client: str, cells: list[str]) -> str:
        parts = [flag, fit(user, user_w).ljust(user_w), fit(client, client_w).ljust(client_w)]
        for column, cell in zip(columns, cells, strict=True):
            text = fit(cell, column.width)
            parts.append(text.ljust(column.width) if column.left else text.rjust(column.width))
        return fit(" ".join(parts).rstrip(), width)

    header = Line(assemble(" ", "USER", "CLIENT-ID", [c.title for c in columns]), "header")
    lines = [Line(assemble("!" if row.throttled else " ", _shown(row.user), _shown(row.client_id),
                           [c.cell(row) for c in columns]), "throttled" if row.throttled else "normal")
             for row in rows]
    return header, lines


def _proxy_text(row: ProxyRow) -> str:
    if row.error is not None:
        return f"UNREACHABLE {row.url}: {row.error}"  # the word first: it survives a narrow screen
    rates = row.rates

    def per_second(name: str, bytes_: bool) -> str:
        value = rates.get(name)
        if value is None:
            return "-"
        return f"{human_bytes(value)}/s" if bytes_ else f"{value:.1f}/s"

    text = (f"{row.url}  in {per_second(REQUEST_BYTES, True)}  out {per_second(RESPONSE_BYTES, True)}  "
            f"requests {per_second(REQUESTS, False)}  throttled {per_second(THROTTLED_RESPONSES, False)}  "
            f"muted {row.muted:.0f}  connections {row.connections:.0f}")
    if row.upstream_up == 0:
        text += "  UPSTREAM DOWN"
    return text


HELP = ("q quit  / filter (Esc clears)  sort: b bytes  p produce  f fetch  r request  u quota use  "
        "t throttle  n name (again: reverse)")


def render(view: View, state: ViewState, width: int, height: int | None, clock: str = "") -> list[Line]:
    """The screen for `width` x `height` (None: as many lines as there are tenants, for --once).

    Every line fits the width; the help line (or the filter being typed) is the last line. When
    the height is short, the per-proxy lines fold into one, then
    the help line and the totals go, so the table keeps the most room; the filter prompt and an
    unreachable proxy stay visible as long as there is a line for them.
    """
    if width <= 0 or (height is not None and height <= 0):
        return []
    rows = sort_rows(filter_rows(view.tenants, state.filter), state.sort, state.reverse)
    failed = [p for p in view.proxies if p.error is not None]
    order = ("asc" if not state.reverse else "desc") if state.sort == NAME_SORT else \
        ("desc" if not state.reverse else "asc")
    title = (f"kthrottle top  {len(view.proxies)} prox{'y' if len(view.proxies) == 1 else 'ies'}"
             + (f" ({len(failed)} unreachable)" if failed else "")
             + f"  {len(rows)} tenant{'' if len(rows) == 1 else 's'}"
             + f"  sort: {SORT_KEYS[state.sort].title} {order}"
             + (f"  filter: {state.filter!r}" if state.filter else "")
             + (f"  {clock}" if clock else ""))
    title_line = Line(fit(title, width), "title")
    total_line = Line(fit(_proxy_text(view.total), width))  # "total  in ...": the url is "total"
    proxy_lines: list[Line] = []
    summary: list[Line] = []
    if len(view.proxies) > 1 or failed:
        proxy_lines = [Line(fit("  " + _proxy_text(p), width), "error" if p.error else "normal")
                       for p in view.proxies]
        if failed:
            first = failed[0]
            more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
            summary = [Line(fit(f"  {_proxy_text(first)}{more}", width), "error")]
        else:
            summary = [Line(fit(f"  {len(view.proxies)} proxies answered", width))]
    header, table = _table(rows, width, len(view.proxies) > 1)
    if not table:
        why = f"no tenant matches {state.filter!r}" if state.filter else "no tenant has a quota bucket yet"
        table = [Line(fit(f"  ({why})", width))]
    bottom = (Line(fit(f"filter: {state.editing}_", width), "prompt") if state.editing is not None
              else Line(fit(HELP, width), "header"))
    if height is None:
        return [title_line, total_line, *proxy_lines, header, *table]
    layouts = (
        [title_line, total_line, *proxy_lines, header],
        [title_line, total_line, *summary, header],
        [title_line, *summary, header],
        [title_line, header],
    )
    # the fullest layout that shows a few tenants, else one tenant; the proxies' line goes last
    bottoms = (True, False) if state.editing is None else (True,)
    wants = (min(len(table), 3), 1)
    candidates = [*((top, b, w) for w in wants for top in layouts[:3] for b in bottoms),
                  *((layouts[3], b, w) for w in wants for b in bottoms)]
    for top, with_bottom, want_rows in candidates:
        used = len(top) + (1 if with_bottom else 0)
        if height - used >= want_rows:
            body = [*top, *table[: height - used]]
            if not with_bottom:
                return body
            return [*body, *[Line("")] * (height - 1 - len(body)), bottom]  # on the last line
    if state.editing is not None:
        return [*[title_line, *summary][: height - 1], bottom]
    return [title_line, *summary, header, *table][:height]
