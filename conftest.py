"""Session fixtures shared by every test directory (tests/integration and spark_tests).

Why here: pytest shows a conftest's fixtures only to tests below it, and both suites must share one
real Kafka cluster: a 3-node KRaft cluster takes seconds to start, so a session starts it once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.local_kafka import TEST_HEAP_MB, LocalKafka


@pytest.fixture(scope="session")
def kafka_cluster() -> Iterator[LocalKafka]:
    """One 3-node cluster for the whole session, with every listener the tests use (PLAINTEXT,
    SASL_PLAINTEXT, SSL and SASL_SSL, the certificates generated at start); a start failure errors
    loudly, never skips. Its heap is TEST_HEAP_MB, below the embedded default: the tests' topics are few."""
    cluster = LocalKafka(brokers=3, sasl=True, tls=True, heap_mb=TEST_HEAP_MB)
    try:
        cluster.start()
    except RuntimeError as exc:
        pytest.fail(f"the local Kafka cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures the rate runs measured (tests/integration/quota_runs.py), after the results."""
    import sys

    runs = sys.modules.get("tests.integration.quota_runs")
    figures = getattr(runs, "FIGURES", [])
    if figures:
        terminalreporter.section("figures measured by the rate runs")
        for line in figures:
            terminalreporter.write_line(line)
