"""Client telemetry (KIP-714) on the local cluster: a broker plugin that records pushes, and subscriptions.

Why: Kafka brokers offer GetTelemetrySubscriptions (API key 71) and PushTelemetry (72) only when a
metrics reporter that takes clients' metrics is configured (Kafka 4.3.1 adds every reporter in
``metric.reporters`` that implements ``ClientTelemetryExporterProvider``, or the deprecated
``ClientTelemetry``, to its ``ClientTelemetryExporterPlugin``; with none, ApiVersions leaves both keys
out), and clients push only what a client-metrics subscription asks for. ``TelemetryRecorder.java``
is such a reporter: it appends one line per push to a file, so a test can see which client pushed,
as the broker authenticated it. It is compiled here with the JDK's ``javac`` against the fetched Kafka
jars, once per source and jars, into the harness cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import socket
import struct
import subprocess
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..kafka_jars import KAFKA_VERSION, ensure_kafka_jars, java_executable, java_tool, kafka_classpath
from ..maven import cache_root
from ..probes import recv_exact

_SOURCE = Path(__file__).resolve().parent / "TelemetryRecorder.java"
_JAR = "kthrottle-telemetry-recorder.jar"

REPORTER_CLASS = "io.kthrottle.harness.telemetry.TelemetryRecorder"
"""The ``metric.reporters`` entry."""
FILE_CONFIG = "kthrottle.telemetry.file"
"""The broker config naming the file the recorder appends to (``TelemetryRecorder.FILE_CONFIG``)."""
PUSH_INTERVAL_MS = 1000
"""The subscriptions' default ``interval.ms``: Kafka's default is 300000 (5 min), far too slow for a test;
Kafka accepts 100 to 3600000 (``ClientMetricsConfigs``)."""
ALL_METRICS = "*"
"""``metrics`` value asking for every metric (``ClientMetricsConfigs.ALL_SUBSCRIBED_METRICS``)."""

GET_TELEMETRY_SUBSCRIPTIONS = 71
PUSH_TELEMETRY = 72
_CONFIG_COMMAND = "kafka.admin.ConfigCommand"
_ZERO_UUID = bytes(16)


@dataclass(frozen=True)
class Push:
    """One PushTelemetry a broker received, as ``TelemetryRecorder`` wrote it."""

    node_id: int
    client_instance_id: str
    client_id: str
    principal: str
    listener: str
    client_address: str
    terminating: bool
    content_type: str
    payload_bytes: int
    push_interval_ms: int


@dataclass(frozen=True)
class Subscription:
    """What a broker answers a new client's GetTelemetrySubscriptions v0 with."""

    error_code: int
    throttle_time_ms: int
    client_instance_id: uuid.UUID
    subscription_id: int
    push_interval_ms: int
    requested_metrics: list[str]


# ------------------------------------------------------------------------------------------ the plugin


def build_plugin() -> Path:
    """The recorder's jar, for a broker's classpath; compiled the first time.

    A jar, not a directory of classes: the JVM refuses to record a class-data archive (the harness's
    ``ClassArchive``) whose classpath holds a non-empty directory. Keyed by the source and the jar set,
    so an edit or a new Kafka recompiles; a file lock keeps parallel test runs from compiling into one
    directory, and the rename makes a build whole or absent.
    """
    libs = ensure_kafka_jars()
    jars = sorted((p.name, p.stat().st_size) for p in libs.glob("*.jar"))
    key = hashlib.sha256(_SOURCE.read_bytes() + repr((str(libs.resolve()), jars)).encode()).hexdigest()[:16]
    base = cache_root() / f"kafka-{KAFKA_VERSION}" / "telemetry-plugin"
    built = base / key
    jar = built / _JAR
    if jar.is_file():
        return jar
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if jar.is_file():
            return jar
        partial = base / f"{key}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        classes = partial / "classes"
        cmd = [java_tool("javac"), "-nowarn", "--release", "17", "-d", str(classes),
               "-cp", kafka_classpath(), str(_SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the telemetry recorder failed ({' '.join(cmd)}):\n"
                               f"{(done.stdout + done.stderr).strip()[-4000:]}")
        with zipfile.ZipFile(partial / _JAR, "w") as archive:
            archive.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
            for path in sorted(classes.rglob("*.class")):
                archive.write(path, path.relative_to(classes).as_posix())
        shutil.rmtree(built, ignore_errors=True)
        partial.rename(built)
    return jar


def broker_properties(record_file: Path) -> dict[str, str | int]:
    """The settings that load the recorder into a broker and name its file."""
    return {"metric.reporters": REPORTER_CLASS, FILE_CONFIG: str(record_file)}


def read_pushes(record_file: Path, node_id: int) -> list[Push]:
    """Every push one broker recorded so far (none when the file does not exist yet)."""
    try:
        text = record_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    pushes = []
    for line in text.split("\n")[:-1]:  # the last piece is empty, or a line still being written
        instance, client_id, principal, listener, address, terminating, content, size, interval = (
            line.split("\t"))
        pushes.append(Push(node_id, instance, client_id, principal, listener, address, terminating == "true",
                           content, int(size), int(interval)))
    return pushes


# ------------------------------------------------------------------------------------- subscriptions


def subscribe(bootstrap: str, name: str, metrics: str = ALL_METRICS, interval_ms: int = PUSH_INTERVAL_MS,
              log4j2: Path | None = None, timeout: float = 120.0) -> None:
    """Create or change the client-metrics subscription ``name`` (``kafka-configs --entity-type
    client-metrics``), for every client: ``metrics`` is a metric-name prefix or ``*``."""
    if "," in metrics:
        metrics = f"[{metrics}]"  # ConfigCommand's syntax for a list value
    cmd = [java_executable(), "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
           *([f"-Dlog4j2.configurationFile={log4j2}", "-Dkthrottle.log.level=warn"] if log4j2 else []),
           "-cp", kafka_classpath(), _CONFIG_COMMAND, "--bootstrap-server", bootstrap, "--alter",
           "--entity-type", "client-metrics", "--entity-name", name,
           "--add-config", f"metrics={metrics},interval.ms={interval_ms}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kafka-configs could not create the client-metrics subscription {name!r}:\n"
                           f"{(done.stdout + done.stderr).strip()[-4000:]}")


def wait_subscribed(host: str, port: int, interval_ms: int, timeout: float = 60.0) -> Subscription:
    """Poll one broker until a new client would be given a subscription pushing every ``interval_ms``.

    Why: a subscription reaches each broker through the metadata log, a moment after kafka-configs
    returns; a client that asks before then is told Kafka's default 5-minute interval and keeps it.
    """
    deadline = time.monotonic() + timeout
    seen: Subscription | None = None
    while True:
        try:
            seen = get_subscription(host, port)
        except OSError:
            seen = None
        if seen is not None and seen.push_interval_ms == interval_ms and seen.requested_metrics:
            return seen
        if time.monotonic() > deadline:
            raise RuntimeError(f"broker {host}:{port} did not apply the client-metrics subscription "
                               f"within {timeout}s (last answer: {seen})")
        time.sleep(0.2)


def get_subscription(host: str, port: int, client_id: str = "kthrottle-harness",
                     client_instance_id: bytes = _ZERO_UUID, timeout: float = 10.0) -> Subscription:
    """Send one GetTelemetrySubscriptions v0 on a new connection and decode the answer."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(get_subscriptions_request(1, client_id, client_instance_id))
        (size,) = struct.unpack(">i", recv_exact(sock, 4))
        return decode_subscription(recv_exact(sock, size))


def get_subscriptions_request(correlation_id: int, client_id: str,
                              client_instance_id: bytes = _ZERO_UUID) -> bytes:
    """A whole GetTelemetrySubscriptions v0 frame (flexible: request header v2, KIP-482).

    The zero client instance id asks the broker to assign one (GetTelemetrySubscriptionsRequest.json).
    """
    cid = client_id.encode()
    body = (struct.pack(">hhih", GET_TELEMETRY_SUBSCRIPTIONS, 0, correlation_id, len(cid)) + cid + b"\x00"
            + client_instance_id + b"\x00")
    return struct.pack(">i", len(body)) + body


def decode_subscription(frame: bytes) -> Subscription:
    """A GetTelemetrySubscriptions v0 response frame (after its size), header v1 included.

    Fields in GetTelemetrySubscriptionsResponse.json order: ThrottleTimeMs, ErrorCode, ClientInstanceId,
    SubscriptionId, AcceptedCompressionTypes, PushIntervalMs, TelemetryMaxBytes, DeltaTemporality,
    RequestedMetrics.
    """
    pos = 4  # correlation id
    pos = _skip_tags(frame, pos)
    throttle, error = struct.unpack_from(">ih", frame, pos)
    pos += 6
    instance = uuid.UUID(bytes=frame[pos : pos + 16])
    pos += 16
    (subscription_id,) = struct.unpack_from(">i", frame, pos)
    pos += 4
    count, pos = _uvarint(frame, pos)
    pos += max(count - 1, 0)  # int8 compression types
    (interval,) = struct.unpack_from(">i", frame, pos)
    pos += 4 + 4 + 1  # TelemetryMaxBytes, DeltaTemporality
    count, pos = _uvarint(frame, pos)
    metrics = []
    for _ in range(max(count - 1, 0)):
        length, pos = _uvarint(frame, pos)
        metrics.append(frame[pos : pos + length - 1].decode())
        pos += length - 1
    return Subscription(error, throttle, instance, subscription_id, interval, metrics)


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip_tags(data: bytes, pos: int) -> int:
    count, pos = _uvarint(data, pos)
    for _ in range(count):
        _tag, pos = _uvarint(data, pos)
        size, pos = _uvarint(data, pos)
        pos += size
    return pos


__all__ = [
    "ALL_METRICS", "FILE_CONFIG", "PUSH_INTERVAL_MS", "REPORTER_CLASS", "Push", "Subscription",
    "broker_properties", "build_plugin", "decode_subscription", "get_subscription",
    "get_subscriptions_request", "read_pushes", "subscribe", "wait_subscribed",
]
