"""`kthrottle top` against real proxies with real traffic, read from a pseudo-terminal's screen.

Two `kthrottle run` proxies in front of the real cluster, both with quotas for two client ids:
`ingest-b` produces at full speed through proxy A against a 1 MB/s quota (throttled), `ingest-a`
at 150 KB/s through each proxy (300 KB/s in all, under its 10 MB/s quota). A third endpoint is
a closed port. `top` runs as its own process, as `--once` and under a pty whose output the pyte
terminal emulator turns back into the screen a person would see.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator

import pyte
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from harness.local_kafka import LocalKafka

from .clients import PARTITIONS, topic_name, wait_until
from .conftest import QUOTA_SETTINGS
from .proxies import REPO, QuotaProxy, free_port_block

HEAVY, LIGHT = "ingest-b", "ingest-a"  # rate order is b, a; name order is a, b
HEAVY_QUOTA = 1_000_000
LIGHT_QUOTA = 10_000_000
LIGHT_RATE = 150_000  # bytes per second through each proxy
QUOTAS = f"""
[[quota]]
client_id = "{HEAVY}"
producer_byte_rate = {HEAVY_QUOTA}

[[quota]]
client_id = "{LIGHT}"
producer_byte_rate = {LIGHT_QUOTA}
"""
COLUMNS, LINES = 150, 30
VALUE = b"x" * 10_000


def _produce_until(stop: threading.Event, bootstrap: str, topic: str, client_id: str,
                   rate: float | None, errors: list[str]) -> None:
    """librdkafka at full speed (rate None) or at `rate` bytes/s until `stop` is set."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "linger.ms": 5,
                         "acks": 1, "queue.buffering.max.kbytes": 4096})

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    started, sent = time.monotonic(), 0
    while not stop.is_set():
        if rate is not None and started + sent * len(VALUE) / rate > time.monotonic():
            producer.poll(0.02)
            continue
        try:
            producer.produce(topic, VALUE, on_delivery=delivered)
            sent += 1
        except BufferError:
            producer.poll(0.05)
        producer.poll(0)
    producer.flush(60)


@pytest.fixture(scope="module")
def two_proxies(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[QuotaProxy, QuotaProxy]]:
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("top-a"), QUOTA_SETTINGS) as a, \
            QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("top-b"), QUOTA_SETTINGS) as b:
        a.set_quotas(QUOTAS)
        b.set_quotas(QUOTAS)
        yield a, b


@pytest.fixture(scope="module")
def traffic(kafka_cluster: LocalKafka, two_proxies: tuple[QuotaProxy, QuotaProxy]) -> Iterator[None]:
    """The two tenants' producers, running for the whole module, and visible in the metrics."""
    a, b = two_proxies
    name = topic_name("top")
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(30)
    wait_until(lambda: len(admin.list_topics(name, timeout=10).topics[name].partitions) == PARTITIONS,
               30, f"{name} in metadata")
    stop, errors = threading.Event(), list[str]()
    threads = [threading.Thread(target=_produce_until, args=args, daemon=True) for args in (
        (stop, a.bootstrap, name, HEAVY, None, errors),
        (stop, a.bootstrap, name, LIGHT, LIGHT_RATE, errors),
        (stop, b.bootstrap, name, LIGHT, LIGHT_RATE, errors))]
    for thread in threads:
        thread.start()
    try:
        # until proxy A has throttled the heavy tenant and both proxies measure the light one
        wait_until(lambda: a.metric("kthrottle_throttles_total", quota="producer_byte_rate",
                                    user="", client_id=HEAVY) > 0, 60, f"{HEAVY} throttled")
        for proxy in (a, b):
            wait_until(lambda p=proxy: p.metric("kthrottle_produce_byte_rate_bytes_per_second",
                                                quota="producer_byte_rate", user="", client_id=LIGHT) > 0,
                       60, f"{LIGHT} measured")
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    assert not errors, errors[:3]


def _dead_endpoint() -> str:
    return f"127.0.0.1:{free_port_block(1)}"  # nothing listens there


def _top_command(a: QuotaProxy, b: QuotaProxy, dead: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "top", "--metrics", f"127.0.0.1:{a.metrics_port}",
            "--metrics", f"http://127.0.0.1:{b.metrics_port}/metrics", "--metrics", dead, *extra]


def _cells(lines: list[str], client_id: str) -> dict[str, str]:
    """The table line of `client_id`, keyed by the header's titles ("FLAG": "!" when throttled)."""
    header = next(line.split() for line in lines if line.lstrip().startswith("USER"))
    found = [line for line in lines if f" {client_id} " in line]
    assert len(found) == 1, f"{client_id}: {len(found)} lines in\n" + "\n".join(lines)
    flag, cells = found[0][:1].strip(), found[0][1:].split()
    return {"FLAG": flag, **dict(zip(header, cells, strict=True))}


def _order(lines: list[str]) -> list[str]:
    """The client ids of the table, top to bottom."""
    return [cid for line in lines for cid in (HEAVY, LIGHT) if f" {cid} " in line]


def test_once_shows_both_tenants_by_rate_the_throttled_one_marked(
        two_proxies: tuple[QuotaProxy, QuotaProxy], traffic: None) -> None:
    a, b = two_proxies
    dead = _dead_endpoint()
    # counters over 5 s: the heavy tenant is throttled about once a second, so some fall in them
    done = subprocess.run(_top_command(a, b, dead, "--once", "--interval", "5", "--width", "200"), cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    lines = done.stdout.splitlines()
    print(done.stdout)

    assert done.returncode == 0, done.stderr
    assert "3 proxies (1 unreachable)" in lines[0]
    assert any(dead in line and "UNREACHABLE" in line for line in lines), done.stdout
    assert _order(lines) == [HEAVY, LIGHT], "sorted by bytes, the heavy tenant first"
    heavy_cells, light_cells = _cells(lines, HEAVY), _cells(lines, LIGHT)
    assert heavy_cells["FLAG"] == "!" and heavy_cells["USER"] == "*"  # a client-id quota spans users
    assert light_cells["FLAG"] == "", "the light tenant is not throttled"
    assert heavy_cells["THROTTLE"] not in ("-", "0ms/s"), heavy_cells
    assert float(heavy_cells["THR/s"]) > 0, heavy_cells
    assert light_cells["THROTTLE"] == "0ms/s" and light_cells["PROXIES"] == "2", light_cells
    assert heavy_cells["PROXIES"] == "1", heavy_cells


def _terminal_env() -> dict[str, str]:
    """The size comes from the pseudo-terminal (TIOCSWINSZ): LINES and COLUMNS in the environment
    would override it for curses, and pytest-xdist's workers have them (80 x 24)."""
    env = {key: value for key, value in os.environ.items() if key not in ("LINES", "COLUMNS")}
    return {**env, "TERM": "xterm"}


class PtyScreen:
    """A process on a pseudo-terminal of COLUMNS x LINES, its output read back as a screen."""

    def __init__(self, command: list[str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        self.process = subprocess.Popen(command, cwd=REPO, stdin=slave, stdout=slave, stderr=slave,
                                        start_new_session=True, env=_terminal_env())
        os.close(slave)
        self.screen = pyte.Screen(COLUMNS, LINES)
        self.stream = pyte.ByteStream(self.screen)

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.master], [], [], left)
            if not ready:
                return
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the process ended and closed its side
                return
            if not data:
                return
            self.stream.feed(data)

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float, what: str) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.2)
            if predicate(self.lines()):
                return self.lines()
        raise AssertionError(f"the screen did not show {what} within {timeout}s:\n" + "\n".join(self.lines()))

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        os.close(self.master)


def test_live_screen_sorts_filters_and_quits_on_keys(two_proxies: tuple[QuotaProxy, QuotaProxy],
                                                      traffic: None) -> None:
    a, b = two_proxies
    dead = _dead_endpoint()
    top = PtyScreen(_top_command(a, b, dead))
    try:
        # the second refresh has throttle rates: the heavy tenant is marked with a throttle time
        lines = top.wait_for(lambda ls: _order(ls) == [HEAVY, LIGHT]
                             and _cells(ls, HEAVY)["FLAG"] == "!"
                             and _cells(ls, HEAVY)["THROTTLE"].endswith("s/s")
                             and _cells(ls, HEAVY)["THROTTLE"] != "0ms/s",
                             30, "both tenants, the throttled one first and marked")
        assert "3 proxies (1 unreachable)" in lines[0]
        assert any(dead in line and "UNREACHABLE" in line for line in lines)
        assert _cells(lines, LIGHT)["FLAG"] == "", "the light tenant is not marked"
        top.type("n")  # sort by name
        lines = top.wait_for(lambda ls: _order(ls) == [LIGHT, HEAVY], 10, "the tenants re-sorted by name")
        assert "sort: name asc" in lines[0]
        top.type("n")  # again: reversed
        top.wait_for(lambda ls: _order(ls) == [HEAVY, LIGHT] and "sort: name desc" in ls[0], 10,
                     "the name order reversed")
        top.type("/ingest-a")
        top.wait_for(lambda ls: "filter: ingest-a_" in ls[-1], 10, "the filter being typed")
        top.type("\r")
        lines = top.wait_for(lambda ls: _order(ls) == [LIGHT] and "filter: 'ingest-a'" in ls[0], 10,
                             "only the filtered tenant")
        top.type("q")
        deadline = time.monotonic() + 15
        while top.process.poll() is None and time.monotonic() < deadline:
            top.pump(0.2)
        assert top.process.returncode == 0, f"top did not quit on q: {top.process.returncode}"
    finally:
        top.close()


def test_a_tiny_terminal_does_not_break_it(two_proxies: tuple[QuotaProxy, QuotaProxy], traffic: None) -> None:
    """Resized to 20 x 4 and back while running: it keeps drawing and still quits on q."""
    a, b = two_proxies
    top = PtyScreen(_top_command(a, b, _dead_endpoint()))
    try:
        top.wait_for(lambda ls: _order(ls) == [HEAVY, LIGHT], 30, "both tenants")
        fcntl.ioctl(top.master, termios.TIOCSWINSZ, struct.pack("HHHH", 4, 20, 0, 0))
        top.process.send_signal(signal.SIGWINCH)
        top.screen.resize(4, 20)
        # redrawn for 4 lines: the proxies fold into the one unreachable, the totals go (see render)
        top.wait_for(lambda ls: ls[0].startswith("kthrottle top") and ls[1].startswith("  UNREACHABLE"),
                     10, "a 20 x 4 screen")
        top.pump(2.5)  # a few refreshes at that size
        assert top.process.poll() is None, "top died on a tiny terminal"
        fcntl.ioctl(top.master, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        top.process.send_signal(signal.SIGWINCH)
        top.screen.resize(LINES, COLUMNS)
        top.wait_for(lambda ls: _order(ls) == [HEAVY, LIGHT], 10, "the full table again")
        top.type("q")
        deadline = time.monotonic() + 15
        while top.process.poll() is None and time.monotonic() < deadline:
            top.pump(0.2)
        assert top.process.returncode == 0
    finally:
        top.close()


def test_kthrottle_top_command_names_an_unreachable_proxy() -> None:
    """`kthrottle top` is the CLI's subcommand: with no proxy answering, --once prints the endpoint as
    unreachable with its error and exits 1 (0 when any proxy answered)."""
    closed = free_port_block(1)
    done = subprocess.run([sys.executable, "-m", "cli", "top", "--metrics", f"127.0.0.1:{closed}",
                           "--once", "--interval", "0.2", "--width", "120"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"UNREACHABLE http://127.0.0.1:{closed}/metrics" in done.stdout, done.stdout
