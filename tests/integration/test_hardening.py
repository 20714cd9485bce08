"""What a misbehaving or unlucky client can make the proxy hold, against the real cluster.

Each test runs the real `kthrottle run` with small limits, so a limit is reached in seconds:
connection limits, the setup and idle timeouts, the request memory budget, non-reading clients,
scrapes during a storm of client ids, an unreachable upstream, and repeated log lines.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import ApiVersionsRequest, MetadataRequest

from harness.local_kafka import LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import PARTITIONS, read_all, topic_name, wait_until
from .proxies import QuotaProxy, RunningProxy, free_port_block
from .quota_runs import report

LIMITS = """\
max_connections = 40
max_connections_per_ip = 30
connection_setup_timeout_ms = 2000
connections_max_idle_ms = 4000
"""


@pytest.fixture(scope="module")
def limited_proxy(kafka_cluster: LocalKafka,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("limits"), LIMITS) as running:
        yield running


# -- raw wire helpers ----------------------------------------------------------------------------

def connect(port: int, source: str = "127.0.0.1", timeout: float = 15) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return bytes(data)

    return exactly(struct.unpack(">i", exactly(4))[0])


def api_versions(sock: socket.socket, correlation_id: int = 1, client_id: str = "raw") -> None:
    """One ApiVersions v3 exchange; raises if the proxy closed the connection."""
    body = ApiVersionsRequest[3](client_software_name="raw", client_software_version="1").encode()
    sock.sendall(frame(encode_request_header(18, 3, correlation_id, client_id) + bytes(body)))
    answer = read_frame(sock)
    assert struct.unpack(">i", answer[:4])[0] == correlation_id


def metadata_request(correlation_id: int, client_id: str) -> bytes:
    body = MetadataRequest[1](topics=[]).encode()
    return frame(encode_request_header(3, 1, correlation_id, client_id) + bytes(body))


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the proxy closes `sock` within `timeout` (reading and dropping anything it sends)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sock.recv(65536) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


# -- connection limits and timeouts -----------------------------------------------------------------

def test_a_silent_connection_is_closed_after_the_setup_timeout(limited_proxy: QuotaProxy) -> None:
    with connect(limited_proxy.port) as silent, connect(limited_proxy.port) as half:
        half.sendall(struct.pack(">i", 100) + b"\x00\x12")  # half a request, then nothing
        started = time.monotonic()
        assert closed_by_peer(silent, timeout=15), "a silent connection stayed open"
        assert closed_by_peer(half, timeout=15), "a connection with half a request stayed open"
        assert time.monotonic() - started >= 1.5  # not before the timeout (2 s)
    limited_proxy.wait_for_log(
        "did not send a complete request within 2000 ms of connecting (connection_setup_timeout_ms)")


def test_an_idle_connection_is_closed_and_a_busy_one_is_not(limited_proxy: QuotaProxy) -> None:
    with (connect(limited_proxy.port) as idle, connect(limited_proxy.port) as busy,
          connect(limited_proxy.port) as stalled):
        api_versions(idle)
        api_versions(busy)
        api_versions(stalled)
        stalled.sendall(struct.pack(">i", 1000) + b"\x00\x12\x00")  # then stops mid-request
        started = time.monotonic()
        correlation_id = 1
        # the busy connection asks something every second, for longer than the idle limit (4 s)
        while time.monotonic() - started < 6.5:
            correlation_id += 1
            api_versions(busy, correlation_id)
            time.sleep(1.0)
        assert closed_by_peer(idle, timeout=5), "an idle connection outlived connections_max_idle_ms"
        assert closed_by_peer(stalled, timeout=5), "a connection stalled mid-request stayed open"
        api_versions(busy, correlation_id + 1)  # still open
    log = limited_proxy.wait_for_log("(connections_max_idle_ms = 4000)")
    assert re.search(r"closed: idle for [45] s \(connections_max_idle_ms = 4000\)", log)


def test_connection_limits_refuse_politely_and_free_up(limited_proxy: QuotaProxy) -> None:
    opened: list[socket.socket] = []
    try:
        for n in range(30):
            sock = connect(limited_proxy.port)
            opened.append(sock)
            api_versions(sock, n)
        # the 31st from 127.0.0.1 is over max_connections_per_ip (30)
        with connect(limited_proxy.port) as over_ip:
            assert closed_by_peer(over_ip, timeout=5)
        # another address still gets in, up to max_connections (40) in all
        for n in range(10):
            sock = connect(limited_proxy.port, source="127.0.0.2")
            opened.append(sock)
            api_versions(sock, n)
        with connect(limited_proxy.port, source="127.0.0.3") as over_total:
            assert closed_by_peer(over_total, timeout=5)
        # the metrics port answers while every client slot is taken
        metrics = limited_proxy.metrics()
        refused = {dict(labels).get("reason"): value for (name, labels), value in metrics.items()
                   if name == "kthrottle_connections_refused_total"}
        assert refused.get("max_connections_per_ip", 0) >= 1 and refused.get("max_connections", 0) >= 1
        assert metrics[("kthrottle_connections", ())] == 40
        # closing some makes room again
        for sock in opened[:5]:
            sock.close()
        del opened[:5]
        wait_until(lambda: limited_proxy.metric("kthrottle_connections") == 35, 10,
                   "closed connections counted")
        with connect(limited_proxy.port, source="127.0.0.3") as again:
            api_versions(again, 99)
    finally:
        for sock in opened:
            sock.close()
    log = limited_proxy.log()
    assert "refused a connection from 127.0.0.1:" in log and "max_connections_per_ip = 30 reached" in log
    assert "max_connections = 40 reached" in log


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.quiet  # CPU seconds of a proxy holding silent connections
def test_running_out_of_descriptors_refuses_clients_and_keeps_metrics(kafka_cluster: LocalKafka) -> None:
    """With 256 descriptors the default max_connections is (256 - 64) / 2 = 96: the rest are refused,
    /metrics still answers, and nothing spins while the silent connections sit there."""
    metrics_port = free_port_block(1)
    with RunningProxy(kafka_cluster.bootstrap, nofile=256,
                      extra_args=["--metrics-port", str(metrics_port)]) as running:
        opened: list[socket.socket] = []
        try:
            for _ in range(150):
                opened.append(connect(running.port))
            wait_until(lambda: "kthrottle_connections 96.0" in http_get(metrics_port, "/metrics")[1], 15,
                       "96 connections admitted")
            time.sleep(0.5)
            refused = 0
            for sock in opened:
                sock.setblocking(False)
                try:
                    refused += sock.recv(1) == b""
                except BlockingIOError:
                    pass  # open: admitted
                except ConnectionResetError:
                    refused += 1
            assert refused == 150 - 96
            status, text = http_get(metrics_port, "/metrics")
            assert status == 200
            assert 'kthrottle_connections_refused_total{reason="max_connections"} 54.0' in text
            before = cpu_seconds(running.process.pid)
            time.sleep(2)
            used = cpu_seconds(running.process.pid) - before
            report(f"proxy holding 96 silent connections (54 refused): {used:.2f} s of CPU in 2 s")
            assert used < 0.5, f"the proxy used {used:.2f} s of CPU in 2 s with nothing to do"
        finally:
            for sock in opened:
                sock.close()
        assert "max_connections = 96 reached" in running.log()


# -- health ---------------------------------------------------------------------------------------

def test_health_endpoints_with_a_reachable_upstream(limited_proxy: QuotaProxy) -> None:
    assert http_get(limited_proxy.metrics_port, "/healthz") == (200, "ok\n")
    status, text = http_get(limited_proxy.metrics_port, "/ready")
    assert status == 200 and "answers ApiVersions" in text
    assert limited_proxy.metric("kthrottle_upstream_up") == 1


@pytest.mark.parametrize("upstream", ["127.0.0.1:1", "no-such-broker.invalid:9092"])
def test_an_unusable_upstream_is_reported_once_and_not_ready(upstream: str) -> None:
    metrics_port = free_port_block(1)
    with RunningProxy(upstream, extra_args=["--metrics-port", str(metrics_port)]) as running:
        for n in range(20):  # clients keep coming: no line per client
            with connect(running.port) as sock:
                sock.sendall(frame(encode_request_header(18, 3, n, "c") + b"\x00\x00\x00"))
                assert closed_by_peer(sock, timeout=15)
        status, text = http_get(metrics_port, "/ready")
        assert status == 503 and upstream.rsplit(":", 1)[0] in text
        assert http_get(metrics_port, "/healthz")[0] == 200
        metrics = http_get(metrics_port, "/metrics")[1]
        assert re.search(r"^kthrottle_upstream_up 0\.0$", metrics, re.M)
        log = running.log()
    assert log.count("upstream unreachable") == 1, log
    assert "cannot reach" not in log  # per-client failures are not logged while the upstream is known down
    host = re.escape(upstream.rsplit(":", 1)[0])
    assert re.search(r"ERROR kthrottle.upstream: upstream unreachable.*" + host, log)


# -- memory ---------------------------------------------------------------------------------------

MEMORY = """\
max_request_bytes = 4194304
queued_max_request_bytes = 8388608
connection_setup_timeout_ms = 60000
"""


def test_requests_past_queued_max_request_bytes_wait_for_room(kafka_cluster: LocalKafka,
                                                              tmp_path: Path) -> None:
    """Three 4 MiB requests against an 8 MiB budget: two are read, the third waits, nothing is lost."""
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path, MEMORY) as running:
        size = 4 * 1024 * 1024 - 64
        header = encode_request_header(18, 3, 7, "big")  # ApiVersions with a body padded to 4 MiB
        socks = [connect(running.port) for _ in range(3)]
        try:
            for sock in socks:  # each sends its size prefix, header and 1 MiB of the body
                sock.sendall(struct.pack(">i", size) + header + b"\x00" * (1024 * 1024))
            wait_until(lambda: running.metric("kthrottle_memory_waiting_connections") == 1, 15,
                       "the third large request waiting for memory")
            assert running.metric("kthrottle_queued_request_bytes") <= 8 * 1024 * 1024 + 2 * 1024 * 1024
            socks[0].sendall(b"\x00" * (size - len(header) - 1024 * 1024))  # the first completes
            wait_until(lambda: running.metric("kthrottle_memory_waiting_connections") == 0, 15,
                       "the waiting connection resumed")
        finally:
            for sock in socks:
                sock.close()
        wait_until(lambda: running.metric("kthrottle_queued_request_bytes") == 0, 15, "memory given back")


def test_clients_that_never_read_hold_bounded_memory(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """A hundred consumers that ask for 8 MB and read nothing cost the proxy a bounded amount each,
    and a consumer beside them still reads everything."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = topic_name("nonreading")
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": kafka_cluster.bootstrap, "linger.ms": 20})
    count = 2400  # 24 MB, about 8 MB a partition
    for n in range(count):
        producer.produce(topic, key=str(n).encode(), value=f"{n:09d}".encode() + b"v" * 9_991)
        producer.poll(0)
    assert producer.flush(30) == 0
    leader = admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    R = FetchRequest[12]
    fetch_body = bytes(R(replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=8_000_000, isolation_level=0,
                         session_id=0, session_epoch=-1, rack_id="", forgotten_topics_data=[],
                         topics=[R.FetchTopic(topic=topic, partitions=[R.FetchTopic.FetchPartition(
                             partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
                             log_start_offset=-1, partition_max_bytes=8_000_000)])]).encode())
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path, "") as running:
        before = rss_bytes(running.process.pid)
        stuck = []
        try:
            for n in range(100):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", running.node_port(leader)))
                sock.sendall(frame(encode_request_header(1, 12, n, "nonreading") + fetch_body))
                stuck.append(sock)
            time.sleep(3)  # the broker answers all of them, as far as the proxy lets it
            grown = rss_bytes(running.process.pid) - before
            # A legitimate consumer beside them still reads every record.
            consumed = read_all({"bootstrap.servers": running.bootstrap}, topic, count)
            assert sum(len(values) for values in consumed.values()) == count
            assert sorted(v[:9] for values in consumed.values() for v in values) == [
                f"{n:09d}" for n in range(count)]
        finally:
            for sock in stuck:
                sock.close()
    print(f"non-reading clients: proxy RSS grew {grown / 1e6:.1f} MB for 100 clients asking 8 MB each")
    assert grown < 100 * 1024 * 1024, f"RSS grew {grown / 1e6:.0f} MB for 100 non-reading clients"


# -- metrics and logs under a storm ------------------------------------------------------------------

STORM = 'quota_window_num = 3\n\n[[quota]]\nclient_id = "<default>"\nrequest_percentage = 1000.0\n'


def test_stopping_while_a_scrape_is_half_sent_logs_no_traceback(kafka_cluster: LocalKafka,
                                                                tmp_path: Path) -> None:
    """A proxy stopped while a metrics client has sent half a request: the handler is cancelled, and
    Python 3.11's asyncio streams would log that as an error with a traceback (h35 saw two)."""
    running = QuotaProxy(kafka_cluster.bootstrap, tmp_path, STORM)
    try:
        with socket.create_connection(("127.0.0.1", running.metrics_port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # no blank line: the request never ends
            time.sleep(0.5)
            running.stop()
    finally:
        running.stop()
    log = running.log()
    assert running.process.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_scrapes_never_fail_during_a_storm_of_client_ids(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path, STORM) as running:
        stop = threading.Event()
        sent = [0]

        def storm(worker: int) -> None:
            with connect(running.port) as sock:
                n = 0
                while not stop.is_set() and n < 40_000:
                    batch = b"".join(metadata_request(n + i, f"storm-{worker}-{n + i}") for i in range(50))
                    sock.sendall(batch)
                    for _ in range(50):
                        read_frame(sock)
                    n += 50
                    sent[0] += 50

        workers = [threading.Thread(target=storm, args=(w,), daemon=True) for w in range(3)]
        for worker in workers:
            worker.start()
        failures: list[str] = []
        buckets: list[float] = []
        deadline = time.monotonic() + 15
        scrapes = 0
        while time.monotonic() < deadline:
            status, text = http_get(running.metrics_port, "/metrics")
            scrapes += 1
            if status != 200:
                failures.append(f"{status}: {text[:200]}")
                continue
            found = re.search(r'^kthrottle_quota_buckets\{quota="request_percentage"\} (\S+)$', text, re.M)
            assert found, text[-2000:]
            buckets.append(float(found.group(1)))
        stop.set()
        for worker in workers:
            worker.join(30)
    print(f"storm: {sent[0]} client ids, {scrapes} scrapes, buckets seen up to {max(buckets):.0f}")
    assert not failures, failures[:3]
    assert scrapes >= 10 and max(buckets) > 1000  # the storm really made buckets while scrapes ran
    assert "Traceback" not in running.log()


def test_repeated_log_lines_are_summarised(limited_proxy: QuotaProxy) -> None:
    before = limited_proxy.log().count("closed: client sent bad data: request size -5")
    for _ in range(60):
        with connect(limited_proxy.port) as sock:
            sock.sendall(struct.pack(">i", -5))
            assert closed_by_peer(sock, timeout=10)
    log = limited_proxy.wait_for_log("more line(s) like this", timeout=25)
    shown = log.count("closed: client sent bad data: request size -5") - before
    # five a 10 s interval; the 60 connections take well under 10 s, so they span two at most
    assert shown <= 10, f"{shown} near-identical lines logged for 60 bad connections"
    assert re.search(r"(\d+) more line\(s\) like this in the last \d+ s, not shown: conn-\d+ from "
                     r"127\.0\.0\.1:\d+ closed: client sent bad data: request size -5", log)
