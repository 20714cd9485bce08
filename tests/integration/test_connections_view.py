"""Who is connected: `/connections` and `kthrottle top`'s connections view, with real clients.

Two `kthrottle run` proxies in front of the real cluster. Through proxy A: librdkafka
(confluent-kafka) producing about 400 KB/s as `rdkafka-conn`, and the Java producer
(ProducerPerformance from the cluster's own jars) offering 100 KB/s as `java-conn` against a
50 KB/s quota, so it is throttled. Through proxy B: a second librdkafka producer, `rdkafka-b`,
at about 100 KB/s. The topic has one partition, so each producer has one busy connection, to
its leader's listener.

The software names and versions asserted are what the clients send in ApiVersions v3+ (KIP-511):
librdkafka's Python binding names itself "confluent-kafka-python", its version
"<binding>-rdkafka-<librdkafka>"; the Java client "apache-kafka-java" with the jars' version.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from kafka.protocol.metadata import ApiVersionsRequest

from harness.kafka_jars import KAFKA_VERSION
from harness.local_kafka import LocalKafka
from protocol.apis import ApiKey
from protocol.headers import encode_request_header
from quotas.recent_traffic import RECENT_SECONDS

from .clients import recv_exact, topic_name, wait_until
from .conftest import JAVA_PRODUCER_PERF, QUOTA_SETTINGS, KafkaJava
from .proxies import REPO, QuotaProxy, RunningProxy, free_port_block

RDKAFKA, JAVA, RDKAFKA_B = "rdkafka-conn", "java-conn", "rdkafka-b"
RDKAFKA_RATE = 400_000  # bytes per second offered
JAVA_RECORDS_PER_S, RECORD = 100, 1000  # 100 KB/s offered
JAVA_QUOTA = 50_000
RDKAFKA_B_RATE = 100_000
QUOTAS = f"""
[[quota]]
client_id = "{JAVA}"
producer_byte_rate = {JAVA_QUOTA}
"""
RDKAFKA_NAME = "confluent-kafka-python"
RDKAFKA_VERSION = f"{confluent_kafka.__version__}-rdkafka-{confluent_kafka.libversion()[0]}"
JAVA_NAME, JAVA_VERSION = "apache-kafka-java", KAFKA_VERSION
COLUMNS, LINES = 160, 30


def _produce_until(stop: threading.Event, bootstrap: str, topic: str, client_id: str, rate: float,
                   errors: list[str]) -> None:
    """librdkafka at `rate` bytes/s until `stop` is set."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "linger.ms": 5, "acks": 1})

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    value = b"r" * RECORD
    started, sent = time.monotonic(), 0
    while not stop.is_set():
        if started + sent * RECORD / rate > time.monotonic():
            producer.poll(0.01)
            continue
        try:
            producer.produce(topic, value, on_delivery=delivered)
            sent += 1
        except BufferError:
            producer.poll(0.05)
        producer.poll(0)
    producer.flush(60)


def connections(proxy: QuotaProxy, query: str = "") -> dict[str, Any]:
    url = f"http://127.0.0.1:{proxy.metrics_port}/connections{'?' + query if query else ''}"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def busiest_row(answer: dict[str, Any], client_id: str) -> dict[str, Any] | None:
    rows = [row for row in answer["connections"] if row["client_id"] == client_id]
    return rows[0] if rows else None  # the list is busiest first


@dataclass
class Bed:
    a: QuotaProxy
    b: QuotaProxy


@pytest.fixture(scope="module")
def bed(kafka_cluster: LocalKafka, kafka_java: KafkaJava, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Bed]:
    """The proxies and the three producers, running for the whole module."""
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("conn-a"), QUOTA_SETTINGS) as a, \
            QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("conn-b"), QUOTA_SETTINGS) as b:
        a.set_quotas(QUOTAS)
        name = topic_name("connections")
        admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
        admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)
        wait_until(lambda: name in admin.list_topics(name, timeout=10).topics, 30, f"{name} in metadata")
        stop, errors = threading.Event(), list[str]()
        threads = [threading.Thread(target=_produce_until, args=args, daemon=True) for args in (
            (stop, a.bootstrap, name, RDKAFKA, RDKAFKA_RATE, errors),
            (stop, b.bootstrap, name, RDKAFKA_B, RDKAFKA_B_RATE, errors))]
        for thread in threads:
            thread.start()
        java = subprocess.Popen(kafka_java.command(
            JAVA_PRODUCER_PERF, "--bootstrap-server", a.bootstrap, "--topic", name,
            "--num-records", "100000000", "--record-size", str(RECORD),
            "--throughput", str(JAVA_RECORDS_PER_S),
            "--command-property", f"client.id={JAVA}", "acks=1",
        ), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        try:
            # until every producer's busy connection shows its software and the Java one was throttled
            def ready() -> bool:
                answer_a, answer_b = connections(a), connections(b)
                rows = [busiest_row(answer_a, RDKAFKA), busiest_row(answer_a, JAVA),
                        busiest_row(answer_b, RDKAFKA_B)]
                return all(row is not None and row["client_software_name"] and row["bytes_in_per_second"] > 0
                           for row in rows) and rows[1] is not None and rows[1]["last_throttle_ms"] > 0

            wait_until(ready, 90, "the three producers' connections, the Java one throttled")
            # The rates are averages over the last RECENT_SECONDS: the rows' rate bands below hold
            # only once a whole window has seen steady traffic, which no condition can show sooner
            # (a rate that is already in band may still contain the start-up burst).
            time.sleep(RECENT_SECONDS + 1)
            if java.poll() is not None:
                assert java.stderr is not None
                raise AssertionError(java.stderr.read().decode(errors="replace")[-3000:])
            yield Bed(a, b)
        finally:
            stop.set()
            java.terminate()
            try:
                java.wait(30)
            except subprocess.TimeoutExpired:
                java.kill()
                java.wait()
            for thread in threads:
                thread.join(90)
    assert not errors, errors[:3]


def test_connections_name_each_client_its_software_and_rates_busiest_first(bed: Bed) -> None:
    answer = connections(bed.a)
    print(json.dumps(answer, indent=1))
    rows = answer["connections"]
    assert answer["left_off"] == 0 and answer["shown"] == answer["open"] == len(rows) >= 2
    assert answer["limit"] == 1000 and answer["rate_seconds"] == 5 and answer["worker"] is None
    throughput = [row["bytes_in_per_second"] + row["bytes_out_per_second"] for row in rows]
    assert throughput == sorted(throughput, reverse=True), "busiest first"

    rdkafka, java = busiest_row(answer, RDKAFKA), busiest_row(answer, JAVA)
    assert rdkafka is not None and java is not None
    assert rows.index(rdkafka) < rows.index(java), "the 400 KB/s producer above the throttled 50 KB/s one"
    assert (rdkafka["client_software_name"], rdkafka["client_software_version"]) == (RDKAFKA_NAME,
                                                                                      RDKAFKA_VERSION)
    assert (java["client_software_name"], java["client_software_version"]) == (JAVA_NAME, JAVA_VERSION)
    for row in (rdkafka, java):
        assert row["principal"] == "ANONYMOUS" and row["address"] == "127.0.0.1", row
        # the producing connection goes to the partition leader's own listener
        assert row["listener"].startswith("broker-"), row
        assert row["age_seconds"] > 5, row
        assert 0 < row["bytes_out_per_second"] < row["bytes_in_per_second"], "produce: in >> out"
    # what each offers, with room for a busy machine; the Java producer is held near its quota
    assert 0.4 * RDKAFKA_RATE < rdkafka["bytes_in_per_second"] < 2.0 * RDKAFKA_RATE, rdkafka
    assert 0.3 * JAVA_QUOTA < java["bytes_in_per_second"] < 1.6 * JAVA_RECORDS_PER_S * RECORD, java
    assert java["last_throttle_ms"] > 0 and rdkafka["last_throttle_ms"] == 0
    assert rdkafka["throttle_ms"] == 0
    # every connection of each client (bootstrap, metadata, producing) names the same software
    for row in rows:
        if row["client_id"] == RDKAFKA and row["client_software_name"] is not None:
            assert row["client_software_name"] == RDKAFKA_NAME, row
        if row["client_id"] == JAVA and row["client_software_name"] is not None:
            assert row["client_software_name"] == JAVA_NAME, row


def test_the_limit_bounds_the_answer_and_counts_the_rest(bed: Bed) -> None:
    whole = connections(bed.a)
    one = connections(bed.a, "limit=1")
    assert one["shown"] == 1 and len(one["connections"]) == 1
    assert one["left_off"] == one["open"] - 1 >= 1
    assert one["connections"][0]["client_id"] == RDKAFKA, one  # the busiest
    none = connections(bed.a, "limit=0")
    assert none["connections"] == [] and none["left_off"] == none["open"] >= len(whole["connections"]) - 2
    with pytest.raises(urllib.error.HTTPError) as refused:
        connections(bed.a, "limit=lots")
    assert refused.value.code == 400 and b"'lots'" in refused.value.read()


# -- kthrottle top's connections view --------------------------------------------------------------


def _top(bed: Bed, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cli", "top", "--metrics", f"127.0.0.1:{bed.a.metrics_port}",
            "--metrics", f"127.0.0.1:{bed.b.metrics_port}", *extra]


def _client_ids(lines: list[str]) -> list[str]:
    """The client ids of the producing rows, top to bottom (a row names its client id as a cell)."""
    return [cid for line in lines for cid in (RDKAFKA, JAVA, RDKAFKA_B)
            if f" {cid} " in line and "broker-" in line]


def test_top_once_prints_the_fleets_connections(bed: Bed) -> None:
    done = subprocess.run(_top(bed, "--connections", "--once", "--width", "220"), cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "connections  2 proxies" in lines[0], lines[0]
    producing = _client_ids(lines)
    assert producing.index(RDKAFKA) < producing.index(JAVA), "busiest first"
    assert RDKAFKA_B in producing, "proxy B's client too"
    assert any(f"{RDKAFKA_NAME}/{RDKAFKA_VERSION}" in line and f" {RDKAFKA} " in line for line in lines)
    assert any(f"{JAVA_NAME}/{JAVA_VERSION}" in line and f" {JAVA} " in line for line in lines)
    assert any(f"127.0.0.1:{bed.b.metrics_port}" in line and f" {RDKAFKA_B} " in line for line in lines), \
        "each row names its proxy"


class Tmux:
    """A process in its own tmux server (a socket in `workdir`), its screen read with capture-pane.

    tmux is a real terminal emulator with a real pty, as an operator's terminal is; harness/
    install_tools.sh (`make tools`) installs it with the other Debian packages the tests run.
    """

    def __init__(self, workdir: Path, command: list[str], width: int, height: int) -> None:
        tmux = shutil.which("tmux")
        assert tmux is not None, "tmux is missing: `make tools` installs it (harness/install_tools.sh)"
        self.tmux = [tmux, "-S", str(workdir / "tmux.sock"), "-f", "/dev/null"]
        # LINES and COLUMNS would override the pane's size for curses (pytest-xdist's workers set them)
        env = {key: value for key, value in os.environ.items() if key not in ("LINES", "COLUMNS", "TMUX")}
        # the shell keeps the pane after the command ends, to read its exit status
        shell = " ".join(shlex.quote(part) for part in command) + "; echo EXIT=$?; sleep 600"
        subprocess.run([*self.tmux, "new-session", "-d", "-x", str(width), "-y", str(height), "-c", str(REPO),
                        shell], env=env, check=True, timeout=30)

    def lines(self) -> list[str]:
        done = subprocess.run([*self.tmux, "capture-pane", "-p"], capture_output=True, text=True,
                              timeout=10, check=True)
        return done.stdout.splitlines()

    def keys(self, keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-l", keys], check=True, timeout=10)

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float, what: str) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines()
            if predicate(lines):
                return lines
            time.sleep(0.2)
        raise AssertionError(f"the screen did not show {what} within {timeout}s:\n" + "\n".join(self.lines()))

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, timeout=10, check=False)


def test_top_connections_view_under_tmux(bed: Bed, tmp_path: Path) -> None:
    top = Tmux(tmp_path, _top(bed), 200, 30)
    try:
        top.wait_for(lambda ls: bool(ls) and ls[0].startswith("kthrottle top  2 proxies"), 30,
                     "the tenants view")
        top.keys("c")

        def shows_connections(lines: list[str]) -> bool:
            producing = _client_ids(lines)
            return ("connections  2 proxies" in lines[0] and {RDKAFKA, JAVA, RDKAFKA_B} <= set(producing)
                    and producing.index(RDKAFKA) < producing.index(JAVA))

        lines = top.wait_for(shows_connections, 30, "the three producers' connections, busiest first")
        print("\n".join(lines))
        header = next(line for line in lines if "CLIENT-ID" in line)
        assert header.split() == ["CLIENT", "LISTENER", "PRINCIPAL", "CLIENT-ID", "SOFTWARE", "AGE", "IN/s",
                                  "OUT/s", "THROTTLE", "LAST-THR", "PROXY"], header
        rdkafka = next(line for line in lines if f" {RDKAFKA} " in line and "broker-" in line)
        java = next(line for line in lines if f" {JAVA} " in line and "broker-" in line)
        assert f"{RDKAFKA_NAME}/{RDKAFKA_VERSION}" in rdkafka and "ANONYMOUS" in rdkafka, rdkafka
        assert f"{JAVA_NAME}/{JAVA_VERSION}" in java, java
        assert "KiB" in rdkafka.split(RDKAFKA_VERSION)[1], "its rate in KiB/s"
        assert lines[-1].startswith("q quit"), "the help line at the bottom"
        top.keys("/java")
        top.wait_for(lambda ls: "filter: java_" in ls[-1], 10, "the filter being typed")
        top.keys("\r")
        top.wait_for(lambda ls: _client_ids(ls) == [JAVA], 10, "only the Java client's producing row")
        top.keys("c")  # back to the tenants
        top.wait_for(lambda ls: ls[0].startswith("kthrottle top  2 proxies") and "sort: bytes" in ls[0], 15,
                     "the tenants view again")
        top.keys("q")
        top.wait_for(lambda ls: "EXIT=0" in ls, 15, "top quitting on q with status 0")
    finally:
        top.close()


# -- run --workers N: each worker answers for its own connections ----------------------------------


def _api_versions_v3(sock: socket.socket, client_id: str) -> None:
    """ApiVersions v3 naming the software "kthrottle-test" 1.0 (KIP-511), and its answer read."""
    request = ApiVersionsRequest(client_software_name="kthrottle-test", client_software_version="1.0")
    frame = encode_request_header(ApiKey.API_VERSIONS, 3, 1, client_id) + bytes(request.encode(version=3))
    sock.sendall(struct.pack(">i", len(frame)) + frame)
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    recv_exact(sock, size)


def test_each_worker_lists_its_own_connections(kafka_cluster: LocalKafka) -> None:
    """With --workers 2 the kernel spreads connections over the workers; worker i's /connections on
    metrics_port + i lists its own, so the two lists are disjoint and together hold every one."""
    metrics_port = free_port_block(2)
    with RunningProxy(kafka_cluster.bootstrap, extra_args=["--workers", "2", "--metrics-port",
                                                           str(metrics_port)]) as proxy:
        deadline = time.monotonic() + 30
        while proxy.log().count("bootstrap.servers=") < 2:
            assert time.monotonic() < deadline, f"not every worker started:\n{proxy.log()[-3000:]}"
            time.sleep(0.1)
        # a client id no terminal should see raw, and a plain one per connection
        ids = [f"worker-test-{i}" for i in range(7)] + ["evil\x1b[2J\x07"]
        socks = [socket.create_connection(("127.0.0.1", proxy.port), timeout=10) for _ in ids]
        try:
            for sock, client_id in zip(socks, ids, strict=True):
                _api_versions_v3(sock, client_id)
            seen: dict[str, int] = {}
            for worker in (0, 1):
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + worker}/connections",
                                            timeout=10) as response:
                    raw = response.read()
                assert b"\x1b" not in raw and b"\x07" not in raw, "control characters escaped"
                answer = json.loads(raw)
                assert answer["worker"] == worker
                for row in answer["connections"]:
                    assert row["client_id"] not in seen, f"{row['client_id']!r} on both workers"
                    seen[row["client_id"]] = worker
                    assert (row["client_software_name"], row["client_software_version"]) == ("kthrottle-test",
                                                                                             "1.0")
            print({client_id: worker for client_id, worker in seen.items()})
            assert sorted(seen) == sorted(ids)
        finally:
            for sock in socks:
                sock.close()
