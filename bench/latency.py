"""Round-trip latency of one small acks=1 Produce, direct to the leader vs through proxies.

Why a raw socket: a client library adds its own queues, timers and threads (librdkafka's linger,
its I/O thread hand-off), whose jitter is larger than what the proxy adds. A blocking socket that
sends one prepared ProduceRequest and reads its response measures the wire plus the proxy, nothing
else, to the microsecond. Every path uses the same kind of connection to the same leader broker, and
all are measured in interleaved blocks so that background work on the machine hits them alike.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from dataclasses import dataclass

from kafka.protocol.producer import ProduceRequest, ProduceResponse
from kafka.record.memory_records import MemoryRecordsBuilder

from protocol.frames import frame
from protocol.headers import encode_request_header, response_body_offset

#: Produce v9 is the first flexible version (compact strings, tagged fields) and every Kafka 3.x/4.x
#: broker speaks it, so the same bytes work against any broker the bench starts.
PRODUCE_VERSION = 9
#: From v10 a Produce response may carry NodeEndpoints (KIP-951), so the proxy decodes every one to
#: rewrite them; v12 is the newest version that still names topics (v13 uses topic ids). Current
#: clients negotiate v10 or later, so this is the latency they see.
KIP951_PRODUCE_VERSION = 12
#: Flexible responses carry header v1: the correlation id, then tagged fields.
RESPONSE_HEADER_VERSION = 1
RECORD_BYTES = 100
#: Magic 2 is the v2 record batch format (the only one Produce v3+ accepts); 0 means no compression.
MAGIC_V2 = 2
NO_COMPRESSION = 0
#: A single round trip that takes longer than this means something is broken, not slow.
SOCKET_TIMEOUT_S = 10.0
#: Errors a just-created topic gives until its leader has applied the new metadata:
#: UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER.
RETRIABLE_ERRORS = frozenset({3, 5, 6})
#: How long the warm-up waits for a new topic to become writable on its leader.
READY_TIMEOUT_S = 30.0
CLIENT_ID = "bench"


@dataclass(frozen=True, slots=True)
class LatencyResult:
    """Round-trip times of one path, in microseconds, sorted."""

    path: str
    samples_us: list[float]

    def percentile(self, fraction: float) -> float:
        """Nearest-rank percentile: a real observed value, no interpolation between samples."""
        ordered = self.samples_us
        rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered))))
        return ordered[rank - 1]

    @property
    def p50(self) -> float:
        return self.percentile(0.50)

    @property
    def p99(self) -> float:
        return self.percentile(0.99)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_us)


def produce_body(topic: str, partition: int, version: int = PRODUCE_VERSION) -> bytes:
    """The body of a ProduceRequest carrying one v2 batch with one 100-byte record, acks=1.

    Built once and resent: the broker assigns offsets itself, so identical batches are fine.
    """
    builder = MemoryRecordsBuilder(magic=MAGIC_V2, compression_type=NO_COMPRESSION, batch_size=1 << 20)
    if builder.append(timestamp=int(time.time() * 1000), key=None, value=b"x" * RECORD_BYTES) is None:
        raise RuntimeError("kafka-python refused to append a 100-byte record to an empty batch")
    builder.close()
    records = bytes(builder.buffer())
    request = ProduceRequest(
        transactional_id=None, acks=1, timeout_ms=30_000,
        topic_data=[ProduceRequest.TopicProduceData(
            name=topic,
            partition_data=[ProduceRequest.TopicProduceData.PartitionProduceData(index=partition,
                                                                                 records=records)],
        )],
    )
    return bytes(request.encode(version=version))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; a closed connection is an error, never a short read."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {size} response bytes")
        got += n
    return bytes(buf)


class ProduceError(RuntimeError):
    """The broker answered with an error code."""

    def __init__(self, message: str, error_code: int) -> None:
        super().__init__(message)
        self.error_code = error_code


class RawProducer:
    """One blocking connection that sends Produce requests one at a time, like a synchronous client."""

    def __init__(self, path: str, address: tuple[str, int], topic: str, partition: int,
                 version: int = PRODUCE_VERSION) -> None:
        if version < 9:
            raise ValueError(f"Produce v{version} is not flexible; the response reader expects v9+")
        self.path = path
        self.version = version
        self.address = address
        self.sock = socket.create_connection(address, timeout=SOCKET_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._body = produce_body(topic, partition, version)
        self._correlation_id = 0

    def round_trip(self) -> float:
        """Send one request, wait for its response, check it; returns the round trip in microseconds.

        Only send-to-last-byte is timed; building the header and decoding the answer are not.
        """
        self._correlation_id += 1
        correlation_id = self._correlation_id
        request = frame(encode_request_header(0, self.version, correlation_id, CLIENT_ID) + self._body)
        start = time.perf_counter_ns()
        self.sock.sendall(request)
        size = int.from_bytes(_recv_exact(self.sock, 4), "big")
        payload = _recv_exact(self.sock, size)
        elapsed_us = (time.perf_counter_ns() - start) / 1000
        self._check(payload, correlation_id)
        return elapsed_us

    def _check(self, payload: bytes, correlation_id: int) -> None:
        got = int.from_bytes(payload[:4], "big", signed=True)
        if got != correlation_id:
            raise RuntimeError(f"{self.path}: response correlation id {got}, expected {correlation_id}")
        offset = response_body_offset(payload, RESPONSE_HEADER_VERSION)
        response = ProduceResponse.decode(memoryview(payload)[offset:], version=self.version)
        for topic in response.responses:
            for part in topic.partition_responses:
                if part.error_code != 0:
                    raise ProduceError(f"{self.path}: produce to {topic.name}-{part.index} failed with "
                                       f"error code {part.error_code} ({part.error_message})",
                                       part.error_code)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Retry until the leader accepts a produce: topic metadata reaches brokers asynchronously."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.round_trip()
                return
            except ProduceError as exc:
                if exc.error_code not in RETRIABLE_ERRORS or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def close(self) -> None:
        self.sock.close()


def measure(targets: dict[str, tuple[str, int]], topic: str, partition: int, *,
            versions: tuple[int, ...] = (PRODUCE_VERSION,), warmup: int = 500, samples: int = 5_000,
            block: int = 250, time_limit_s: float = 90.0) -> dict[int, dict[str, LatencyResult]]:
    """Interleave blocks of round trips on every path and version; {version: {path: result}}.

    `targets` maps a path name ("direct", "proxy", ...) to the address that path sends to.
    Interleaving in blocks (not one long run each) spreads any slow spell of the machine, a broker
    GC or log roll, and the brokers' JIT warming up, over every series alike. The time limit bounds
    the whole measurement: when reached, fewer samples are kept, and the caller sees how many.
    """
    clients = [RawProducer(path, address, topic, partition, version)
               for version in versions for path, address in targets.items()]
    results: dict[RawProducer, list[float]] = {c: [] for c in clients}
    deadline = time.monotonic() + time_limit_s
    try:
        for client in clients:
            client.wait_ready()
        done = 0
        while done < warmup:
            step = min(block, warmup - done)
            for client in clients:
                for _ in range(step):
                    client.round_trip()
            done += step
        while any(len(r) < samples for r in results.values()) and time.monotonic() < deadline:
            for client, kept in results.items():
                for _ in range(min(block, samples - len(kept))):
                    kept.append(client.round_trip())
    finally:
        for client in clients:
            client.close()
    return {version: {c.path: LatencyResult(c.path, sorted(results[c]))
                      for c in clients if c.version == version}
            for version in versions}
