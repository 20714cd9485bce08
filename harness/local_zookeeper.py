"""A real Apache ZooKeeper server (standalone) on loopback, for the ZooKeeper quota source's tests and demos.

Why: the quota source must be proven against the real server, watches, sessions and restarts included, not
a fake. This module fetches ZooKeeper's jars from Maven Central once (through ``harness/zookeeper/pom.xml``)
and runs ``ZooKeeperServerMain`` in one small JVM on a free 127.0.0.1 port with its own data directory.
``stop()`` then ``start()`` restarts it on the same port with the same data, which is how tests simulate a
ZooKeeper outage. Used as a library (``LocalZooKeeper``) and as a foreground command (``main``).

Environment variables:
    KTHROTTLE_CACHE           cache root for the jars (default ``~/.cache/kthrottle``)
    KTHROTTLE_ZOOKEEPER_LIBS  use this directory of ZooKeeper jars as is, skipping Maven
    JAVA_HOME                 the JVM to run (else ``java`` on PATH)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType

from harness.kafka_jars import java_executable
from harness.maven import cache_root, fetch_once
from harness.processes import die_with_parent, free_ports, tail

ZOOKEEPER_VERSION = "3.9.5"

_POM = Path(__file__).resolve().parent / "zookeeper" / "pom.xml"
_HOST = "127.0.0.1"
_MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
_WORKDIR_PREFIX = "kthrottle-zk-"
_OWNER_FILE = ".owner-pid"
_PROBE_TIMEOUT_S = 2.0
_STOP_WAIT_S = 10.0
_MAIN_DIED = re.compile(rb"ERROR Thread Thread\[main[^\]]*\] died")

# Logback config: INFO to stdout, which the harness sends to zookeeper.log. Without a config file logback
# logs everything at DEBUG, which on a shared 2-core machine is noise and CPU.
_LOGBACK_XML = """\
<configuration>
  <appender name="OUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>[%d] %p %m [%c{1}]%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="OUT"/></root>
</configuration>
"""


# --------------------------------------------------------------------------------------------- jars


def ensure_zookeeper_jars() -> Path:
    """Return the directory holding ZooKeeper's runtime jars, fetching them with Maven the first time."""
    override = os.environ.get("KTHROTTLE_ZOOKEEPER_LIBS")
    if override:
        libs = Path(override).expanduser()
        if not any(libs.glob("zookeeper-*.jar")):
            raise RuntimeError(f"KTHROTTLE_ZOOKEEPER_LIBS={override} holds no zookeeper-*.jar")
        return libs
    return fetch_once(_POM, cache_root() / f"zookeeper-{ZOOKEEPER_VERSION}" / "libs",
                      what=f"the ZooKeeper {ZOOKEEPER_VERSION} jars",
                      expect=f"zookeeper-{ZOOKEEPER_VERSION}.jar",
                      hint="or point KTHROTTLE_ZOOKEEPER_LIBS at a ZooKeeper distribution's lib/ directory")


# --------------------------------------------------------------------------------------------- probes


def four_letter_word(host: str, port: int, word: str, timeout: float = _PROBE_TIMEOUT_S) -> str:
    """Send one of ZooKeeper's four-letter commands (``ruok``, ``srvr``) and return the whole answer.

    Raises OSError when nothing answers; the server closes the connection after answering.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(word.encode("ascii"))
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _serving(host: str, port: int) -> bool:
    """True once the server answers ``srvr`` with its mode: ``ruok`` says imok before it serves requests."""
    try:
        return "Mode: standalone" in four_letter_word(host, port, "srvr")
    except OSError:
        return False


# --------------------------------------------------------------------------------------------- server

_LIVE: weakref.WeakSet[LocalZooKeeper] = weakref.WeakSet()


def _remove_stale_workdirs() -> None:
    """Delete temporary workdirs whose owning process is gone (SIGKILLed, so close() never ran)."""
    for owner in Path(tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*/{_OWNER_FILE}"):
        try:
            os.kill(int(owner.read_text().strip()), 0)
        except ProcessLookupError:
            shutil.rmtree(owner.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue


@atexit.register
def _close_all() -> None:
    """Last line of defence against leaked JVMs: close every server still running at interpreter exit."""
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.close()


class LocalZooKeeper:
    """One standalone ZooKeeper server on 127.0.0.1, in its own JVM, with a private data directory.

    ``start()`` picks a free port the first time and keeps it: after ``stop()``, ``start()`` brings the
    server back on the same port with the same data (ZooKeeper writes every transaction to its log before
    acknowledging it, so nothing acknowledged is lost). ``close()`` stops it and deletes the data unless
    the caller chose ``workdir``. As a context manager it starts on entry and closes on exit.
    """

    def __init__(self, workdir: Path | None = None, port: int | None = None, heap_mb: int = 128) -> None:
        self.heap_mb = heap_mb
        self._given_workdir = workdir
        self.workdir: Path | None = None
        self.port: int | None = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def connect_string(self) -> str:
        """``host:port`` for ZooKeeper clients (kazoo's ``hosts``, Kafka's ``zookeeper.connect``)."""
        if self.port is None:
            raise RuntimeError("LocalZooKeeper was never started: it has no port yet")
        return f"{_HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where the server writes its log (stdout, stderr and logback INFO)."""
        if self.workdir is None:
            raise RuntimeError("LocalZooKeeper was never started: it has no log yet")
        return self.workdir / "zookeeper.log"

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> None:
        """Launch the server (same port and data as before, after a ``stop()``) and wait until it serves.

        On failure or timeout the JVM is killed and RuntimeError carries the log's tail.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"LocalZooKeeper already running on {self.connect_string}")
        began = time.monotonic()
        java = java_executable()
        libs = ensure_zookeeper_jars()
        if self.workdir is None:
            if self._given_workdir is not None:
                self.workdir = Path(self._given_workdir).resolve()
                self.workdir.mkdir(parents=True, exist_ok=True)
            else:
                _remove_stale_workdirs()
                self.workdir = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
                (self.workdir / _OWNER_FILE).write_text(f"{os.getpid()}\n")
        if self.port is None:
            self.port = free_ports(1)[0]
        _LIVE.add(self)
        (self.workdir / "data").mkdir(exist_ok=True)
        config = self.workdir / "zoo.cfg"
        config.write_text(self._config())
        logback = self.workdir / "logback.xml"
        logback.write_text(_LOGBACK_XML)
        cmd = [
            java, f"-Xmx{self.heap_mb}m", "-Xms16m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true", f"-Dlogback.configurationFile={logback}",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp", str(libs / "*"), _MAIN_CLASS, str(config),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            log_offset = log.tell()
            log.write(f"---- starting ZooKeeper {ZOOKEEPER_VERSION} on {self.connect_string}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        try:
            self._wait_serving(began + timeout, log_offset)
        except BaseException:
            self._kill()
            raise
        self.startup_seconds = time.monotonic() - began

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 10 s); port and data stay for a later ``start()``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        """Stop the server and delete its data (unless the caller chose the workdir)."""
        self.stop()
        _LIVE.discard(self)
        if self.workdir is not None and self._given_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def alive(self) -> bool:
        """True while the server's JVM is running."""
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> LocalZooKeeper:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _config(self) -> str:
        """Standalone, loopback only, no admin HTTP server; ``srvr`` and ``ruok`` allowed for the probe."""
        assert self.workdir is not None
        props = {
            "tickTime": 2000,
            "dataDir": self.workdir / "data",
            "clientPort": self.port,
            "clientPortAddress": _HOST,
            "maxClientCnxns": 0,
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "ruok,srvr,stat,mntr",
        }
        return "".join(f"{key}={value}\n" for key, value in props.items())

    def _wait_serving(self, deadline: float, log_offset: int) -> None:
        assert self.proc is not None and self.port is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ZooKeeper exited with code {self.proc.returncode} while starting on "
                    f"{self.connect_string}\n{tail(self.log_path)}"
                )
            if self._main_thread_died(log_offset):
                raise RuntimeError(
                    f"ZooKeeper failed while starting on {self.connect_string} (its JVM stays up but will "
                    f"never serve)\n{tail(self.log_path)}"
                )
            if _serving(_HOST, self.port):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"ZooKeeper did not serve on {self.connect_string} within the timeout\n{tail(self.log_path)}"
        )

    def _main_thread_died(self, log_offset: int) -> bool:
        """ZooKeeper logs an uncaught start-up error and keeps its JVM alive: spot it rather than time out."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(log_offset)
                return _MAIN_DIED.search(log.read()) is not None
        except OSError:
            return False

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Run a local ZooKeeper in the foreground until SIGINT/SIGTERM; print ``connect=H:P`` when it serves."""
    parser = argparse.ArgumentParser(
        prog="kthrottle local-zookeeper",
        description=f"Run a standalone Apache ZooKeeper {ZOOKEEPER_VERSION} on 127.0.0.1 until interrupted.",
    )
    parser.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep config, data and log here")
    parser.add_argument("--heap-mb", type=int, default=128, help="JVM heap in MiB (default: 128)")
    parser.add_argument("--timeout", type=float, default=60.0, help="startup timeout in seconds")
    args = parser.parse_args(argv)

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda _s, _f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = LocalZooKeeper(workdir=args.workdir, port=args.port, heap_mb=args.heap_mb)
    code = 0
    try:
        print(f"starting ZooKeeper {ZOOKEEPER_VERSION}...", file=sys.stderr, flush=True)
        server.start(timeout=args.timeout)
        print(f"connect={server.connect_string}", flush=True)
        ready = f"ready in {server.startup_seconds:.1f}s; log in {server.log_path}"
        print(ready, file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            if not server.alive():
                print(f"ZooKeeper exited; stopping\n{tail(server.log_path)}", file=sys.stderr, flush=True)
                code = 1
                break
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


if __name__ == "__main__":
    sys.exit(main())
