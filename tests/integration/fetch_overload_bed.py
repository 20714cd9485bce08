"""The fetch overload bed (issue 27's consumer case): consumers catching up overload the broker.

A plaintext Fetch costs a broker little: it sends the log's bytes from the page cache without
copying them (sendfile), and three consumers flat out moved gold's p99 from 1.1 to 7.0 ms on the
produce bed's broker. Over TLS the broker encrypts every byte it sends, so a backlog read flat out
costs it CPU per byte, as on a real cluster with TLS listeners:
- One broker with SSL listeners, its JVM held to BROKER_CORES of a core (harness/cpu_limit.py),
  after its JIT has warmed up on the same work unlimited. It runs as Kafka's own scripts start one
  (HEAP_MB, and their G1 collector: `LocalKafka(kafka_gc=True)`), since gold's slow answers follow
  the broker's collections here, which follow the bytes it encrypts.
- The backlog: FILL_MB of incompressible 10 KB records in 64 KB batches (a broker sends a batch
  whole), in a topic of PARTITIONS partitions, written before the quota (it stays in the page
  cache: the bed loads the CPU, not the disk).
- Three best-effort consumers (share 1 each), each in a group of its own from the earliest
  offset, flat out over TLS; gold (share 10): 200 acks=all records of 1 KB a second, to a topic
  of its own on the same broker, over TLS.
- Through a proxy, the clients speak plaintext to it and it speaks TLS to the broker
  (`[upstream_tls]`), so the broker does the same work on every path.

docs/protecting-the-cluster.md has the figures of each path (the concurrency limit, which counts a
catching-up consumer's Fetch, protects gold best) and what they show. Used by bench/fetch_overload.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from harness.cpu_limit import CpuLimit
from harness.kafka_jars import java_executable
from harness.local_kafka import LocalKafka
from tests.integration import overload_bed
from tests.integration.bed_clients import BedClient, start_consumers, start_gold, start_paced_fetcher
from tests.integration.overload_bed import GOODPUT_S, PHASE_S, QUIET_RUNS, QUIET_S, SETTLE_S, SKIP_S, Phase

BROKER_CORES = 0.5
#: Kafka's own default (bin/kafka-server-start.sh's -Xmx1G). With 512 MB the broker collected its
#: young generation 8-13 times per 18 s phase, each stopping it for 10-16 ms under the quota, and
#: gold's slow answers followed the collections whatever the proxy did (docs/protecting-the-cluster.md).
HEAP_MB = 1024
#: the backlog: the consumers read at most ~150 MB/s each on this machine, for PHASE_S seconds
FILL_MB = 4000
PARTITIONS = 6
RECORD_BYTES = 10_000


@dataclass
class FetchBed:
    kafka: LocalKafka
    backlog: str
    gold_topic: str
    limit: CpuLimit

    @property
    def ca(self) -> str:
        assert self.kafka.certificates is not None
        return str(self.kafka.certificates.ca)

    def collections(self) -> tuple[int, float]:
        """The broker JVM's garbage collections so far, and the seconds they took (jstat, from the
        JDK that runs it): on this bed gold's slow answers follow them (the module's docstring)."""
        jstat = Path(java_executable()).resolve().parent / "jstat"
        lines = subprocess.run([str(jstat), "-gc", str(self.kafka.pid(1))], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split("\n")
        figures = dict(zip(lines[0].split(), lines[1].split(), strict=True))
        return int(figures["YGC"]) + int(figures["FGC"]), float(figures["GCT"])

    @property
    def upstream_tls(self) -> str:
        """The `[upstream_tls]` table a proxy in front of the bed needs."""
        return f'\n[upstream_tls]\nca = "{self.ca}"\n'

    # -- what one run of tests/integration/overload_runs.py needs ------------------------------
    direction = "fetch_byte_rate"

    @property
    def proxy_config(self) -> str:
        return self.upstream_tls

    @property
    def title(self) -> str:
        return f"fetch overload bed (broker at {self.limit.cores} core, TLS)"

    @property
    def direct(self) -> str:
        """The broker's SSL listener."""
        assert self.kafka.ssl_bootstrap is not None, "the fetch bed has no SSL listener"
        return self.kafka.ssl_bootstrap

    def _ca(self, bootstrap: str) -> str | None:
        """The CA to trust at `bootstrap`: the broker's listener is TLS, a proxy in front is plaintext."""
        return self.ca if bootstrap == self.direct else None

    def quiet_at(self, bootstrap: str) -> Phase:
        return quiet(bootstrap, self, self._ca(bootstrap))

    def overloaded_at(self, bootstrap: str) -> Phase:
        return overloaded(bootstrap, self, self._ca(bootstrap))

    def settle_at(self, bootstrap: str) -> None:
        settle(bootstrap, self, self._ca(bootstrap))

    def gold_at(self, bootstrap: str, seconds: float) -> BedClient:
        return start_gold(bootstrap, self.gold_topic, seconds, ssl_ca=self._ca(bootstrap))


def _fill(bootstrap: str, topic: str, megabytes: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 65_536})
    value = os.urandom(RECORD_BYTES)
    for _ in range(megabytes * 1_000_000 // RECORD_BYTES):
        while True:
            try:
                producer.produce(topic, value)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(120) == 0, "the backlog was not all written"


@contextlib.contextmanager
def fetch_overload_bed() -> Iterator[FetchBed]:
    """The bed's cluster, its backlog and gold's topic; the broker warmed up, then held."""
    with LocalKafka(brokers=1, heap_mb=HEAP_MB, tls=True, kafka_gc=True) as kafka:
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        backlog, gold_topic = "fetch-backlog", "fetch-gold"
        for name, partitions in ((backlog, PARTITIONS), (gold_topic, 1)):
            admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
        _fill(kafka.bootstrap, backlog, FILL_MB)
        assert kafka.ssl_bootstrap is not None and kafka.certificates is not None
        ca = str(kafka.certificates.ca)
        start_consumers(kafka.ssl_bootstrap, backlog, 10, ssl_ca=ca).result()  # the JIT warms up unlimited
        with CpuLimit(kafka.pid(1), BROKER_CORES, "kthrottle-fetch-bed") as limit:
            bed = FetchBed(kafka, backlog, gold_topic, limit)
            settle(kafka.ssl_bootstrap, bed, ca)
            yield bed


def _gold(bootstrap: str, bed: FetchBed, seconds: float, ssl_ca: str | None,
          after_s: float = 0.0) -> tuple[float, float]:
    return start_gold(bootstrap, bed.gold_topic, seconds, ssl_ca=ssl_ca).result().gold_percentiles(after_s)


def settle(bootstrap: str, bed: FetchBed, ssl_ca: str | None) -> None:
    """Gold alone for 3 s at a time until its p99 is below 15 ms (at most SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and _gold(bootstrap, bed, 3, ssl_ca)[1] >= 15.0:
        pass


def quiet(bootstrap: str, bed: FetchBed, ssl_ca: str | None) -> Phase:
    """Gold alone: the lowest p50 and p99 of QUIET_RUNS runs (overload_bed.quiet says why), each
    after its first second, as on the produce bed: counted from gold's first record, a run's p99 took
    in its connection's start (TLS directly) and read 0.9-20.9 ms from run to run."""
    runs = [_gold(bootstrap, bed, QUIET_S, ssl_ca, after_s=1.0) for _ in range(QUIET_RUNS)]
    return Phase(min(p50 for p50, _ in runs), min(p99 for _, p99 in runs), 0.0)


def overloaded(bootstrap: str, bed: FetchBed, ssl_ca: str | None, paced: float | None = None) -> Phase:
    """Gold beside the three consumers; goodput is the record bytes/s the consumers received.
    `paced`: beside one consumer reading that many bytes/s evenly, one Fetch at a time, instead
    (paced_fetcher.py: the floor)."""
    gold = start_gold(bootstrap, bed.gold_topic, PHASE_S, ssl_ca=ssl_ca)
    consumers = (start_consumers(bootstrap, bed.backlog, PHASE_S, ssl_ca=ssl_ca) if paced is None
                 else start_paced_fetcher(bootstrap, bed.backlog, PARTITIONS, PHASE_S, paced, ssl_ca=ssl_ca))
    consumed, gold_result = consumers.result(), gold.result()
    p50, p99 = gold_result.gold_percentiles(SKIP_S)
    return Phase(p50, p99, consumed.consumed(PHASE_S - GOODPUT_S, PHASE_S))


def capacity_table(capacity: float, adaptive: bool, controller: str = "aimd") -> str:
    """A `[capacity]` for the proxy: `capacity` fetch bytes/s, adaptive or not."""
    return overload_bed.capacity_table(capacity, adaptive, controller, direction="fetch_byte_rate")


__all__ = ["BROKER_CORES", "FetchBed", "capacity_table", "fetch_overload_bed", "overloaded", "quiet",
           "settle"]
