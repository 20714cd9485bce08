"""Session fixtures and the parallel run's plumbing, shared by every test directory (tests/ and
spark_tests/).

Why here: pytest shows a conftest's fixtures only to tests below it, and both suites must share one
real Kafka cluster per process: a 3-node KRaft cluster takes seconds to start, so a session starts it
once. Under pytest-xdist (`make test` runs `-n`), each worker is its own session, so each worker has
its own cluster, ports (a slice of `harness.ports`), temp dirs and certificates. What else a
parallel run needs lives here too:
- every test outside tests/unit goes into an `xdist_group` (its module, `spark` for Spark's tests,
  `quiet` for those marked so), so a module's fixtures are set up on one worker only;
- groups are handed out longest first (`tests/durations.json`), so no long module starts last;
- a test marked `quiet` gets the CPU it asks for: its worker's CPU weight is raised, or, where the
  run can't make a cgroup, no other test runs beside it (`tests/quiet/`);
- the figures that workers measured are printed once, by the controller, after the results.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from harness.local_kafka import TEST_HEAP_MB, LocalKafka
from harness.ports import PORTS_ENV, port_range, worker_slice
from tests.durations import group_costs
from tests.quiet import MARKER as QUIET
from tests.quiet import Guard, Need, Way, choose_way, guard_for

_ROOT = Path(__file__).resolve().parent
_UNIT = _ROOT / "tests" / "unit"
_SPARK = _ROOT / "spark_tests"
_FIGURES_KEY = "kthrottle_figures"
_collected_figures: list[str] = []

# Hypothesis' default 200 ms deadline per example is a timed assertion, and one that a busy machine
# trips: speed lives in bench/, so no example has a deadline.
settings.register_profile("kthrottle", deadline=None)
settings.load_profile("kthrottle")


def _session_cluster() -> LocalKafka:
    return LocalKafka(brokers=3, sasl=True, tls=True, heap_mb=TEST_HEAP_MB, light_jit=True)


@pytest.fixture(scope="session")
def kafka_cluster(request: pytest.FixtureRequest) -> Iterator[LocalKafka]:
    """One 3-node cluster for the whole session, with every listener the tests use (PLAINTEXT,
    SASL_PLAINTEXT, SSL and SASL_SSL, the certificates generated at start); a start failure errors
    loudly, never skips. Its heap is TEST_HEAP_MB, below the embedded default: the tests' topics are
    few. An xdist worker has usually started it already (``pytest_collection_finish``)."""
    stash = request.config.stash
    if _early_failure in stash:
        pytest.fail(f"the local Kafka cluster did not start: {stash[_early_failure]}", pytrace=False)
    cluster = stash.get(_early_cluster, None)
    if cluster is None:
        cluster = _session_cluster()
        try:
            cluster.start()
        except RuntimeError as exc:
            pytest.fail(f"the local Kafka cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


_early_cluster = pytest.StashKey[LocalKafka]()
_early_failure = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """An xdist worker starts its cluster once it has collected, before its first test: the workers'
    starts overlap at the beginning, while no test runs, instead of landing beside a test that must
    run alone (the controller hands out tests once every worker has collected)."""
    if _worker_input(session.config) is None:
        return
    guard = session.config.stash.get(_guard, None)
    if guard is not None:
        guard.collected(frozenset(_need(item) for item in session.items))
    if not any("kafka_cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    cluster = _session_cluster()
    try:
        cluster.start()
    except RuntimeError as exc:  # the fixture fails every test that needs it, with this reason
        session.config.stash[_early_failure] = str(exc)
        return
    session.config.stash[_early_cluster] = cluster


# ------------------------------------------------------------------------------- the parallel run


def _worker_input(config: pytest.Config) -> dict[str, object] | None:
    return getattr(config, "workerinput", None)


def pytest_configure(config: pytest.Config) -> None:
    """The controller picks how quiet tests get their CPU; a worker takes its slice of the ports and
    its part in that."""
    worker = _worker_input(config)
    if worker is None:
        if getattr(config.option, "dist", "no") != "no":  # the xdist controller
            config.stash[_way] = choose_way()
        return
    index = int(str(worker["workerid"]).removeprefix("gw"))
    count = int(str(worker["workercount"]))
    low, high = worker_slice(index % count, count, port_range())
    os.environ[PORTS_ENV] = f"{low}-{high}"  # for this worker and everything it starts
    try:
        config.stash[_guard] = guard_for(worker, str(worker["workerid"]))
    except OSError as exc:
        raise pytest.UsageError(f"worker {worker['workerid']} cannot take its part in giving quiet "
                                f"tests their CPU: {exc}") from exc


_way = pytest.StashKey[Way]()
_guard = pytest.StashKey[Guard]()


def pytest_configure_node(node: object) -> None:
    """xdist (controller): tell each worker how quiet tests get their CPU."""
    config: pytest.Config = node.config  # type: ignore[attr-defined]
    node.workerinput.update(config.stash[_way].worker_input())  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    early = config.stash.get(_early_cluster, None)
    if early is not None:
        early.stop()  # a no-op when the session fixture used and stopped it
    guard = config.stash.get(_guard, None)
    if guard is not None:
        guard.close()
    way = config.stash.get(_way, None)
    if way is not None:
        way.remove()


def _group(item: pytest.Item) -> str | None:
    path = item.path.resolve()
    if _need(item) >= Need.QUIET:
        return QUIET
    if _UNIT in path.parents:
        return None  # pure and fast: spread one test at a time, they fill the run's tail
    if _SPARK in path.parents:
        return "spark"  # one SparkSession per worker that runs them: only one worker
    return path.relative_to(_ROOT).as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests and order the groups longest first; within a group the order is unchanged."""
    groups = {id(item): _group(item) for item in items}
    for item in items:
        if groups[id(item)] is not None:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    cost = group_costs((groups[id(item)], item.path.resolve().relative_to(_ROOT).as_posix())
                       for item in items)
    order = {id(item): index for index, item in enumerate(items)}
    # in the quiet group, a test that must be alone goes first: the other workers are only starting
    items.sort(key=lambda item: (-cost[groups[id(item)]], _need(item) is not Need.ALONE, order[id(item)]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item,
                            nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Around the test's setup, call and teardown: the quiet CPU for a quiet test, kept while the next
    test is quiet too."""
    guard = item.config.stash.get(_guard, None)
    if guard is None:
        return (yield)
    need = _need(item)
    guard.before(need)
    try:
        return (yield)
    finally:
        guard.after(need, Need.ORDINARY if nextitem is None else _need(nextitem))


def _need(item: pytest.Item) -> Need:
    return Need.of({mark.name for mark in item.iter_markers()})


# ------------------------------------------------------------------------------- measured figures


def _figures() -> list[str]:
    runs = sys.modules.get("tests.integration.quota_runs")
    return list(getattr(runs, "FIGURES", []))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker hands its figures to the controller."""
    if _worker_input(session.config) is not None:
        session.config.workeroutput[_FIGURES_KEY] = _figures()  # type: ignore[attr-defined]


def pytest_testnodedown(node: object, error: object) -> None:
    """xdist (controller): keep what a finished worker measured."""
    _collected_figures.extend(getattr(node, "workeroutput", {}).get(_FIGURES_KEY, []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How quiet tests got their CPU, and the figures the rate runs measured
    (tests/integration/quota_runs.py), after the results."""
    way = terminalreporter.config.stash.get(_way, None)
    if way is not None:
        terminalreporter.write_line(way.describe())
    figures = _collected_figures or _figures()
    if figures:
        terminalreporter.section("figures measured by the rate runs")
        for line in figures:
            terminalreporter.write_line(line)
