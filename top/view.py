"""`kthrottle top`'s screen (pure): rows, the operator's sort and filter, a terminal size in; lines out.

Why pure: the screen is a function of two scrapes per proxy (top_figures.py), the operator's sort
and filter, and the terminal's size, so every size, sort and failure can be tested without a
terminal or a socket. top/app.py only fetches the text, keeps time, reads keys and draws these
lines with curses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from quotas.types import QuotaType
from top.figures import (
    DEFAULT_SORT,
    NAME_SORT,
    REQUEST_BYTES,
    REQUESTS,
    RESPONSE_BYTES,
    SORT_KEYS,
    THROTTLED_RESPONSES,
    ProxyRow,
    TenantRow,
    View,
    filter_rows,
    sort_rows,
)

# -- keys ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViewState:
    """What the operator chose: sort, filter, the filter being typed (None when not typing), and
    which view: tenants, or connections (top/connections.py)."""

    sort: str = DEFAULT_SORT
    reverse: bool = False
    filter: str = ""
    editing: str | None = None
    quit: bool = False
    connections: bool = False


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
    if key == "c":
        return replace(state, connections=not state.connections)
    if state.connections:  # one order there: busiest first
        return state
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
    capacity: bool = False  # about the cluster capacity: hidden while no tenant shown has its figures


BAR_WIDTH = 10
#: A name column is not cut below this while other columns can still be dropped.
MIN_NAME_WIDTH = 12
#: Nor wider than this (long client ids are cut with '~').
MAX_NAME_WIDTH = 24
P, F, R = QuotaType.PRODUCE.value, QuotaType.FETCH.value, QuotaType.REQUEST.value


def _limit_bytes(row: TenantRow, quota: str) -> str:
    limit = row.limits.get(quota)
    return "-" if limit is None else human_bytes(limit)


def _weight(row: TenantRow) -> str:
    """A capacity tenant's weight, its `share` setting as configured (3, 0.5, 12.5), "-" without
    capacity figures (kthrottle_capacity_share)."""
    return "-" if row.weight is None else f"{row.weight:.4g}"


def _demand(row: TenantRow) -> str:
    demand = row.demand
    return "-" if demand is None else human_bytes(demand)


COLUMNS: tuple[Column, ...] = (
    Column("PRODUCE/s", 9, 1, lambda r: human_bytes(r.produce)),
    Column("P-QUOTA", 9, 6, lambda r: _limit_bytes(r, P), quota=True),
    Column("P%", 5, 3, lambda r: _percent(r.used(P)), quota=True),
    Column("FETCH/s", 9, 2, lambda r: human_bytes(r.fetch)),
    Column("F-QUOTA", 9, 6, lambda r: _limit_bytes(r, F), quota=True),
    Column("F%", 5, 3, lambda r: _percent(r.used(F)), quota=True),
    Column("REQ%", 6, 5, lambda r: f"{r.request:.1f}"),
    # the cluster capacity (docs/protecting-the-cluster.md): the tenant's weight and its produce +
    # fetch demand as estimated (TenantRow.demand)
    Column("SHARE", 5, 5, _weight, capacity=True),
    Column("DEMAND/s", 9, 4, _demand, capacity=True),
    Column("USE", 5, 2, lambda r: _percent(r.usage), quota=True),
    Column("QUOTA-USE", BAR_WIDTH, 4, lambda r: bar(r.usage, BAR_WIDTH), left=True, quota=True),
    Column("THROTTLE", 8, 1, lambda r: _throttle_text(r.throttle_rate)),
    Column("THR/s", 6, 3, lambda r: _optional(r.throttles_rate)),
    # shadow mode (quotas/shadow.py): the throttle time computed and not applied, beside THROTTLE
    Column("WOULD", 8, 2, lambda r: _throttle_text(r.shadow_rate), quota=True),
)
PROXIES_COLUMN = Column("PROXIES", 7, 7, lambda r: str(r.proxies))


def _layout(rows: Sequence[TenantRow], width: int, fleet: bool) -> tuple[int, int, list[Column]]:
    """User and client-id widths and the columns that fit `width` (least important dropped first)."""
    columns = [c for c in ([*COLUMNS, PROXIES_COLUMN] if fleet else COLUMNS)
               if not (c.quota and rows and all(c.cell(r) == "-" for r in rows))
               and not (c.capacity and all(c.cell(r) == "-" for r in rows))]  # no [capacity]: never shown
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


HELP = ("q quit  / filter (Esc clears)  c connections  sort: b bytes  p produce  f fetch  r request  "
        "u quota use  t throttle  n name (again: reverse)")


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
