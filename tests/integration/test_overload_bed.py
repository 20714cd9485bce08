"""The protection on a cluster that is really overloaded (issue 27), on the produce bed of
overload_bed.py: one run of overload_runs.py (direct, the bare proxy, the concurrency limit; what is
asserted).

The issue's p99 target is reported, not asserted: inside `make test` it missed in two runs of six
(h44 7.6 ms against 6.6, h46 8.8 against 7.5). A tolerance of 1.5 for the limit met it in all nine
runs tried (h49-h52 and five alone) but cost goodput, and h53 failed the goodput assertion with it
(0.831x), so the limit keeps 2.0. One producer paced evenly through the bare proxy, nothing
queued (`python -m bench.overload "proxy paced 1"`: the floor of a path through the proxy), met it in
one phase of three alongside the limit (5.9-8.7 ms against 5.9-6.5).

docs/protecting-the-cluster.md has the figures and the command.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.overload_bed import Bed, overload_bed
from tests.integration.overload_runs import one_run

#: Latencies, alone (tests/quiet/): beside the suite's other workers gold's quiet p99 read 3.4-17.9 ms
#: where alone it reads 0.6-0.7 ms, and the direct overload 46-50 ms in two runs (h15, h17), so the
#: bed's own proof failed there; its broker has a cgroup quota of its own.
pytestmark = [pytest.mark.quiet, pytest.mark.alone]


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    with overload_bed() as made:
        yield made


def test_the_bed_overloads_at_the_broker_and_the_concurrency_limit_protects_gold(bed: Bed,
                                                                                  tmp_path: Path) -> None:
    one_run(bed, tmp_path)
