"""`make bench`: the fetch overload bed (issue 27's consumer case), every path side by side.

The bed (tests/integration/fetch_overload_bed.py) is one broker held to half a core, serving a
backlog over TLS to three consumers flat out, so that the broker's encryption of what it sends is
what overloads. Gold (share 10, 200 acks=all records of 1 KB a second) runs alone, then beside the
consumers, on each path:

    direct              the broker's SSL listener itself
    direct paced F      the broker's SSL listener beside ONE consumer reading F x what the three
                        took, evenly, one Fetch of at most 512 KB at a time
                        (tests/integration/paced_fetcher.py): what the broker allows gold at that
                        load when nothing queues ahead of it, the floor any proxy is judged against
    proxy               kthrottle without a [capacity] (clients plaintext to it, TLS upstream)
    proxy paced 1       kthrottle without a [capacity] beside ONE consumer reading what the three
                        took direct, evenly, one Fetch at a time (as `direct paced 1`): nothing
                        queues, so this is the floor of any path through the proxy on this machine
    proxy aimd          adaptive, AIMD, fetch capacity 2 x what the consumers took direct
    proxy gradient      adaptive, Gradient2's rule, the same capacity
    proxy concurrency   adaptive, the per-broker concurrency limit (Produce and catching-up
                        Fetch requests in flight), the same capacity

For each: gold's p50 / p99 alone and overloaded, the p99's ratio to its quiet p99, and goodput
(record bytes/s the consumers received) as a share of direct's; for the adaptive paths the
factor's lowest. The issue's targets are those of the produce bed: p99 at most 2 x quiet + 5 ms,
goodput at least 0.85 x direct, at once. With `--legs`, each proxy path's overloaded phase also
says where gold's time went: in the proxy on the way in, at the broker, or in the proxy on the way
back (bench/gold_legs.py, tcpdump on loopback).

Run: `.venv/bin/python -m bench.fetch_overload [--legs]` (as root: it makes a cgroup). About 8 minutes.
Name paths to run only those after direct:
`python -m bench.fetch_overload "direct paced 1" "proxy concurrency"`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
from pathlib import Path

from bench import gold_legs
from bench.overload import _broker_limits, _line, legs_line
from tests.integration.fetch_overload_bed import (
    FetchBed,
    capacity_table,
    fetch_overload_bed,
    overloaded,
    quiet,
    settle,
)
from tests.integration.overload_bed import SHARES, Phase
from tests.integration.proxies import QuotaProxy

#: the loads of the paced direct paths, as shares of what the three consumers took flat out
PACED = (0.85, 1.0)
#: the proxy paths: name, the adaptive controller (None: no [capacity]), and the paced consumer's
#: share of direct's goodput (None: the three consumers flat out)
_PATHS = (("proxy", None, None), ("proxy paced 1", None, 1.0), ("proxy aimd", "aimd", None),
          ("proxy gradient", "gradient", None), ("proxy concurrency", "concurrency", None))


def _overloaded(bootstrap: str, bed: FetchBed, ssl_ca: str | None,
                paced: float | None = None) -> tuple[Phase, str]:
    """The overloaded phase, and the broker's collections during it."""
    count, seconds = bed.collections()
    loaded = overloaded(bootstrap, bed, ssl_ca, paced)
    count_after, seconds_after = bed.collections()
    return loaded, f"broker GCs {count_after - count} ({(seconds_after - seconds) * 1000:.0f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="run only these paths after direct")
    parser.add_argument("--legs", action="store_true", help="time gold's requests on each leg (tcpdump)")
    arguments = parser.parse_args()
    legs, only = arguments.legs, arguments.paths
    known = [f"direct paced {fraction:g}" for fraction in PACED] + [name for name, _, _ in _PATHS]
    unknown = set(only) - set(known)
    if unknown:
        raise SystemExit(f"unknown path(s) {sorted(unknown)}: known {known}")
    with fetch_overload_bed() as bed:
        assert bed.kafka.ssl_bootstrap is not None
        direct_bootstrap = bed.kafka.ssl_bootstrap
        broker_port = int(direct_bootstrap.rsplit(":", 1)[1])
        loaded, collected = _overloaded(direct_bootstrap, bed, bed.ca)
        direct = loaded.goodput
        settle(direct_bootstrap, bed, bed.ca)
        alone = quiet(direct_bootstrap, bed, bed.ca)
        print("path             gold alone p50/p99 ms   overloaded p50/p99 ms   p99/quiet   "
              "goodput (x direct)")
        print(_line("direct", alone, loaded, direct, collected), flush=True)
        for fraction in PACED:
            name = f"direct paced {fraction:g}"
            if only and name not in only:
                continue
            settle(direct_bootstrap, bed, bed.ca)
            paced, collected = _overloaded(direct_bootstrap, bed, bed.ca, paced=fraction * direct)
            print(_line(name, alone, paced, direct, collected), flush=True)
        for name, controller, pace in _PATHS:
            if only and name not in only:
                continue
            table = ("" if controller is None
                     else capacity_table(2 * direct, adaptive=True, controller=controller))
            with tempfile.TemporaryDirectory() as work, \
                    QuotaProxy(direct_bootstrap, Path(work), bed.upstream_tls + table) as proxy:
                proxy.set_quotas(SHARES)
                settle(proxy.bootstrap, bed, None)
                alone = quiet(proxy.bootstrap, bed, None)
                with (gold_legs.capture(Path(work), proxy.node_port(1), broker_port) if legs
                      else contextlib.nullcontext()) as pcap:
                    loaded, extra = _overloaded(proxy.bootstrap, bed, None,
                                                None if pace is None else pace * direct)
                if "adaptive = true" in table:
                    moves = re.findall(r"capacity factor [\d.]+ -> ([\d.]+)", proxy.log())
                    factors = [float(m) for m in moves]
                    extra += f"; factor lowest {min(factors, default=1.0):.2f}"
                    limits = _broker_limits(proxy.log())
                    if limits:
                        waits = proxy.metric("kthrottle_broker_request_waits_total")
                        extra += f"; broker limit lowest {min(limits):.1f}, {waits:.0f} waits"
                print(_line(name, alone, loaded, direct, extra), flush=True)
                if pcap is not None:
                    print(f"    {legs_line(proxy, broker_port, pcap, tls_upstream=True)}", flush=True)
        print(f"broker held by its CPU quota for {bed.limit.throttled_s():.0f} s in all")


if __name__ == "__main__":
    main()
