"""What the quota state costs in memory: 10,000 (user, client-id) buckets, and a producer-id filter.

Entities: one `QuotaEngine` with produce, fetch and request quotas on `user <default>, client-id
<default>`, so every (user, client-id) pair gets its own bucket in each of the three managers,
as on a broker. 100 users x 100 client-ids are charged (produce bytes, fetch bytes, request time)
once per second of a fake clock for 12 seconds: by then every rate holds its full ring of samples
(`quota.window.num` + 1 = 12), the steady state of a client that keeps sending. The cost is read
twice: with tracemalloc in this process (what Python allocated, exact), and as the growth of VmRSS
in a fresh interpreter without tracemalloc (what the machine pays, allocator slack included).

A flood of client ids (issue 10): 200,000 distinct client ids under a `client-id <default>` quota
(produce, fetch, request), each charged once, 20,000 per second of fake time, with `expire_idle`
called once per fake second as the proxy does. Read at the peak (all ids within the rates' 11 s of
history) and again after the expiry has run until no bucket is left; with the default cap
(`EngineConfig.max_buckets`) beside its budget, and without a cap for comparison. Client-id
strings are made per charge, as the wire decoder makes them, so the ones the engine keeps count.

Producer ids: a `BloomFilter(100_000, 0.01)` takes 100k random 63-bit ids and is probed with 100k
other ids; every hit is a false positive (a new producer id that the quota would not charge).

Figures are printed, never asserted; the bench fails only if the engine keeps the wrong number of
buckets or throttles within these quotas (broken behaviour, not slowness).

`python -m bench.memory` runs this part alone.
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import DEFAULT, QuotaEntity
from quotas.manager import DEFAULT_MAX_BUCKETS
from quotas.producer_ids import MAX_LAYERS, BloomFilter
from quotas.types import QuotaType

USERS = 100
CLIENTS = 100
ENTITIES = USERS * CLIENTS
#: One charge per second of fake time; 12 fills the 11 + 1 samples of Kafka's default window.
CHARGES = 12
CHARGE_INTERVAL_MS = 1000
#: Quotas far above what the charges reach: this measures memory, not throttling.
BYTE_RATE = 10_000_000_000.0
REQUEST_PERCENTAGE = 100_000.0
ENTITY_TARGET_MB = 100.0
BLOOM_IDS = 100_000
BLOOM_FP_RATE = 0.01
MB = 1_000_000
KIB = 1024
CHILD_TIMEOUT_S = 300.0
#: The client-id flood: distinct ids, how many arrive per second of fake time.
FLOOD_IDS = 200_000
FLOOD_IDS_PER_SECOND = 20_000
#: Quota types a `<default>` client-id flood creates buckets in (produce, fetch, request).
FLOOD_QUOTA_TYPES = 3
#: The cap's budget per bucket: a bucket charged once measures ~0.75 KB traced and ~0.85 KB of RSS
#: (its share of the resolution cache included), so the flood at the cap must stay under
#: max_buckets x 3 quota types x 1 KB.
BUCKET_BUDGET_BYTES = 1000
FLOOD_BUDGET_MB = DEFAULT_MAX_BUCKETS * FLOOD_QUOTA_TYPES * BUCKET_BUDGET_BYTES / MB
#: What may stay once every bucket expired: emptied dicts keep their tables until they shrink.
AFTER_EXPIRY_BUDGET_MB = 5.0
REPO = Path(__file__).resolve().parents[1]


class MemoryBenchFailure(RuntimeError):
    """The engine did something wrong (bucket count, a throttle): the figures would mean nothing."""


@dataclass(frozen=True, slots=True)
class EntityMemory:
    """Bytes the 10,000 pairs added: after their first charge and after `CHARGES` charges each."""

    first_bytes: int
    full_bytes: int
    buckets: int
    seconds: float


@dataclass(frozen=True, slots=True)
class BloomResult:
    ids: int
    probes: int
    false_positives: int
    hashes: int
    bit_array_bytes: int
    traced_bytes: int
    add_us: float
    probe_us: float
    #: The engine's own per-user filters: capacity, layers at most, users at most, bytes per layer.
    engine_capacity: int
    engine_max_users: int
    engine_layer_bytes: int

    @property
    def rate(self) -> float:
        return self.false_positives / self.probes

    @property
    def engine_bound_bytes(self) -> int:
        """MAX_LAYERS per user at most (a layer lives 1.5 windows, a new one starts every half)."""
        return MAX_LAYERS * self.engine_layer_bytes * self.engine_max_users


@dataclass(frozen=True, slots=True)
class FloodMemory:
    """The client-id flood, read at its peak and after the expiry emptied the engine."""

    max_buckets: int | None
    peak_bytes: int
    after_bytes: int
    #: live buckets per quota type at the peak, and charges that went to the overflow bucket
    peak_buckets: int
    overflow_charges: int
    #: expire_idle calls (one per fake second) from the peak until nothing was left, and their cost
    expiry_calls: int
    expiry_ms_median: float
    expiry_ms_max: float
    seconds: float

    @property
    def label(self) -> str:
        return "uncapped" if self.max_buckets is None else f"cap {self.max_buckets:,}"

    def line(self, kind: str, budget: bool) -> str:
        over = f" (budget {FLOOD_BUDGET_MB:.0f} MB)" if budget else ""
        after = (f" (budget {AFTER_EXPIRY_BUDGET_MB:.0f} MB)" if budget and kind == "tracemalloc"
                 else " (freed pages stay with the allocator)" if kind == "RSS" else "")
        return (f"  {self.label:>12} {kind:>11}: peak {self.peak_bytes / MB:6.1f} MB{over}, "
                f"after expiry {self.after_bytes / MB:5.1f} MB{after}   [{self.peak_buckets:,} buckets "
                f"per quota type, {self.overflow_charges:,} overflowed charges; "
                f"{self.peak_bytes / FLOOD_IDS:.0f} B per id]")


@dataclass(frozen=True, slots=True)
class MemoryReport:
    traced: EntityMemory
    rss: EntityMemory
    bloom: BloomResult
    #: the client-id flood: (traced, RSS) with the default cap, then without a cap
    flood: tuple[tuple[FloodMemory, FloodMemory], tuple[FloodMemory, FloodMemory]]

    def lines(self) -> list[str]:
        t, r, b = self.traced, self.rss, self.bloom
        (capped_t, capped_r), (free_t, free_r) = self.flood
        return [
            f"{ENTITIES:,} entities: {t.full_bytes / MB:.1f} MB (tracemalloc), "
            f"{r.full_bytes / MB:.1f} MB RSS (target < {ENTITY_TARGET_MB:.0f} MB)   "
            "[produce+fetch+request buckets per (user, client-id), "
            f"{CHARGES} charges each, full sample rings; after 1 charge: {t.first_bytes / MB:.1f} MB traced, "
            f"{r.first_bytes / MB:.1f} MB RSS; {t.full_bytes / ENTITIES:.0f} B per entity]",
            f"producer-id Bloom filter, {b.ids // 1000}k PIDs at {BLOOM_FP_RATE:.0%}: false positives "
            f"{100 * b.rate:.2f}% ({b.false_positives:,} of {b.probes:,} probes), {b.hashes} hashes, "
            f"{b.bit_array_bytes / KIB:.0f} KiB bits ({b.traced_bytes / KIB:.0f} KiB traced), "
            f"add {b.add_us:.1f} us, probe {b.probe_us:.1f} us   [engine default: {b.engine_capacity:,} ids "
            f"per layer = {b.engine_layer_bytes / KIB:.1f} KiB, <= {MAX_LAYERS} layers x "
            f"{b.engine_max_users:,} users = {b.engine_bound_bytes / MB:.1f} MB]",
            f"{FLOOD_IDS:,} client ids under client-id <default> (produce+fetch+request, one charge each, "
            f"{FLOOD_IDS_PER_SECOND:,}/s):",
            capped_t.line("tracemalloc", True),
            capped_r.line("RSS", True),
            free_t.line("tracemalloc", False),
            free_r.line("RSS", False),
            f"  expiry, 1 call per second (timed without tracemalloc): {capped_r.expiry_calls} calls to "
            f"empty the capped engine, {capped_r.expiry_ms_median:.1f} ms median, "
            f"{capped_r.expiry_ms_max:.1f} ms max per call (uncapped: {free_r.expiry_calls} calls, "
            f"{free_r.expiry_ms_median:.1f} ms median, {free_r.expiry_ms_max:.1f} ms max)",
        ]


# -- entities -----------------------------------------------------------------------------------


def _engine() -> QuotaEngine:
    engine = QuotaEngine(EngineConfig())
    engine.set_quotas({QuotaEntity(DEFAULT, DEFAULT): {
        QuotaType.PRODUCE: BYTE_RATE, QuotaType.FETCH: BYTE_RATE, QuotaType.REQUEST: REQUEST_PERCENTAGE}})
    return engine


def _names() -> tuple[list[str], list[str]]:
    return [f"user-{u:03d}" for u in range(USERS)], [f"client-{c:03d}" for c in range(CLIENTS)]


def _charge_round(engine: QuotaEngine, users: list[str], clients: list[str], now_ms: int) -> int:
    """One charge for every pair; returns how many were throttled (none should be)."""
    throttled = 0
    for user in users:
        for client in clients:
            verdict = engine.charge(user, client, now_ms, produce_bytes=1_000, fetch_bytes=10_000,
                                    request_time_ms=0.5)
            throttled += verdict.throttle_ms > 0
    return throttled


def _check(engine: QuotaEngine, throttled: int) -> int:
    counts = {t.value: len(m.buckets) for t, m in engine.managers.items()}
    expected = {QuotaType.PRODUCE.value: ENTITIES, QuotaType.FETCH.value: ENTITIES,
                QuotaType.REQUEST.value: ENTITIES, QuotaType.PRODUCER_IDS.value: 0}
    if counts != expected:
        raise MemoryBenchFailure(f"engine holds {counts} buckets, expected {expected}")
    if throttled:
        raise MemoryBenchFailure(f"{throttled} charges were throttled under quotas they cannot reach")
    return counts[QuotaType.PRODUCE.value]


def _traced_bytes() -> int:
    return tracemalloc.get_traced_memory()[0]


def _rss_bytes() -> int:
    """VmRSS of this process, in bytes (Linux); 0 elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _entity_memory(read_bytes: Callable[[], int]) -> EntityMemory:
    """Build the engine and the names first, so only what the charges create is counted."""

    def read() -> int:  # after a full collection, so garbage does not count
        gc.collect()
        return read_bytes()

    engine = _engine()
    users, clients = _names()
    start = time.perf_counter()
    base = read()
    throttled = _charge_round(engine, users, clients, 0)
    first = read() - base
    for charge in range(1, CHARGES):
        throttled += _charge_round(engine, users, clients, charge * CHARGE_INTERVAL_MS)
    full = read() - base
    buckets = _check(engine, throttled)
    return EntityMemory(first, full, buckets, time.perf_counter() - start)


def entity_memory_traced() -> EntityMemory:
    """In this process, with tracemalloc on only for the measurement (it slows every allocation)."""
    tracemalloc.start()
    try:
        return _entity_memory(_traced_bytes)
    finally:
        tracemalloc.stop()


def entity_memory_rss() -> EntityMemory:
    """In a fresh interpreter, so this process's heap (and its free lists) cannot absorb the growth."""
    done = subprocess.run([sys.executable, "-m", "bench.memory", "--rss-child"], cwd=REPO,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise MemoryBenchFailure(f"the RSS measurement failed (exit {done.returncode}):\n"
                                 f"{done.stderr[-4000:]}")
    fields = json.loads(done.stdout.strip().splitlines()[-1])
    return EntityMemory(**fields)


# -- a flood of client ids ---------------------------------------------------------------------


def _flood(read_bytes: Callable[[], int], max_buckets: int | None) -> FloodMemory:
    """Charge FLOOD_IDS new client ids, then let the expiry run down; bytes are read after a
    full collection, relative to the engine built with its quotas."""

    def read() -> int:
        gc.collect()
        return read_bytes()

    engine = QuotaEngine(EngineConfig(max_buckets=max_buckets))
    engine.set_quotas({QuotaEntity(None, DEFAULT): {
        QuotaType.PRODUCE: BYTE_RATE, QuotaType.FETCH: BYTE_RATE, QuotaType.REQUEST: REQUEST_PERCENTAGE}})
    started = time.perf_counter()
    base = read()
    throttled = 0
    now_ms = 0
    for i in range(FLOOD_IDS):
        # an int made per charge, as the proxy's clock gives; the id string made per charge too
        now_ms = i * 1000 // FLOOD_IDS_PER_SECOND
        verdict = engine.charge("ANONYMOUS", f"flood-client-{i:06d}", now_ms, produce_bytes=1_000,
                                fetch_bytes=10_000, request_time_ms=0.5)
        throttled += verdict.throttle_ms > 0
        if (i + 1) % FLOOD_IDS_PER_SECOND == 0:
            engine.expire_idle(now_ms)
    if throttled:
        raise MemoryBenchFailure(f"{throttled} flood charges were throttled under quotas they cannot reach")
    counts = engine.bucket_counts()
    peak_buckets = counts[QuotaType.PRODUCE]
    expected = FLOOD_IDS if max_buckets is None else max_buckets + 1  # + the overflow bucket
    if any(counts[t] != expected for t in (QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST)):
        raise MemoryBenchFailure(f"the flood left {counts} buckets, expected {expected} per quota type")
    overflow = engine.overflow_counts()[QuotaType.PRODUCE]
    peak = read() - base
    costs: list[float] = []
    while (any(engine.bucket_counts().values())
           or any(manager.cached_resolutions for manager in engine.managers.values())):
        if len(costs) > 10_000:
            raise MemoryBenchFailure(f"the expiry left {engine.bucket_counts()} after {len(costs)} calls")
        now_ms += 1000
        began = time.perf_counter()
        engine.expire_idle(now_ms)
        costs.append((time.perf_counter() - began) * 1000)
    after = read() - base
    costs.sort()
    return FloodMemory(max_buckets, peak, after, peak_buckets, overflow, len(costs), costs[len(costs) // 2],
                       costs[-1], time.perf_counter() - started)


def flood_traced(max_buckets: int | None) -> FloodMemory:
    tracemalloc.start()
    try:
        return _flood(_traced_bytes, max_buckets)
    finally:
        tracemalloc.stop()


def flood_rss(max_buckets: int | None) -> FloodMemory:
    """In a fresh interpreter (see entity_memory_rss); RSS rarely shrinks when Python frees memory."""
    cap = "none" if max_buckets is None else str(max_buckets)
    done = subprocess.run([sys.executable, "-m", "bench.memory", "--rss-flood-child", cap], cwd=REPO,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise MemoryBenchFailure(f"the flood RSS measurement failed (exit {done.returncode}):\n"
                                 f"{done.stderr[-4000:]}")
    return FloodMemory(**json.loads(done.stdout.strip().splitlines()[-1]))


def flood_memory() -> tuple[tuple[FloodMemory, FloodMemory], tuple[FloodMemory, FloodMemory]]:
    return ((flood_traced(DEFAULT_MAX_BUCKETS), flood_rss(DEFAULT_MAX_BUCKETS)),
            (flood_traced(None), flood_rss(None)))


# -- producer-id Bloom filter -------------------------------------------------------------------


def bloom_false_positives(ids: int = BLOOM_IDS, fp_rate: float = BLOOM_FP_RATE,
                          seed: int = 936) -> BloomResult:
    rng = random.Random(seed)
    added: set[int] = set()
    while len(added) < ids:
        added.add(rng.getrandbits(63))
    probes: list[int] = []
    while len(probes) < ids:
        pid = rng.getrandbits(63)
        if pid not in added:
            probes.append(pid)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        bloom = BloomFilter(ids, fp_rate)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    start = time.perf_counter()
    for pid in added:
        bloom.add(pid)
    add_s = time.perf_counter() - start
    start = time.perf_counter()
    false_positives = sum(1 for pid in probes if pid in bloom)
    probe_s = time.perf_counter() - start
    missing = sum(1 for pid in list(added)[:1000] if pid not in bloom)
    if missing:
        raise MemoryBenchFailure(f"the Bloom filter lost {missing} of 1000 ids it was given")
    config = EngineConfig()
    layer = BloomFilter(config.pid_filter_capacity, config.pid_false_positive_rate)
    return BloomResult(ids, len(probes), false_positives, bloom.hashes, bloom.memory_bytes, traced,
                       add_s / ids * 1e6, probe_s / len(probes) * 1e6, config.pid_filter_capacity,
                       config.pid_max_users, layer.memory_bytes)


def measure() -> MemoryReport:
    traced = entity_memory_traced()
    rss = entity_memory_rss()
    return MemoryReport(traced, rss, bloom_false_positives(), flood_memory())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--rss-child"]:
        result = _entity_memory(_rss_bytes)
        print(json.dumps({"first_bytes": result.first_bytes, "full_bytes": result.full_bytes,
                          "buckets": result.buckets, "seconds": result.seconds}))
        return 0
    if len(args) == 2 and args[0] == "--rss-flood-child":
        flood = _flood(_rss_bytes, None if args[1] == "none" else int(args[1]))
        print(json.dumps({name: getattr(flood, name) for name in FloodMemory.__slots__}))
        return 0
    if args:
        print("usage: python -m bench.memory", file=sys.stderr)
        return 2
    report = measure()
    print(f"entities: tracemalloc run {report.traced.seconds:.1f} s, RSS run {report.rss.seconds:.1f} s; "
          f"flood runs {', '.join(f'{f.seconds:.0f} s' for pair in report.flood for f in pair)}")
    print("\n".join(report.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
