"""`kthrottle top`: a live terminal view of running proxies, read from their metrics endpoints.

The thin I/O half: fetch each `--metrics` URL (in parallel, each with a timeout, so one slow or
dead proxy never holds the others), keep the previous scrape for the counters' rates, read keys
and draw top/view.py's lines with curses. `--once` prints one screen to stdout instead. In the
connections view (`c`, or `--connections`) it reads each proxy's `/connections` instead
(top/connections.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TextIO

from top.connections import (
    MAX_CONNECTIONS_BYTES,
    ConnectionsScrape,
    ConnectionsView,
    build_connections_view,
    connections_url,
    parse_connections,
    render_connections,
)
from top.figures import (
    DEFAULT_SORT,
    SORT_KEYS,
    ProxyRow,
    Scrape,
    View,
    build_view,
    metrics_url,
    scrape_from_text,
)
from top.view import (
    BACKSPACE,
    ENTER,
    ESCAPE,
    Line,
    ViewState,
    press,
    render,
)

if TYPE_CHECKING:
    import curses

#: Seconds between refreshes unless --interval says otherwise (Prometheus's rate gauges move per
#: quota sample, 1 s by default, Kafka's quota.window.size.seconds).
DEFAULT_INTERVAL_S = 1.0
#: A proxy must answer a scrape within this; a slower one is shown as unreachable for that refresh.
SCRAPE_TIMEOUT_S = 3.0
#: Largest metrics text read from one endpoint (a proxy exports at most metrics_max_entities
#: series per quota type; 1,000 entities x 5 types x 6 families is about 3 MB).
MAX_METRICS_BYTES = 64 * 1024 * 1024
#: How often the screen loop looks for a key press or a finished refresh.
KEY_POLL_MS = 100
#: Width of the --once screen when stdout is not a terminal.
ONCE_WIDTH = 160


def fetch(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> Scrape:
    """One scrape; any failure becomes the Scrape's error, for the screen to show."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_METRICS_BYTES)
        at = time.monotonic()
        return scrape_from_text(url, at, body.decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        return Scrape(url, time.monotonic(), error=f"HTTP {exc.code} {exc.reason}")
    except urllib.error.URLError as exc:
        return Scrape(url, time.monotonic(), error=str(exc.reason))
    except (OSError, ValueError) as exc:  # timeouts, resets, malformed answers
        return Scrape(url, time.monotonic(), error=str(exc) or type(exc).__name__)


def fetch_connections(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> ConnectionsScrape:
    """One proxy's `/connections` (`url` is its metrics URL); a failure becomes the scrape's error."""
    try:
        with urllib.request.urlopen(connections_url(url), timeout=timeout) as response:
            body = response.read(MAX_CONNECTIONS_BYTES)
        return parse_connections(url, body.decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        return ConnectionsScrape(url, error=f"HTTP {exc.code} {exc.reason}")
    except urllib.error.URLError as exc:
        return ConnectionsScrape(url, error=str(exc.reason))
    except (OSError, ValueError, TypeError) as exc:  # timeouts, resets, malformed answers
        return ConnectionsScrape(url, error=str(exc) or type(exc).__name__)


class Scraper:
    """Scrapes every endpoint together and keeps, per endpoint, the last scrape that answered."""

    def __init__(self, urls: Sequence[str], timeout: float = SCRAPE_TIMEOUT_S) -> None:
        self.urls = list(urls)
        self.timeout = timeout
        self.previous: dict[str, Scrape] = {}
        self._pool = ThreadPoolExecutor(max_workers=min(len(self.urls), 16), thread_name_prefix="top-scrape")

    def refresh(self) -> View:
        current = list(self._pool.map(lambda url: fetch(url, self.timeout), self.urls))
        view = build_view(current, self.previous)
        for scrape in current:
            if scrape.figures is not None:
                self.previous[scrape.url] = scrape
        return view

    def refresh_connections(self) -> ConnectionsView:
        """Every proxy's `/connections` at once, merged busiest first."""
        return build_connections_view(list(self._pool.map(lambda url: fetch_connections(url, self.timeout),
                                                          self.urls)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def run_once(urls: Sequence[str], interval: float, state: ViewState, width: int, height: int | None,
             out: TextIO) -> int:
    """Two scrapes `interval` apart (so throttle counters have a rate), one screen to `out`.

    Exit status 0 when at least one proxy answered, 1 when none did. The connections view needs
    one read (the proxies measure the rates).
    """
    scraper = Scraper(urls)
    if state.connections:
        try:
            connections = scraper.refresh_connections()
        finally:
            scraper.close()
        for line in render_connections(connections, state.filter, None, width, height, _clock()):
            out.write(line.text + "\n")
        out.flush()
        return 0 if any(p.error is None for p in connections.proxies) else 1
    try:
        scraper.refresh()
        time.sleep(interval)
        view = scraper.refresh()
    finally:
        scraper.close()
    for line in render(view, state, width, height, _clock()):
        out.write(line.text + "\n")
    out.flush()
    return 0 if any(p.error is None for p in view.proxies) else 1


class _Refresher(threading.Thread):
    """Scrapes every `interval` on its own thread, so keys answer at once while a proxy is slow."""

    def __init__(self, scraper: Scraper, interval: float, connections: bool = False) -> None:
        super().__init__(name="top-refresh", daemon=True)
        self.scraper = scraper
        self.interval = interval
        self.stopping = threading.Event()
        self.fresh = threading.Event()
        #: refresh now, not after the interval (the operator switched views)
        self.wake = threading.Event()
        #: which view to refresh: the connections (True) or the tenants
        self.connections = connections
        self._lock = threading.Lock()
        self._view: View | None = None
        self._connections: ConnectionsView | None = None

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            self.wake.clear()
            if self.connections:
                try:
                    connections = self.scraper.refresh_connections()
                except Exception as exc:  # a bug must show on the screen, not freeze it
                    connections = ConnectionsView([], [ConnectionsScrape("kthrottle top",
                                                                         error=f"internal error: {exc!r}")])
                with self._lock:
                    self._connections = connections
            else:
                try:
                    view = self.scraper.refresh()
                except Exception as exc:  # a bug must show on the screen, not freeze it
                    view = View([], [ProxyRow("kthrottle top", error=f"internal error: {exc!r}")],
                                ProxyRow("total"))
                with self._lock:
                    self._view = view
            self.fresh.set()
            self.wake.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def switch(self, connections: bool) -> None:
        """Refresh the other view from now on, at once."""
        if connections != self.connections:
            self.connections = connections
            self.wake.set()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def view(self) -> View | None:
        with self._lock:
            return self._view

    def connections_view(self) -> ConnectionsView | None:
        with self._lock:
            return self._connections


def _key_name(code: int) -> str | None:
    """curses's key code as press() names it."""
    import curses

    if code in (curses.KEY_ENTER, 10, 13):
        return ENTER
    if code in (curses.KEY_BACKSPACE, 127, 8):
        return BACKSPACE
    if code == 27:
        return ESCAPE
    if 0 <= code < 0x110000 and chr(code).isprintable():
        return chr(code)
    return None


def _styles() -> dict[str, int]:
    import curses

    styles = {"title": curses.A_BOLD, "header": curses.A_REVERSE, "normal": curses.A_NORMAL,
              "throttled": curses.A_BOLD, "error": curses.A_BOLD, "prompt": curses.A_BOLD}
    with contextlib.suppress(curses.error):
        if curses.has_colors():
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_RED, -1)
            curses.init_pair(2, curses.COLOR_YELLOW, -1)
            styles["throttled"] = curses.color_pair(1) | curses.A_BOLD
            styles["error"] = curses.color_pair(2) | curses.A_BOLD
    return styles


def _draw(screen: curses.window, lines: list[Line], styles: dict[str, int]) -> None:
    import curses

    screen.erase()
    height, width = screen.getmaxyx()
    for y, line in enumerate(lines[:height]):
        # the bottom-right cell cannot be written without curses moving past the screen's end
        with contextlib.suppress(curses.error):
            screen.addnstr(y, 0, line.text, width - (1 if y == height - 1 else 0),
                           styles.get(line.style, 0))
    screen.refresh()


def _interactive(screen: curses.window, urls: Sequence[str], interval: float, state: ViewState) -> int:
    import curses

    with contextlib.suppress(curses.error):
        curses.curs_set(0)
    styles = _styles()
    screen.timeout(KEY_POLL_MS)
    scraper = Scraper(urls)
    refresher = _Refresher(scraper, interval, state.connections)
    refresher.start()
    try:
        dirty = True
        while not state.quit:
            if refresher.fresh.is_set():
                refresher.fresh.clear()
                dirty = True
            if dirty:
                height, width = screen.getmaxyx()
                lines = _screen(refresher, state, width, height, len(urls))
                _draw(screen, lines, styles)
                dirty = False
            code = screen.getch()
            if code == -1:
                continue
            dirty = True
            if code == curses.KEY_RESIZE:
                continue
            key = _key_name(code)
            if key is not None:
                state = press(state, key)
                refresher.switch(state.connections)
    finally:
        refresher.stop()
        scraper.close()
    return 0


def _screen(refresher: _Refresher, state: ViewState, width: int, height: int, endpoints: int) -> list[Line]:
    """The current view's lines, or a line saying it is being read."""
    if state.connections:
        connections = refresher.connections_view()
        if connections is not None:
            return render_connections(connections, state.filter, state.editing, width, height, _clock())
    else:
        view = refresher.view()
        if view is not None:
            return render(view, state, width, height, _clock())
    return [Line(f"kthrottle top: reading {endpoints} endpoint(s)...", "title")][:height]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kthrottle top`'s options (shared by cli/main.py and `python -m top`)."""
    parser.add_argument("--metrics", action="append", required=True, metavar="URL",
                        help="a proxy's metrics endpoint (host:port or http://host:port/metrics); "
                             "repeat for every proxy of a fleet")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S,
                        help=f"seconds between refreshes (default {DEFAULT_INTERVAL_S:g})")
    parser.add_argument("--sort", choices=sorted(SORT_KEYS), default=DEFAULT_SORT,
                        help="initial sort: " + ", ".join(f"{k} {v.title}" for k, v in SORT_KEYS.items()))
    parser.add_argument("--filter", default="",
                        help="show only tenants whose user or client-id contains this")
    parser.add_argument("--connections", action="store_true",
                        help="start in the connections view (each proxy's /connections; key c switches)")
    parser.add_argument("--once", action="store_true",
                        help="print one screen to stdout (two scrapes --interval apart) and exit")
    parser.add_argument("--width", type=int, help="--once: line width (default: the terminal's, else 160)")
    parser.add_argument("--height", type=int, help="--once: at most this many lines (default: all tenants)")


def run(args: argparse.Namespace) -> int:
    """Run `kthrottle top` with parsed arguments."""
    try:
        urls = [metrics_url(u) for u in args.metrics]
    except ValueError as exc:
        print(f"kthrottle top: {exc}", file=sys.stderr)
        return 2
    if args.interval <= 0:
        print(f"kthrottle top: --interval must be positive, not {args.interval}", file=sys.stderr)
        return 2
    state = ViewState(sort=args.sort, filter=args.filter, connections=args.connections)
    if args.once:
        width = args.width or (shutil.get_terminal_size().columns if sys.stdout.isatty() else ONCE_WIDTH)
        return run_once(urls, args.interval, state, width, args.height, sys.stdout)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("kthrottle top: not a terminal; use --once to print one screen", file=sys.stderr)
        return 2
    import curses

    os.environ.setdefault("ESCDELAY", "25")  # Esc cancels the filter at once, not after curses's 1 s
    try:
        return curses.wrapper(_interactive, urls, args.interval, state)
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kthrottle top",
                                     description="live view of running kthrottle proxies' tenants")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
