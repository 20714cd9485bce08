"""A small local SparkSession with Spark's own Kafka connector, and what the tests read from it.

Sized for a 2-core machine that also runs the rest of the test suite: one driver JVM with 1 GiB, no UI,
two shuffle partitions. `local[8]` gives eight task slots, not eight cores: a Kafka task held by a
throttled fetch waits without using CPU, and with only two slots a throttled query's waiting tasks
would queue another query's tasks behind them, measuring Spark's scheduler instead of the proxy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from harness.local_kafka import java_executable

from .jars import SPARK_VERSION, ensure_spark_kafka_jars

SLOTS = 8


def start_spark(workdir: str) -> SparkSession:
    """The session every test shares; raises with the reason when Java, pyspark or the jars are wrong.

    `workdir` takes what Spark writes on its own (the warehouse and scratch directories), which would
    otherwise land in the current directory.
    """
    import pyspark

    if pyspark.__version__ != SPARK_VERSION:
        raise RuntimeError(f"pyspark {pyspark.__version__} is installed, the tests pin {SPARK_VERSION} "
                           "(the connector jars must be the same version): pip install -e '.[test]'")
    java = java_executable()  # raises when there is no JDK
    if not os.environ.get("JAVA_HOME"):
        # spark-submit finds java on PATH too, but JAVA_HOME makes the choice explicit and the same.
        os.environ["JAVA_HOME"] = str(os.path.dirname(os.path.dirname(os.path.realpath(java))))
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # else Spark warns and picks another interface
    jars = ",".join(str(jar) for jar in ensure_spark_kafka_jars())
    spark = (
        SparkSession.builder.master(f"local[{SLOTS}]")
        .appName("kthrottle-spark-tests")
        .config("spark.jars", jars)
        .config("spark.driver.memory", "1g")
        .config("spark.driver.extraJavaOptions", "-XX:+UseSerialGC -Djava.net.preferIPv4Stack=true")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.enabled", "false")  # tiny data; streaming turns it off anyway
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", os.path.join(workdir, "warehouse"))
        .config("spark.local.dir", os.path.join(workdir, "scratch"))
        .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
        # Spark keeps an idle Kafka producer for 10 minutes by default. The session outlives each test's
        # proxy and cluster, so an idle writer went on reconnecting to their closed ports (into later
        # tests' output) for minutes; close it once it has been idle 30 s instead.
        .config("spark.kafka.producer.cache.timeout", "30s")
        .config("spark.kafka.producer.cache.evictorThreadRunInterval", "10s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def kafka_options(bootstrap: str, client_id: str, **extra: str) -> dict[str, str]:
    """The options a user sets on readStream/writeStream to go through the proxy as `client_id`."""
    return {"kafka.bootstrap.servers": bootstrap, "kafka.client.id": client_id, **extra}


def await_stop(query: StreamingQuery, timeout: float) -> None:
    """Wait (bounded) for a query that stops by itself (availableNow); fail with its exception if any."""
    finished = query.awaitTermination(timeout)
    if not finished:
        query.stop()
        raise AssertionError(f"query {query.name} did not finish within {timeout}s; "
                             f"last progress: {json.dumps(query.lastProgress)[:2000]}")
    error = query.exception()
    assert error is None, f"query {query.name} failed: {error}"


@dataclass(frozen=True)
class Batch:
    """One micro-batch as Spark reports it in the query's progress."""

    batch_id: int
    start: float  # epoch seconds when the trigger fired
    duration: float  # seconds
    rows: int
    processed_rows_per_second: float

    @property
    def end(self) -> float:
        return self.start + self.duration


def batches(query: StreamingQuery) -> list[Batch]:
    """Every reported batch that read rows, in order (no-data progress events left out)."""
    seen: dict[int, Batch] = {}
    for progress in query.recentProgress:
        if progress["numInputRows"] <= 0:
            continue
        start = datetime.fromisoformat(progress["timestamp"].replace("Z", "+00:00")).timestamp()
        seen[progress["batchId"]] = Batch(progress["batchId"], start, progress["batchDuration"] / 1000.0,
                                          progress["numInputRows"], progress["processedRowsPerSecond"])
    return [seen[key] for key in sorted(seen)]


@dataclass(frozen=True)
class Rate:
    """Rows per second over a run of consecutive batches, from the first one's start to the last one's end."""

    rows: int
    seconds: float
    batches: int
    mean_processed_rows_per_second: float

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds

    def describe(self, row_bytes: int) -> str:
        return (f"{self.rows_per_second * row_bytes:,.0f} B/s ({self.rows} rows of {row_bytes:,} B in "
                f"{self.seconds:.1f} s over {self.batches} batches; mean processedRowsPerSecond "
                f"{self.mean_processed_rows_per_second:,.1f})")


def steady_rate(all_batches: list[Batch], skip_s: float, until: float | None = None) -> Rate:
    """The rate over the batches that started `skip_s` or more after the first one (and before `until`).

    Skipping the start leaves out the burst a quota allows a new client (its first padded windows).
    """
    assert all_batches, "the query reported no batch with rows"
    first = all_batches[0].start
    steady = [b for b in all_batches if b.start >= first + skip_s and (until is None or b.end <= until)]
    assert len(steady) >= 2, (f"only {len(steady)} batches in the steady part (after {skip_s}s): "
                              f"{[(b.batch_id, round(b.start - first, 1), b.rows) for b in all_batches]}")
    seconds = steady[-1].end - steady[0].start
    mean_processed = sum(b.processed_rows_per_second for b in steady) / len(steady)
    return Rate(sum(b.rows for b in steady), seconds, len(steady), mean_processed)


def triggered_rate(all_batches: list[Batch], start: float, end: float) -> Rate:
    """Rows per second of a query on a fixed trigger interval between two wall-clock times.

    Measured from the first to the last batch that started inside the span, without the last one's rows
    (as RunResult.rate does for clients), so that where the edges fall against the trigger does not
    swing the figure by one batch.
    """
    inside = [b for b in all_batches if start <= b.start < end]
    assert len(inside) >= 3, f"only {len(inside)} batches between the marks"
    rows = sum(b.rows for b in inside[:-1])
    mean_processed = sum(b.processed_rows_per_second for b in inside) / len(inside)
    return Rate(rows, inside[-1].start - inside[0].start, len(inside) - 1, mean_processed)
