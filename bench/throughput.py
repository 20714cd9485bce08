"""`make bench`: produce and consume throughput and produce latency, direct vs through the proxy.

One run starts one real 3-broker cluster and one proxy in front of it, and measures both paths
against the same brokers on the same machine at the same time, so the ratios mean something even
on a small, busy machine where the absolute figures do not. Figures are printed, never asserted:
the bench fails only when something breaks (records missing, client errors, the proxy dying).

Choices that keep the broker from being the bottleneck: topics have replication factor 1 (no
follower fetches competing with the proxy for the CPU; acks=1 waits for the leader only) and 6
partitions, two per broker. Records are not compressed, so the bytes counted are the bytes moved.
Direct and proxy runs alternate after an unmeasured warm-up of both paths, each produce run on a
fresh topic, and the median per path is reported, so neither warm-up nor drift favours a side.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from proxy.local_kafka import KAFKA_VERSION, LocalKafka
from tests.integration.proxies import RunningProxy

from . import cpu, latency

PARTITIONS = 6
REPLICATION_FACTOR = 1
RECORD_BYTES = 10_000
KEY_BYTES = 8
MB = 1_000_000
#: Targets are printed next to the figures for the reader; nothing checks them.
PRODUCE_RATIO_TARGET = 0.85
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
PATHS = ("direct", "proxy")
LatencyPair = tuple[latency.LatencyResult, latency.LatencyResult]
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

    @property
    def ratio(self) -> float:
        return self.median_mb_per_s("proxy") / self.median_mb_per_s("direct")

    @property
    def round_ratios(self) -> list[float]:
        """proxy/direct within each round: their spread shows how noisy the machine was."""
        pairs = zip(self._runs("direct"), self._runs("proxy"), strict=False)
        return sorted(p.mb_per_s / d.mb_per_s for d, p in pairs)

    @property
    def proxy_cpu_ms_per_mb(self) -> float | None:
        """The proxy's CPU cost per MB moved: comparable across machines, unlike the ratio."""
        costs = [1000 * r.proxy_cpu_s / (r.payload_bytes / MB)
                 for r in self._runs("proxy") if r.proxy_cpu_s is not None]
        return statistics.median(costs) if costs else None

    @property
    def proxy_faults_per_mb(self) -> float | None:
        """Minor page faults per MB: about 244 (10^6 B / 4 KB pages) per fresh buffer the bytes pass."""
        faults = [r.proxy_faults / (r.payload_bytes / MB)
                  for r in self._runs("proxy") if r.proxy_faults is not None]
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


def produce(path: str, bootstrap: str, topic: str, records: int) -> tuple[int, int, float]:
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


def consume(path: str, bootstrap: str, topic: str, records: int) -> tuple[int, int, float]:
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
        raise BenchFailure(f"{path}: all {records} records came in the first batch; use more --records")
    return timed_records, timed_bytes, seconds


# -- the bench ----------------------------------------------------------------------------------


class Bench:
    """One cluster, one proxy, one admin client, and the runs made through both paths."""

    def __init__(self, cluster: LocalKafka, proxy: RunningProxy, admin: AdminClient, records: int) -> None:
        self.cluster = cluster
        self.proxy = proxy
        self.admin = admin
        self.records = records
        self.bootstraps = {"direct": cluster.bootstrap, "proxy": proxy.bootstrap}
        self.tag = uuid.uuid4().hex[:8]

    def check_alive(self) -> None:
        """Fail at once with the proxy's log rather than after a run's time limit."""
        if not self.proxy.alive():
            raise BenchFailure(f"the proxy exited during the bench:\n{self.proxy.log()[-4000:]}")
        if not self.cluster.alive():
            raise BenchFailure("a Kafka broker exited during the bench")

    def timed(self, path: str, transfer: Callable[[], tuple[int, int, float]]) -> Run:
        """One run, with the proxy's CPU time and the machine's load over it."""
        self.check_alive()
        window = cpu.CpuWindow.open(self.proxy.process.pid)
        records, payload, seconds = transfer()
        usage = window.close()
        return Run(path, records, payload, seconds, usage.process_cpu_s, usage.process_faults, usage.busy,
                   usage.iowait)

    def alternate(self, rounds: int, measure: Callable[[str, int], Run]) -> list[Run]:
        """Direct, proxy, direct, proxy, ...; `measure(path, round)` makes one run."""
        runs: list[Run] = []
        for round_no in range(rounds):
            for path in PATHS:
                run = measure(path, round_no)
                print(f"  round {round_no + 1} {path:6} {run.mb_per_s:7.1f} MB/s "
                      f"{run.records_per_s:7.0f} rec/s {run.seconds:6.2f} s{_cpu_note(run)}", flush=True)
                runs.append(run)
        return runs

    def produce_rounds(self, rounds: int, warmup_records: int) -> tuple[Comparison, str]:
        """Alternating produce runs; returns them and one topic kept full for the consume runs."""
        for path in PATHS:  # unmeasured: JIT-warm the brokers, connect the proxy to each broker
            topic = f"bench-warmup-{path}-{self.tag}"
            create_topic(self.admin, topic)
            produce(path, self.bootstraps[path], topic, warmup_records)
            delete_topic(self.admin, topic)
        kept: list[str] = []

        def one(path: str, round_no: int) -> Run:
            topic = f"bench-produce-{path}-{round_no}-{self.tag}"
            create_topic(self.admin, topic)
            run = self.timed(path, lambda: produce(path, self.bootstraps[path], topic, self.records))
            if kept:
                delete_topic(self.admin, topic)
            else:
                kept.append(topic)
            return run

        print(f"produce: {self.records} x {RECORD_BYTES} B records, {PARTITIONS} partitions, replication "
              f"factor {REPLICATION_FACTOR}, acks=1, linger.ms=5, batch.size=1000000; fresh topic per run",
              flush=True)
        return Comparison("produce", self.alternate(rounds, one)), kept[0]

    def consume_rounds(self, rounds: int, topic: str) -> Comparison:
        """Alternating reads of one topic; unmeasured first reads warm the page cache and both paths."""
        for path in PATHS:
            consume(path, self.bootstraps[path], topic, self.records)
        print(f"consume: the same {self.records} records from {topic} each run, default fetch sizes, "
              "timed from the first batch of 1000", flush=True)
        runs = self.alternate(rounds, lambda path, _round: self.timed(
            path, lambda: consume(path, self.bootstraps[path], topic, self.records)))
        return Comparison("consume", runs)

    def produce_latency(self, samples: int, warmup: int) -> dict[int, LatencyPair]:
        """Per Produce version; direct goes to the leader's own port, proxy to the proxy's port for it."""
        self.check_alive()
        topic = f"bench-latency-{self.tag}"
        create_topic(self.admin, topic, partitions=1)
        leader = partition_leader(self.admin, topic, 0)
        direct = self.cluster.broker_address(leader)
        proxied = ("127.0.0.1", self.proxy.node_port(leader))
        print(f"latency: {latency.RECORD_BYTES} B acks=1 Produce over a raw socket, one at a time, to leader "
              f"node {leader} (direct {direct[0]}:{direct[1]}, proxy {proxied[0]}:{proxied[1]}); "
              f"{warmup} warm-up, {samples} timed each, interleaved in blocks", flush=True)
        found = latency.measure(direct, proxied, topic, 0, versions=LATENCY_VERSIONS, warmup=warmup,
                                samples=samples, time_limit_s=LATENCY_TIME_LIMIT_S)
        for version, results in found.items():
            for result in results:
                if len(result.samples_us) < samples:
                    print(f"  note: v{version} {result.path} kept {len(result.samples_us)} of {samples} "
                          f"samples (time limit {LATENCY_TIME_LIMIT_S:.0f} s)", flush=True)
                print(f"  v{version:<2} {result.path:6} p50 {result.p50:7.1f} us  p99 {result.p99:7.1f} us  "
                      f"mean {result.mean:7.1f} us  ({len(result.samples_us)} samples)", flush=True)
        delete_topic(self.admin, topic)
        return found


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


def _cpu_note(run: Run) -> str:
    parts = []
    if run.path == "proxy" and run.proxy_cpu_s is not None:
        parts.append(f"proxy CPU {100 * run.proxy_cpu_s / run.seconds:3.0f}% of a core")
        if run.proxy_faults is not None:
            parts.append(f"{run.proxy_faults / (run.payload_bytes / MB):4.0f} faults/MB")
    if run.machine_busy is not None:
        parts.append(f"machine {100 * run.machine_busy:3.0f}% busy")
    if run.machine_iowait is not None and run.machine_iowait >= IOWAIT_NOTE:
        parts.append(f"{100 * run.machine_iowait:.0f}% waiting on disk")
    return "   " + ", ".join(parts) if parts else ""


def summary(produced: Comparison, consumed: Comparison, lat: dict[int, LatencyPair], brokers: int) -> str:
    """The block people paste into issues: medians, ratios, targets."""
    rounds = len(produced.runs) // len(PATHS)
    lines = [f"kthrottle bench (Kafka {KAFKA_VERSION}, {brokers} brokers, this machine: "
             f"{os.cpu_count()} cores; medians of {rounds} runs per path, MB = 10^6 bytes)"]
    for comp, target in ((produced, PRODUCE_RATIO_TARGET), (consumed, None)):
        note = f"  (target >= {target:.2f})" if target is not None else ""
        sides = "   ".join(f"{path} {comp.median_mb_per_s(path):6.1f} MB/s "
                           f"{comp.median_records_per_s(path):6.0f} rec/s" for path in PATHS)
        spread = comp.round_ratios
        lines.append(f"{comp.name} 10KB   {sides}   ratio {comp.ratio:.2f}{note}"
                     f"  (per round {spread[0]:.2f}..{spread[-1]:.2f})")
    for version, (direct, proxied) in lat.items():
        label = "" if version == latency.PRODUCE_VERSION else f" (v{version})"
        goal = f"  (target <= {ADDED_P50_TARGET_US:.0f} us)" if version == latency.PRODUCE_VERSION else ""
        lines.append(f"produce 100B p50{label}  direct {direct.p50:6.1f} us   proxy {proxied.p50:6.1f} us   "
                     f"added {proxied.p50 - direct.p50:6.1f} us{goal}")
        lines.append(f"produce 100B p99{label}  direct {direct.p99:6.1f} us   proxy {proxied.p99:6.1f} us   "
                     f"added {proxied.p99 - direct.p99:6.1f} us")
    costs = [f"{c.name} {c.proxy_cpu_ms_per_mb:.2f} ms ({c.proxy_faults_per_mb or 0:.0f} page faults)"
             for c in (produced, consumed) if c.proxy_cpu_ms_per_mb is not None]
    if costs:
        lines.append("proxy CPU per MB  " + "   ".join(costs))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> str:
    """Start everything, measure, stop everything; returns the summary block."""
    busy = cpu.sample_busy()
    if busy is not None and busy > BUSY_BEFORE_WARNING:
        print(f"note: the machine was already {100 * busy:.0f}% busy before the bench started; "
              "expect noisier figures", flush=True)
    print(f"starting {args.brokers} Kafka {KAFKA_VERSION} brokers...", flush=True)
    with LocalKafka(brokers=args.brokers) as cluster:
        proxy = RunningProxy(cluster.bootstrap)
        bench: Bench | None = None
        try:
            check_listeners(proxy, cluster.node_ids)
            print(f"cluster {cluster.bootstrap} (up in {cluster.startup_seconds or 0:.1f} s), "
                  f"proxy {proxy.bootstrap} (pid {proxy.process.pid})", flush=True)
            bench = Bench(cluster, proxy, AdminClient({"bootstrap.servers": cluster.bootstrap}), args.records)
            produced, topic = bench.produce_rounds(args.rounds, warmup_records=max(1, args.records // 4))
            consumed = bench.consume_rounds(args.rounds, topic)
            delete_topic(bench.admin, topic)
            lat = bench.produce_latency(args.samples, args.warmup)
            bench.check_alive()
        finally:
            proxy.stop()
            # librdkafka clients must be gone before the brokers, or they log reconnect failures.
            bench = None
            gc.collect()
    return summary(produced, consumed, lat, args.brokers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description="direct vs proxy throughput and latency on a local 3-broker cluster, side by side")
    parser.add_argument("--records", type=int, default=20_000, help="10 KB records per throughput run")
    parser.add_argument("--rounds", type=int, default=7, help="runs per path, alternating (at least 2)")
    parser.add_argument("--samples", type=int, default=5_000, help="timed produce round trips per path")
    parser.add_argument("--warmup", type=int, default=500, help="untimed produce round trips per path")
    parser.add_argument("--brokers", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.records < 1 or args.samples < 1 or args.warmup < 0 or args.brokers < 1:
        parser.error("need --rounds >= 2, --records >= 1, --samples >= 1, --warmup >= 0, --brokers >= 1")
    began = time.monotonic()
    block = run(args)
    print()
    print(block)
    print(f"(bench took {time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
