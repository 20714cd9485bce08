"""A real Apache Kafka cluster (KRaft, combined broker+controller nodes) on loopback, for tests and demos.

Why: the proxy must be proven against the real broker, not a mock. This module fetches Kafka's jars from
Maven Central once (through ``harness/pom.xml``, see ``kafka_jars``), formats N storage directories with a
shared cluster id, and runs one JVM per node on free 127.0.0.1 ports, configured by ``broker_config``. It is
used as a library (``LocalKafka``), as the ``kafka_cluster`` pytest fixture and as the
``kthrottle local-kafka`` command (``main``).

Environment variables: see ``kafka_jars`` (the cache, the jars, the JVM and its class-data archives).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
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

from . import telemetry
from .broker_config import (
    BROKER_LOG4J2,
    HOST,
    LISTENERS,
    SASL_MECHANISMS,
    SASL_USERS,
    SCRAM_MECHANISMS,
    SSL_CLIENT_AUTH,
    SSL_PRINCIPAL_MAPPING_RULES,
    Node,
    server_properties,
)
from .certificates import TestCertificates
from .kafka_jars import KAFKA_VERSION, ClassArchive, ensure_kafka_jars, java_executable, kafka_classpath
from .probes import accepts, handshakes, metadata_brokers
from .processes import die_with_parent as _die_with_parent
from .processes import free_ports as _free_ports
from .processes import tail as _tail

# What callers import from here, wherever it now lives (local_zookeeper.py takes the three private
# process helpers, which live in processes.py).
__all__ = [
    "KAFKA_VERSION", "LISTENERS", "SASL_MECHANISMS", "SASL_USERS", "SCRAM_MECHANISMS", "SSL_CLIENT_AUTH",
    "SSL_PRINCIPAL_MAPPING_RULES", "ClassArchive", "LocalKafka",
    "ensure_kafka_jars", "java_executable", "kafka_classpath",
]

#: Heap of each broker JVM of the embedded cluster (`make run`, `kthrottle local-kafka`, LocalKafka()):
#: 1 GiB, what Kafka's own bin/kafka-server-start.sh gives a broker (-Xmx1G -Xms1G). 384 MiB ran out
#: (OutOfMemoryError) under librdkafka's test suite, which creates thousands of topics: every
#: partition's log, index and metadata-image objects live on the heap. Three brokers take 3 GiB of the
#: 24 GiB, 2-core machine this is sized for. The collector stays Serial (see `_launch`): with three JVMs
#: on two cores, G1's concurrent threads would compete with the brokers' own.
DEFAULT_HEAP_MB = 1024
#: The test suite's own cluster (conftest.py) and the tests' extra clusters: tens of topics, and
#: 3 x 384 MiB leaves room for the JVM tools, Spark and the proxies the tests start beside it.
TEST_HEAP_MB = 384
#: The JIT of the test clusters' brokers (``LocalKafka(light_jit=True)``): C1 only. Measured on the 2-core
#: machine, a 3-node cluster reaches ready on 7.6 CPU-s instead of 13.7 and idles at 0.08 of a core
#: instead of 0.13; a parallel run keeps three such clusters up for its whole length. The tests' brokers
#: move a few MB/s, far below where C2's faster code pays; `make run` and the benchmarks keep C2.
LIGHT_JIT_FLAGS = ("-XX:TieredStopAtLevel=1",)
#: The collector of the harness's brokers: one thread, no concurrent work beside the application,
#: the least CPU and memory for clusters that only tests use.
SERIAL_GC_FLAGS = ("-XX:+UseSerialGC",)
#: The collector a broker started by Kafka's own scripts runs with (bin/kafka-run-class.sh's
#: KAFKA_JVM_PERFORMANCE_OPTS): G1, aiming at 20 ms pauses. The overload beds model a production
#: broker, whose pauses are what its clients see (``LocalKafka(kafka_gc=True)``).
KAFKA_GC_FLAGS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
                  "-XX:+ExplicitGCInvokesConcurrent", "-XX:MaxInlineLevel=15")

_START_ATTEMPTS = 2
_CDS_DUMP_WAIT_S = 60.0
_ERROR_LINES = 8
_ERROR_LINE = re.compile(r"\b(ERROR|FATAL)\b|Exception:|^Error|^Caused by")


# --------------------------------------------------------------------------------------------- helpers


def _new_cluster_id() -> str:
    """A random UUID in URL-safe base64 without padding, as ``kafka-storage random-uuid`` prints.

    Like Kafka's ``Uuid.randomUuid`` it never starts with "-", which the tool would parse as an option.
    """
    while True:
        cluster_id = urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


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
    deleted. ``heap_mb`` is the heap of each broker JVM (``DEFAULT_HEAP_MB``, 1 GiB, unless given; the
    test suite gives ``TEST_HEAP_MB``); ``light_jit`` compiles with C1 only (``LIGHT_JIT_FLAGS``: less
    CPU to start and to idle, lower peak throughput), for clusters that only tests use; ``kafka_gc`` runs
    the collector Kafka's own scripts choose (``KAFKA_GC_FLAGS``) instead of the serial one.

    ``telemetry`` loads the harness's client-telemetry recorder (``harness.telemetry``) into every broker,
    so they offer KIP-714's GetTelemetrySubscriptions and PushTelemetry and record each push they receive
    (``telemetry_pushes``); clients push once a subscription asks them to (``subscribe_client_metrics``).
    """

    def __init__(
        self,
        brokers: int = 3,
        sasl: bool = False,
        workdir: Path | None = None,
        heap_mb: int = DEFAULT_HEAP_MB,
        tls: bool = False,
        telemetry: bool = False,
        light_jit: bool = False,
        authorizer: bool = False,
        kafka_gc: bool = False,
    ) -> None:
        """`authorizer`: Kafka's StandardAuthorizer, with the listeners' anonymous principal (brokers,
        controllers, plaintext clients) and the first SASL user as super users; other SASL users
        may do nothing an ACL does not grant (a proxy refused by the cluster)."""
        if brokers < 1:
            raise ValueError("brokers must be >= 1")
        self.brokers = brokers
        self.sasl = sasl
        self.tls = tls
        self.telemetry = telemetry
        self.authorizer = authorizer
        self.heap_mb = heap_mb
        self.jit_flags: tuple[str, ...] = LIGHT_JIT_FLAGS if light_jit else ()
        self.gc_flags: tuple[str, ...] = KAFKA_GC_FLAGS if kafka_gc else SERIAL_GC_FLAGS
        self._given_workdir = workdir
        self.workdir: Path | None = None
        self.cluster_id = _new_cluster_id()
        self.node_ids: list[int] = list(range(1, brokers + 1))
        self._nodes: list[Node] = []
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
        libs = Path(classpath).parent
        archive_kind = ""
        if self.telemetry:  # another classpath: class-data archives of their own, per build of the plugin
            plugin = telemetry.build_plugin()
            classpath += os.pathsep + str(plugin)
            archive_kind = f"-telemetry-{plugin.parent.name}"
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
                Node(nid, ports[i * per_node : (i + 1) * per_node], self.sasl, self.tls)
                for i, nid in enumerate(self.node_ids)
            ]
            self.bootstrap = ",".join(f"{HOST}:{n.client_port}" for n in self._nodes)
            self.sasl_bootstrap = (
                ",".join(f"{HOST}:{n.sasl_port}" for n in self._nodes) if self.sasl else None
            )
            if self.tls:
                self.ssl_bootstrap = ",".join(f"{HOST}:{n.ssl_port}" for n in self._nodes)
                self.sasl_ssl_bootstrap = ",".join(f"{HOST}:{n.sasl_ssl_port}" for n in self._nodes)
                self.certificates = TestCertificates.generate(self.workdir / "certificates")
            log4j = self.workdir / "log4j2.properties"
            log4j.write_text(BROKER_LOG4J2)
            for node in self._nodes:
                self._node_dir(node).mkdir(parents=True, exist_ok=True)
                self._config_path(node).write_text(self._server_properties(node))
            self._format(java, classpath, deadline, ClassArchive(f"format{archive_kind}", java, libs))
            self._broker_cds = ClassArchive(f"broker{archive_kind}", java, libs)
            for node in self._nodes:
                self._launch(node, java, classpath, log4j, record=node is self._nodes[0])
            self._wait_ready(deadline)
            self._ready = True
        except BaseException as exc:
            logs = self.logs_tail()
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

    def telemetry_pushes(self) -> list[telemetry.Push]:
        """Every PushTelemetry the brokers have received so far, node by node (needs ``telemetry``)."""
        if not self.telemetry:
            raise RuntimeError("this cluster was started without telemetry=True")
        return [push for node in self._nodes for push in telemetry.read_pushes(self._telemetry_file(node),
                                                                               node.node_id)]

    def subscribe_client_metrics(
        self,
        name: str = "kthrottle",
        metrics: str = telemetry.ALL_METRICS,
        interval_ms: int = telemetry.PUSH_INTERVAL_MS,
        timeout: float = 120.0,
    ) -> None:
        """Ask every client for ``metrics`` every ``interval_ms`` (a client-metrics subscription, KIP-714).

        Returns once every broker hands the subscription to a new client, so a client started next
        gets it rather than Kafka's 5-minute default.
        """
        if not self.telemetry:
            raise RuntimeError("this cluster was started without telemetry=True: brokers would ignore it")
        assert self.workdir is not None, "not started"
        deadline = time.monotonic() + timeout
        telemetry.subscribe(self.bootstrap, name, metrics, interval_ms,
                            log4j2=self.workdir / "log4j2.properties", timeout=timeout)
        for node in self._nodes:
            telemetry.wait_subscribed(HOST, node.client_port, interval_ms,
                                      timeout=max(1.0, deadline - time.monotonic()))

    def log_path(self, node_id: int) -> Path:
        """Where node ``node_id`` writes its log (stdout, stderr and log4j2 INFO)."""
        assert self.workdir is not None, "not started"
        return self.workdir / f"node-{node_id}" / "server.log"

    def pid(self, node_id: int) -> int:
        """The JVM process id of node `node_id` (tests slow a broker from outside: SIGSTOP/SIGCONT)."""
        for node in self._nodes:
            if node.node_id == node_id and node.proc is not None:
                return node.proc.pid
        raise KeyError(f"no running node {node_id}")

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
        return HOST, port

    # ------------------------------------------------------------------ internals

    def restart(self, node_id: int, timeout: float = 60.0) -> None:
        """kill -9 one node and start it again on its own data and ports (a broker crash and its
        return); returns once every broker answers Metadata listing all of them again."""
        (node,) = [n for n in self._nodes if n.node_id == node_id]
        assert node.proc is not None and self.workdir is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(timeout=10)
        log4j = self.workdir / "log4j2.properties"
        self._launch(node, java_executable(), kafka_classpath(), log4j, record=False)
        self._wait_ready(time.monotonic() + timeout)

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

    def _node_dir(self, node: Node) -> Path:
        assert self.workdir is not None
        return self.workdir / f"node-{node.node_id}"

    def _config_path(self, node: Node) -> Path:
        return self._node_dir(node) / "server.properties"

    def _telemetry_file(self, node: Node) -> Path:
        return self._node_dir(node) / "telemetry.tsv"

    def _server_properties(self, node: Node) -> str:
        extra: dict[str, str | int] = {}
        if self.telemetry:
            extra.update(telemetry.broker_properties(self._telemetry_file(node)))
        if self.authorizer:
            extra.update({"authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                          "super.users": f"User:ANONYMOUS;User:{next(iter(SASL_USERS))}"})
        return server_properties(node, self._nodes, self._node_dir(node),
                                 certificates=self.certificates if self.tls else None, extra=extra)

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

    def _launch(self, node: Node, java: str, classpath: str, log4j: Path, record: bool) -> None:
        """Start one node in its own session (so it can be killed as a group) with output to server.log."""
        assert self._broker_cds is not None
        cds_flags, node.recording = self._broker_cds.flags(record=record)
        cmd = [
            java,
            f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
            *self.gc_flags, "-XX:CICompilerCount=2", *self.jit_flags, "-XX:+ExitOnOutOfMemoryError",
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
                    got = metadata_brokers(HOST, node.client_port, timeout=2.0)
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

    def _other_listeners_ready(self, node: Node) -> bool:
        """SASL ports accept TCP; TLS ports complete a handshake that verifies the broker's certificate."""
        if node.sasl_port is not None and not accepts(HOST, node.sasl_port):
            return False
        if self.certificates is None:
            return True
        return all(
            port is not None and handshakes(HOST, port, self.certificates.ca)
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

    def logs_tail(self) -> str:
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
