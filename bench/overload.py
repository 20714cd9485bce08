"""`make bench`: the overload bed (issue 27), every path side by side in one run.

The bed (tests/integration/overload_bed.py) is one broker held to half a core by a cgroup CPU
quota and compressing every byte it appends, so that the broker is what overloads. Gold (share
10, 200 acks=all records of 1 KB a second) runs alone, then beside three flat-out producers, on
each path:

    direct              the broker itself
    direct paced F      the broker itself beside ONE producer sending F x what the three took,
                        evenly (no backlog, ~100 KB requests): what the broker allows gold at that
                        load when nothing queues ahead of it, the floor any proxy is judged against
    proxy               kthrottle without a [capacity]: forwarding only (the bare-relay figure;
                        a byte relay cannot front a broker whose metadata names its own address)
    proxy paced 1       kthrottle without a [capacity] beside ONE producer sending what the three
                        took, evenly: nothing queues, so this is the floor of any path through the
                        proxy on this machine (the proxy's own work on the two cores the broker
                        and the clients share), the one the proxy paths are judged against
    proxy static        kthrottle with a static capacity of 0.85 x what the bed took direct: the
                        best a rate limit can do when it knows the capacity (the floor)
    proxy aimd          adaptive, AIMD, capacity 2 x the bed's
    proxy gradient      adaptive, Gradient2's rule, capacity 2 x the bed's
    proxy concurrency   adaptive, each broker's Produce requests in flight limited by latency
                        (quotas/broker_concurrency.py), capacity 2 x the bed's

For each: gold's p50 / p99 alone and overloaded, the p99's ratio to its own quiet p99, goodput
(the flat-out producers' acknowledged bytes/s) as a share of direct's, and for the adaptive paths
the factor's lowest and how long it took to get back to 1.0 once the overload stopped. The issue's
targets: p99 at most 2 x quiet + 5 ms and goodput at least 0.85 x direct, at once.

With `--legs`, each proxy path's overloaded phase also says where gold's time went: in the proxy
on the way in, at the broker, or in the proxy on the way back (bench/gold_legs.py, tcpdump).

Run: `.venv/bin/python -m bench.overload [--legs]` (as root: it makes a cgroup). About 9 minutes.
Name paths to run only those after direct: `python -m bench.overload "direct paced 0.9" "proxy concurrency"`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import tempfile
import time
from pathlib import Path

from bench import gold_legs
from tests.integration.overload_bed import (
    SHARES,
    SKIP_S,
    Phase,
    capacity_table,
    overload_bed,
    overloaded,
    quiet,
    settle,
)
from tests.integration.proxies import QuotaProxy

#: the loads of the paced direct paths, as shares of what the three flat-out producers got through
PACED = (0.9, 1.0)


def _factor_after(proxy: QuotaProxy, timeout: float = 40.0) -> float:
    """Seconds until the factor in force is back at 1.0 (inf: not within `timeout`)."""
    start = time.monotonic()
    while proxy.metric("kthrottle_capacity_factor") < 1.0:
        if time.monotonic() - start > timeout:
            return float("inf")
        time.sleep(0.25)
    return time.monotonic() - start


def _lowest_factor(log: str) -> float:
    factors = [float(m) for m in re.findall(r"capacity factor [\d.]+ -> ([\d.]+)", log)]
    return min(factors, default=1.0)


def _broker_limits(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"request limit [\d.]+ -> ([\d.]+)", log)]


def _line(path: str, alone: Phase, loaded: Phase, direct: float, extra: str = "") -> str:
    return (f"{path:<16} {alone.p50:6.1f} / {alone.p99:6.1f}   {loaded.p50:8.1f} / {loaded.p99:8.1f}   "
            f"{loaded.p99 / alone.p99:7.1f}x   {loaded.goodput / 1e6:6.2f} MB/s "
            f"{loaded.goodput / direct:5.2f}x"
            f"   target p99 <= {2 * alone.p99 + 5:5.1f} ms {extra}")


def legs_line(proxy: QuotaProxy, broker_port: int, pcap: Path, *, tls_upstream: bool = False) -> str:
    """Where gold's time went in the phase `pcap` captured (bench/gold_legs.py)."""
    try:
        timed = gold_legs.legs(pcap, proxy.node_port(1), broker_port, tls_upstream=tls_upstream)
    except ValueError as exc:
        kept = Path(tempfile.mkdtemp(prefix="kthrottle-legs-")) / pcap.name
        shutil.copyfile(pcap, kept)
        return f"gold's legs not known: {exc} (the capture is kept: {kept})"
    return gold_legs.summary(timed, SKIP_S)


def main(only: list[str], legs: bool) -> None:
    with overload_bed() as bed:
        bootstrap, topic = bed.kafka.bootstrap, bed.topic
        broker_port = int(bootstrap.rsplit(":", 1)[1])
        loaded = overloaded(bootstrap, topic)  # first: the broker's first seconds under its quota are slow
        direct = loaded.goodput
        settle(bootstrap, topic)
        alone = quiet(bootstrap, topic)
        print("path             gold alone p50/p99 ms   overloaded p50/p99 ms   p99/quiet   "
              "goodput (x direct)")
        print(_line("direct", alone, loaded, direct), flush=True)
        settle(bed.kafka.bootstrap, bed.topic)
        for fraction in PACED:
            name = f"direct paced {fraction:g}"
            if only and name not in only:
                continue
            paced = overloaded(bootstrap, topic, paced=fraction * direct)
            print(_line(name, alone, paced, direct), flush=True)
            settle(bed.kafka.bootstrap, bed.topic)
        # name, [capacity], and the paced producer's share of direct's goodput (None: the three)
        paths = [("proxy", "", None), ("proxy paced 1", "", 1.0),
                 ("proxy static", capacity_table(0.85 * direct, adaptive=False), None),
                 ("proxy aimd", capacity_table(2 * direct, adaptive=True, controller="aimd"), None),
                 ("proxy gradient", capacity_table(2 * direct, adaptive=True, controller="gradient"), None),
                 ("proxy concurrency", capacity_table(2 * direct, adaptive=True, controller="concurrency"),
                  None)]
        known = [f"direct paced {fraction:g}" for fraction in PACED] + [name for name, _, _ in paths]
        unknown = set(only) - set(known)
        if unknown:
            raise SystemExit(f"unknown path(s) {sorted(unknown)}: known {known}")
        for name, table, pace in paths:
            if only and name not in only:
                continue
            with tempfile.TemporaryDirectory() as work, QuotaProxy(bootstrap, Path(work), table) as proxy:
                proxy.set_quotas(SHARES)
                alone = quiet(proxy.bootstrap, topic)
                with (gold_legs.capture(Path(work), proxy.node_port(1), broker_port) if legs
                      else contextlib.nullcontext()) as pcap:
                    loaded = overloaded(proxy.bootstrap, topic,
                                        paced=None if pace is None else pace * direct)
                extra = ""
                if "adaptive = true" in table:
                    back = _factor_after(proxy)
                    extra = f"factor lowest {_lowest_factor(proxy.log()):.2f}, back at 1.0 {back:.1f} s after"
                    limits = _broker_limits(proxy.log())
                    if limits:
                        extra += f"; broker limit lowest {min(limits):.1f}"
                print(_line(name, alone, loaded, direct, extra), flush=True)
                if pcap is not None:
                    print(f"    {legs_line(proxy, broker_port, pcap)}", flush=True)
            settle(bed.kafka.bootstrap, bed.topic)
        print(f"broker held by its CPU quota for {bed.limit.throttled_s():.0f} s in all")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="run only these paths after direct")
    parser.add_argument("--legs", action="store_true", help="time gold's requests on each leg (tcpdump)")
    arguments = parser.parse_args()
    main(arguments.paths, arguments.legs)
