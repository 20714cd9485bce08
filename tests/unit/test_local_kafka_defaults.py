"""The embedded cluster's defaults (`make run`, `kthrottle local-kafka`): what the help text says."""

from __future__ import annotations

from pathlib import Path

from harness.local_kafka import (
    DEFAULT_HEAP_MB,
    KAFKA_GC_FLAGS,
    LIGHT_JIT_FLAGS,
    SERIAL_GC_FLAGS,
    TEST_HEAP_MB,
    LocalKafka,
)
from harness.local_kafka_cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def test_brokers_get_kafkas_own_1_gib_heap_by_default() -> None:
    """384 MiB ran out under librdkafka's test suite (thousands of topics)."""
    assert DEFAULT_HEAP_MB == 1024
    assert LocalKafka().heap_mb == DEFAULT_HEAP_MB  # what `make run` starts (cli.main: LocalKafka(brokers=3))
    parser = build_parser()
    assert parser.parse_args([]).heap_mb == DEFAULT_HEAP_MB  # `kthrottle local-kafka`
    assert "(default: 1024," in " ".join(parser.format_help().split())
    assert "DEFAULT_HEAP_MB" in (LocalKafka.__doc__ or "")


def test_the_test_suites_cluster_keeps_its_smaller_heap() -> None:
    assert TEST_HEAP_MB < DEFAULT_HEAP_MB
    session_cluster = (REPO / "conftest.py").read_text()
    expected = "LocalKafka(brokers=3, sasl=True, tls=True, heap_mb=TEST_HEAP_MB, light_jit=True)"
    assert expected in session_cluster


def test_only_test_clusters_give_up_c2() -> None:
    """`make run` and the benchmarks keep the full JIT; the tests' clusters ask for C1 only."""
    assert LocalKafka().jit_flags == ()
    assert LocalKafka(light_jit=True).jit_flags == LIGHT_JIT_FLAGS == ("-XX:TieredStopAtLevel=1",)


def test_only_the_fetch_bed_runs_kafkas_own_collector() -> None:
    """The fetch bed models a production broker whose collections gold's slow answers follow: it runs
    the G1 settings of Kafka's own scripts; every other cluster keeps the serial collector."""
    assert LocalKafka().gc_flags == SERIAL_GC_FLAGS == ("-XX:+UseSerialGC",)
    assert LocalKafka(kafka_gc=True).gc_flags == KAFKA_GC_FLAGS
    assert KAFKA_GC_FLAGS[:2] == ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20")
    assert "kafka_gc=True" in (REPO / "tests/integration/fetch_overload_bed.py").read_text()
