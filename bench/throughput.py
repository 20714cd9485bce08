"""`make bench`: produce and consume throughput and produce latency, direct vs through the proxy.

One run starts one real 3-broker cluster and two proxies in front of it: "proxy" without quotas
and "proxy+quotas" with a quota file whose quotas apply to every bench client but are never
exceeded (10 GB/s byte rates, request_percentage 100000, 100000 producer ids per second, among
1,000 other client-id entities, see `quota_file_text`), so the second path pays for the quota
engine's bookkeeping and nothing else. All three paths run against the same brokers on the same
machine at the same time, so the ratios mean something even on a small, busy machine where the
absolute figures do not. Figures are printed, never asserted: the bench fails only when something
breaks (records missing, client errors, a proxy dying, the quota proxy throttling or not charging).

Choices that keep the broker from being the bottleneck: topics have replication factor 1 (no
follower fetches competing with the proxy for the CPU; acks=1 waits for the leader only) and 6
partitions, two per broker. Records are not compressed, so the bytes counted are the bytes moved.
The paths alternate (direct, proxy, proxy+quotas, direct, ...) after an unmeasured warm-up of each,
each produce run on a fresh topic, and the median per path is reported, so neither warm-up nor
drift favours a side. Runs are long enough to measure the steady state: each consume run reads
600 MB (over a second at the direct rate). With 200 MB (0.2 s), every run mostly measured how fast
librdkafka's fetchers ramp up on fresh connections, which varied by +-40% from run to run on
either path.

The summary ends with the memory of the quota state (10,000 (user, client-id) entities, the
producer-id Bloom filter), measured in-process without the cluster: see `bench/memory.py`.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from prometheus_client.parser import text_string_to_metric_families

from harness.local_kafka import KAFKA_VERSION, LocalKafka
from tests.integration.proxies import RunningProxy

from . import cpu, latency, memory, relay_floor

PARTITIONS = 6
REPLICATION_FACTOR = 1
RECORD_BYTES = 10_000
KEY_BYTES = 8
MB = 1_000_000
#: Targets are printed next to the figures for the reader; nothing checks them.
PRODUCE_RATIO_TARGET = 0.85
CONSUME_RATIO_TARGET = 0.85
ADDED_P50_TARGET_US = 150.0
#: Upper bounds that turn a hang into an error: no step on a healthy machine comes close.
RUN_TIME_LIMIT_S = 120.0
ADMIN_TIMEOUT_S = 30.0
LATENCY_TIME_LIMIT_S = 90.0
#: Above this the machine was busy before the bench began, and its figures are noisier.
BUSY_BEFORE_WARNING = 0.25
#: Disk waits above this share of the machine's time are shown next to a run: they explain a slow
#: run that the CPU figures do not.
IOWAIT_NOTE = 0.05
PATHS = ("direct", "proxy", "proxy+quotas")
#: The paths that go through a proxy (each has its own proxy process).
PROXIED = PATHS[1:]
#: The quota file of "proxy+quotas": bounds far above anything the bench can reach.
QUOTA_BYTE_RATE = 10_000_000_000
QUOTA_REQUEST_PERCENTAGE = 100_000.0
QUOTA_PRODUCER_IDS_RATE = 100_000
#: Other client-id entities in the file, as a real table has; no bench client matches them.
OTHER_QUOTA_ENTITIES = 1_000
LatencyByPath = dict[str, latency.LatencyResult]
#: v9 answers are forwarded untouched; v12 answers are decoded by the proxy (KIP-951 NodeEndpoints).
LATENCY_VERSIONS = (latency.PRODUCE_VERSION, latency.KIP951_PRODUCE_VERSION)


@dataclass(frozen=True, slots=True)
class Run:
    """One timed transfer on one path, with what the proxy and the machine spent on it."""

    path: str
    records: int
    payload_bytes: int
    seconds: float
    proxy_cpu_s: float | None = None
    proxy_faults: int | None = None
    machine_busy: float | None = None
    machine_iowait: float | None = None

    @property
    def mb_per_s(self) -> float:
        return self.payload_bytes / MB / self.seconds

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds


@dataclass(frozen=True, slots=True)
class Comparison:
    """The runs of both paths for one measurement, reduced to medians."""

    name: str
    runs: list[Run]

    def _runs(self, path: str) -> list[Run]:
        return [r for r in self.runs if r.path == path]

    def median_mb_per_s(self, path: str) -> float:
        return statistics.median(r.mb_per_s for r in self._runs(path))

    def median_records_per_s(self, path: str) -> float:
        return statistics.median(r.records_per_s for r in self._runs(path))

    def ratio(self, path: str, base: str = "direct") -> float:
        return self.median_mb_per_s(path) / self.median_mb_per_s(base)

    def round_ratios(self, path: str, base: str = "direct") -> list[float]:
        """path/base within each round: their spread shows how noisy the machine was."""
        pairs = zip(self._runs(base), self._runs(path), strict=False)
        return sorted(p.mb_per_s / b.mb_per_s for b, p in pairs)

    def proxy_cpu_ms_per_mb(self, path: str) -> float | None:
        """A proxy's CPU cost per MB moved: comparable across machines, unlike the ratio."""
        costs = [1000 * r.proxy_cpu_s / (r.payload_bytes / MB)
                 for r in self._runs(path) if r.proxy_cpu_s is not None]
        return statistics.median(costs) if costs else None

    def machine_ms_per_mb(self, path: str) -> float | None:
        """CPU the whole machine spent per MB on this path (every process and the kernel)."""
        cores = os.cpu_count() or 1
        costs = [1000 * r.machine_busy * cores * r.seconds / (r.payload_bytes / MB)
                 for r in self._runs(path) if r.machine_busy is not None]
        return statistics.median(costs) if costs else None

    def proxy_faults_per_mb(self, path: str) -> float | None:
        """Minor page faults per MB: about 244 (10^6 B / 4 KB pages) per fresh buffer the bytes pass."""
        faults = [r.proxy_faults / (r.payload_bytes / MB)
                  for r in self._runs(path) if r.proxy_faults is not None]
        return statistics.median(faults) if faults else None


class BenchFailure(RuntimeError):
    """Something broke (missing records, a client error): the figures would be meaningless."""


# -- topics -------------------------------------------------------------------------------------


def create_topic(admin: AdminClient, name: str, partitions: int = PARTITIONS) -> None:
    """Create a topic and wait until every partition has a leader, so no run times an election."""
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions,
                                            replication_factor=REPLICATION_FACTOR)])
    futures[name].result(timeout=ADMIN_TIMEOUT_S)
    deadline = time.monotonic() + ADMIN_TIMEOUT_S
    while time.monotonic() < deadline:
        meta = admin.list_topics(name, timeout=ADMIN_TIMEOUT_S).topics.get(name)
        if (meta is not None and meta.error is None and len(meta.partitions) == partitions
                and all(p.leader >= 0 for p in meta.partitions.values())):
            return
        time.sleep(0.1)
    raise BenchFailure(f"topic {name} has no leader for every partition after {ADMIN_TIMEOUT_S}s")


def delete_topic(admin: AdminClient, name: str) -> None:
    """Free the disk: ten runs of 200 MB each would otherwise pile up on the brokers."""
    admin.delete_topics([name])[name].result(timeout=ADMIN_TIMEOUT_S)


def partition_leader(admin: AdminClient, topic: str, partition: int) -> int:
    meta = admin.list_topics(topic, timeout=ADMIN_TIMEOUT_S).topics[topic]
    leader = int(meta.partitions[partition].leader)
    if leader < 0:
        raise BenchFailure(f"{topic}-{partition} has no leader")
    return leader


# -- produce and consume ------------------------------------------------------------------------


def produce(path: str, bootstrap: str, topic: str, records: int,
            config: dict[str, object] | None = None) -> tuple[int, int, float]:
    """Send `records` keyed 10 KB records with librdkafka and wait for every acknowledgement.

    Returns (records, payload bytes, seconds). The clock starts after the producer has fetched metadata
    (start-up is not throughput) and stops when flush() returns: the last acks=1 response is in.
    """
    producer = Producer({
        "bootstrap.servers": bootstrap,
        "client.id": f"bench-produce-{path}",
        "acks": 1,
        "linger.ms": 5,
        "batch.size": 1_000_000,
        "compression.type": "none",
        "enable.idempotence": False,
        "queue.buffering.max.kbytes": 1_048_576,
        "queue.buffering.max.messages": max(100_000, records),
        **(config or {}),
    })
    producer.list_topics(topic, timeout=ADMIN_TIMEOUT_S)
    value = os.urandom(RECORD_BYTES)
    errors: list[str] = []
    delivered = 0

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        nonlocal delivered
        if err is not None:
            errors.append(str(err))
        else:
            delivered += 1

    start = time.perf_counter()
    deadline = time.monotonic() + RUN_TIME_LIMIT_S
    for i in range(records):
        key = i.to_bytes(KEY_BYTES, "big")
        while True:
            try:
                producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
                break
            except BufferError:  # the local queue is full: let librdkafka send some first
                if time.monotonic() > deadline:
                    raise BenchFailure(f"{path}: producer queue full for {RUN_TIME_LIMIT_S}s") from None
                producer.poll(0.01)
        if i % 1000 == 999:
            producer.poll(0)
    left = producer.flush(max(0.0, deadline - time.monotonic()))
    seconds = time.perf_counter() - start
    if left or errors or delivered != records:
        raise BenchFailure(f"{path}: produced {delivered} of {records} records to {topic} "
                           f"({left} unacknowledged, {len(errors)} errors: {errors[:3]})")
    return records, records * (RECORD_BYTES + KEY_BYTES), seconds


def consume(path: str, bootstrap: str, topic: str, records: int,
            config: dict[str, object] | None = None) -> tuple[int, int, float]:
    """Read the whole topic from the beginning with librdkafka; check every record arrives once.

    Returns (records timed, their payload bytes, seconds). Partitions are assigned, not
    subscribed, so no group rebalance is involved. Default fetch sizes (fetch.max.bytes 50 MB,
    max.partition.fetch.bytes 1 MB) are what users get; the local queue is larger (see below).
    The clock starts when the first batch (up to 1000 records) has arrived and that batch is not
    counted: connecting and resolving offsets take tens of milliseconds, a large share of a
    sub-second run, and are not throughput.
    """
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "client.id": f"bench-consume-{path}",
        "group.id": f"bench-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        # librdkafka stops fetching a partition for fetch.queue.backoff.ms (1 s) whenever its local
        # queue holds more than queued.max.messages.kbytes (64 MB). A fast path fills that queue
        # faster than Python drains it and then idles for a second: the faster path would look
        # slower. Room for the whole topic and a short backoff measure the fetch path instead.
        "queued.max.messages.kbytes": 1_048_576,
        "fetch.queue.backoff.ms": 10,
        **(config or {}),
    })
    try:
        consumer.list_topics(topic, timeout=ADMIN_TIMEOUT_S)
        seen = bytearray(records)
        received = duplicates = 0
        timed_records = timed_bytes = 0
        start: float | None = None
        deadline = time.monotonic() + RUN_TIME_LIMIT_S
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        while received < records and time.monotonic() < deadline:
            # Never ask for more than is left: consume() waits its whole timeout for a full batch.
            batch = consumer.consume(num_messages=min(1000, records - received), timeout=0.5)
            for msg in batch:
                err = msg.error()
                if err is not None:
                    raise BenchFailure(f"{path}: consumer error on {topic}: {err}")
                key, value = msg.key(), msg.value()
                if key is None or value is None or len(key) != KEY_BYTES:
                    raise BenchFailure(f"{path}: record at {topic}-{msg.partition()}@{msg.offset()} "
                                       "is not one the bench produced")
                index = int.from_bytes(key, "big")
                if index >= records:
                    raise BenchFailure(f"{path}: unexpected key {index} in {topic}")
                if seen[index]:
                    duplicates += 1
                    continue
                seen[index] = 1
                received += 1
                if start is not None:
                    timed_records += 1
                    timed_bytes += len(key) + len(value)
            if start is None and batch:
                start = time.perf_counter()
        seconds = time.perf_counter() - (start or 0.0)
    finally:
        consumer.close()
    if received != records:
        raise BenchFailure(f"{path}: consumed {received} of {records} records from {topic} "
                           f"within {RUN_TIME_LIMIT_S}s")
    if duplicates:
        print(f"  note: {path} consumer saw {duplicates} duplicate records (producer retries)", flush=True)
    if timed_records == 0:
        raise BenchFailure(f"{path}: all {records} records came in the first batch; use more of them")
    return timed_records, timed_bytes, seconds


# -- the bench ----------------------------------------------------------------------------------


class Bench:
    """One cluster, its proxies (one per proxied path), one admin client, and the runs on every path."""

    def __init__(self, cluster: LocalKafka, proxies: dict[str, RunningProxy], admin: AdminClient,
                 records: int, consume_records: int) -> None:
        self.cluster = cluster
        self.proxies = proxies
        self.admin = admin
        self.records = records
        self.consume_records = consume_records
        self.bootstraps = {"direct": cluster.bootstrap} | {path: p.bootstrap for path, p in proxies.items()}
        self.tag = uuid.uuid4().hex[:8]

    def check_alive(self) -> None:
        """Fail at once with the proxy's log rather than after a run's time limit."""
        for path, proxy in self.proxies.items():
            if not proxy.alive():
                raise BenchFailure(f"the {path} proxy exited during the bench:\n{proxy.log()[-4000:]}")
        if not self.cluster.alive():
            raise BenchFailure("a Kafka broker exited during the bench")

    def timed(self, path: str, transfer: Callable[[], tuple[int, int, float]]) -> Run:
        """One run, with its proxy's CPU time (none for direct) and the machine's load over it."""
        self.check_alive()
        proxy = self.proxies.get(path)
        window = cpu.CpuWindow.open(proxy.process.pid if proxy is not None else os.getpid())
        records, payload, seconds = transfer()
        usage = window.close()
        if proxy is None:
            return Run(path, records, payload, seconds, None, None, usage.busy, usage.iowait)
        return Run(path, records, payload, seconds, usage.process_cpu_s, usage.process_faults, usage.busy,
                   usage.iowait)

    def alternate(self, rounds: int, measure: Callable[[str, int], Run]) -> list[Run]:
        """Direct, proxy, proxy+quotas, direct, ...; `measure(path, round)` makes one run."""
        runs: list[Run] = []
        for round_no in range(rounds):
            for path in PATHS:
                run = measure(path, round_no)
                print(f"  round {round_no + 1} {path:12} {run.mb_per_s:7.1f} MB/s "
                      f"{run.records_per_s:7.0f} rec/s {run.seconds:6.2f} s{_cpu_note(run)}", flush=True)
                runs.append(run)
        return runs

    def produce_rounds(self, rounds: int, warmup_records: int) -> Comparison:
        """Alternating produce runs, each to a fresh topic deleted after it."""
        for path in PATHS:  # unmeasured: JIT-warm the brokers, connect each proxy to each broker
            topic = f"bench-warmup-{path.replace('+', '-')}-{self.tag}"
            create_topic(self.admin, topic)
            produce(path, self.bootstraps[path], topic, warmup_records)
            delete_topic(self.admin, topic)

        def one(path: str, round_no: int) -> Run:
            topic = f"bench-produce-{path.replace('+', '-')}-{round_no}-{self.tag}"
            create_topic(self.admin, topic)
            run = self.timed(path, lambda: produce(path, self.bootstraps[path], topic, self.records))
            delete_topic(self.admin, topic)
            return run

        print(f"produce: {self.records} x {RECORD_BYTES} B records, {PARTITIONS} partitions, replication "
              f"factor {REPLICATION_FACTOR}, acks=1, linger.ms=5, batch.size=1000000; fresh topic per run",
              flush=True)
        return Comparison("produce", self.alternate(rounds, one))

    def consume_rounds(self, rounds: int) -> Comparison:
        """Alternating reads of one topic, filled directly first; unmeasured first reads warm the
        page cache and every path."""
        topic = f"bench-consume-{self.tag}"
        create_topic(self.admin, topic)
        produce("direct", self.bootstraps["direct"], topic, self.consume_records)
        records = self.consume_records
        for path in PATHS:
            consume(path, self.bootstraps[path], topic, records)
        print(f"consume: the same {records} records from {topic} each run, default fetch sizes, "
              "timed from the first batch of 1000", flush=True)
        runs = self.alternate(rounds, lambda path, _round: self.timed(
            path, lambda: consume(path, self.bootstraps[path], topic, records)))
        delete_topic(self.admin, topic)
        return Comparison("consume", runs)

    def produce_latency(self, samples: int, warmup: int) -> dict[int, LatencyByPath]:
        """Per Produce version; direct goes to the leader's own port, each proxy to its port for it."""
        self.check_alive()
        topic = f"bench-latency-{self.tag}"
        create_topic(self.admin, topic, partitions=1)
        leader = partition_leader(self.admin, topic, 0)
        targets = {"direct": self.cluster.broker_address(leader)} | {
            path: ("127.0.0.1", proxy.node_port(leader)) for path, proxy in self.proxies.items()}
        where = ", ".join(f"{path} {host}:{port}" for path, (host, port) in targets.items())
        print(f"latency: {latency.RECORD_BYTES} B acks=1 Produce over a raw socket, one at a time, to leader "
              f"node {leader} ({where}); {warmup} warm-up, {samples} timed each, interleaved in blocks",
              flush=True)
        found = latency.measure(targets, topic, 0, versions=LATENCY_VERSIONS, warmup=warmup,
                                samples=samples, time_limit_s=LATENCY_TIME_LIMIT_S)
        for version, results in found.items():
            for result in results.values():
                if len(result.samples_us) < samples:
                    print(f"  note: v{version} {result.path} kept {len(result.samples_us)} of {samples} "
                          f"samples (time limit {LATENCY_TIME_LIMIT_S:.0f} s)", flush=True)
                print(f"  v{version:<2} {result.path:12} p50 {result.p50:7.1f} us  p99 {result.p99:7.1f} us  "
                      f"mean {result.mean:7.1f} us  ({len(result.samples_us)} samples)", flush=True)
        delete_topic(self.admin, topic)
        return found


# -- the quota proxy ----------------------------------------------------------------------------


def quota_file_text(others: int = OTHER_QUOTA_ENTITIES) -> str:
    """Quotas every bench client falls under (client-id and user defaults), none within reach.

    The bench clients' client-ids ("bench", "bench-produce-proxy+quotas", ...) match no named
    entity, so `client-id <default>` governs their bytes and request time (one bucket per
    client-id) and `user <default>` their producer ids; the named entities only make the table
    as large as a real one, so lookups are not measured on an empty dict.
    """
    lines = ["# written by bench/throughput.py: quotas that apply to the bench but are never exceeded",
             "[[quota]]", 'client_id = "<default>"', f"producer_byte_rate = {QUOTA_BYTE_RATE}",
             f"consumer_byte_rate = {QUOTA_BYTE_RATE}", f"request_percentage = {QUOTA_REQUEST_PERCENTAGE}",
             "", "[[quota]]", 'user = "<default>"', f"producer_ids_rate = {QUOTA_PRODUCER_IDS_RATE}"]
    for i in range(others):
        lines += ["", "[[quota]]", f'client_id = "app-{i:04d}"',
                  f"producer_byte_rate = {1_048_576 * (1 + i % 8)}",
                  f"consumer_byte_rate = {2_097_152 * (1 + i % 8)}",
                  f"request_percentage = {25.0 * (1 + i % 4)}"]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    """A port the kernel considers free now (for the quota proxy's metrics endpoint)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_quota_proxy(upstream: str, quota_path: Path, metrics_port: int) -> RunningProxy:
    """The second proxy, with the quota file; fails unless the proxy says it loaded every entity."""
    entities = 2 + OTHER_QUOTA_ENTITIES
    proxy = RunningProxy(upstream, extra_args=["--config", str(quota_path),
                                               "--metrics-port", str(metrics_port)])
    try:
        log = proxy.wait_for_log("quotas from")
    except AssertionError as exc:
        proxy.stop()
        raise BenchFailure(str(exc)) from None
    if f": {entities} entities" not in log:
        proxy.stop()
        raise BenchFailure(f"the quota proxy did not load {entities} quota entities:\n{log[-4000:]}")
    return proxy


@dataclass(frozen=True, slots=True)
class QuotaState:
    """What the quota proxy's engine did for the bench clients, read from its metrics at the end."""

    entities: int
    buckets: dict[str, list[str]]
    throttled: float

    def line(self) -> str:
        kinds = "   ".join(f"{kind}: {', '.join(ids)}" for kind, ids in self.buckets.items())
        return (f"proxy+quotas  {self.entities:,} quota entities; bench buckets charged {kinds}; "
                f"throttled responses {self.throttled:.0f}")


#: metric family per quota that the bench clients must have charged, by what it measures
_CHARGED_FAMILIES = {"produce": "kthrottle_produce_byte_rate_bytes_per_second",
                     "fetch": "kthrottle_fetch_byte_rate_bytes_per_second",
                     "request": "kthrottle_request_time_percent"}


def quota_state(metrics_port: int) -> QuotaState:
    """Check the quotas applied (a bucket per bench client) and never throttled anything."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=ADMIN_TIMEOUT_S) as response:
        text = response.read().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    buckets: dict[str, list[str]] = {}
    for kind, name in _CHARGED_FAMILIES.items():
        family = families.get(name)
        ids = sorted({s.labels.get("client_id", "") for s in family.samples}) if family else []
        if not ids:
            raise BenchFailure(f"the quota proxy charged no {kind} bucket: its quotas did not apply "
                               f"to the bench clients (no {name} series at {url})")
        buckets[kind] = ids
    throttled = sum(sample.value for name in ("kthrottle_throttled_responses", "kthrottle_throttles")
                    if (family := families.get(name)) is not None
                    for sample in family.samples if sample.name.endswith("_total"))
    if throttled:
        raise BenchFailure(f"the quota proxy throttled the bench ({throttled:.0f} throttles): its quotas "
                           "are meant to be out of reach, so its figures would measure throttling")
    return QuotaState(2 + OTHER_QUOTA_ENTITIES, buckets, throttled)


def check_listeners(proxy: RunningProxy, node_ids: list[int], timeout_s: float = 10.0) -> None:
    """Every broker must have its proxy port: a missing one (port taken) would hang a run, not fail it."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = proxy.log()
        if "cannot open the listener" in log:
            raise BenchFailure(f"the proxy could not open a broker listener:\n{log[-4000:]}")
        missing = [n for n in node_ids if f"broker {n} is served on" not in log]
        if not missing:
            return
        if time.monotonic() > deadline or not proxy.alive():
            raise BenchFailure(f"the proxy serves no port for broker(s) {missing}:\n{log[-4000:]}")
        time.sleep(0.05)


# -- the summary --------------------------------------------------------------------------------


def _cpu_note(run: Run) -> str:
    parts = []
    if run.path != "direct" and run.proxy_cpu_s is not None:
        parts.append(f"proxy CPU {100 * run.proxy_cpu_s / run.seconds:3.0f}% of a core")
        if run.proxy_faults is not None:
            parts.append(f"{run.proxy_faults / (run.payload_bytes / MB):4.0f} faults/MB")
    if run.machine_busy is not None:
        parts.append(f"machine {100 * run.machine_busy:3.0f}% busy")
    if run.machine_iowait is not None and run.machine_iowait >= IOWAIT_NOTE:
        parts.append(f"{100 * run.machine_iowait:.0f}% waiting on disk")
    return "   " + ", ".join(parts) if parts else ""


def _spread(values: list[float]) -> str:
    return f"{values[0]:.2f}..{values[-1]:.2f}"


def _throughput_lines(comp: Comparison, target: float | None) -> list[str]:
    lines = []
    for path in PATHS:
        label = f"{comp.name} 10KB" if path == PATHS[0] else ""
        line = (f"{label:13} {path:12} {comp.median_mb_per_s(path):6.1f} MB/s "
                f"{comp.median_records_per_s(path):6.0f} rec/s")
        if path != "direct":
            line += f"   ratio {comp.ratio(path):.2f} (per round {_spread(comp.round_ratios(path))})"
            if target is not None:
                line += f"  (target >= {target:.2f})"
        if path == "proxy+quotas":
            line += (f"   vs proxy {comp.ratio(path, 'proxy'):.2f} "
                     f"(per round {_spread(comp.round_ratios(path, 'proxy'))})")
        lines.append(line)
    return lines


def _latency_lines(lat: dict[int, LatencyByPath]) -> list[str]:
    lines = []
    for version, results in lat.items():
        label = "" if version == latency.PRODUCE_VERSION else f" (v{version})"
        direct = results["direct"]
        for name, fraction in (("p50", 0.50), ("p99", 0.99)):
            base = direct.percentile(fraction)
            sides = [f"direct {base:6.1f} us"]
            for path in PROXIED:
                value = results[path].percentile(fraction)
                sides.append(f"{path} {value:6.1f} us (+{value - base:.1f} us, ratio {value / base:.2f})")
            goal = (f"  (target added <= {ADDED_P50_TARGET_US:.0f} us)"
                    if version == latency.PRODUCE_VERSION and name == "p50" else "")
            lines.append(f"produce 100B {name}{label:6}  " + "   ".join(sides) + goal)
    return lines


def _ceiling_lines(comps: list[Comparison], floor: relay_floor.RelayFloor | None) -> list[str]:
    """The machine's CPU per MB on each path, and the ratio no proxy could beat were it CPU-bound."""
    lines = []
    if floor is not None:
        lines.append(f"one more TCP hop (a bare uvloop relay, bench/relay_floor.py) costs this machine "
                     f"{floor.hop_ms_per_mb:.2f} ms of CPU per MB ({floor.direct_ms_per_mb:.2f} direct, "
                     f"{floor.relayed_ms_per_mb:.2f} relayed); the bare relay's own throughput ratio "
                     f"{floor.relayed_mb_per_s / floor.direct_mb_per_s:.2f} "
                     f"({floor.direct_mb_per_s:.0f} MB/s direct, {floor.relayed_mb_per_s:.0f} MB/s relayed)")
    for comp in comps:
        costs = {path: comp.machine_ms_per_mb(path) for path in PATHS}
        direct = costs["direct"]
        if direct is None:
            continue
        line = f"{comp.name} machine CPU per MB  " + "   ".join(
            f"{path} {cost:.2f} ms" for path, cost in costs.items() if cost is not None)
        if floor is not None:
            line += (f"   (with every core busy, even a bare relay would reach only "
                     f"{direct / (direct + floor.hop_ms_per_mb):.2f}x direct)")
        lines.append(line)
    return lines


def summary(produced: Comparison, consumed: Comparison, lat: dict[int, LatencyByPath], brokers: int,
            quotas: QuotaState, mem: memory.MemoryReport, machine: str,
            floor: relay_floor.RelayFloor | None = None) -> str:
    """The block people paste into issues: medians, ratios, targets, memory."""
    rounds = len(produced.runs) // len(PATHS)
    lines = [f"kthrottle bench (Kafka {KAFKA_VERSION}, {brokers} brokers, this machine: "
             f"{os.cpu_count()} cores; medians of {rounds} runs per path, MB = 10^6 bytes)", machine]
    lines += _throughput_lines(produced, PRODUCE_RATIO_TARGET)
    lines += _throughput_lines(consumed, CONSUME_RATIO_TARGET)
    lines += _latency_lines(lat)
    costs = []
    for comp in (produced, consumed):
        for path in PROXIED:
            cost = comp.proxy_cpu_ms_per_mb(path)
            if cost is not None:
                costs.append(f"{comp.name} {path} {cost:.2f} ms ({comp.proxy_faults_per_mb(path) or 0:.0f} "
                             "page faults)")
    if costs:
        lines.append("proxy CPU per MB  " + "   ".join(costs))
    lines += _ceiling_lines([produced, consumed], floor)
    lines.append(quotas.line())
    lines += mem.lines()
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def run(args: argparse.Namespace) -> str:
    """Start everything, measure, stop everything; returns the summary block."""
    load_start = _load()
    busy = cpu.sample_busy()
    if busy is not None and busy > BUSY_BEFORE_WARNING:
        print(f"note: the machine was already {100 * busy:.0f}% busy before the bench started; "
              "expect noisier figures", flush=True)
    print(f"memory: {memory.ENTITIES:,} (user, client-id) entities in a QuotaEngine (tracemalloc here, "
          f"RSS in a fresh interpreter), the producer-id Bloom filter at {memory.BLOOM_IDS:,} ids...",
          flush=True)
    began = time.monotonic()
    mem = memory.measure()
    print("\n".join(f"  {line}" for line in mem.lines()), flush=True)
    print(f"  ({time.monotonic() - began:.0f} s)", flush=True)
    print("the cost of one more TCP hop on this machine (a bare relay, direct vs relayed)...", flush=True)
    floor = relay_floor.measure()
    if floor is not None:
        print(f"  {floor.direct_ms_per_mb:.2f} ms per MB direct, {floor.relayed_ms_per_mb:.2f} ms relayed; "
              f"{floor.direct_mb_per_s:.0f} MB/s direct, {floor.relayed_mb_per_s:.0f} MB/s relayed",
              flush=True)
    print(f"starting {args.brokers} Kafka {KAFKA_VERSION} brokers...", flush=True)
    with (LocalKafka(brokers=args.brokers) as cluster,
          tempfile.TemporaryDirectory(prefix="kthrottle-bench-") as tmp):
        quota_path = Path(tmp) / "quotas.toml"
        quota_path.write_text(quota_file_text())
        proxies: dict[str, RunningProxy] = {}
        bench: Bench | None = None
        try:
            proxies["proxy"] = RunningProxy(cluster.bootstrap)
            check_listeners(proxies["proxy"], cluster.node_ids)
            metrics_port = free_port()
            proxies["proxy+quotas"] = start_quota_proxy(cluster.bootstrap, quota_path, metrics_port)
            check_listeners(proxies["proxy+quotas"], cluster.node_ids)
            print(f"cluster {cluster.bootstrap} (up in {cluster.startup_seconds or 0:.1f} s), "
                  + ", ".join(f"{path} {p.bootstrap} (pid {p.process.pid})" for path, p in proxies.items())
                  + f"; quota file {quota_path} ({2 + OTHER_QUOTA_ENTITIES} entities)", flush=True)
            bench = Bench(cluster, proxies, AdminClient({"bootstrap.servers": cluster.bootstrap}),
                          args.records, args.consume_records)
            produced = bench.produce_rounds(args.rounds, warmup_records=max(1, args.records // 4))
            consumed = bench.consume_rounds(args.rounds)
            lat = bench.produce_latency(args.samples, args.warmup)
            bench.check_alive()
            quotas = quota_state(metrics_port)
        finally:
            for proxy in proxies.values():
                proxy.stop()
            # librdkafka clients must be gone before the brokers, or they log reconnect failures.
            bench = None
            gc.collect()
    busy_note = f"; machine {100 * busy:.0f}% busy just before" if busy is not None else ""
    machine = f"load average (1/5/15 min): {load_start} at start, {_load()} at end{busy_note}"
    return summary(produced, consumed, lat, args.brokers, quotas, mem, machine, floor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description="direct vs proxy vs proxy+quotas throughput and latency on a local cluster, side by "
                    "side, and the memory of the quota state")
    parser.add_argument("--records", type=int, default=30_000, help="10 KB records per produce run")
    parser.add_argument("--consume-records", type=int, default=60_000,
                        help="10 KB records in the topic every consume run reads")
    parser.add_argument("--rounds", type=int, default=7, help="runs per path, alternating (at least 2)")
    parser.add_argument("--samples", type=int, default=5_000, help="timed produce round trips per path")
    parser.add_argument("--warmup", type=int, default=500, help="untimed produce round trips per path")
    parser.add_argument("--brokers", type=int, default=3)
    args = parser.parse_args(argv)
    if (args.rounds < 2 or min(args.records, args.consume_records, args.samples, args.brokers) < 1
            or args.warmup < 0):
        parser.error("need --rounds >= 2, --records, --consume-records, --samples, --brokers >= 1, "
                     "--warmup >= 0")
    began = time.monotonic()
    block = run(args)
    print()
    print(block)
    print(f"(bench took {time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
