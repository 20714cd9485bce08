"""Fixtures for tests against a real Kafka cluster started by the project's own harness.

The session's `kafka_cluster` itself lives in the repository's root conftest.py, so that spark_tests/ shares
the same cluster. It never skips: if Kafka cannot start, every test that needs it errors with the reason.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.local_kafka import ClassArchive, LocalKafka, ensure_kafka_jars, java_executable, kafka_classpath

from .proxies import QuotaProxy, RunningProxy

# Main classes of the Kafka 4.3.1 tools, verified with `unzip -l` on the jars Maven fetches
# (test_harness.py checks they exist and runs the console ones). Kafka 4 moved most tools from Scala
# `kafka.*` to `org.apache.kafka.tools.*`; ConfigCommand and StorageTool are still Scala.
JAVA_CONSOLE_PRODUCER = "org.apache.kafka.tools.ConsoleProducer"
JAVA_CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
JAVA_TOPIC_COMMAND = "org.apache.kafka.tools.TopicCommand"
JAVA_CONFIG_COMMAND = "kafka.admin.ConfigCommand"
JAVA_PRODUCER_PERF = "org.apache.kafka.tools.ProducerPerformance"
JAVA_CONSUMER_PERF = "org.apache.kafka.tools.ConsumerPerformance"
JAVA_CONSUMER_GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
JAVA_METADATA_QUORUM_COMMAND = "org.apache.kafka.tools.MetadataQuorumCommand"
JAVA_STORAGE_TOOL = "kafka.tools.StorageTool"

JAVA_TOOL_CLASSES = (
    JAVA_CONSOLE_PRODUCER,
    JAVA_CONSOLE_CONSUMER,
    JAVA_TOPIC_COMMAND,
    JAVA_CONFIG_COMMAND,
    JAVA_PRODUCER_PERF,
    JAVA_CONSUMER_PERF,
    JAVA_CONSUMER_GROUP_COMMAND,
    JAVA_METADATA_QUORUM_COMMAND,
    JAVA_STORAGE_TOOL,
)

# Short-lived tools: only warnings, on stderr, so stdout carries just the tool's own output.
_TOOLS_LOG4J2 = """\
status = warn
appender.err.type = Console
appender.err.name = ERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %p %m (%c{1})%n
rootLogger.level = warn
rootLogger.appenderRef.err.ref = ERR
"""

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration, so `-m "not integration"` runs the fast suite alone."""
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)


class KafkaJava:
    """Runs a main class from the Kafka jars, e.g. the console producer, with quiet logging.

    The JVM flags favour start-up over peak speed (C1 only, a class-data archive per tool recorded by its
    first successful run), because tools run for seconds and tests run many of them.
    """

    def __init__(self, log4j2: Path, bootstrap: str, sasl_bootstrap: str | None) -> None:
        self.bootstrap = bootstrap
        self.sasl_bootstrap = sasl_bootstrap
        self._java = java_executable()
        self._classpath = kafka_classpath()
        self._log4j2 = log4j2

    def command(self, main_class: str, *args: str, cds_flags: tuple[str, ...] = ()) -> list[str]:
        """The full java command line, for tests that need to start a tool with Popen themselves."""
        return [
            self._java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", *cds_flags,
            f"-Dlog4j2.configurationFile={self._log4j2}",
            "-cp", self._classpath, main_class, *args,
        ]  # fmt: skip

    def run(
        self, main_class: str, *args: str, timeout: float = 120, input: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """Run to completion and return the result (check returncode yourself; stderr holds warnings)."""
        archive = ClassArchive(f"tool-{main_class}", self._java, ensure_kafka_jars())
        cds_flags, recording = archive.flags(record=True)
        ok = False
        try:
            done = subprocess.run(
                self.command(main_class, *args, cds_flags=tuple(cds_flags)),
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
            ok = done.returncode == 0
            return done
        finally:
            if recording is not None:
                archive.publish(recording, ok)

    __call__ = run


@pytest.fixture(scope="session")
def kafka_java(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> KafkaJava:
    """A `KafkaJava` bound to the session cluster: `kafka_java.run(JAVA_TOPIC_COMMAND, "--list", ...)`."""
    log4j2 = tmp_path_factory.mktemp("kafka-java") / "log4j2-tools.properties"
    log4j2.write_text(_TOOLS_LOG4J2)
    return KafkaJava(log4j2, kafka_cluster.bootstrap, kafka_cluster.sasl_bootstrap)


@pytest.fixture(scope="session")
def proxy(kafka_cluster: LocalKafka) -> Iterator[RunningProxy]:
    """`kthrottle run` in front of the cluster's PLAINTEXT listener, for the whole session."""
    with RunningProxy(kafka_cluster.bootstrap) as running:
        yield running
    assert running.process.returncode == 0, f"the proxy exited with {running.process.returncode}"


@pytest.fixture(scope="session")
def sasl_proxy(kafka_cluster: LocalKafka) -> Iterator[RunningProxy]:
    """`kthrottle run` in front of the cluster's SASL_PLAINTEXT listener."""
    assert kafka_cluster.sasl_bootstrap, "the session cluster was started without SASL"
    with RunningProxy(kafka_cluster.sasl_bootstrap) as running:
        yield running


#: Quota proxies use 3 samples of 1 s: see test_quota_accuracy.py.
QUOTA_SETTINGS = ("quota_window_num = 3\nproducer_id_quota_window_num = 3\n"
                  "producer_id_quota_window_size_seconds = 1")


@pytest.fixture(scope="module")
def quota_proxy(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """A proxy with a quota file the test rewrites, one per test module."""
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("quota"), QUOTA_SETTINGS) as running:
        yield running


@pytest.fixture(scope="module")
def sasl_quota_proxy(kafka_cluster: LocalKafka,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """The same in front of the SASL listener."""
    assert kafka_cluster.sasl_bootstrap
    workdir = tmp_path_factory.mktemp("sasl-quota")
    with QuotaProxy(kafka_cluster.sasl_bootstrap, workdir, QUOTA_SETTINGS) as running:
        yield running
