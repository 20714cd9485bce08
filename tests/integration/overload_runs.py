"""Issue 27's one run on an overload bed, whichever bed: what is measured through the proxy, what is
asserted, and what is only reported. Used by test_overload_bed.py (producers) and
test_fetch_overload_bed.py (consumers catching up).

1. direct: gold beside the bed's best-effort load, then alone. The bed overloads at the broker:
   gold's p99 rises at least OVERLOAD_RATIO x. The load's goodput is what the bed takes.
2. through a proxy with adaptive off (a static capacity of twice the bed's, which never binds: the
   bare proxy): gold's p99 rises at least OFF_RATIO x, so the bed shows something through the
   proxy too.
3. through a proxy with adaptive on, controller "concurrency" (each broker's counted requests in
   flight limited by latency, quotas/broker_concurrency.py): the limit engages (it is cut, and
   requests wait for a slot), the goodput is at
   least GOODPUT_TARGET x direct's (the issue's target), gold's p99 below direct's and, where the
   bare proxy missed the issue's p99 target, below the bare proxy's; and once the overload stops,
   with gold alone, the limit is gone (back at its maximum) within RECOVERY_S. Where the bare proxy
   met the target itself, two p99s near the broker's own floor are compared, and that is noise: on
   the produce bed the bare proxy read 7.5-8.7 ms in 8 suite runs of 25 (h39-h63), and in h63 (8.0 ms, target
   8.4) the limit read 9.9 ms; the figures are reported either way.

The issue's p99 target (at most P99_TARGET x quiet + P99_SLACK_MS) is reported, not asserted: each
test's docstring says how often it missed. On this machine even a path through the proxy where
nothing queues (one client paced evenly, `proxy paced 1` in the benches) met it in 3 phases of 8
over both beds, where the broker alone met it in 6 (docs/protecting-the-cluster.md, "The floor
through the proxy").
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from quotas.broker_concurrency import MAX_LIMIT
from tests.integration.bed_clients import BedClient
from tests.integration.overload_bed import SHARES, Phase, capacity_table
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import report

OVERLOAD_RATIO = 5.0
OFF_RATIO = 3.0
RECOVERY_S = 20.0
#: the issue's targets: gold's p99 at most 2 x quiet + 5 ms (reported), goodput at least 0.85 x direct's
P99_TARGET = 2.0
P99_SLACK_MS = 5.0
GOODPUT_TARGET = 0.85
#: what adaptive capacity answers latency with on these beds (docs/protecting-the-cluster.md)
KEPT = "concurrency"
LIMIT = "kthrottle_broker_request_limit"
WAITS = "kthrottle_broker_request_waits_total"


class OverloadBed(Protocol):
    """What one run needs of a bed (overload_bed.Bed, fetch_overload_bed.FetchBed): gold and the
    bed's load on a path given by its bootstrap, the broker's own (`direct`) or a proxy's."""

    direction: str

    @property
    def title(self) -> str: ...
    @property
    def direct(self) -> str: ...
    @property
    def proxy_config(self) -> str: ...
    def quiet_at(self, bootstrap: str) -> Phase: ...
    def overloaded_at(self, bootstrap: str) -> Phase: ...
    def settle_at(self, bootstrap: str) -> None: ...
    def gold_at(self, bootstrap: str, seconds: float) -> BedClient: ...


def one_run(bed: OverloadBed, workdir: Path) -> None:
    """The module's run on `bed`, judged (`judge`). Direct is overloaded first: the broker's first
    seconds under its quota are slow even for gold alone (p99 53 ms against 2 ms later on the
    produce bed), so its quiet figure is taken once that has passed. Each path settles (the last
    phase's queue drains) before gold alone is measured on it."""
    direct = bed.overloaded_at(bed.direct)
    bed.settle_at(bed.direct)
    direct_alone = bed.quiet_at(bed.direct)
    capacity = 2 * direct.goodput  # twice what the bed takes: the static capacity never binds
    with _proxy(bed, workdir / "off", capacity_table(capacity, False, direction=bed.direction)) as proxy:
        bed.settle_at(proxy.bootstrap)
        off = bed.quiet_at(proxy.bootstrap), bed.overloaded_at(proxy.bootstrap)
    with _proxy(bed, workdir / "on", capacity_table(capacity, True, KEPT, bed.direction)) as proxy:
        bed.settle_at(proxy.bootstrap)
        on_alone = bed.quiet_at(proxy.bootstrap)
        on = with_the_limit(proxy, lambda: bed.overloaded_at(proxy.bootstrap),
                            lambda seconds: bed.gold_at(proxy.bootstrap, seconds))
    judge(bed.title, (direct_alone, direct), off, on_alone, on)


@contextlib.contextmanager
def _proxy(bed: OverloadBed, workdir: Path, table: str) -> Iterator[QuotaProxy]:
    """A proxy in front of the bed's broker, with `table` and the bed's shares."""
    workdir.mkdir()
    with QuotaProxy(bed.direct, workdir, bed.proxy_config + table) as proxy:
        proxy.set_quotas(SHARES)
        yield proxy


@dataclass(frozen=True)
class Limited:
    """The overloaded phase with the limit on; the requests that waited for a slot in it, the lowest
    limit the proxy logged (its log summarises repeated lines, so this is an upper bound on the
    lowest), and the seconds until the limit was gone again with gold alone."""

    loaded: Phase
    waits: float
    lowest_logged: float
    back_s: float


def with_the_limit(proxy: QuotaProxy, overload: Callable[[], Phase],
                   gold: Callable[[float], BedClient]) -> Limited:
    """`overload` through `proxy` (adaptive on), then `gold` alone (the limit moves on answers) until
    the limit is gone, for at most 2 x RECOVERY_S. Nothing scrapes the proxy while gold is measured
    (a scrape's text is formatted on a thread of the proxy's process): whether the limit engaged is
    told by the waits counted over the phase and the cuts the proxy logged."""
    waits = proxy.metric(WAITS, mode="enforced")
    loaded = overload()
    waits = proxy.metric(WAITS, mode="enforced") - waits
    lowest = min((float(m) for m in re.findall(r"request limit [\d.]+ -> ([\d.]+)", proxy.log())),
                 default=MAX_LIMIT)
    alone = gold(2 * RECOVERY_S)
    start = time.monotonic()
    try:
        while proxy.metric(LIMIT, broker="1") < MAX_LIMIT and time.monotonic() - start < 2 * RECOVERY_S:
            time.sleep(0.25)
        return Limited(loaded, waits, lowest, time.monotonic() - start)
    finally:
        alone.process.kill()  # its figures are not needed: only the limit's way back
        alone.process.wait(10)


def _target(alone: Phase) -> float:
    """The issue's p99 target on a path whose quiet figure is `alone`."""
    return P99_TARGET * alone.p99 + P99_SLACK_MS


def _figures(name: str, alone: Phase, loaded: Phase, direct: float) -> str:
    return (f"{name}: gold p50/p99 alone {alone.p50:.1f}/{alone.p99:.1f} ms, overloaded "
            f"{loaded.p50:.1f}/{loaded.p99:.1f} ms ({loaded.p99 / alone.p99:.1f}x; target <= "
            f"{_target(alone):.1f} ms), goodput {loaded.goodput / 1e6:.2f} MB/s "
            f"({loaded.goodput / direct:.2f}x direct; target >= {GOODPUT_TARGET}x)")


def judge(bed: str, direct: tuple[Phase, Phase], off: tuple[Phase, Phase], on_alone: Phase,
          on: Limited) -> None:
    """Report the run's figures, then assert what the module's docstring lists. Each pair is
    (gold alone, overloaded) on that path."""
    (direct_alone, loaded), (off_alone, off_loaded), on_loaded = direct, off, on.loaded
    capacity = loaded.goodput
    report(f"{bed}: "
           + "; ".join(_figures(name, alone, phase, capacity) for name, alone, phase in (
               ("direct", direct_alone, loaded), ("adaptive off", off_alone, off_loaded),
               (f"adaptive on ({KEPT})", on_alone, on_loaded)))
           + f"; on against direct: p99 {on_loaded.p99 / loaded.p99:.2f}x; on against off: p99 "
           f"{on_loaded.p99 / off_loaded.p99:.2f}x, goodput {on_loaded.goodput / off_loaded.goodput:.2f}x; "
           f"{on.waits:.0f} requests waited for a slot, broker limit lowest logged {on.lowest_logged:.1f}, "
           f"gone {on.back_s:.1f} s after the overload")
    assert loaded.p99 >= OVERLOAD_RATIO * direct_alone.p99, "the bed did not overload the broker"
    assert off_loaded.p99 >= OFF_RATIO * off_alone.p99, \
        "adaptive off: gold did not suffer, the run shows nothing"
    assert on.waits > 0 and on.lowest_logged < MAX_LIMIT, "the broker's request limit never engaged"
    assert on_loaded.p99 < loaded.p99, "the limit did not keep gold's tail below direct's"
    assert on_loaded.p99 < off_loaded.p99 or off_loaded.p99 <= _target(off_alone), \
        "the limit did not keep gold's tail below the bare proxy's, which missed the p99 target"
    assert on_loaded.goodput >= GOODPUT_TARGET * capacity, \
        "the limit cost more throughput than the issue allows"
    assert on.back_s <= RECOVERY_S, f"the limit was still there {on.back_s:.0f} s after the overload"


__all__ = ["GOODPUT_TARGET", "KEPT", "LIMIT", "OFF_RATIO", "OVERLOAD_RATIO", "P99_SLACK_MS", "P99_TARGET",
           "RECOVERY_S", "WAITS", "Limited", "OverloadBed", "judge", "one_run", "with_the_limit"]
