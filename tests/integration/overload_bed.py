"""The overload bed (issue 27): a cluster whose broker, not this machine, is what overloads.

- One broker, its JVM held to BROKER_CORES of a core by a cgroup CPU quota (harness/cpu_limit.py,
  2 ms period: that module says why), after its JIT has warmed up.
- The bed's topic has `compression.type=gzip` at level 9, and the producers send incompressible
  records uncompressed, so the broker compresses every byte it appends: its CPU per byte is high
  while the clients' and the proxy's stay low. The broker saturates at about 12-30 MB/s, a rate
  the 2-core machine can carry through the proxy with CPU to spare (it is 27-40 % busy then).
- Gold (share 10): 200 acks=all records of 1 KB a second, in a process of its own; three
  best-effort producers (share 1 each) flat out, acks=all, 4 KB records in 16 KB batches, in
  another (bed_clients.py says why processes).
- A phase lasts PHASE_S; gold's latencies count after its first SKIP_S, goodput over the last
  GOODPUT_S.

Used by tests/integration/test_overload_bed.py and bench/overload.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from harness.cpu_limit import CpuLimit
from harness.local_kafka import LocalKafka
from tests.integration.bed_clients import BedClient, start_flat, start_gold
from tests.integration.test_quotas import _topic

BROKER_CORES = 0.5
PHASE_S = 18
SKIP_S = 4
GOODPUT_S = 12
QUIET_S = 4
QUIET_RUNS = 3
#: after a phase, the broker drains what was queued before the next one starts (`settle`)
SETTLE_S = 30
SETTLED_P99_MS = 15.0
SHARES = ('[[quota]]\nclient_id = "gold"\nshare = 10\n\n'
          '[[quota]]\nclient_id = "<default>"\nshare = 1\n')


@dataclass(frozen=True)
class Phase:
    """Gold's p50 and p99 (ms), and the best-effort producers' acknowledged bytes/s."""

    p50: float
    p99: float
    goodput: float


@dataclass
class Bed:
    kafka: LocalKafka
    topic: str
    limit: CpuLimit
    #: what its load moves, as a `[capacity]` names it
    direction = "produce_byte_rate"
    #: what a proxy in front of it needs beside its quotas (nothing: plaintext)
    proxy_config = ""

    @property
    def title(self) -> str:
        return f"overload bed (broker at {self.limit.cores} core)"

    @property
    def direct(self) -> str:
        return self.kafka.bootstrap

    def quiet_at(self, bootstrap: str) -> Phase:
        return quiet(bootstrap, self.topic)

    def overloaded_at(self, bootstrap: str) -> Phase:
        return overloaded(bootstrap, self.topic)

    def settle_at(self, bootstrap: str) -> None:
        settle(bootstrap, self.topic)

    def gold_at(self, bootstrap: str, seconds: float) -> BedClient:
        return start_gold(bootstrap, self.topic, seconds)


@contextlib.contextmanager
def overload_bed() -> Iterator[Bed]:
    """The bed's cluster and topic, its broker warmed up and then held to BROKER_CORES."""
    with LocalKafka(brokers=1, heap_mb=512) as kafka:
        topic = _topic(kafka.bootstrap, "bed")
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
            ConfigEntry("compression.type", "gzip", incremental_operation=AlterConfigOpType.SET),
            ConfigEntry("compression.gzip.level", "9", incremental_operation=AlterConfigOpType.SET)])
        for future in admin.incremental_alter_configs([resource]).values():
            future.result(30)
        start_flat(kafka.bootstrap, topic, 8).result()  # the JIT warms up unlimited
        with CpuLimit(kafka.pid(1), BROKER_CORES, "kthrottle-bed") as limit:
            settle(kafka.bootstrap, topic)
            yield Bed(kafka, topic, limit)


def settle(bootstrap: str, topic: str) -> None:
    """Wait until the broker has drained what the last phase queued: gold alone for 3 s at a
    time until its p99 is below SETTLED_P99_MS (at most SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if start_gold(bootstrap, topic, 3).result().gold_percentiles(0)[1] < SETTLED_P99_MS:
            return


def quiet(bootstrap: str, topic: str) -> Phase:
    """Gold alone: the lowest p50 and p99 of QUIET_RUNS runs of QUIET_S. Whatever else happens
    meanwhile only adds to them: one GC pause of the broker's moved a run's p99 from 1.5 to 68 ms,
    and beside the suite's other workers the median of three read 3.4-17.9 ms where alone it
    reads 0.6-0.7 ms (h15: a 13 ms quiet p99 made a 46 ms overload read as 3.4x)."""
    runs = [start_gold(bootstrap, topic, QUIET_S).result().gold_percentiles(1) for _ in range(QUIET_RUNS)]
    return Phase(min(p50 for p50, _ in runs), min(p99 for _, p99 in runs), 0.0)


def overloaded(bootstrap: str, topic: str, paced: float | None = None) -> Phase:
    """Gold beside the three flat-out producers; `paced`: beside one producer sending this many
    bytes/s evenly instead (the bench's measure of what the broker allows gold at a given load)."""
    gold = start_gold(bootstrap, topic, PHASE_S)
    flat = (start_flat(bootstrap, topic, PHASE_S) if paced is None
            else start_flat(bootstrap, topic, PHASE_S, producers=1, offered_rate=paced))
    flat_result, gold_result = flat.result(), gold.result()
    p50, p99 = gold_result.gold_percentiles(SKIP_S)
    return Phase(p50, p99, flat_result.goodput(PHASE_S - GOODPUT_S, PHASE_S))


def capacity_table(capacity: float, adaptive: bool, controller: str = "aimd",
                   direction: str = "produce_byte_rate") -> str:
    """A `[capacity]` for the proxy: `capacity` bytes/s in `direction`, adaptive or not."""
    table = f"\n[capacity]\n{direction} = {int(capacity)}\nadaptive = {str(adaptive).lower()}\n"
    if adaptive:
        table += f'controller = "{controller}"\n'
    return table


__all__ = [
    "BROKER_CORES",
    "SHARES",
    "Bed",
    "Phase",
    "capacity_table",
    "overload_bed",
    "overloaded",
    "quiet",
    "settle",
]
