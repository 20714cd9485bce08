"""`python -m bench.capacity`: what sharing a cluster capacity (issue 21) costs.

1. The decision: QuotaEngine.charge of a produce (with a quota) with no `[capacity]`, with one
   never reached, and with one every tenant is over (water-filling binding, token buckets
   deciding), min of repeats; the ratio to "off" is the figure (issue target: at most 1.2x).
   Also one refresh (measure every tenant, water-fill) at 100, 1,000 and 10,000 tenants.
2. The exchange: bytes per entity of a full usage report, with and without the capacity's
   demand stream (one more entry per tenant and direction) and the adaptive factor.
3. Throughput: produce and consume of 10 KB records direct, through a plain proxy and through a
   proxy with a `[capacity]` never reached (and `share`s for the bench clients), alternating
   rounds on one 3-broker cluster, medians (bench/throughput.py's clients).

Figures are printed, never asserted; it fails only when something breaks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import timeit
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient

from harness.local_kafka import LocalKafka
from quotas.adaptive_capacity import AdaptiveConfig
from quotas.capacity import REFRESH_INTERVAL_MS, CapacityConfig
from quotas.engine import QuotaEngine
from quotas.entity import DEFAULT, QuotaEntity
from quotas.fleet import encode_usage
from quotas.types import EntitySetting, QuotaType
from tests.integration.proxies import RunningProxy

from .throughput import BenchFailure, consume, create_topic, delete_topic, produce

SECRET = b"bench-secret-0123456789abcdef"


def _engine(capacity: CapacityConfig | None, tenants: int = 100, quota: float = 1e12) -> QuotaEngine:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, DEFAULT): {QuotaType.PRODUCE: quota, EntitySetting.SHARE: 1.0}})
    if capacity is not None:
        engine.capacity.configure(capacity)
    for i in range(tenants):
        engine.charge("u", f"c{i}", 0, produce_bytes=10_000)
    engine.capacity.refresh(REFRESH_INTERVAL_MS)
    return engine


def decision_cost() -> list[str]:
    # (capacity, quota): every charge of "binding" is throttled by the capacity, of "quota binding"
    # by a Kafka quota with no capacity: what a throttled decision costs without sharing
    cases = {"off": (None, 1e12), "never reached": (CapacityConfig(produce_byte_rate=1e12), 1e12),
             "binding": (CapacityConfig(produce_byte_rate=1_000.0), 1e12), "quota binding": (None, 1_000.0)}
    costs: dict[str, float] = {}
    for name, (config, quota) in cases.items():
        engine = _engine(config, quota=quota)
        clock = iter(range(1_000, 10**9))
        charge = engine.charge

        def one(charge=charge, clock=clock) -> None:  # type: ignore[no-untyped-def]
            charge("u", "c7", next(clock) // 1000, produce_bytes=10_000)

        costs[name] = min(timeit.repeat(one, number=20_000, repeat=5)) / 20_000 * 1e6
    lines = [f"decision  QuotaEngine.charge (produce, with a quota): capacity off {costs['off']:.2f} us; "
             f"never reached {costs['never reached']:.2f} us ({costs['never reached'] / costs['off']:.2f}x); "
             f"binding {costs['binding']:.2f} us ({costs['binding'] / costs['off']:.2f}x)  (target <= 1.2x); "
             f"a Kafka quota binding, capacity off: {costs['quota binding']:.2f} us (capacity binding "
             f"{costs['binding'] / costs['quota binding']:.2f}x that)"]
    for tenants in (100, 1_000, 10_000):
        engine = _engine(CapacityConfig(produce_byte_rate=1_000.0), tenants)
        now = [2 * REFRESH_INTERVAL_MS]

        def refresh(engine=engine, now=now) -> None:  # type: ignore[no-untyped-def]
            now[0] += REFRESH_INTERVAL_MS
            engine.capacity.refresh(now[0])

        cost = min(timeit.repeat(refresh, number=3, repeat=3)) / 3 * 1000
        lines.append(f"refresh   {tenants:>6,} tenants: {cost:.2f} ms per refresh, every "
                     f"{REFRESH_INTERVAL_MS} ms ({cost / REFRESH_INTERVAL_MS:.1%} of one core)")
    return lines


def exchange_bytes(entities: int = 10_000) -> list[str]:
    sizes = {}
    with_capacity = CapacityConfig(produce_byte_rate=1e9, adaptive=AdaptiveConfig())
    for name, config in (("quotas only", None), ("+ capacity (produce, adaptive)", with_capacity)):
        engine = _engine(config, entities)
        usage = engine.local_usage(REFRESH_INTERVAL_MS + 1)
        datagrams = encode_usage("bench", 1, 1, 0, True, usage, [], SECRET)
        sizes[name] = (sum(len(d) for d in datagrams), len(usage))
    base = sizes["quotas only"][0]
    return [f"exchange  full report of {entities:,} entities: "
            + "; ".join(f"{name}: {size:,} B, {entries:,} entries, {size / entities:.1f} B per entity"
                        for name, (size, entries) in sizes.items())
            + f" ({sizes['+ capacity (produce, adaptive)'][0] / base:.2f}x)"]


def throughput(rounds: int, records: int) -> list[str]:
    with LocalKafka(brokers=3) as kafka, tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "capacity.toml"
        config.write_text("[capacity]\nproduce_byte_rate = 100000000000\nfetch_byte_rate = 100000000000\n\n"
                          "[[quota]]\nclient_id = \"<default>\"\nshare = 1\n")
        plain = RunningProxy(kafka.bootstrap)
        capped = RunningProxy(kafka.bootstrap, extra_args=["--config", str(config)])
        paths = {"direct": kafka.bootstrap, "proxy": plain.bootstrap, "proxy+capacity": capped.bootstrap}
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        rates: dict[str, dict[str, list[float]]] = {p: {"produce": [], "consume": []} for p in paths}
        try:
            for _ in range(rounds):
                for path, bootstrap in paths.items():
                    topic = f"bench-capacity-{uuid.uuid4().hex[:8]}"
                    create_topic(admin, topic)
                    sent, size, seconds = produce(path, bootstrap, topic, records)
                    if sent != records:
                        raise BenchFailure(f"{path}: {sent} of {records} records acknowledged")
                    rates[path]["produce"].append(size / seconds / 1e6)
                    _got, size, seconds = consume(path, bootstrap, topic, records)
                    rates[path]["consume"].append(size / seconds / 1e6)
                    delete_topic(admin, topic)
            if "capacity" not in capped.log() and not capped.alive():
                raise BenchFailure("the capacity proxy died")
        finally:
            plain.stop()
            capped.stop()
    lines = []
    for kind in ("produce", "consume"):
        direct = statistics.median(rates["direct"][kind])
        lines.append(f"{kind:<9} MB/s (median of {rounds}): " + "; ".join(
            f"{path} {statistics.median(r[kind]):.0f} ({statistics.median(r[kind]) / direct:.2f}x)"
            for path, r in rates.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--no-cluster", action="store_true", help="only the in-process figures")
    args = parser.parse_args(argv)
    lines = decision_cost() + exchange_bytes()
    for line in lines:
        print(line, flush=True)
    if not args.no_cluster:
        for line in throughput(args.rounds, args.records):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
