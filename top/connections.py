"""`kthrottle top`'s connections view (pure): `/connections` answers in, screen lines out.

The tenants view says which (user, client id) uses what; this one says who is connected: every
open connection of every proxy given with `--metrics`, busiest first (bytes in + out per second,
over the proxy's last few seconds), with the software each client named (KIP-511). Each proxy
sends at most `CONNECTIONS_LIMIT` rows, its busiest, and says how many it left off; merged, the
first `CONNECTIONS_LIMIT` rows are therefore the fleet's busiest, and the rest are counted.

Client ids, principals and software names are whatever a client sent: every character that is not
printable (escape sequences, other controls, bidi overrides) is shown as `?`, so a hostile client
id cannot move the cursor, clear the screen or reorder what an operator reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from proxy.observability.connection_row import ConnectionRow
from top.view import Line, fit, human_bytes

#: Rows asked of each proxy (`/connections?limit=`): more than a screen shows, far below the
#: proxy's own bound.
CONNECTIONS_LIMIT = 500
#: Largest `/connections` answer read (500 rows are about 150 KB).
MAX_CONNECTIONS_BYTES = 16 * 1024 * 1024


def connections_url(metrics_url: str, limit: int = CONNECTIONS_LIMIT) -> str:
    """The `/connections` URL beside a metrics URL (http://host:port/metrics)."""
    parts = urlsplit(metrics_url)
    return urlunsplit((parts.scheme, parts.netloc, "/connections", f"limit={limit}", ""))


def printable(text: str | None) -> str:
    """`text` with every non-printable character (controls, escapes, bidi overrides) as '?'."""
    if text is None:
        return "-"
    return text if text.isprintable() else "".join(ch if ch.isprintable() else "?" for ch in text)


@dataclass
class ConnectionsScrape:
    """One proxy's `/connections` answer, or why there is none."""

    url: str
    rows: list[ConnectionRow] = field(default_factory=list)
    open: int = 0
    left_off: int = 0
    error: str | None = None


def parse_connections(url: str, body: str) -> ConnectionsScrape:
    """A `/connections` JSON answer; ValueError (naming the problem) when it is not one."""
    answer = json.loads(body)
    if not isinstance(answer, dict) or not isinstance(answer.get("connections"), list):
        raise ValueError("not a /connections answer (no connections list)")
    rows = [ConnectionRow.from_json(item, url) for item in answer["connections"]]
    return ConnectionsScrape(url, rows, int(answer.get("open") or len(rows)),
                             int(answer.get("left_off") or 0))


@dataclass
class ConnectionsView:
    """Every proxy's connections, merged busiest first, and what was left off."""

    rows: list[ConnectionRow]
    proxies: list[ConnectionsScrape]

    @property
    def open(self) -> int:
        return sum(p.open for p in self.proxies if p.error is None)


def build_connections_view(scrapes: Sequence[ConnectionsScrape]) -> ConnectionsView:
    rows = [row for scrape in scrapes if scrape.error is None for row in scrape.rows]
    rows.sort(key=lambda row: row.throughput, reverse=True)
    return ConnectionsView(rows, list(scrapes))


def filter_connections(rows: Sequence[ConnectionRow], text: str) -> list[ConnectionRow]:
    """Rows whose address, principal, client id or software contains `text` (any case)."""
    if not text:
        return list(rows)
    needle = text.lower()
    return [row for row in rows
            if any(needle in (value or "").lower()
                   for value in (row.address, row.principal, row.client_id, row.software, row.listener))]


def human_age(seconds: float) -> str:
    """12s, 5m03s, 2h04m, 3d02h."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


@dataclass(frozen=True)
class _Column:
    title: str
    cell: Callable[[ConnectionRow], str]
    priority: int  # the largest is dropped first when the terminal is too narrow
    width: int = 0  # 0: as wide as its widest cell, up to `cap`
    cap: int = 24
    left: bool = True


def _address(row: ConnectionRow) -> str:
    address = printable(row.address)
    return f"[{address}]:{row.port}" if ":" in address else f"{address}:{row.port}"


def _proxy(row: ConnectionRow) -> str:
    return urlsplit(row.proxy).netloc or row.proxy


COLUMNS: tuple[_Column, ...] = (
    _Column("CLIENT", _address, 3, cap=47),
    _Column("LISTENER", lambda r: printable(r.listener), 6, cap=12),
    _Column("PRINCIPAL", lambda r: printable(r.principal), 4, cap=20),
    _Column("CLIENT-ID", lambda r: printable(r.client_id), 1),
    _Column("SOFTWARE", lambda r: printable(r.software), 2, cap=48),
    _Column("AGE", lambda r: human_age(r.age_seconds), 5, width=6, left=False),
    _Column("IN/s", lambda r: human_bytes(r.bytes_in_per_second), 1, width=8, left=False),
    _Column("OUT/s", lambda r: human_bytes(r.bytes_out_per_second), 1, width=8, left=False),
    _Column("THROTTLE", lambda r: f"{r.throttle_ms}ms", 2, width=8, left=False),
    _Column("LAST-THR", lambda r: f"{r.last_throttle_ms}ms", 5, width=8, left=False),
)
PROXY_COLUMN = _Column("PROXY", _proxy, 7, cap=21)
#: A text column is not cut below this while other columns can still be dropped.
MIN_TEXT_WIDTH = 8


def _table(rows: Sequence[ConnectionRow], width: int, fleet: bool) -> tuple[Line, list[Line]]:
    columns = [*COLUMNS, PROXY_COLUMN] if fleet else list(COLUMNS)
    cells = [[column.cell(row) for column in columns] for row in rows]
    widths = [column.width or min(max([len(column.title), *(len(c[i]) for c in cells)]), column.cap)
              for i, column in enumerate(columns)]
    keep = list(range(len(columns)))

    def needed(indexes: list[int]) -> int:
        return 1 + sum(min(widths[i], MIN_TEXT_WIDTH) if columns[i].width == 0 else widths[i]
                       for i in indexes) + len(indexes)

    while len(keep) > 1 and needed(keep) > width:
        keep.remove(max(reversed(keep), key=lambda i: columns[i].priority))  # ties: the rightmost
    room = width - 1 - len(keep) - sum(widths[i] for i in keep)
    for i in sorted(keep, key=lambda i: -columns[i].priority):  # cut the least useful names first
        if room >= 0:
            break
        if columns[i].width == 0:
            cut = min(widths[i] - MIN_TEXT_WIDTH, -room)
            if cut > 0:
                widths[i] -= cut
                room += cut

    def assemble(flag: str, texts: list[str]) -> str:
        parts = [flag]
        for i in keep:
            text = fit(texts[i], widths[i])
            parts.append(text.ljust(widths[i]) if columns[i].left else text.rjust(widths[i]))
        return fit(" ".join(parts).rstrip(), width)

    header = Line(assemble(" ", [column.title for column in columns]), "header")
    lines = [Line(assemble("!" if row.throttle_ms > 0 else " ", texts), "throttled" if row.throttle_ms > 0
                  else "normal") for row, texts in zip(rows, cells, strict=True)]
    return header, lines


CONNECTIONS_HELP = "q quit  / filter (Esc clears)  c tenants view  (busiest first: bytes in + out per second)"


def render_connections(view: ConnectionsView, filter_text: str, editing: str | None, width: int,
                       height: int | None, clock: str = "") -> list[Line]:
    """The connections screen for `width` x `height` (None: every row, for --once); the help line
    (or the filter being typed) is the last line, unreachable proxies stay visible."""
    if width <= 0 or (height is not None and height <= 0):
        return []
    rows = filter_connections(view.rows, filter_text)
    failed = [p for p in view.proxies if p.error is not None]
    left_off = sum(p.left_off for p in view.proxies if p.error is None)
    count = len(view.proxies)
    title = (f"kthrottle top  connections  {count} prox{'y' if count == 1 else 'ies'}"
             + (f" ({len(failed)} unreachable)" if failed else "")
             + f"  {view.open} open" + (f" ({left_off} left off by the proxies)" if left_off else "")
             + (f"  {len(rows)} shown  filter: {filter_text!r}" if filter_text else "")
             + (f"  {clock}" if clock else ""))
    top = [Line(fit(title, width), "title")]
    top += [Line(fit(f"  UNREACHABLE {p.url}: {p.error}", width), "error") for p in failed]
    header, table = _table(rows, width, count > 1)
    if not table:
        why = f"no connection matches {filter_text!r}" if filter_text else "no open connection"
        table = [Line(fit(f"  ({why})", width))]
    bottom = (Line(fit(f"filter: {editing}_", width), "prompt") if editing is not None
              else Line(fit(CONNECTIONS_HELP, width), "header"))
    if height is None:
        return [*top, header, *table]
    body = [*top[: max(height - 2, 1)], header][: height]
    room = height - len(body) - 1
    if room <= 0:
        return [*body[: height - 1], bottom] if height > 1 else body[:1]
    shown = table[:room]
    return [*body, *shown, *[Line("")] * (room - len(shown)), bottom]


__all__ = ["CONNECTIONS_LIMIT", "MAX_CONNECTIONS_BYTES", "ConnectionRow", "ConnectionsScrape",
           "ConnectionsView", "build_connections_view", "connections_url", "filter_connections",
           "human_age", "parse_connections", "printable", "render_connections"]
