"""Large Metadata answers, direct vs through the proxy (issue 10, item 6).

Before the brokers-array splice, the proxy decoded and re-encoded every Metadata answer to change the
broker addresses: an answer naming 10,000 topics took 177 ms through the proxy (13 ms direct), all
of it on the event loop, so four clients asking for all topics in a loop raised an unrelated
client's p50 from 1 ms to 316 ms. This bench prints, side by side with a direct connection to the
same broker in the same run:

1. the rewrite itself, in this process, on the broker's real all-topic answer: the old
   decode+swap+encode against `rewrite_addresses` (the splice);
2. Metadata(all topics) round trips, p50, direct vs proxy;
3. an unrelated client's round trip (Metadata for one small topic) p50, alone and while four other
   processes ask for all topics in a loop, direct vs proxy. The loaders ask broker 1 and the
   unrelated client broker 2, so that through the proxy they share nothing but the proxy; on a
   small machine every process still shares the cores, which the direct column shows.

Every client is a blocking raw socket (see bench/latency.py for why); the loaders are separate
processes, so their reading does not hold this process's GIL while the unrelated client is timed.
Figures are printed beside their targets, never asserted.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import multiprocessing.synchronize
import socket
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from harness.local_kafka import KAFKA_VERSION, LocalKafka
from protocol.addresses import rewrite_addresses
from protocol.apis import ApiKey
from protocol.broker_array import Address
from protocol.frames import frame
from protocol.headers import encode_request_header
from tests.integration.proxies import RunningProxy

from .throughput import BenchFailure, check_listeners

#: Metadata v12: the newest version kafka-python clients send; flexible, so the header has tags.
METADATA_VERSION = 12
RESPONSE_HEADER_BYTES = 5
#: The issue's case.
DEFAULT_TOPICS = 10_000
#: Topics per CreateTopics request: 1,000 took about 1.5 s on a busy 2-core machine.
CREATE_BATCH = 1_000
ADMIN_TIMEOUT_MS = 120_000
#: Until broker 1 lists every new topic (the metadata log reaches brokers a little after CreateTopics).
TOPICS_VISIBLE_TIMEOUT_S = 120.0
SOCKET_TIMEOUT_S = 30.0
#: Measurement sizes: small enough that the whole bench stays near two minutes on 2 cores.
ALL_TOPICS_SAMPLES = 40
ALL_TOPICS_BLOCK = 10
UNLOADED_SAMPLES = 400
LOADED_SECONDS = 8.0
LOADERS = 4
LOADER_WARMUP_S = 1.0
REWRITE_REPEATS = 20
#: Targets printed beside the figures (nothing checks them). The proxy's rewrite of an all-topic
#: answer is a copy, not a decode, so it should add little to the broker's own time; the unrelated
#: client should see about what it sees with no load through the same path.
ADDED_ALL_TOPICS_P50_TARGET_MS = 5.0
UNRELATED_LOADED_P50_TARGET_MS = 5.0
#: The issue's figures before the change, for the reader.
BEFORE = {"all_direct_ms": 13.0, "all_proxy_ms": 177.0, "unrelated_unloaded_ms": 1.0,
          "unrelated_loaded_ms": 316.0}


@dataclass(frozen=True, slots=True)
class RoundTrips:
    """Round-trip times of one client, in milliseconds, sorted."""

    samples_ms: list[float]

    def percentile(self, fraction: float) -> float:
        """Nearest-rank percentile: a real observed value, as in bench/latency.py."""
        rank = max(1, min(len(self.samples_ms), math.ceil(fraction * len(self.samples_ms))))
        return self.samples_ms[rank - 1]

    @property
    def p50(self) -> float:
        return self.percentile(0.50)

    @property
    def p99(self) -> float:
        return self.percentile(0.99)


class RawClient:
    """One blocking connection that sends a prepared Metadata request and reads its answer."""

    def __init__(self, address: tuple[str, int], topics: list[str] | None) -> None:
        self.sock = socket.create_connection(address, timeout=SOCKET_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request_class = MetadataRequest[METADATA_VERSION]
        wanted = None if topics is None else [
            request_class.MetadataRequestTopic(topic_id=None, name=name) for name in topics]
        self._body = bytes(request_class(topics=wanted, allow_auto_topic_creation=False,
                                         include_topic_authorized_operations=False).encode())
        self._correlation_id = 0

    def exchange(self) -> bytes:
        """One request and its whole answer (header and body, no size prefix)."""
        self._correlation_id += 1
        self.sock.sendall(frame(encode_request_header(3, METADATA_VERSION, self._correlation_id, "bench-md")
                                + self._body))
        size = int.from_bytes(self._recv_exact(4), "big")
        answer = self._recv_exact(size)
        if int.from_bytes(answer[:4], "big", signed=True) != self._correlation_id:
            raise BenchFailure("Metadata answer with the wrong correlation id")
        return answer

    def round_trip_ms(self) -> float:
        start = time.perf_counter_ns()
        self.exchange()
        return (time.perf_counter_ns() - start) / 1e6

    def _recv_exact(self, size: int) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = self.sock.recv_into(view[got:], size - got)
            if n == 0:
                raise ConnectionError(f"connection closed after {got} of {size} bytes")
            got += n
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def _load_loop(address: tuple[str, int], stop: multiprocessing.synchronize.Event, done: Any) -> None:
    """A loader process: Metadata for all topics, back to back, until told to stop."""
    client = RawClient(address, None)
    try:
        while not stop.is_set():
            client.exchange()
            with done.get_lock():
                done.value += 1
    finally:
        client.close()


@dataclass(frozen=True, slots=True)
class Loaded:
    unrelated: RoundTrips
    loader_requests_per_s: float


def under_load(load_address: tuple[str, int], probe_address: tuple[str, int], probe_topic: str,
               seconds: float) -> Loaded:
    """The unrelated client's round trips while LOADERS processes ask for all topics in a loop."""
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    done = spawn.Value("l", 0)
    loaders = [spawn.Process(target=_load_loop, args=(load_address, stop, done), daemon=True)
               for _ in range(LOADERS)]
    for process in loaders:
        process.start()
    probe = RawClient(probe_address, [probe_topic])
    samples: list[float] = []
    try:
        deadline = time.monotonic() + 60
        while done.value < LOADERS:  # every loader has its answers flowing
            if time.monotonic() > deadline or not all(p.is_alive() for p in loaders):
                raise BenchFailure("the all-topic loaders did not start")
            time.sleep(0.05)
        time.sleep(LOADER_WARMUP_S)
        first = done.value
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            samples.append(probe.round_trip_ms())
        rate = (done.value - first) / (time.monotonic() - began)
    finally:
        stop.set()
        probe.close()
        for process in loaders:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    if any(p.exitcode not in (0, None) for p in loaders):
        raise BenchFailure(f"a loader failed: exit codes {[p.exitcode for p in loaders]}")
    return Loaded(RoundTrips(sorted(samples)), rate)


def unloaded(address: tuple[str, int], topics: list[str] | None, samples: int) -> RoundTrips:
    client = RawClient(address, topics)
    try:
        for _ in range(min(samples // 10, 20)):
            client.exchange()  # warm-up
        return RoundTrips(sorted(client.round_trip_ms() for _ in range(samples)))
    finally:
        client.close()


def all_topics_interleaved(targets: dict[str, tuple[str, int]]) -> dict[str, RoundTrips]:
    """Metadata(all topics) round trips, in interleaved blocks so drift hits every path alike."""
    clients = {path: RawClient(address, None) for path, address in targets.items()}
    kept: dict[str, list[float]] = {path: [] for path in targets}
    try:
        for client in clients.values():
            client.exchange()
        while any(len(k) < ALL_TOPICS_SAMPLES for k in kept.values()):
            for path, client in clients.items():
                kept[path].extend(client.round_trip_ms() for _ in range(ALL_TOPICS_BLOCK))
    finally:
        for client in clients.values():
            client.close()
    return {path: RoundTrips(sorted(samples)) for path, samples in kept.items()}


def _decode_swap_encode(answer: bytes, advertise: Callable[[int], Address]) -> bytes:
    """The rewrite as it was before the splice (decode everything, swap, encode everything)."""
    message = MetadataResponse.decode(memoryview(answer)[RESPONSE_HEADER_BYTES:], version=METADATA_VERSION)
    for broker in message.brokers:
        broker.host, broker.port = advertise(broker.node_id)
    return answer[:RESPONSE_HEADER_BYTES] + bytes(message.encode())


def rewrite_costs(answer: bytes) -> tuple[float, float]:
    """(old decode+encode, splice) in ms per call on the same answer; checks they agree."""
    def advertise(node_id: int) -> Address:
        return "127.0.0.1", 30000 + node_id

    old = _decode_swap_encode(answer, advertise)
    new = rewrite_addresses(ApiKey.METADATA, METADATA_VERSION, answer, 1, advertise).frame
    if old != new:
        raise BenchFailure("the splice and the old decode+encode disagree on the broker's answer")
    old_ms = min(timeit.repeat(lambda: _decode_swap_encode(answer, advertise), number=1,
                               repeat=max(3, REWRITE_REPEATS // 4))) * 1000
    new_ms = min(timeit.repeat(
        lambda: rewrite_addresses(ApiKey.METADATA, METADATA_VERSION, answer, 1, advertise),
        number=10, repeat=REWRITE_REPEATS)) * 100
    return old_ms, new_ms


def create_topics(bootstrap: str, names: list[str]) -> float:
    """Create the topics (1 partition, 1 replica) in batches; returns the seconds it took."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="bench-metadata-admin")
    began = time.monotonic()
    try:
        for start in range(0, len(names), CREATE_BATCH):
            batch = names[start : start + CREATE_BATCH]
            admin.create_topics({name: {"num_partitions": 1, "replication_factor": 1} for name in batch},
                                timeout_ms=ADMIN_TIMEOUT_MS)
    finally:
        admin.close()
    return time.monotonic() - began


def wait_visible(address: tuple[str, int], names: list[str]) -> bytes:
    """Broker's all-topic answer once it lists every topic (each with a leader)."""
    wanted = set(names)
    client = RawClient(address, None)
    deadline = time.monotonic() + TOPICS_VISIBLE_TIMEOUT_S
    try:
        while True:
            answer = client.exchange()
            decoded = MetadataResponse.decode(answer[RESPONSE_HEADER_BYTES:], version=METADATA_VERSION)
            led = {t.name for t in decoded.topics if t.error_code == 0 and t.partitions
                   and all(p.leader_id >= 0 for p in t.partitions)}
            if wanted <= led:
                return answer
            if time.monotonic() > deadline:
                raise BenchFailure(f"broker lists {len(wanted & led)} of {len(wanted)} topics after "
                                   f"{TOPICS_VISIBLE_TIMEOUT_S:.0f} s")
            time.sleep(1.0)
    finally:
        client.close()


def _row(label: str, direct: float, proxied: float, target: str, before: str) -> str:
    return f"  {label:<44} {direct:>9.2f} {proxied:>9.2f}   {target:<28} {before}"


def run(args: argparse.Namespace) -> str:
    names = [f"md-load-{i:05d}" for i in range(args.topics)]
    print(f"starting {args.brokers} Kafka {KAFKA_VERSION} brokers and a proxy...", flush=True)
    with LocalKafka(brokers=args.brokers) as cluster, RunningProxy(cluster.bootstrap) as proxy:
        check_listeners(proxy, cluster.node_ids)
        print(f"  cluster up in {cluster.startup_seconds or 0:.1f} s", flush=True)
        direct = cluster.broker_address(1)
        targets = {"direct": direct, "proxy": ("127.0.0.1", proxy.node_port(1))}
        # The unrelated client asks another broker (broker 2 when there is one).
        other = cluster.node_ids[1 % len(cluster.node_ids)]
        probes = {"direct": cluster.broker_address(other), "proxy": ("127.0.0.1", proxy.node_port(other))}
        print(f"creating {args.topics:,} topics (1 partition, 1 replica)...", flush=True)
        created_s = create_topics(cluster.bootstrap, names)
        began = time.monotonic()
        answer = wait_visible(direct, names)
        visible_s = time.monotonic() - began
        print(f"  created in {created_s:.1f} s, all listed by broker 1 {visible_s:.1f} s later; "
              f"the all-topic answer is {len(answer):,} bytes", flush=True)

        print("the rewrite alone, in this process, on that answer...", flush=True)
        old_ms, new_ms = rewrite_costs(answer)
        print("Metadata(all topics) round trips, direct vs proxy...", flush=True)
        all_topics = all_topics_interleaved(targets)
        print("an unrelated client (Metadata for one topic), alone...", flush=True)
        alone = {path: unloaded(address, [names[0]], UNLOADED_SAMPLES) for path, address in probes.items()}
        loaded: dict[str, Loaded] = {}
        for path, address in targets.items():
            print(f"  ...and while {LOADERS} clients ask for all topics in a loop ({path})...", flush=True)
            loaded[path] = under_load(address, probes[path], names[0], LOADED_SECONDS)
        if not proxy.alive():
            raise BenchFailure(f"the proxy died:\n{proxy.log()[-4000:]}")

    d, p = all_topics["direct"], all_topics["proxy"]
    quiet, busy = alone["proxy"].p50, loaded["proxy"].unrelated.p50
    busy_direct = loaded["direct"].unrelated.p50

    def verdict(value: float, budget: float) -> str:
        return f"{value:+.2f} ms " + ("(met)" if value <= budget else "(MISSED)")

    lines = [
        f"Large Metadata (issue 10, item 6): {args.topics:,} topics, {len(answer):,}-byte answer, "
        f"Metadata v{METADATA_VERSION}, {args.brokers} brokers; topics created in {created_s:.1f} s",
        f"  rewrite of that answer in-process: old decode+encode {old_ms:.2f} ms, splice {new_ms:.3f} ms "
        f"({old_ms / new_ms:,.0f}x less)",
        f"  {'p50, ms':<44} {'direct':>9} {'proxy':>9}   {'target':<28} before (issue)",
        _row("Metadata(all topics)", d.p50, p.p50,
             f"proxy <= direct + {ADDED_ALL_TOPICS_P50_TARGET_MS:.0f}",
             f"{BEFORE['all_direct_ms']:.0f} / {BEFORE['all_proxy_ms']:.0f}"),
        _row("unrelated client, alone", alone["direct"].p50, quiet, "",
             f"{BEFORE['unrelated_unloaded_ms']:.0f}"),
        _row(f"unrelated client, {LOADERS} all-topic loaders", busy_direct, busy,
             f"<= alone, direct + {UNRELATED_LOADED_P50_TARGET_MS:.0f}",
             f"proxy {BEFORE['unrelated_loaded_ms']:.0f}"),
        _row("unrelated client, loaded, p99", loaded["direct"].unrelated.p99,
             loaded["proxy"].unrelated.p99, "", ""),
        f"  all-topic answers served to the loaders: {loaded['direct'].loader_requests_per_s:.1f}/s direct, "
        f"{loaded['proxy'].loader_requests_per_s:.1f}/s through the proxy; unrelated samples "
        f"{len(loaded['direct'].unrelated.samples_ms)} direct, {len(loaded['proxy'].unrelated.samples_ms)} "
        "proxy",
        f"  Metadata(all topics) p99: {d.p99:.2f} ms direct, {p.p99:.2f} ms proxy "
        f"({len(d.samples_ms)} samples each)",
        "  verdict: all-topic answer through the proxy "
        + verdict(p.p50 - d.p50, ADDED_ALL_TOPICS_P50_TARGET_MS)
        + "; unrelated client through the proxy under load vs alone "
        + verdict(busy - quiet, UNRELATED_LOADED_P50_TARGET_MS)
        + ", vs direct under the same load " + verdict(busy - busy_direct, UNRELATED_LOADED_P50_TARGET_MS),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.metadata_load",
        description="large Metadata answers, direct vs through the proxy, and what they do to other clients")
    parser.add_argument("--topics", type=int, default=DEFAULT_TOPICS)
    parser.add_argument("--brokers", type=int, default=3)
    args = parser.parse_args(argv)
    if args.topics < 1 or args.brokers < 1:
        parser.error("need --topics >= 1 and --brokers >= 1")
    began = time.monotonic()
    block = run(args)
    print()
    print(block)
    print(f"(bench took {time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
