"""The report for people: a text table (stdout) and an HTML page with hand-written SVG charts.

Pure Python over the few rows the job collects (one per tenant and hour): no Spark, no plotting
library, so the page opens anywhere and the module is tested without a JVM.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

Row = Mapping[str, Any]

SHARES = (("producer_byte_rate", "produce"), ("consumer_byte_rate", "fetch"))
"""The quota shares the text table shows (all of them are in the Parquet and the HTML)."""

MARKED_POINTS = 60
"""Lines with at most this many points get a dot on each (more would hide the line)."""

TICK_STEPS_MS = tuple(s * 1000 for s in (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600,
                                          86_400, 7 * 86_400))
"""Round steps for the time axis' ticks: the smallest giving at most six."""

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass
class Summary:
    """What the report covers, for its header."""

    topic: str
    from_ms: int | None
    to_ms: int | None
    events: int
    skipped: dict[str, tuple[int, str]] = field(default_factory=dict)
    top: int = 5
    throttled_most_share: float = 0.5

    @property
    def skipped_total(self) -> int:
        return sum(n for n, _ in self.skipped.values())


def size(n: float) -> str:
    """Bytes in binary units, as quotas are usually set (1048576 = 1 MiB)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


def hour_title(hour: str) -> str:
    """`2026-11-23T16` -> `2026-11-23 16:00 UTC`."""
    return f"{hour.replace('T', ' ')}:00 UTC"


def _by_hour(rows: Sequence[Row]) -> dict[str, list[Row]]:
    hours: dict[str, list[Row]] = {}
    for row in sorted(rows, key=lambda r: (r["hour"], r["rank"])):
        hours.setdefault(row["hour"], []).append(row)
    return hours


def header(summary: Summary) -> list[str]:
    span = ("every interval in the topic" if summary.from_ms is None and summary.to_ms is None else
            f"intervals starting {when(summary.from_ms)} .. {when(summary.to_ms)}")
    lines = [f"kthrottle usage report: topic {summary.topic}, {span}",
             f"{summary.events} events read, {summary.skipped_total} records skipped"]
    for reason, (count, first) in sorted(summary.skipped.items()):
        lines.append(f"  skipped {count}: {reason} (first at {first})")
    return lines


def text(rows: Sequence[Row], summary: Summary) -> str:
    """Per hour: the top talkers and every tenant throttled most of the hour, as aligned columns."""
    lines = header(summary)
    columns = ["rank", "user", "client_id", "bytes in", "bytes out", "requests"]
    for _, name in SHARES:
        columns += [f"{name} avg", f"{name} peak"]
    columns += ["throttles", "throttled"]
    for hour, tenants in _by_hour(rows).items():
        throttled = [r for r in tenants if r["throttled_most"]]
        shown = [r for r in tenants if r["rank"] <= summary.top or r["throttled_most"]]
        lines += ["", f"{hour_title(hour)}: {plural(len(tenants), 'tenant')}, "
                  f"{len(throttled)} throttled most of the hour, "
                  f"{size(sum(r['bytes_in'] for r in tenants))} in, "
                  f"{size(sum(r['bytes_out'] for r in tenants))} out"]
        table = [columns]
        for r in shown:
            cells = [str(r["rank"]), r["user"], r["client_id"], size(r["bytes_in"]), size(r["bytes_out"]),
                     f"{r['requests']:,}"]
            for key, _ in SHARES:
                cells += [percent(r[f"{key}_share_avg"]), percent(r[f"{key}_share_peak"])]
            cells += [f"{r['throttle_count']:,}",
                      f"{r['throttled_ms'] / 1000:,.1f} s ({percent(r['throttled_share'])})"
                      f"{' *' if r['throttled_most'] else ''}"]
            table.append(cells)
        widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
        left = {1, 2}  # names left-aligned, figures right-aligned
        for row in table:
            lines.append("  ".join(cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
                                   for i, cell in enumerate(row)).rstrip())
        if len(shown) < len(tenants):
            more = plural(len(tenants) - len(shown), "more tenant")
            lines.append(f"  ... and {more} (all in the Parquet output)")
    if rows:
        lines += ["", f"avg: share of the quota used while active; peak: the highest interval's rate / "
                  f"quota; * throttled more than {summary.throttled_most_share:.0%} of the hour"]
    else:
        lines += ["", "no usage events in this range"]
    return "\n".join(lines) + "\n"


def svg_chart(points: Mapping[tuple[str, str], Sequence[tuple[int, float]]], title: str,
              width: int = 880, height: int = 300) -> str:
    """A line chart of bytes/s over time, one line per tenant, with axes and a legend."""
    left, right, top, bottom = 80, 220, 30, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    all_points = [p for line in points.values() for p in line]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    if not all_points:
        parts.append(f'<text x="{left}" y="{top + plot_h // 2}">no data</text></svg>')
        return "\n".join(parts)
    t0 = min(t for t, _ in all_points)
    t1 = max(t for t, _ in all_points)
    y_max = max(v for _, v in all_points) or 1.0
    span = max(t1 - t0, 1)

    def x(t: int) -> float:
        return left + (t - t0) / span * plot_w

    def y(v: float) -> float:
        return top + plot_h - v / y_max * plot_h

    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>')
    for i in range(5):  # y ticks
        v = y_max * i / 4
        parts.append(f'<line x1="{left - 4}" y1="{y(v):.1f}" x2="{left + plot_w}" y2="{y(v):.1f}" '
                     f'stroke="#eee"/><text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">'
                     f'{html.escape(size(v))}/s</text>')
    step = next((s for s in TICK_STEPS_MS if span / s <= 6), TICK_STEPS_MS[-1])
    shape = "%H:%M:%S" if step < 60_000 else "%H:%M" if span < 86_400_000 else "%m-%d %H:%M"
    for t in range(-(-t0 // step) * step, t1 + 1, step):  # x ticks on round times
        label = datetime.fromtimestamp(t / 1000, UTC).strftime(shape)
        parts.append(f'<line x1="{x(t):.1f}" y1="{top + plot_h}" x2="{x(t):.1f}" y2="{top + plot_h + 4}" '
                     f'stroke="#999"/><text x="{x(t):.1f}" y="{top + plot_h + 16}" '
                     f'text-anchor="middle">{label}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{height - 6}" text-anchor="end">UTC</text>')
    for n, ((user, client_id), line) in enumerate(points.items()):
        colour = PALETTE[n % len(PALETTE)]
        coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in sorted(line))
        name = html.escape(f"{user} / {client_id}")
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}">'
                     f'<title>{name}</title></polyline>')
        for t, v in (line if len(line) <= MARKED_POINTS else ()):
            parts.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2" fill="{colour}"/>')
        ly = top + 10 + n * 16
        parts.append(f'<rect x="{left + plot_w + 12}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{left + plot_w + 26}" y="{ly + 1}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


_HTML_COLUMNS = [("rank", "rank"), ("user", "user"), ("client_id", "client id"), ("bytes_in", "bytes in"),
                 ("bytes_out", "bytes out"), ("requests", "requests"),
                 ("producer_byte_rate_share_avg", "produce avg"),
                 ("producer_byte_rate_share_peak", "produce peak"),
                 ("consumer_byte_rate_share_avg", "fetch avg"),
                 ("consumer_byte_rate_share_peak", "fetch peak"),
                 ("request_percentage_share_avg", "request avg"),
                 ("request_percentage_share_peak", "request peak"),
                 ("throttle_count", "throttles"), ("throttled_ms", "throttled")]


def _cell(key: str, value: Any) -> str:
    if key in ("bytes_in", "bytes_out"):
        return f'<td title="{value} B">{html.escape(size(value))}</td>'
    if key.endswith(("_share_avg", "_share_peak")):
        return f"<td>{percent(value)}</td>"
    if key == "throttled_ms":
        return f"<td>{value / 1000:,.1f} s ({value / 36_000:.0f}%)</td>"
    if isinstance(value, int):
        return f"<td>{value:,}</td>"
    return f'<td class="name">{html.escape(str(value))}</td>'


def page(rows: Sequence[Row], summary: Summary,
         series: Sequence[Row], bucket_ms: int) -> str:
    """The HTML report: charts of the top tenants' bytes in and out over time, then the hourly tables."""
    charts = []
    steps = sorted({r["bucket_ms"] for r in series})
    # every step from the first to the last: a tenant without an event in a step used nothing in it
    times = list(range(steps[0], steps[-1] + 1, bucket_ms)) if steps else []
    charted = sorted({(r["user"], r["client_id"]) for r in series})
    for column, title in (("bytes_in", "bytes in (produce) per second"),
                          ("bytes_out", "bytes out (fetch) per second")):
        values = {(r["user"], r["client_id"], r["bucket_ms"]): r[column] for r in series}
        lines = {tenant: [(t, values.get((*tenant, t), 0) / (bucket_ms / 1000)) for t in times]
                 for tenant in charted}
        charts.append(svg_chart(lines, f"{title}, top {summary.top} tenants, {bucket_ms // 1000} s steps"))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>kthrottle usage report</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:2em}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td.name{text-align:left}"
             "tr.throttled{background:#fdd}</style></head><body>",
             "<h1>kthrottle usage report</h1>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in header(summary)]
    parts += charts
    for hour, tenants in _by_hour(rows).items():
        parts.append(f"<h2>{html.escape(hour_title(hour))}</h2><table><tr>"
                     + "".join(f"<th>{html.escape(name)}</th>" for _, name in _HTML_COLUMNS) + "</tr>")
        for r in tenants:
            css = ' class="throttled"' if r["throttled_most"] else ""
            parts.append(f"<tr{css}>" + "".join(_cell(key, r[key]) for key, _ in _HTML_COLUMNS) + "</tr>")
        parts.append("</table>")
    parts.append(f"<p>Rows in red: throttled more than {summary.throttled_most_share:.0%} of the hour. "
                 "avg: share of the quota used while active; peak: the highest interval's rate / quota.</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
