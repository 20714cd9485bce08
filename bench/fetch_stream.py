"""`make bench`: consume throughput with Fetch v15 and v17, direct, through a bare relay, through kthrottle.

Up to v15 a large Fetch response passes through the proxy untouched as it arrives; from v16 it may
end with KIP-951 NodeEndpoints, so the proxy follows each streamed response's layout to find and
rewrite that tail, and announces a few bytes of slack up front (protocol/fetch_stream.py). This
measures what that costs: one consumer connection fetching the same partitions over and over with
Fetch v15 and with v17, directly from the broker, through a bare uvloop relay that forwards bytes
without looking at them (the least any proxy can cost: see bench/relay_floor.py), and through
`kthrottle run`. Each response is about PARTITIONS x 1 MiB (librdkafka's and Java's default
max.partition.fetch.bytes), far above the 64 KiB from which the proxy streams.

The client is a raw socket reading each response into one buffer (no decoding beyond the size
prefix), one request in flight, as a consumer has per broker; the first response of every run is
decoded with kafka-python and must name every partition, so a broken frame fails the bench. The
six (version, path) runs alternate, RUN_BYTES each, and the median of ROUNDS is printed with its
ratio to direct at the same version, and the CPU time the relay or proxy process spent per MB,
which a busy 2-core machine disturbs far less than the MB/s. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import struct
import sys
import time
import uuid
from multiprocessing.connection import Connection
from typing import NamedTuple

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kafka.protocol.consumer import FetchRequest, FetchResponse
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from harness.local_kafka import KAFKA_VERSION, LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header
from tests.integration.proxies import RunningProxy

from . import cpu

MB = 1_000_000
PARTITIONS = 4
PARTITION_MAX_BYTES = 1_048_576
RECORD_BYTES = 100_000
RECORDS_PER_PARTITION = 120  # 12 MB each: every fetch offset below leaves 1 MiB to read
#: Offsets the fetches cycle through, so the broker serves different bytes (all from the page cache).
FETCH_OFFSETS = (0, 20, 40, 60, 80, 100)
RUN_BYTES = 400 * MB
ROUNDS = 7
VERSIONS = (15, 17)
PATHS = ("direct", "relay", "proxy")
#: Turns a hang into an error; no run on a healthy machine comes close.
RUN_TIME_LIMIT_S = 120.0


def _relay_process(listener: socket.socket, target: tuple[str, int], ready: Connection) -> None:
    """Forward every accepted connection to `target`, bytes untouched: a bare proxy."""
    import uvloop

    class Forward(asyncio.Protocol):
        def __init__(self) -> None:
            self.peer: asyncio.Transport | None = None
            self.pending: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            if self.peer is None:
                self.pending.append(data)
            else:
                self.peer.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.peer is not None:
                self.peer.close()

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        async def accept_loop() -> None:
            while True:
                client, _ = await loop.sock_accept(listener)
                inbound, outbound = Forward(), Forward()
                out_transport, _ = await loop.create_connection(lambda o=outbound: o, *target)  # type: ignore[misc]
                in_transport, _ = await loop.connect_accepted_socket(lambda i=inbound: i, client)  # type: ignore[misc]
                inbound.peer, outbound.peer = out_transport, in_transport
                for data in inbound.pending:
                    out_transport.write(data)

        ready.send("listening")
        await accept_loop()

    uvloop.run(serve())


def start_relay(target: tuple[str, int]) -> tuple[multiprocessing.process.BaseProcess, tuple[str, int]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(
        target=_relay_process, args=(listener, target, child), daemon=True)
    process.start()
    if not parent.poll(30):
        raise RuntimeError("the relay did not start")
    parent.recv()
    return process, listener.getsockname()


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def topic_id(address: tuple[str, int], topic: str) -> uuid.UUID:
    v12 = MetadataRequest[12]
    request = v12(topics=[v12.MetadataRequestTopic(topic_id=None, name=topic)],
                  allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(frame(encode_request_header(3, 12, 1, "bench") + bytes(request.encode())))
        (size,) = struct.unpack(">i", recv_exact(sock, 4))
        body = recv_exact(sock, size)
    (found,) = MetadataResponse.decode(body[5:], version=12).topics
    return uuid.UUID(str(found.topic_id))


def fetch_requests(version: int, topic: uuid.UUID) -> list[bytes]:
    """One framed Fetch request per offset in FETCH_OFFSETS, every partition from that offset."""
    R = FetchRequest[version]
    T = R.FetchTopic
    requests = []
    for index, offset in enumerate(FETCH_OFFSETS):
        wanted = [T.FetchPartition(partition=p, current_leader_epoch=-1, fetch_offset=offset,
                                   last_fetched_epoch=-1, log_start_offset=-1,
                                   partition_max_bytes=PARTITION_MAX_BYTES) for p in range(PARTITIONS)]
        body = R(max_wait_ms=500, min_bytes=1, max_bytes=50_000_000, isolation_level=0, session_id=0,
                 session_epoch=-1, topics=[T(topic_id=topic, partitions=wanted)], forgotten_topics_data=[],
                 rack_id="")
        requests.append(frame(encode_request_header(1, version, index, "bench") + bytes(body.encode())))
    return requests


def check_response(payload: bytes, version: int) -> None:
    """The frame decodes exactly (kafka-python) and carries records for every partition."""
    R = FetchResponse[version]
    decode = R._struct.compiled_decode_from(version, compact=True, tagged=True, data_class=R[None])
    message, pos = decode(memoryview(payload), 5)
    if pos != len(payload):
        raise AssertionError(f"Fetch v{version}: {len(payload) - pos} bytes left after the response")
    sizes = [len(p.records or b"") for t in message.responses for p in t.partitions]
    if len(sizes) != PARTITIONS or min(sizes) < RECORD_BYTES:
        raise AssertionError(f"Fetch v{version}: partitions' record bytes {sizes}")


class Run(NamedTuple):
    mb_per_s: float
    #: CPU time of the forwarding process (relay or proxy) per MB; None for direct
    cpu_ms_per_mb: float | None


def measure(address: tuple[str, int], version: int, topic: uuid.UUID, run_bytes: int,
            forwarder: int | None = None) -> Run:
    """Fetch responses read on one connection until `run_bytes` have come; `forwarder` is the pid
    whose CPU time the run costs (the relay or the proxy)."""
    requests = fetch_requests(version, topic)
    buffer = memoryview(bytearray(4 << 20))
    with socket.create_connection(address, timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(requests[0])  # the first response is read whole and checked, untimed
        (size,) = struct.unpack(">i", recv_exact(sock, 4))
        check_response(recv_exact(sock, size), version)
        received = 0
        n = 0
        cpu_before = cpu.process_cpu_seconds(forwarder) if forwarder is not None else None
        began = time.perf_counter()
        while received < run_bytes:
            sock.sendall(requests[n % len(requests)])
            n += 1
            (size,) = struct.unpack(">i", recv_exact(sock, 4))
            left = size
            while left:
                got = sock.recv_into(buffer, min(left, len(buffer)))
                if not got:
                    raise ConnectionError("closed mid-response")
                left -= got
            received += 4 + size
            if time.perf_counter() - began > RUN_TIME_LIMIT_S:
                raise RuntimeError(f"a run took over {RUN_TIME_LIMIT_S} s")
        elapsed = time.perf_counter() - began
        cpu_after = cpu.process_cpu_seconds(forwarder) if forwarder is not None else None
        cost = (1000 * (cpu_after - cpu_before) / (received / MB)
                if cpu_before is not None and cpu_after is not None else None)
        return Run(received / MB / elapsed, cost)


def produce(bootstrap: str, topic: str) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "1", "linger.ms": 5,
                         "compression.type": "none"})
    value = b"v" * RECORD_BYTES
    for _ in range(RECORDS_PER_PARTITION):
        for partition in range(PARTITIONS):
            producer.produce(topic, value=value, partition=partition)
        producer.poll(0)
    if producer.flush(60) != 0:
        raise RuntimeError("records still unsent after 60 s")


def run(rounds: int, run_bytes: int) -> str:
    print(f"starting 1 Kafka {KAFKA_VERSION} broker...", flush=True)
    with LocalKafka(brokers=1) as cluster:
        host, port = cluster.bootstrap.split(",")[0].rsplit(":", 1)
        broker = (host, int(port))
        topic = "fetch-stream-bench"
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
        time.sleep(1.0)  # the broker applies the new leadership just after CreateTopics answers
        produce(cluster.bootstrap, topic)
        ident = topic_id(broker, topic)
        relay, relay_address = start_relay(broker)
        proxy = RunningProxy(cluster.bootstrap)
        try:
            addresses = {"direct": broker, "relay": relay_address,
                         "proxy": ("127.0.0.1", proxy.node_port(cluster.node_ids[0]))}
            pids = {"direct": None, "relay": relay.pid, "proxy": proxy.process.pid}
            runs: dict[tuple[int, str], list[Run]] = {(v, p): [] for v in VERSIONS for p in PATHS}
            order: list[tuple[int, str]] = list(runs)
            for version, path in order:  # warm-up, unmeasured
                measure(addresses[path], version, ident, run_bytes // 10)
            for round_no in range(rounds):
                for version, path in order if round_no % 2 == 0 else reversed(order):
                    runs[version, path].append(measure(addresses[path], version, ident, run_bytes,
                                                       pids[path]))
                print(f"  round {round_no + 1}/{rounds}: " + ", ".join(
                    f"v{v} {p} {runs[v, p][-1].mb_per_s:.0f}" for v, p in order) + " MB/s", flush=True)
            if not proxy.alive():
                raise RuntimeError(f"the proxy exited:\n{proxy.log()[-2000:]}")
        finally:
            proxy.stop()
            relay.kill()
            relay.join()
    def median(v: int, p: str) -> float:
        return statistics.median(r.mb_per_s for r in runs[v, p])

    def cost(v: int, p: str) -> float:
        return statistics.median(r.cpu_ms_per_mb or 0.0 for r in runs[v, p])

    lines = [f"Fetch streaming (one connection, {PARTITIONS} x 1 MiB responses, {rounds} rounds of "
             f"{run_bytes // MB} MB; median MB/s, ratio to direct at the same version, and the "
             "forwarding process's CPU ms per MB):"]
    for version in VERSIONS:
        lines.append(f"  Fetch v{version}: direct {median(version, 'direct'):.0f}, " + ", ".join(
            f"{p} {median(version, p):.0f} ({median(version, p) / median(version, 'direct'):.2f}x, "
            f"{cost(version, p):.3f} ms/MB)" for p in PATHS[1:]))
    v15, v17 = VERSIONS
    lines.append(f"  proxy v{v17} vs v{v15}: {median(v17, 'proxy') / median(v15, 'proxy'):.2f}x the MB/s, "
                 f"{cost(v17, 'proxy') / cost(v15, 'proxy'):.2f}x the CPU per MB "
                 f"(bare relay: {median(v17, 'relay') / median(v15, 'relay'):.2f}x, "
                 f"{cost(v17, 'relay') / cost(v15, 'relay'):.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fetch_stream", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--run-mb", type=int, default=RUN_BYTES // MB)
    args = parser.parse_args(argv)
    print(run(args.rounds, args.run_mb * MB), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
