"""A real Apache Kafka cluster (KRaft, combined broker+controller nodes) on loopback, for tests and demos.

Why: the proxy must be proven against the real broker, not a mock. This module fetches Kafka's jars from
Maven Central once (through ``harness/pom.xml``), formats N storage directories with a shared cluster id,
and runs one JVM per node on free 127.0.0.1 ports. It is used as a library (``LocalKafka``), as the
``kafka_cluster`` pytest fixture and as the ``kthrottle local-kafka`` command (``main``).

Environment variables:
    KTHROTTLE_CACHE       cache root for the jars (default ``~/.cache/kthrottle``)
    KTHROTTLE_KAFKA_LIBS  use this directory of Kafka jars as is, skipping Maven
    KTHROTTLE_KAFKA_CDS   set to 0 to turn off the JVM class-data-sharing archives (see ``ClassArchive``)
    JAVA_HOME             the JVM to run (else ``java`` on PATH)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from base64 import urlsafe_b64encode
from pathlib import Path
from types import TracebackType

from .certificates import TestCertificates
from .maven import cache_root, fetch_once

KAFKA_VERSION = "4.3.1"

SASL_USERS: dict[str, str] = {
    "admin": "admin-secret",
    "alice": "alice-secret",
    "bob": "bob-secret",
}
"""Users known to the SASL_PLAINTEXT and SASL_SSL listeners, for PLAIN and both SCRAM mechanisms alike."""

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SASL_MECHANISMS = ("PLAIN", *SCRAM_MECHANISMS)

LISTENERS = ("PLAINTEXT", "SASL_PLAINTEXT", "SSL", "SASL_SSL")
"""The client listeners a node can have, named (as in Kafka) after their security protocol."""

SSL_PRINCIPAL_MAPPING_RULES = "RULE:^CN=([^,]+),.*$/$1/,DEFAULT"
"""The brokers' ``ssl.principal.mapping.rules``: a client certificate "CN=alice,OU=eng,O=kthrottle" is
User:alice, the same principal as the SASL user alice; a DN the rule does not match stays the whole DN."""
SSL_CLIENT_AUTH = "requested"
"""``ssl.client.auth`` of the SSL listener: a client certificate gives the principal, none gives ANONYMOUS."""

_POM = Path(__file__).resolve().parent / "pom.xml"
_HOST = "127.0.0.1"
_START_ATTEMPTS = 2
_CDS_DUMP_WAIT_S = 60.0
_CDS_STALE_S = 3600.0
_LOG_TAIL_LINES = 40
_ERROR_LINES = 8
_ERROR_LINE = re.compile(r"\b(ERROR|FATAL)\b|Exception:|^Error|^Caused by")

# Log4j2 config for the brokers: INFO to stdout, which the harness sends to node-<id>/server.log (one writer,
# so JVM crash messages and log lines stay in order). The request logger is silenced: it logs every request.
_BROKER_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.target = SYSTEM_OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c{1})%n
rootLogger.level = ${sys:kthrottle.log.level:-info}
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.clients.name = org.apache.kafka.clients
logger.clients.level = warn
"""


# --------------------------------------------------------------------------------------------- jars


def ensure_kafka_jars() -> Path:
    """Return the directory holding Kafka's runtime jars, fetching them with Maven the first time."""
    override = os.environ.get("KTHROTTLE_KAFKA_LIBS")
    if override:
        libs = Path(override).expanduser()
        if not any(libs.glob("kafka_2.13-*.jar")):
            raise RuntimeError(f"KTHROTTLE_KAFKA_LIBS={override} holds no kafka_2.13-*.jar")
        return libs
    return fetch_once(_POM, cache_root() / f"kafka-{KAFKA_VERSION}" / "libs",
                      what=f"the Kafka {KAFKA_VERSION} jars", expect="kafka_2.13-*.jar",
                      hint="or point KTHROTTLE_KAFKA_LIBS at a Kafka distribution's libs/ directory")


def kafka_classpath() -> str:
    """The ``java -cp`` argument for every Kafka class (the JVM expands the ``*`` itself)."""
    return str(ensure_kafka_jars() / "*")


def java_executable() -> str:
    """Pick ``$JAVA_HOME/bin/java`` when set, else ``java`` on PATH; fail with a clear message."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise RuntimeError("no 'java' on PATH and JAVA_HOME is unset: Kafka needs a JDK/JRE 17+")
    return java


# --------------------------------------------------------------------------------------------- helpers


def _free_ports(count: int) -> list[int]:
    """Ask the kernel for distinct free ports; all sockets stay open until every port is chosen."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((_HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _new_cluster_id() -> str:
    """A random UUID in URL-safe base64 without padding, as ``kafka-storage random-uuid`` prints.

    Like Kafka's ``Uuid.randomUuid`` it never starts with "-", which the tool would parse as an option.
    """
    while True:
        cluster_id = urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _jaas_plain() -> str:
    users = " ".join(f'user_{name}="{password}"' for name, password in SASL_USERS.items())
    admin = next(iter(SASL_USERS))
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{admin}" password="{SASL_USERS[admin]}" {users};'
    )


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel SIGKILLs it when the spawning thread exits (Linux only).

    This is what keeps brokers from leaking when pytest itself is SIGKILLed and atexit never runs.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _metadata_brokers(host: str, port: int, timeout: float) -> list[int]:
    """Send one Metadata v1 request (no topics) and return the node ids the broker lists.

    Hand-encoded on purpose: readiness must not depend on the client library under test.
    """
    client_id = b"kthrottle-harness"
    body = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _recv_exact(sock, 4))[0]
        data = _recv_exact(sock, size)
    pos = 4  # correlation id
    (count,) = struct.unpack_from(">i", data, pos)
    pos += 4
    nodes = []
    for _ in range(count):
        node_id, host_len = struct.unpack_from(">ih", data, pos)
        pos += 6 + host_len + 4  # host, port
        (rack_len,) = struct.unpack_from(">h", data, pos)
        pos += 2 + max(rack_len, 0)
        nodes.append(node_id)
    return sorted(nodes)


def _accepts(host: str, port: int) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _handshakes(host: str, port: int, ca: Path) -> bool:
    """True when a TLS handshake on host:port verifies the server against ``ca``, hostname included."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection((host, port), timeout=2.0) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except OSError:  # ssl.SSLError is an OSError
        return False


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return bytes(buf)


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


class ClassArchive:
    """A dynamic class-data-sharing (AppCDS) archive of the classes one kind of Kafka JVM loads.

    Why: on a 2-core machine three brokers starting at once are CPU-bound, mostly loading and verifying
    classes; mapping them from an archive cuts each broker's start-up CPU by about 40%. The first run
    records the archive when a JVM exits cleanly (``-XX:ArchiveClassesAtExit``, into a private file
    renamed into place, so concurrent runs never see half a file); later runs map it. The key covers the
    JVM and the jars, so a new JDK or refetched jars simply record a new archive. If the JVM rejects an
    archive it only logs a warning and starts without it (``-Xshare:auto``, the default).
    """

    def __init__(self, kind: str, java: str, libs: Path) -> None:
        self.enabled = os.environ.get("KTHROTTLE_KAFKA_CDS", "1") != "0"
        key = "none"
        try:
            real_java = Path(java).resolve()
            jars = sorted((p.name, p.stat().st_size) for p in libs.glob("*.jar"))
            key = hashlib.sha256(
                f"{real_java}|{real_java.stat().st_mtime_ns}|{libs.resolve()}|{jars}".encode()
            ).hexdigest()[:16]
        except OSError:
            self.enabled = False  # an optimisation only: never a reason to fail
        self.path = cache_root() / f"kafka-{KAFKA_VERSION}" / "cds" / f"{kind}-{key}.jsa"

    def flags(self, record: bool) -> tuple[list[str], Path | None]:
        """JVM flags to map the archive, or (when ``record`` and none exists) to record it at exit.

        Returns the flags and the private file a recording JVM writes, to ``publish`` after a clean exit.
        """
        if not self.enabled:
            return [], None
        if self.path.is_file():
            return [f"-XX:SharedArchiveFile={self.path}"], None
        if not record:
            return [], None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for stale in self.path.parent.glob("*.tmp"):  # left by a run that was SIGKILLed
                if time.time() - stale.stat().st_mtime > _CDS_STALE_S:
                    stale.unlink(missing_ok=True)
            fd, name = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            os.close(fd)
        except OSError:  # read-only cache: run without an archive
            return [], None
        # The dump lists every class it cannot archive as a warning: keep that noise out of the log.
        return [f"-XX:ArchiveClassesAtExit={name}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"], Path(name)

    def publish(self, recorded: Path, ok: bool) -> None:
        """Move a recorded archive into place if the JVM exited cleanly; drop it otherwise."""
        with contextlib.suppress(OSError):
            if ok and recorded.stat().st_size > 0:
                os.replace(recorded, self.path)
            else:
                recorded.unlink()


# --------------------------------------------------------------------------------------------- cluster

_LIVE: weakref.WeakSet[LocalKafka] = weakref.WeakSet()
_WORKDIR_PREFIX = "kthrottle-kafka-"
_OWNER_FILE = ".owner-pid"


def _remove_stale_workdirs() -> None:
    """Delete temporary workdirs whose owning process is gone (it was SIGKILLed, so stop() never ran).

    Its brokers died with it (PDEATHSIG), but their logs and data would otherwise pile up in /tmp.
    """
    for owner in Path(tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*/{_OWNER_FILE}"):
        try:
            os.kill(int(owner.read_text().strip()), 0)
        except ProcessLookupError:
            shutil.rmtree(owner.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue


@atexit.register
def _stop_all() -> None:
    """Last line of defence against leaked JVMs: stop every cluster still running at interpreter exit."""
    for cluster in list(_LIVE):
        with contextlib.suppress(Exception):
            cluster.stop()


class _PortClash(RuntimeError):
    """A node could not bind a port picked as free: someone else took it in between."""


class _Node:
    """One combined broker+controller JVM and its ports."""

    def __init__(self, node_id: int, ports: list[int], sasl: bool, tls: bool = False) -> None:
        self.node_id = node_id
        self.client_port, self.internal_port, self.controller_port = ports[:3]
        rest = iter(ports[3:])
        self.sasl_port: int | None = next(rest) if sasl else None
        self.ssl_port: int | None = next(rest) if tls else None
        self.sasl_ssl_port: int | None = next(rest) if tls else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.recording: Path | None = None  # this JVM records the class archive at exit


class LocalKafka:
    """N Kafka nodes in KRaft combined mode on 127.0.0.1, each with its own JVM and data directory.

    Every node is a voter of a static controller quorum (``controller.quorum.voters``). Listeners:
    PLAINTEXT (clients), SASL_PLAINTEXT (clients, when ``sasl``), INTERNAL (inter-broker, plaintext) and
    CONTROLLER. Topics are never auto-created: tests create what they use (``default.replication.factor``
    is 1; the internal offsets/transaction topics have min(3, N) replicas and 10 partitions, to start fast).

    ``tls`` adds two client listeners from certificates generated at each start into
    ``<workdir>/certificates`` (``certificates``, a ``TestCertificates``): SSL (``ssl_bootstrap``; client
    certificates requested and mapped by ``SSL_PRINCIPAL_MAPPING_RULES``, none gives User:ANONYMOUS) and
    SASL_SSL (``sasl_ssl_bootstrap``; the same mechanisms and ``SASL_USERS`` as SASL_PLAINTEXT, so the SCRAM
    credentials are created whether or not ``sasl`` is also on). Inter-broker traffic stays plaintext.

    ``workdir``: keep configs, data and logs there after ``stop`` (for debugging); each ``start`` wipes the
    ``node-*`` directories in it and formats a new cluster. Without it a temporary directory is used and
    deleted. ``heap_mb`` is the heap of each broker JVM.
    """

    def __init__(
        self,
        brokers: int = 3,
        sasl: bool = False,
        workdir: Path | None = None,
        heap_mb: int = 384,
        tls: bool = False,
    ) -> None:
        if brokers < 1:
            raise ValueError("brokers must be >= 1")
        self.brokers = brokers
        self.sasl = sasl
        self.tls = tls
        self.heap_mb = heap_mb
        self._given_workdir = workdir
        self.workdir: Path | None = None
        self.cluster_id = _new_cluster_id()
        self.node_ids: list[int] = list(range(1, brokers + 1))
        self._nodes: list[_Node] = []
        self.bootstrap: str = ""
        self.sasl_bootstrap: str | None = None
        self.ssl_bootstrap: str | None = None
        self.sasl_ssl_bootstrap: str | None = None
        self.certificates: TestCertificates | None = None
        self.startup_seconds: float | None = None
        self._ready = False
        self._broker_cds: ClassArchive | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 120.0) -> None:
        """Format, launch and wait until every broker answers Metadata listing all brokers.

        On failure or timeout everything started is killed and RuntimeError carries the logs' tails. Ports
        are picked free but only bound seconds later by Kafka; if another process took one meanwhile, the
        start is retried once with fresh ports.
        """
        if self._nodes:
            raise RuntimeError("LocalKafka already started")
        began = time.monotonic()
        deadline = began + timeout
        for attempt in range(_START_ATTEMPTS):
            try:
                self._start_once(deadline)
                break
            except _PortClash as exc:
                if attempt + 1 == _START_ATTEMPTS or time.monotonic() > deadline:
                    raise RuntimeError(str(exc)) from None
        self.startup_seconds = time.monotonic() - began

    def _start_once(self, deadline: float) -> None:
        java = java_executable()
        classpath = kafka_classpath()
        if self._given_workdir is not None:
            self.workdir = Path(self._given_workdir).resolve()
            self.workdir.mkdir(parents=True, exist_ok=True)
            for old in self.workdir.glob("node-*"):  # every start formats a new cluster
                shutil.rmtree(old, ignore_errors=True)
        else:
            _remove_stale_workdirs()
            self.workdir = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
            (self.workdir / _OWNER_FILE).write_text(f"{os.getpid()}\n")
        _LIVE.add(self)
        try:
            per_node = 3 + (1 if self.sasl else 0) + (2 if self.tls else 0)
            ports = _free_ports(per_node * self.brokers)
            self._nodes = [
                _Node(nid, ports[i * per_node : (i + 1) * per_node], self.sasl, self.tls)
                for i, nid in enumerate(self.node_ids)
            ]
            self.bootstrap = ",".join(f"{_HOST}:{n.client_port}" for n in self._nodes)
            self.sasl_bootstrap = (
                ",".join(f"{_HOST}:{n.sasl_port}" for n in self._nodes) if self.sasl else None
            )
            if self.tls:
                self.ssl_bootstrap = ",".join(f"{_HOST}:{n.ssl_port}" for n in self._nodes)
                self.sasl_ssl_bootstrap = ",".join(f"{_HOST}:{n.sasl_ssl_port}" for n in self._nodes)
                self.certificates = TestCertificates.generate(self.workdir / "certificates")
            log4j = self.workdir / "log4j2.properties"
            log4j.write_text(_BROKER_LOG4J2)
            for node in self._nodes:
                self._node_dir(node).mkdir(parents=True, exist_ok=True)
                self._config_path(node).write_text(self._server_properties(node))
            libs = Path(classpath).parent
            self._format(java, classpath, deadline, ClassArchive("format", java, libs))
            self._broker_cds = ClassArchive("broker", java, libs)
            for node in self._nodes:
                self._launch(node, java, classpath, log4j, record=node is self._nodes[0])
            self._wait_ready(deadline)
            self._ready = True
        except BaseException as exc:
            logs = self._logs_tail()
            clash = isinstance(exc, RuntimeError) and self._bind_failed()
            self.stop()
            if isinstance(exc, RuntimeError):
                if clash:
                    raise _PortClash(f"{exc}\n{logs}") from None
                raise RuntimeError(f"{exc}\n{logs}") from None
            raise

    def stop(self) -> None:
        """Kill every node's process group and delete the data (unless the caller chose the workdir).

        SIGKILL at once: the data is thrown away, the logs are written unbuffered, and a controlled
        shutdown of a shrinking KRaft quorum can stall for many seconds. Only the node recording the
        class-data archive (once per machine) is stopped cleanly first.
        """
        self._finish_recording()
        for node in self._nodes:
            if node.proc is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.proc.pid, signal.SIGKILL)  # the whole group, in case the JVM forked anything
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        self._nodes = []
        self._ready = False
        _LIVE.discard(self)
        if self.workdir is not None and self._given_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> LocalKafka:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ introspection

    def log_path(self, node_id: int) -> Path:
        """Where node ``node_id`` writes its log (stdout, stderr and log4j2 INFO)."""
        assert self.workdir is not None, "not started"
        return self.workdir / f"node-{node_id}" / "server.log"

    def alive(self) -> bool:
        """True while every node's JVM is running."""
        return bool(self._nodes) and all(n.proc is not None and n.proc.poll() is None for n in self._nodes)

    def broker_address(
        self, node_id: int, sasl: bool = False, *, listener: str | None = None
    ) -> tuple[str, int]:
        """(host, port) of one broker's client listener, for tests that target a single node.

        ``listener`` names it by security protocol (one of ``LISTENERS``); without it ``sasl`` picks
        SASL_PLAINTEXT over PLAINTEXT.
        """
        name = listener or ("SASL_PLAINTEXT" if sasl else "PLAINTEXT")
        if name not in LISTENERS:
            raise ValueError(f"unknown listener {name!r}: one of {', '.join(LISTENERS)}")
        node = next(n for n in self._nodes if n.node_id == node_id)
        port = {
            "PLAINTEXT": node.client_port,
            "SASL_PLAINTEXT": node.sasl_port,
            "SSL": node.ssl_port,
            "SASL_SSL": node.sasl_ssl_port,
        }[name]
        if port is None:
            raise ValueError(f"this cluster has no {name} listener")
        return _HOST, port

    # ------------------------------------------------------------------ internals

    def _finish_recording(self) -> None:
        """Stop the node that records the class archive cleanly (SIGTERM, then its JVM writes the archive).

        Only after a successful start: a JVM stopped half-way through start-up has not loaded the
        classes worth archiving. This costs a few seconds once per machine, on the first stop.
        """
        for node in self._nodes:
            if node.recording is None or node.proc is None or self._broker_cds is None:
                continue
            ok = False
            if self._ready and node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.proc.pid, signal.SIGTERM)
                try:
                    ok = node.proc.wait(timeout=_CDS_DUMP_WAIT_S) in (0, 143)
                except subprocess.TimeoutExpired:
                    ok = False
            if not ok:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait()
            self._broker_cds.publish(node.recording, ok)
            node.recording = None

    def _node_dir(self, node: _Node) -> Path:
        assert self.workdir is not None
        return self.workdir / f"node-{node.node_id}"

    def _config_path(self, node: _Node) -> Path:
        return self._node_dir(node) / "server.properties"

    def _server_properties(self, node: _Node) -> str:
        """The broker config; the small thread counts and partition counts suit a 2-core test machine."""
        rf = min(3, self.brokers)
        voters = ",".join(f"{n.node_id}@{_HOST}:{n.controller_port}" for n in self._nodes)
        listeners = [
            f"PLAINTEXT://{_HOST}:{node.client_port}",
            f"INTERNAL://{_HOST}:{node.internal_port}",
            f"CONTROLLER://{_HOST}:{node.controller_port}",
        ]
        advertised = listeners[:2]
        if node.sasl_port is not None:
            sasl_listener = f"SASL_PLAINTEXT://{_HOST}:{node.sasl_port}"
            listeners.append(sasl_listener)
            advertised.append(sasl_listener)
        protocol_map = (
            "PLAINTEXT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
        )
        if self.tls:
            tls_listeners = [f"SSL://{_HOST}:{node.ssl_port}", f"SASL_SSL://{_HOST}:{node.sasl_ssl_port}"]
            listeners += tls_listeners
            advertised += tls_listeners
            protocol_map += ",SSL:SSL,SASL_SSL:SASL_SSL"
        props: dict[str, str | int] = {
            "process.roles": "broker,controller",
            "node.id": node.node_id,
            "controller.quorum.voters": voters,
            "controller.listener.names": "CONTROLLER",
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": protocol_map,
            "inter.broker.listener.name": "INTERNAL",
            "log.dirs": str(self._node_dir(node) / "data"),
            "num.network.threads": 2,
            "num.io.threads": 2,
            "background.threads": 2,
            "num.replica.fetchers": 1,
            "num.recovery.threads.per.data.dir": 1,
            "log.cleaner.threads": 1,
            "num.partitions": 1,
            "default.replication.factor": 1,
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": 10,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": 1,
            "transaction.state.log.num.partitions": 10,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": 1,
            "group.initial.rebalance.delay.ms": 0,
            "broker.heartbeat.interval.ms": 500,
            "log.segment.bytes": 64 * 1024 * 1024,
            # Keep every record for the cluster's life: tests write records with fixed old timestamps
            # (2023), which the default 7-day retention would delete whenever its 5-minute check fell
            # mid-test, leaving a reader OFFSET_OUT_OF_RANGE.
            "log.retention.ms": -1,
        }
        sasl_listeners = [
            name for name, on in (("sasl_plaintext", self.sasl), ("sasl_ssl", self.tls)) if on
        ]
        if sasl_listeners:
            props["sasl.enabled.mechanisms"] = ",".join(SASL_MECHANISMS)
        for listener in sasl_listeners:
            props[f"listener.name.{listener}.plain.sasl.jaas.config"] = _jaas_plain()
            for mech in SCRAM_MECHANISMS:
                props[f"listener.name.{listener}.{mech.lower()}.sasl.jaas.config"] = (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                )
        if self.tls:
            props.update(self._tls_properties())
        return "".join(f"{key}={value}\n" for key, value in props.items())

    def _tls_properties(self) -> dict[str, str | int]:
        """The SSL and SASL_SSL listeners' keystore and truststore, as PEM files (KIP-651).

        A PEM keystore is one file with the PKCS#8 key and the certificate chain; with the key unencrypted
        neither ``ssl.key.password`` nor a keystore password is set (Kafka refuses a keystore password for
        PEM). Only the SSL listener asks for client certificates: that is where a certificate is the identity.
        """
        certs = self.certificates
        assert certs is not None
        props: dict[str, str | int] = {"ssl.principal.mapping.rules": SSL_PRINCIPAL_MAPPING_RULES}
        for listener in ("ssl", "sasl_ssl"):
            prefix = f"listener.name.{listener}."
            props[prefix + "ssl.keystore.type"] = "PEM"
            props[prefix + "ssl.keystore.location"] = str(certs.server_keystore)
            props[prefix + "ssl.truststore.type"] = "PEM"
            props[prefix + "ssl.truststore.location"] = str(certs.ca)
        props["listener.name.ssl.ssl.client.auth"] = SSL_CLIENT_AUTH
        return props

    def _format(self, java: str, classpath: str, deadline: float, cds: ClassArchive) -> None:
        """Format every node's storage with the shared cluster id; the JVMs run in parallel to save time."""
        scram = [
            arg
            for mech in (SCRAM_MECHANISMS if self.sasl or self.tls else ())
            for name, password in SASL_USERS.items()
            for arg in ("--add-scram", f"{mech}=[name={name},password={password}]")
        ]
        running = []
        recording: Path | None = None
        for node in self._nodes:
            cds_flags, recorded = cds.flags(record=recording is None)
            recording = recording or recorded
            cmd = [
                java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", *cds_flags,
                f"-Dlog4j2.configurationFile={self.workdir}/log4j2.properties", "-Dkthrottle.log.level=warn",
                "-cp", classpath, "kafka.tools.StorageTool", "format",
                "--config", str(self._config_path(node)), "--cluster-id", self.cluster_id, *scram,
            ]  # fmt: skip
            log = open(self._node_dir(node) / "format.log", "wb")  # noqa: SIM115 - closed below
            running.append((node, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        failures = []
        for node, log, proc in running:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            finally:
                log.close()
            if proc.returncode != 0:
                failures.append(
                    f"node {node.node_id}: exit {proc.returncode}\n"
                    + _tail(self._node_dir(node) / "format.log")
                )
        if recording is not None:
            cds.publish(recording, ok=not failures)
        if failures:
            raise RuntimeError("kafka-storage format failed:\n" + "\n".join(failures))

    def _launch(self, node: _Node, java: str, classpath: str, log4j: Path, record: bool) -> None:
        """Start one node in its own session (so it can be killed as a group) with output to server.log."""
        assert self._broker_cds is not None
        cds_flags, node.recording = self._broker_cds.flags(record=record)
        cmd = [
            java,
            f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
            "-XX:+UseSerialGC", "-XX:CICompilerCount=2", "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true", *cds_flags,
            f"-Dlog4j2.configurationFile={log4j}",
            f"-Dkafka.logs.dir={self._node_dir(node)}",
            "-cp", classpath, "kafka.Kafka", str(self._config_path(node)),
        ]  # fmt: skip
        on_main = threading.current_thread() is threading.main_thread()
        with open(self.log_path(node.node_id), "ab") as log:
            node.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._node_dir(node),
                start_new_session=True,
                # PDEATHSIG follows the spawning *thread*: only safe when that is the main thread.
                preexec_fn=_die_with_parent if on_main and sys.platform == "linux" else None,
            )

    def _wait_ready(self, deadline: float) -> None:
        """Poll each broker with Metadata until all list every node id, or raise on a dead JVM/timeout."""
        want = sorted(self.node_ids)
        pending = list(self._nodes)
        last: dict[int, str] = {}
        while pending:
            for node in self._nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"Kafka node {node.node_id} exited with code {node.proc.returncode}")
            for node in list(pending):
                try:
                    got = _metadata_brokers(_HOST, node.client_port, timeout=2.0)
                except (OSError, struct.error) as exc:
                    last[node.node_id] = repr(exc)
                    continue
                if got == want and self._other_listeners_ready(node):
                    pending.remove(node)
                else:
                    last[node.node_id] = f"lists brokers {got}"
            if not pending:
                return
            if time.monotonic() > deadline:
                state = ", ".join(f"node {k}: {v}" for k, v in sorted(last.items()))
                raise RuntimeError(f"Kafka cluster not ready before the timeout ({state})")
            time.sleep(0.2)

    def _other_listeners_ready(self, node: _Node) -> bool:
        """SASL ports accept TCP; TLS ports complete a handshake that verifies the broker's certificate."""
        if node.sasl_port is not None and not _accepts(_HOST, node.sasl_port):
            return False
        if self.certificates is None:
            return True
        return all(
            port is not None and _handshakes(_HOST, port, self.certificates.ca)
            for port in (node.ssl_port, node.sasl_ssl_port)
        )

    def _nodes_launched(self) -> bool:
        return any(n.proc is not None for n in self._nodes)

    def _bind_failed(self) -> bool:
        """Did some node fail because a port picked as free was taken (worth a retry)?"""
        if self.workdir is None:
            return False
        return any(
            "Address already in use" in log.read_text(errors="replace")
            for log in self.workdir.glob("node-*/server.log")
        )

    def _logs_tail(self) -> str:
        """What a failed start shows: each log's first error lines (the cause: Kafka logs its whole
        shutdown after it) and its last lines. The format log only matters if no broker was launched."""
        if self.workdir is None:
            return ""
        parts = []
        for nid in self.node_ids:
            for name, tail in (("format.log", 10), ("server.log", 15)):
                path = self.workdir / f"node-{nid}" / name
                if not path.exists() or (name == "format.log" and self._nodes_launched()):
                    continue
                lines = path.read_text(errors="replace").splitlines()
                errors = [ln for ln in lines if _ERROR_LINE.search(ln)][:_ERROR_LINES]
                body = "\n".join([*errors, "...", *lines[-tail:]] if errors else lines[-tail:])
                parts.append(f"--- node {nid} {name} ---\n{body}")
        return "\n".join(parts)


# --------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Run a local cluster in the foreground until SIGINT/SIGTERM (``kthrottle local-kafka``)."""
    parser = argparse.ArgumentParser(
        prog="kthrottle local-kafka",
        description=f"Run a local Apache Kafka {KAFKA_VERSION} KRaft cluster on 127.0.0.1 until interrupted.",
    )
    parser.add_argument("--brokers", type=int, default=3, help="number of nodes (default: 3)")
    parser.add_argument("--sasl", action="store_true", help="add a SASL_PLAINTEXT listener (PLAIN, SCRAM)")
    parser.add_argument("--tls", action="store_true",
                        help="add SSL and SASL_SSL listeners, with test certificates generated at start")
    parser.add_argument("--heap-mb", type=int, default=384, help="JVM heap per node in MiB (default: 384)")
    parser.add_argument("--timeout", type=float, default=120.0, help="startup timeout in seconds")
    args = parser.parse_args(argv)

    stop = threading.Event()
    interrupt_startup = [True]  # a signal during start() aborts it (start() kills what it launched), once

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()
        if interrupt_startup[0]:
            interrupt_startup[0] = False
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalKafka(brokers=args.brokers, sasl=args.sasl, heap_mb=args.heap_mb, tls=args.tls)
    code = 0
    try:
        print(f"starting {args.brokers} Kafka {KAFKA_VERSION} node(s)...", file=sys.stderr, flush=True)
        cluster.start(timeout=args.timeout)
        interrupt_startup[0] = False
        print(f"bootstrap={cluster.bootstrap}")
        if cluster.sasl_bootstrap:
            print(f"sasl_bootstrap={cluster.sasl_bootstrap}")
        if cluster.certificates is not None:
            print(f"ssl_bootstrap={cluster.ssl_bootstrap}")
            print(f"sasl_ssl_bootstrap={cluster.sasl_ssl_bootstrap}")
            print(f"certificates={cluster.certificates.directory}")
        sys.stdout.flush()
        users = ", ".join(f"{u}/{p}" for u, p in SASL_USERS.items())
        print(
            f"ready in {cluster.startup_seconds:.1f}s; logs in {cluster.workdir}"
            + (f"; SASL users {users}" if args.sasl or args.tls else ""),
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            if not cluster.alive():
                print(f"a Kafka node exited; stopping\n{cluster._logs_tail()}", file=sys.stderr, flush=True)
                code = 1
                break
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("interrupted during startup", file=sys.stderr, flush=True)
        code = 130
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


if __name__ == "__main__":
    sys.exit(main())
