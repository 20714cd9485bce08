"""Fixtures for the Spark tests: one local SparkSession and one proxy with quotas, both for the session.

The Kafka cluster is the session's `kafka_cluster` from the repository's root conftest.py, shared with
tests/integration. Nothing here skips: without pyspark, Java or Maven every test errors with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

try:
    import pyspark  # noqa: F401
except ImportError as exc:  # collection fails loudly, naming the fix
    raise ImportError("spark_tests need pyspark (pinned in pyproject's `test` and `spark` extras): "
                      "pip install -e '.[test]'") from exc

from pyspark.sql import SparkSession

from harness.local_kafka import LocalKafka
from tests.integration.proxies import QuotaProxy

from .spark import start_spark

# Kafka's quota.window.num = 3 (of 1 s), as tests/integration/conftest.py sets it: the arithmetic is
# Kafka's either way, but with the default 11 samples a greedy client's rate swings in a sawtooth of
# ~11 s, longer than these runs; with 3 it settles after ~3 s, so a short run measures the quota itself.
SETTINGS = "quota_window_num = 3"


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    try:
        session = start_spark(str(tmp_path_factory.mktemp("spark")))
    except Exception as exc:
        pytest.fail(f"Spark did not start: {exc}", pytrace=False)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def spark_proxy(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """`kthrottle run` with a quota file and metrics, in front of the cluster's PLAINTEXT listener."""
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("spark-proxy"), SETTINGS) as running:
        yield running
