"""The protection on a cluster that is really overloaded (issue 27), on the bed of overload_bed.py.

One run, in order:
1. direct: gold beside three flat-out producers, then alone. The bed overloads at the broker:
   gold's p99 rises at least OVERLOAD_RATIO x. The producers' goodput is what the bed takes.
2. through a proxy with adaptive off (a static capacity of twice the bed's, which never binds):
   gold's p99 rises at least OFF_RATIO x, so the bed shows something through the proxy too.
3. through a proxy with adaptive on (the kept controller, KEPT): gold's median latency is at most
   MEDIAN_RATIO of what it is with adaptive off, and once the overload stops the factor is back at 1.0
   within RECOVERY_S.

Gold's p99 is reported, not asserted, and so are the issue's two targets (p99 at most 2 x quiet +
5 ms, goodput at least 0.85 x direct): adaptive on lowered gold's p99 in some runs and not in
others (56.7 ms against 55.1 ms off), and no rate limit met both targets on this bed, not even a
static one set to 0.85 of the capacity measured in the same run (bench/overload.py,
docs/protecting-the-cluster.md says why and what would).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.overload_bed import (
    SHARES,
    Bed,
    Phase,
    capacity_table,
    overload_bed,
    overloaded,
    quiet,
    settle,
)
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import report

#: Latencies: its worker's CPU weight raised (tests/quiet/); its broker has a cgroup quota of its own.
pytestmark = pytest.mark.quiet

OVERLOAD_RATIO = 5.0
OFF_RATIO = 3.0
RECOVERY_S = 20.0
#: Alone, adaptive on gave gold 0.16-0.22 of its median wait with adaptive off (three runs); beside
#: the suite's other workers, 0.55: the other workers' CPU waits are in both.
MEDIAN_RATIO = 0.75
#: the controller kept after comparing both on this bed (docs/protecting-the-cluster.md)
KEPT = "aimd"


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with overload_bed() as made:
        yield made


def _through(bed: Bed, workdir: Path, table: str) -> tuple[Phase, Phase, float]:
    """Gold alone and overloaded through a proxy with `table`; seconds until its factor is back
    at 1.0 after the overload (0 without adaptive)."""
    workdir.mkdir()
    with QuotaProxy(bed.kafka.bootstrap, workdir, table) as proxy:
        proxy.set_quotas(SHARES)
        alone = quiet(proxy.bootstrap, bed.topic)
        loaded = overloaded(proxy.bootstrap, bed.topic)
        start = time.monotonic()
        while "adaptive = true" in table and proxy.metric("kthrottle_capacity_factor") < 1.0:
            if time.monotonic() - start > 2 * RECOVERY_S:
                break
            time.sleep(0.25)
        return alone, loaded, time.monotonic() - start


def _figures(name: str, alone: Phase, loaded: Phase, direct: float) -> str:
    return (f"{name}: gold p50/p99 alone {alone.p50:.1f}/{alone.p99:.1f} ms, overloaded "
            f"{loaded.p50:.1f}/{loaded.p99:.1f} ms ({loaded.p99 / alone.p99:.1f}x; target <= "
            f"{2 * alone.p99 + 5:.1f} ms), goodput {loaded.goodput / 1e6:.2f} MB/s "
            f"({loaded.goodput / direct:.2f}x direct; target >= 0.85x)")


def test_the_bed_overloads_at_the_broker_and_adaptive_capacity_protects_gold(bed: Bed,
                                                                             tmp_path: Path) -> None:
    # overloaded first: the broker's first seconds under its quota are slow even for gold alone
    # (p99 53 ms against 2 ms later), so its quiet figure is taken once that has passed
    direct = overloaded(bed.kafka.bootstrap, bed.topic)
    capacity = direct.goodput
    settle(bed.kafka.bootstrap, bed.topic)
    direct_alone = quiet(bed.kafka.bootstrap, bed.topic)
    off_alone, off, _ = _through(bed, tmp_path / "off", capacity_table(2 * capacity, adaptive=False))
    settle(bed.kafka.bootstrap, bed.topic)
    on_alone, on, back = _through(bed, tmp_path / "on", capacity_table(2 * capacity, adaptive=True,
                                                                       controller=KEPT))
    report(f"overload bed (broker at {bed.limit.cores} core): "
           + "; ".join(_figures(name, alone, loaded, capacity) for name, alone, loaded in (
               ("direct", direct_alone, direct), ("adaptive off", off_alone, off),
               (f"adaptive on ({KEPT})", on_alone, on)))
           + f"; factor back at 1.0 {back:.1f} s after the overload")
    assert direct.p99 >= OVERLOAD_RATIO * direct_alone.p99, "the bed did not overload the broker"
    assert off.p99 >= OFF_RATIO * off_alone.p99, "adaptive off: gold did not suffer, the run shows nothing"
    assert on.p50 <= MEDIAN_RATIO * off.p50, "adaptive on did not shorten gold's median wait"
    assert back <= RECOVERY_S
