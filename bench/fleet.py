"""`python -m bench.fleet`: what one quota across a fleet (issue 11) costs.

1. Exchange traffic. One member with N active entities (10,000 by default) and two peers, all real
   FleetExchange objects on loopback UDP in this process, for some seconds. Each entity is a
   client id under a `<default>` producer_byte_rate quota, charged ten times a second (once with
   --charges-per-s 1, for 100,000 entities: Python cannot charge a million times a second), either
   "steady" (at half its quota, +-5 %: its rate barely moves, so mostly full syncs go out) or
   "greedy" (offering twice its quota and waiting out each throttle, as a client does: its rate
   saws, so delta and urgent reports go out too). Printed: bytes and datagrams per second sent to
   each peer, per entity, by report kind, and what building one full report and applying it cost.
2. The decision: QuotaEngine.charge for one entity alone, and with a fleet of 3 attached whose two
   peers report that entity (the hot path then adds their rates), min of repeats.
3. Throughput: produce and consume of 10 KB records direct, through `kthrottle run`, and through
   `kthrottle run --workers 2`, alternating rounds on one cluster, medians (bench/throughput.py's
   clients). On 2 cores the workers share the cores with the brokers and the client, so they may
   not gain; the figure that travels is the proxies' CPU per MB beside it.

Figures are printed, never asserted; it fails only when something breaks.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import os
import random
import re
import socket
import statistics
import sys
import time
import timeit
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import uvloop
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry

from config.fleet import FleetSettings
from harness.local_kafka import KAFKA_VERSION, LocalKafka
from proxy.fleet.exchange import ENCODE_SLICE, FleetExchange, FleetMetrics
from proxy.fleet.membership import StaticMembership
from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import DEFAULT, QuotaEntity
from quotas.fleet import NameItems, PeerUsage, UsageEntry, UsageTracker, decode_usage, encode_usage
from quotas.rate import WindowConfig
from quotas.types import QuotaType
from tests.integration.proxies import RunningProxy

from . import cpu
from .throughput import BenchFailure, check_listeners, consume, create_topic, delete_topic, produce

QUOTA = 1_000_000.0  # bytes per second per entity (only ratios to it matter)
SECRET = b"bench-secret-0123456789abcdef"
NAME = "bench"
PATHS = ("direct", "proxy", "workers2")
MB = 1_000_000


# -- 1. exchange traffic ------------------------------------------------------------------------------


@dataclass
class Traffic:
    scenario: str
    entities: int
    seconds: float
    bytes_per_peer: float
    datagrams_per_peer: float
    by_kind: dict[str, float]
    full: FullReportCost
    #: CPU seconds of the member's process (charging and reporting) and of its two peers' process
    sender_cpu_s: float
    peers_cpu_s: float = 0.0

    def lines(self) -> list[str]:
        per_s = self.bytes_per_peer / self.seconds
        kinds = ", ".join(f"{kind} {n / self.seconds:.1f}/s" for kind, n in sorted(self.by_kind.items()))
        cost = self.full
        return [f"exchange, {self.entities:,} {self.scenario} entities: {per_s / 1000:,.1f} kB/s to each "
                f"peer ({per_s / self.entities:.1f} B/s per entity), "
                f"{self.datagrams_per_peer / self.seconds:.0f} datagrams/s per peer; reports {kinds}; "
                f"CPU: the member {100 * self.sender_cpu_s / self.seconds:.0f} % of a core (charging "
                f"included), its two peers {100 * self.peers_cpu_s / self.seconds:.0f} %",
                f"  one full report: {cost.datagrams} datagrams ({cost.bytes / 1000:,.0f} kB); measuring "
                f"every bucket {cost.measure_ms:.1f} ms, tracking {cost.track_ms:.1f} ms, encoding "
                f"{cost.encode_ms:.1f} ms (sent in slices of {ENCODE_SLICE} entries); a peer applies it "
                f"(verify + parse + merge) in {cost.apply_ms:.1f} ms"]


@dataclass
class FullReportCost:
    datagrams: int
    bytes: int
    measure_ms: float
    track_ms: float
    encode_ms: float
    apply_ms: float


def _engine(entities: int) -> QuotaEngine:
    engine = QuotaEngine(EngineConfig(window=WindowConfig(11, 1000), max_buckets=None))
    engine.set_quotas({QuotaEntity(None, DEFAULT): {QuotaType.PRODUCE: QUOTA}})
    return engine


def _udp_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


def _peers_process(addresses: list[tuple[str, int]], sender: tuple[str, int],
                   stop: multiprocessing.synchronize.Event, results: multiprocessing.Queue[float]) -> None:
    """The two peers, in their own process as they would be on their own hosts: they receive and
    apply the member's reports (their own engines are idle, so they send heartbeats only)."""

    async def run() -> None:
        exchanges = []
        for address in addresses:
            settings = FleetSettings(listen=address, secret=SECRET, name=NAME, peers=[sender, *addresses])
            exchange = FleetExchange(_engine(0), settings, NAME, StaticMembership([sender], {address}),
                                     FleetMetrics(CollectorRegistry()))
            await exchange.start()
            exchanges.append(exchange)
        started = time.process_time()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        results.put(time.process_time() - started)
        for exchange in exchanges:
            await exchange.close()

    uvloop.run(run())


def traffic(entities: int, scenario: str, seconds: float, charges_per_s: float) -> Traffic:
    """One member charging `entities` buckets, its two peers in another process."""
    addresses = [("127.0.0.1", port) for port in _udp_ports(3)]
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    results: multiprocessing.Queue[float] = context.Queue()
    peers = context.Process(target=_peers_process, args=(addresses[1:], addresses[0], stop, results),
                            daemon=True)
    peers.start()
    try:
        result = uvloop.run(_traffic(addresses, entities, scenario, seconds, charges_per_s))
    finally:
        stop.set()
    result.peers_cpu_s = results.get(timeout=30)
    peers.join(timeout=30)
    return result


async def _traffic(addresses: list[tuple[str, int]], entities: int, scenario: str, seconds: float,
                   charges_per_s: float) -> Traffic:
    settings = FleetSettings(listen=addresses[0], secret=SECRET, name=NAME, peers=addresses)
    sender = FleetExchange(_engine(entities), settings, NAME, StaticMembership(addresses, {addresses[0]}),
                           FleetMetrics(CollectorRegistry()))
    await sender.start()
    engine = sender.engine
    clients = [f"app-{i:06d}" for i in range(entities)]
    rng = random.Random(7)
    greedy = scenario == "greedy"
    per_charge = (2.0 if greedy else 0.5) * QUOTA / charges_per_s
    slices = 10  # each tick charges a tenth of the entities; every entity is charged charges_per_s a second
    tick_s = 1.0 / charges_per_s / slices
    loop = asyncio.get_running_loop()
    warmup_s = 3.0
    began = loop.time()
    baseline: tuple[float, float, dict[str, float]] | None = None
    measured_from = began
    cpu_from = time.process_time()
    tick = 0
    while loop.time() - began < warmup_s + seconds:
        part = clients[tick % slices::slices]
        now = time.monotonic() * 1000
        for client in part:
            if greedy and engine.hold_ms("", client, 0, now) > 0:
                continue
            engine.charge("", client, now, produce_bytes=int(per_charge * rng.uniform(0.95, 1.05)))
        tick += 1
        if baseline is None and loop.time() - began >= warmup_s:
            baseline = _counters(sender.metrics)
            measured_from = loop.time()
            cpu_from = time.process_time()
        await asyncio.sleep(max(0.0, began + tick * tick_s - loop.time()))
    assert baseline is not None
    elapsed = loop.time() - measured_from
    sender_cpu = time.process_time() - cpu_from
    end = _counters(sender.metrics)
    peers = len(addresses) - 1
    by_kind = {kind: end[2].get(kind, 0.0) - baseline[2].get(kind, 0.0) for kind in end[2]}
    await sender.close()
    return Traffic(f"{scenario} (each charged {charges_per_s:g}x/s)", entities, elapsed,
                   (end[0] - baseline[0]) / peers, (end[1] - baseline[1]) / peers, by_kind,
                   _full_report_cost(engine), sender_cpu)


def _counters(metrics: FleetMetrics) -> tuple[float, float, dict[str, float]]:
    kinds = {sample.labels["kind"]: sample.value for family in metrics.syncs.collect()
             for sample in family.samples if sample.name.endswith("_total")}
    return metrics.bytes_sent._value.get(), metrics.sent._value.get(), kinds


def _full_report_cost(engine: QuotaEngine) -> FullReportCost:
    """One full report built from `engine` as the exchange builds it, and applied by a peer that
    holds the previous one (the steady state: every entry refreshes one the peer has); each
    step's best of three tries (the first pays one-time costs, any may meet a GC pause)."""
    costs: list[FullReportCost] = []
    peers = PeerUsage(engine.config.window.history_ms)
    names = NameItems()  # kept across reports, as the exchange's tracker keeps it
    for attempt in range(4):
        now = int(time.monotonic() * 1000)
        started = time.perf_counter()
        usage = engine.local_usage(now, False)
        measured = time.perf_counter()
        entries = UsageTracker().due(usage, True)
        tracked = time.perf_counter()
        datagrams = encode_usage(NAME, 1, 1 + 10_000 * attempt, int(time.time() * 1000), True, entries,
                                 [], SECRET, names=names)
        encoded = time.perf_counter()
        for datagram in datagrams:
            peers.accept(decode_usage(datagram, SECRET, NAME, int(time.time() * 1000)), now)
        applied = time.perf_counter()
        costs.append(FullReportCost(len(datagrams), sum(map(len, datagrams)), 1000 * (measured - started),
                                    1000 * (tracked - measured), 1000 * (encoded - tracked),
                                    1000 * (applied - encoded)))
    costs = costs[1:]  # the first apply created every entry: not what a peer does each second
    return FullReportCost(costs[0].datagrams, costs[0].bytes, min(c.measure_ms for c in costs),
                          min(c.track_ms for c in costs), min(c.encode_ms for c in costs),
                          min(c.apply_ms for c in costs))


# -- 2. the decision ------------------------------------------------------------------------------


def decision_cost() -> tuple[float, float]:
    """us per charge for an entity under quota: a lone proxy, and a member of 3 whose peers report it."""
    results = []
    for fleet in (False, True):
        engine = _engine(1)
        if fleet:
            peers = PeerUsage(engine.config.window.history_ms)
            engine.attach_fleet(peers, on_urgent=lambda: None)
            now = int(time.monotonic() * 1000)
            for sender in (11, 12):
                datagram = encode_usage(NAME, sender, 1, int(time.time() * 1000), True,
                                        [UsageEntry(QuotaType.PRODUCE, "", "app", QUOTA / 10)], [], SECRET)[0]
                peers.accept(decode_usage(datagram, SECRET, NAME, int(time.time() * 1000)), now)
        number = 20_000
        results.append(min(timeit.repeat(_charger(engine), number=number, repeat=7)) / number * 1e6)
    return results[0], results[1]


def _charger(engine: QuotaEngine) -> Callable[[], None]:
    """One 100-byte produce charge per call, 10 us apart (1 MB/s offered: under the quota)."""
    clock = [time.monotonic() * 1000]

    def charge() -> None:
        clock[0] += 0.01
        engine.charge("", "app", clock[0], produce_bytes=100)

    return charge


# -- 3. throughput -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    path: str
    payload: int
    seconds: float
    proxy_cpu_s: float | None

    @property
    def mb_per_s(self) -> float:
        return self.payload / MB / self.seconds


def _pids(proxy: RunningProxy | None) -> list[int]:
    """The processes doing a proxy's work: itself, or its workers (the parent only supervises)."""
    if proxy is None:
        return []
    workers = dict(re.findall(r"worker (\d+) started \(pid (\d+)\)", proxy.log()))
    return [int(pid) for pid in workers.values()] or [proxy.process.pid]


def _timed(path: str, proxy: RunningProxy | None, transfer: Callable[[], tuple[int, int, float]]) -> Run:
    pids = _pids(proxy)
    before = [cpu.process_cpu_seconds(pid) for pid in pids]
    _records, payload, seconds = transfer()
    after = [cpu.process_cpu_seconds(pid) for pid in pids]
    used = None
    if pids and None not in before and None not in after:
        used = sum(a - b for a, b in zip(after, before, strict=True))  # type: ignore[operator]
    return Run(path, payload, seconds, used)


def _workers_proxy(upstream: str) -> RunningProxy:
    metrics_port = _free_tcp_block(2)
    proxy = RunningProxy(upstream, extra_args=["--workers", "2", "--metrics-port", str(metrics_port)])
    deadline = time.monotonic() + 30
    while proxy.log().count("bootstrap.servers=") < 2:
        if time.monotonic() > deadline or not proxy.alive():
            proxy.stop()
            raise BenchFailure(f"--workers 2 did not start:\n{proxy.log()[-4000:]}")
        time.sleep(0.05)
    proxy.metrics_port = metrics_port  # type: ignore[attr-defined]
    return proxy


def _free_tcp_block(size: int) -> int:
    from tests.integration.proxies import free_port_block

    return free_port_block(size)


def _worker_bytes(proxy: RunningProxy) -> list[float]:
    """Bytes each worker moved (requests + responses), from its metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for worker in (0, 1):
        port = proxy.metrics_port + worker  # type: ignore[attr-defined]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("kthrottle_request_bytes_total", "kthrottle_response_bytes_total"):
                    total += sample.value
        out.append(total)
    return out


def throughput(rounds: int, records: int, consume_records: int) -> list[str]:
    lines: list[str] = []
    print(f"starting 3 Kafka {KAFKA_VERSION} brokers, `kthrottle run` and `kthrottle run --workers 2`...",
          flush=True)
    with LocalKafka(brokers=3) as cluster:
        proxies: dict[str, RunningProxy] = {}
        try:
            proxies["proxy"] = RunningProxy(cluster.bootstrap)
            proxies["workers2"] = _workers_proxy(cluster.bootstrap)
            for proxy in proxies.values():
                check_listeners(proxy, cluster.node_ids)
            bootstraps = {"direct": cluster.bootstrap} | {p: proxy.bootstrap for p, proxy in proxies.items()}
            admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
            tag = uuid.uuid4().hex[:8]
            produced: list[Run] = []
            for path in PATHS:  # unmeasured warm-up of every path
                topic = f"fleet-warm-{path}-{tag}"
                create_topic(admin, topic)
                produce(path, bootstraps[path], topic, max(1, records // 4))
                delete_topic(admin, topic)
            for round_no in range(rounds):
                for path in PATHS:
                    topic = f"fleet-produce-{path}-{round_no}-{tag}"
                    create_topic(admin, topic)
                    run = _timed(path, proxies.get(path),
                                 lambda p=path, t=topic: produce(p, bootstraps[p], t, records))
                    delete_topic(admin, topic)
                    produced.append(run)
                    print(f"  produce round {round_no + 1} {path:9} {run.mb_per_s:7.1f} MB/s", flush=True)
            topic = f"fleet-consume-{tag}"
            create_topic(admin, topic)
            produce("direct", cluster.bootstrap, topic, consume_records)
            for path in PATHS:
                consume(path, bootstraps[path], topic, consume_records)
            consumed: list[Run] = []
            split_before = _worker_bytes(proxies["workers2"])
            for round_no in range(rounds):
                for path in PATHS:
                    run = _timed(path, proxies.get(path),
                                 lambda p=path: consume(p, bootstraps[p], topic, consume_records))
                    consumed.append(run)
                    print(f"  consume round {round_no + 1} {path:9} {run.mb_per_s:7.1f} MB/s", flush=True)
            split_after = _worker_bytes(proxies["workers2"])
            delete_topic(admin, topic)
            for proxy in proxies.values():
                if not proxy.alive():
                    raise BenchFailure(f"a proxy exited during the bench:\n{proxy.log()[-4000:]}")
        finally:
            for proxy in proxies.values():
                proxy.stop()
    for name, runs in (("produce", produced), ("consume", consumed)):
        direct = statistics.median(r.mb_per_s for r in runs if r.path == "direct")
        parts = []
        for path in PATHS:
            mine = [r for r in runs if r.path == path]
            rate = statistics.median(r.mb_per_s for r in mine)
            part = f"{path} {rate:6.1f} MB/s"
            if path != "direct":
                costs = [1000 * r.proxy_cpu_s / (r.payload / MB) for r in mine if r.proxy_cpu_s is not None]
                part += f" ({rate / direct:.2f}x direct"
                part += f", proxy CPU {statistics.median(costs):.2f} ms/MB)" if costs else ")"
            parts.append(part)
        lines.append(f"{name} 10KB  " + "   ".join(parts))
    moved = [after - before for after, before in zip(split_after, split_before, strict=True)]
    lines.append(f"consume through --workers 2: worker 0 moved {moved[0] / MB:,.0f} MB, worker 1 "
                 f"{moved[1] / MB:,.0f} MB (the kernel picks a worker per connection)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--entities", type=int, nargs="+", default=[10_000],
                        help="active entities for the exchange traffic (several: one run each)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per traffic run")
    parser.add_argument("--charges-per-s", type=float, default=10,
                        help="charges per entity per second (0.2: every 5 s, still active)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput runs per path, alternating")
    parser.add_argument("--records", type=int, default=30_000, help="10 KB records per produce run")
    parser.add_argument("--consume-records", type=int, default=60_000, help="10 KB records per consume run")
    parser.add_argument("--no-throughput", action="store_true", help="skip the cluster part")
    args = parser.parse_args(argv)
    began = time.monotonic()
    lines = [f"kthrottle fleet bench ({os.cpu_count()} cores)"]
    for entities in args.entities:
        for scenario in ("steady", "greedy"):
            print(f"exchange traffic: {entities:,} {scenario} entities, 2 peers, {args.seconds:.0f} s...",
                  flush=True)
            run = traffic(entities, scenario, args.seconds, args.charges_per_s)
            print("\n".join(run.lines()), flush=True)
            lines += run.lines()
    alone, member = decision_cost()
    lines.append(f"decision (QuotaEngine.charge, one entity under quota): alone {alone:.2f} us, in a fleet "
                 f"of 3 with both peers reporting it {member:.2f} us ({member / alone:.2f}x)")
    print(lines[-1], flush=True)
    if not args.no_throughput:
        lines += throughput(args.rounds, args.records, args.consume_records)
    print()
    print("\n".join(lines))
    print(f"(bench took {time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
