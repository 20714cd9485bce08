"""`kthrottle run --workers N`: N proxy processes on one host, one quota among them.

One Python process moves about one core's worth of bytes; to use more cores, N worker processes
each run the whole proxy and share its listeners (the bootstrap port and every broker port) with
SO_REUSEPORT, so the kernel spreads client connections over them. A client's connections may then
land on different workers, which is why the workers form a fleet (proxy/fleet/exchange.py) and enforce one
quota per entity together, exactly as proxies on several hosts do.

With no `[fleet]` table, the fleet needs no configuration: this supervising parent binds one UDP
socket per worker on 127.0.0.1 (kept open here, so a restarted worker comes back on the same
address), makes a random secret, and hands each worker its socket and the list of all of them
(environment, never the command line). With a `[fleet]` table, worker i joins that fleet on the
configured UDP port + i (static peers: the siblings are added to the list).

The parent only supervises: it restarts a worker that dies, after a back-off that doubles from
RESTART_BACKOFF_S up to RESTART_BACKOFF_MAX_S (reset once the worker has run for STABLE_AFTER_S),
logs each death and restart, forwards SIGHUP (quota file reload), and on SIGINT/SIGTERM stops
every worker. Worker i serves metrics on metrics_port + i.

A worker that cannot start for a reason a restart would not change (a setting refused:
SETTINGS_ERROR_EXIT; a port it cannot bind: BIND_ERROR_EXIT) hands its one line to the parent
through a pipe (`report_fatal`) instead of printing it; when that happens within FATAL_WITHIN_S of
the worker's first start, the parent stops every worker and prints that line once, exiting with
the worker's code, as a single `kthrottle run` would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType

from config.fleet import SECRET_ENV, FleetSettings, offset_for_worker, read_secret
from config.settings import ProxySettings, SettingsError

log = logging.getLogger("kthrottle.workers")

#: What a worker learns from its parent: its index, the workers' UDP addresses, its socket.
WORKER_ENV = "KTHROTTLE_WORKER"
#: Most workers one host runs (each holds a fleet member's state and a share of the descriptors).
MAX_WORKERS = 64
#: First pause before restarting a dead worker; doubled at each death in a row, up to the max.
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
#: A worker that ran this long before it died starts again from the first back-off.
STABLE_AFTER_S = 30.0
#: A worker that exits with the settings-error code within this time of its first start means the
#: configuration cannot work: the parent stops instead of restarting it forever.
FATAL_WITHIN_S = 15.0
#: How long workers get to close their connections when the parent stops.
STOP_TIMEOUT_S = 15.0
#: The exit code `kthrottle run` uses for a setting it refuses.
SETTINGS_ERROR_EXIT = 2
#: The exit code `kthrottle run` uses when a port it must serve cannot be bound at start: `listen`,
#: `metrics_port` (+ the worker index), or `node_port_base` + N for a broker found at start. Another
#: process holds the port, or the host is not this machine's: retrying does not help, the holder
#: must go or the setting must change. Its one line (config.common.BindError) names the address
#: and the setting. Not 1 (Python's code for an uncaught exception) nor 2 (a refused setting).
BIND_ERROR_EXIT = 3
#: Exit codes after which the parent stops instead of restarting (within FATAL_WITHIN_S).
FATAL_EXITS = {SETTINGS_ERROR_EXIT: "a setting it refused", BIND_ERROR_EXIT: "a port it cannot bind"}
#: The loopback fleet's name (nothing else shares its random secret).
LOOPBACK_FLEET_NAME = "kthrottle-workers"
_POLL_S = 0.1
#: In a worker: its index, and the pipe on which `report_fatal` hands its parent the one line.
_worker_index: int | None = None
_report_fd: int | None = None


def configure_worker(settings: ProxySettings) -> int | None:
    """In a worker: shared listeners, metrics port + index, the fleet. None outside a worker."""
    global _worker_index, _report_fd
    spec = os.environ.pop(WORKER_ENV, None)  # not passed on to anything this process starts
    if spec is None:
        return None
    info = json.loads(spec)
    index = int(info["index"])
    _worker_index = index
    if info.get("report_fd") is not None:
        _report_fd = int(info["report_fd"])
    addresses = [(str(host), int(port)) for host, port in info["udp"]]
    settings.reuse_port = True
    _share_connection_rates(settings, len(addresses))
    if settings.metrics_port:
        settings.metrics_port += index
    if info.get("fd") is not None:
        secret = read_secret(None, os.environ)
        os.environ.pop(SECRET_ENV, None)
        settings.fleet = FleetSettings(listen=addresses[index], secret=secret, name=LOOPBACK_FLEET_NAME,
                                       peers=addresses, inherited_fd=int(info["fd"]))
    elif settings.fleet is not None:
        fleet = offset_for_worker(settings.fleet, index)
        if fleet.membership == "static":
            fleet.peers = sorted(set(fleet.peers) | set(addresses))
        settings.fleet = fleet
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s %(name)s[worker {index}]: %(message)s"))
    return index


def worker_index() -> int | None:
    """This process's index among the workers of `run --workers N`; None outside a worker."""
    return _worker_index


def report_fatal(line: str) -> bool:
    """In a worker: hand the parent the one line that says why this worker exits at start; the
    parent prints it once for the whole fleet (the other workers may fail the same way). False
    outside a worker, or when the pipe is gone: the caller prints the line itself."""
    if _report_fd is None:
        return False
    try:
        os.write(_report_fd, line.encode(errors="replace")[:4096])
    except OSError:
        return False
    return True


def _share_connection_rates(settings: ProxySettings, workers: int) -> None:
    """The proxy-wide and listener connection-creation rates are the whole proxy's: each of the
    `workers` (which the kernel gives an even share of new connections) enforces its share, rounded
    up. The per-IP rates need no share: their buckets travel in the fleet exchange."""
    limits = settings.client_addresses
    for key in ("max_connection_creation_rate", "listener_max_connection_creation_rate"):
        rate = getattr(limits, key)
        if rate is not None:
            setattr(limits, key, -(-rate // workers))


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    first_started: float = 0.0
    backoff: float = RESTART_BACKOFF_S
    start_at: float = 0.0
    restarts: int = 0
    report: int | None = None  # the read end of the worker's report pipe (see report_fatal)

    def reported(self) -> str:
        """What the worker reported before it exited ('' when nothing), the pipe closed after."""
        if self.report is None:
            return ""
        chunks = []
        os.set_blocking(self.report, False)
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.report, 4096):
                chunks.append(chunk)
        os.close(self.report)
        self.report = None
        return b"".join(chunks).decode(errors="replace").strip()


def _command(args: argparse.Namespace, settings: ProxySettings, index: int) -> list[str]:
    """The worker's `kthrottle run`, with the parent's flags (its settings come from the same file)."""
    command = [sys.executable, "-m", "cli", "--log-level", str(args.log_level), "run",
               "--upstream", ",".join(f"{host}:{port}" for host, port in settings.upstream)]
    if args.config is not None:
        command += ["--config", str(args.config)]
    if args.listen:
        command += ["--listen", args.listen]
    if args.advertised_host:
        command += ["--advertised-host", args.advertised_host]
    if args.metrics_port is not None:
        command += ["--metrics-port", str(args.metrics_port)]
    if args.node_port_base is not None:
        command += ["--node-port-base", str(args.node_port_base)]
    if args.demo and index == 0:
        command.append("--demo")
    return command


class Supervisor:
    """Starts the workers, restarts the ones that die, stops them all on a signal."""

    def __init__(self, args: argparse.Namespace, settings: ProxySettings, count: int) -> None:
        self.args = args
        self.settings = settings
        self.workers = [_Worker(index) for index in range(count)]
        self.stopping = False
        self.fatal: str | None = None
        self.fatal_code = SETTINGS_ERROR_EXIT
        self._sockets: list[socket.socket] = []
        self._env: dict[str, str] = {}
        self._udp: list[tuple[str, int]] = []

    def _prepare(self) -> None:
        count = len(self.workers)
        fleet = self.settings.fleet
        if fleet is None:
            for _ in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind(("127.0.0.1", 0))
                sock.set_inheritable(True)
                self._sockets.append(sock)
                self._udp.append(sock.getsockname()[:2])
            self._env = {SECRET_ENV: secrets.token_hex(32)}
            log.info("%d workers share the listeners and form a fleet over %s (random secret)", count,
                     ", ".join(f"udp {host}:{port}" for host, port in self._udp))
        else:
            host, port = fleet.advertised
            self._udp = [(host, port + index) for index in range(count)]
            log.info("%d workers share the listeners and join fleet %s as %s", count,
                     repr(fleet.name) if fleet.name else "(named after the cluster id)",
                     ", ".join(f"udp {h}:{p}" for h, p in self._udp))

    def _start(self, worker: _Worker) -> None:
        report, report_end = os.pipe()
        info: dict[str, object] = {"index": worker.index, "udp": self._udp, "report_fd": report_end}
        pass_fds: tuple[int, ...] = (report_end,)
        if self._sockets:
            fd = self._sockets[worker.index].fileno()
            info["fd"] = fd
            pass_fds += (fd,)
        env = {**os.environ, **self._env, WORKER_ENV: json.dumps(info)}
        try:
            worker.process = subprocess.Popen(_command(self.args, self.settings, worker.index), env=env,
                                              pass_fds=pass_fds)
        except BaseException:
            os.close(report)
            raise
        finally:
            os.close(report_end)  # the worker holds it now: its exit closes the pipe
        worker.report = report
        worker.started = time.monotonic()
        if not worker.first_started:
            worker.first_started = worker.started
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    def _check(self, worker: _Worker, now: float) -> None:
        process = worker.process
        if process is None:
            if now >= worker.start_at:
                worker.restarts += 1
                self._start(worker)
                log.warning("worker %d restarted (restart %d)", worker.index, worker.restarts)
            return
        code = process.poll()
        if code is None:
            return
        worker.process = None
        ran = now - worker.started
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        line = worker.reported()
        if code in FATAL_EXITS and now - worker.first_started < FATAL_WITHIN_S:
            if self.fatal is None:  # the first worker's words; the others usually failed the same way
                self.fatal = line or (f"worker {worker.index} {how} at start "
                                      f"({FATAL_EXITS[code]}: see its log)")
                self.fatal_code = code
            return
        if ran >= STABLE_AFTER_S:
            worker.backoff = RESTART_BACKOFF_S
        worker.start_at = now + worker.backoff
        log.error("worker %d (pid %d) %s after %.1f s%s; restarting it in %.1f s", worker.index, process.pid,
                  how, ran, f" ({line})" if line else "", worker.backoff)
        worker.backoff = min(2 * worker.backoff, RESTART_BACKOFF_MAX_S)

    def _signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            for worker in self.workers:
                if worker.process is not None and worker.process.poll() is None:
                    worker.process.send_signal(signal.SIGHUP)
            return
        self.stopping = True

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._signal)
        self._prepare()
        try:
            for worker in self.workers:
                self._start(worker)
            while not self.stopping and self.fatal is None:
                now = time.monotonic()
                for worker in self.workers:
                    self._check(worker, now)
                time.sleep(_POLL_S)
        finally:
            self._stop_all()
            for sock in self._sockets:
                sock.close()
            for worker in self.workers:
                worker.reported()  # closes the pipes
        if self.fatal is not None:
            print(f"kthrottle: {self.fatal}", file=sys.stderr, flush=True)
            return self.fatal_code
        return 0

    def _stop_all(self) -> None:
        running = [w.process for w in self.workers if w.process is not None and w.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop within %.0f s; killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.wait()


def supervise(args: argparse.Namespace, settings: ProxySettings) -> int:
    """Run `args.workers` workers until SIGINT or SIGTERM (see the module docstring)."""
    count = args.workers
    if not 1 <= count <= MAX_WORKERS:
        print(f"kthrottle: --workers {count} must be between 1 and {MAX_WORKERS}", file=sys.stderr)
        return SETTINGS_ERROR_EXIT
    try:
        return Supervisor(args, settings, count).run()
    except SettingsError as exc:
        print(f"kthrottle: {exc}", file=sys.stderr)
        return SETTINGS_ERROR_EXIT
