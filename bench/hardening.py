"""`python -m bench.hardening`: what misbehaving clients cost a real proxy process, beside the budgets.

1. Proxy RSS while 1,000 clients each ask for a large fetch and never read it, beside the budget
   (the RSS before + 1,000 x what one connection may buffer: `connection_buffer_bytes` queued for
   the client plus one read from the broker).
2. Proxy RSS while eight clients each send a 100 MB request at once, and a few seconds after, beside
   the budget `queued_max_request_bytes` sets (before it, RSS went from 38 to 791 MB and stayed).
3. Proxy RSS after 200,000 distinct client ids under a `<default>` client-id quota, beside the
   budget that `max_quota_buckets` sets, and the time one /metrics scrape takes then.

Figures are printed, never asserted: the budgets are what the limits promise, to compare by eye.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import struct
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import MetadataRequest

from config.settings import ProxySettings
from harness.local_kafka import LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header
from tests.integration.proxies import RunningProxy, free_port_block

#: One read from a socket by uvloop (its read buffer), which the proxy may hold beside its queue.
UVLOOP_READ_BYTES = 256 * 1024


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert found is not None
    return int(found.group(1)) * 1024


def fetch_frame(topic: str, correlation_id: int, max_bytes: int) -> bytes:
    R = FetchRequest[12]
    body = R(replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=max_bytes, isolation_level=0,
             session_id=0, session_epoch=-1, rack_id="", forgotten_topics_data=[],
             topics=[R.FetchTopic(topic=topic, partitions=[R.FetchTopic.FetchPartition(
                 partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
                 log_start_offset=-1, partition_max_bytes=max_bytes)])]).encode()
    return frame(encode_request_header(1, 12, correlation_id, "nonreading") + bytes(body))


def non_reading(cluster: LocalKafka, clients: int, fetch_mb: int) -> str:
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    topic = f"bench-nonreading-{int(time.time())}"
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": cluster.bootstrap, "linger.ms": 20})
    for _ in range(fetch_mb * 100):
        producer.produce(topic, value=b"v" * 10_000)
        producer.poll(0)
    producer.flush(60)
    leader = admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    request = fetch_frame(topic, 1, fetch_mb * 1_000_000)
    with RunningProxy(cluster.bootstrap) as proxy:
        time.sleep(1)
        before = rss(proxy.process.pid)
        socks = []
        try:
            for _ in range(clients):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", proxy.node_port(leader)))
                sock.sendall(request)
                socks.append(sock)
            time.sleep(5)
            after = rss(proxy.process.pid)
        finally:
            for sock in socks:
                sock.close()
    per_connection = ProxySettings().connection_buffer_bytes + UVLOOP_READ_BYTES
    budget = before + clients * per_connection
    return (f"{clients:,} clients asking {fetch_mb} MB each, reading nothing: proxy RSS "
            f"{before / 1e6:.0f} -> {after / 1e6:.0f} MB ({(after - before) / clients / 1e3:.0f} KB per "
            "client); budget "
            f"{budget / 1e6:.0f} MB ({per_connection // 1024} KB per client); before the bound: about 4 MB "
            "per client")


def large_requests(cluster: LocalKafka, clients: int, request_mb: int) -> str:
    import threading

    size = request_mb * 1024 * 1024
    header = encode_request_header(18, 0, 1, "large")  # ApiVersions v0, padded: the broker refuses it
    chunk = b"\0" * (1024 * 1024)
    with RunningProxy(cluster.bootstrap) as proxy:
        time.sleep(1)
        before = peak = rss(proxy.process.pid)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss(proxy.process.pid))
                time.sleep(0.05)

        def send() -> None:
            with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
                sock.sendall(struct.pack(">i", size) + header)
                left = size - len(header)
                while left > 0:
                    sock.sendall(chunk[:left])
                    left -= len(chunk)
                sock.settimeout(30)
                with contextlib.suppress(OSError):
                    sock.recv(1)  # an answer or a close: the broker had it all

        sampler = threading.Thread(target=sample)
        sampler.start()
        began = time.monotonic()
        senders = [threading.Thread(target=send) for _ in range(clients)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
        took = time.monotonic() - began
        time.sleep(5)
        done.set()
        sampler.join()
        after = rss(proxy.process.pid)
    budget = ProxySettings().queued_max_request_bytes
    return (f"{clients} clients sending {request_mb} MB requests at once: proxy RSS {before / 1e6:.0f} -> "
            f"peak {peak / 1e6:.0f} MB -> {after / 1e6:.0f} MB 5 s after ({took:.1f} s); budget "
            f"queued_max_request_bytes {budget / 1e6:.0f} MB; before the bound: 38 -> 791 MB, not given back")


def metadata_request(correlation_id: int, client_id: str) -> bytes:
    return frame(encode_request_header(3, 1, correlation_id, client_id) + bytes(MetadataRequest[1](topics=[])
                                                                                  .encode()))


def client_id_storm(cluster: LocalKafka, ids: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "kthrottle.toml"
        config.write_text('[proxy]\n\n[[quota]]\nclient_id = "<default>"\nrequest_percentage = 1000.0\n')
        metrics_port = free_port_block(1)
        with RunningProxy(cluster.bootstrap, extra_args=["--config", str(config),
                                                         "--metrics-port", str(metrics_port)]) as proxy:
            time.sleep(1)
            before = rss(proxy.process.pid)
            began = time.monotonic()
            peak = before
            with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
                for start in range(0, ids, 100):
                    batch = range(start, start + 100)
                    sock.sendall(b"".join(metadata_request(n, f"storm-{n}") for n in batch))
                    for _ in range(100):
                        size = struct.unpack(">i", _exactly(sock, 4))[0]
                        _exactly(sock, size)
                    if start % 20_000 == 0:
                        peak = max(peak, rss(proxy.process.pid))
            took = time.monotonic() - began
            peak = max(peak, rss(proxy.process.pid))
            scrape_began = time.monotonic()
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=60).read().decode()
            scrape_s = time.monotonic() - scrape_began
            found = re.search(r'^kthrottle_quota_buckets\{quota="request_percentage"\} (\S+)$', text, re.M)
            buckets = float(found.group(1)) if found else float("nan")
    cap = ProxySettings().max_quota_buckets
    return (f"{ids:,} client ids in {took:.0f} s: proxy RSS {before / 1e6:.0f} -> peak {peak / 1e6:.0f} MB; "
            f"{buckets:.0f} request buckets live at the end (cap {cap:,} per quota type); "
            f"one /metrics scrape then took {scrape_s * 1000:.0f} ms")


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the proxy closed the connection")
        data += chunk
    return bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hardening", description=__doc__)
    parser.add_argument("--clients", type=int, default=1000, help="non-reading clients")
    parser.add_argument("--fetch-mb", type=int, default=8, help="what each non-reading client asks for")
    parser.add_argument("--ids", type=int, default=200_000, help="distinct client ids in the storm")
    args = parser.parse_args(argv)
    with LocalKafka(brokers=1, heap_mb=1536) as cluster:  # room for eight 100 MB requests
        lines = [non_reading(cluster, args.clients, args.fetch_mb), large_requests(cluster, 8, 100),
                 client_id_storm(cluster, args.ids)]
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
