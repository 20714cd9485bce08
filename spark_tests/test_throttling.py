"""Quotas on Spark's own Kafka source and sink, through the proxy, measured from Spark's query progress.

Each quota names the Spark query's `kafka.client.id` (or, for producer ids, the user: plaintext
connections are ANONYMOUS). Rates are Spark's figures: the rows of the micro-batches it reports, times
the record size, over the steady part of the run (after the burst a new client's padded quota windows
allow, see conftest.SETTINGS), and each test also checks the data itself: nothing lost, nothing twice.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from harness.local_kafka import LocalKafka
from tests.integration.clients import wait_until
from tests.integration.proxies import QuotaProxy

from .kafka import Header, Record, create_topic, produce, read_all
from .spark import await_stop, batches, kafka_options, steady_rate, triggered_rate

#: Spark must be able to write and read faster than the quotas it is held to.
pytestmark = pytest.mark.cpu_sensitive

VALUE = 10_000  # bytes per record value: rates in rows are rates in bytes
PARTITIONS = 6
BURST_S = 3.0  # left out of rate measurements: a new client may burst (num - 1) windows = 2 s of quota
CEILING = 1.1  # the bound on the measured rate, as a multiple of the quota
FLOOR = 0.5  # a sanity bound below: a rate far under the quota means the run measured something else
# Spark's consumers fetch at most this much per partition and request. With Kafka's default of 1 MiB,
# one fetch is a whole second of a 1 MiB/s quota: a task's fetch then feeds ten micro-batches at once
# and Spark's per-batch figures follow the fetch size instead of the quota (measured: 9 batches in
# 3 s, then one of 5-12 s).
FETCH = {"kafka.max.partition.fetch.bytes": "65536"}


def _bulk(count: int, partitions: int = PARTITIONS,
          headers: bool = False) -> Iterator[tuple[int, bytes, bytes, list[Header], None]]:
    """`count` records of VALUE bytes, each value unique (its number first) so a duplicate is visible."""
    pad = b"x" * (VALUE - 10)
    for i in range(count):
        yield (i % partitions, f"r{i}".encode(), f"{i:010d}".encode() + pad,
               [("n", str(i).encode())] if headers else [], None)


def _summary(frame: DataFrame) -> list[tuple[int, int, bytes, int, int]]:
    """(partition, offset, key, value length, value crc32) of every row a Spark query put in a table."""
    rows = frame.selectExpr("partition", "offset", "key", "length(value) AS size",
                            "crc32(value) AS crc").collect()
    return sorted((r.partition, r.offset, bytes(r.key), r.size, r.crc) for r in rows)


def _expected(records: list[Record]) -> list[tuple[int, int, bytes, int, int]]:
    return sorted((r.partition, r.offset, r.key or b"", len(r.value or b""), zlib.crc32(r.value or b""))
                  for r in records)


def _throttle_figures(proxy: QuotaProxy, quota: str, client_id: str, user: str = "") -> tuple[float, float]:
    """(throttles, total throttle seconds) the proxy's metrics show for one quota bucket."""
    labels = {"quota": quota, "user": user, "client_id": client_id}
    return (proxy.metric("kthrottle_throttles_total", **labels),
            proxy.metric("kthrottle_throttle_time_seconds_total", **labels))


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_consumer_byte_rate_holds_spark_ingest(spark: SparkSession, spark_proxy: QuotaProxy) -> None:
    """3. A consumer_byte_rate quota on the query's kafka.client.id holds Spark's ingest rate."""
    quota, client = 1_048_576, "spark-ingest"
    topic = create_topic(spark_proxy.bootstrap, "spark-ingest", PARTITIONS)
    stored = produce(spark_proxy.bootstrap, topic, _bulk(1200))
    spark_proxy.set_quotas(f'[[quota]]\nclient_id = "{client}"\nconsumer_byte_rate = {quota}')
    table = _name("ingest")
    query = (spark.readStream.format("kafka")
             .options(**kafka_options(spark_proxy.bootstrap, client, subscribe=topic,
                                      startingOffsets="earliest", maxOffsetsPerTrigger="60", **FETCH))
             .load()
             .writeStream.format("memory").queryName(table).trigger(availableNow=True).start())
    began = time.monotonic()
    await_stop(query, 240)
    elapsed = time.monotonic() - began
    rate = steady_rate(batches(query), BURST_S)
    measured = rate.rows_per_second * VALUE
    throttles, throttle_s = _throttle_figures(spark_proxy, "consumer_byte_rate", client)
    print(f"\n[spark ingest] consumer_byte_rate quota {quota:,} B/s on client.id {client}: "
          f"Spark read {len(stored)} records of {VALUE:,} B in {elapsed:.1f} s; steady part "
          f"{rate.describe(VALUE)} = {measured / quota:.3f}x the quota; proxy: {throttles:.0f} throttled "
          f"fetches, {throttle_s:.1f} s of throttle time")
    assert measured <= CEILING * quota, f"Spark ingested {measured:,.0f} B/s under a {quota:,} B/s quota"
    assert measured >= FLOOR * quota, f"Spark ingested only {measured:,.0f} B/s under a {quota:,} B/s quota"
    assert throttles > 0 and throttle_s > 0
    got, want = _summary(spark.table(table)), _expected(stored)
    assert got == want, f"{len(got)} rows read, {len(want)} produced, {len(got) - len(set(got))} duplicates"


def test_throttled_tenant_does_not_slow_the_other(spark: SparkSession, spark_proxy: QuotaProxy) -> None:
    """4. Two queries, two tenants: a is held to its quota, b keeps >= 90 % of its rate alone.

    Tenant b offers a steady rate (48 rows of 10 kB, 16 per partition, per 1 s trigger): at full speed
    it would be bound by this 2-core machine's CPU, shared with tenant a's query, and the check would
    measure scheduling rather than whether throttling a stops at a. Its rate alone is measured in the
    same run, before and after the phase beside throttled a, and the two are averaged so that drift
    cancels.
    """
    quota, offered_rows = 524_288, 48
    topic_a = create_topic(spark_proxy.bootstrap, "tenant-a", 3)
    topic_b = create_topic(spark_proxy.bootstrap, "tenant-b", 3)
    produce(spark_proxy.bootstrap, topic_a, _bulk(1000, partitions=3))
    produce(spark_proxy.bootstrap, topic_b, _bulk(2100, partitions=3))
    spark_proxy.set_quotas(f'[[quota]]\nclient_id = "spark-tenant-a"\nconsumer_byte_rate = {quota}')

    def start(topic: str, client: str, max_rows: int, interval: str | None) -> StreamingQuery:
        writer = (spark.readStream.format("kafka")
                  .options(**kafka_options(spark_proxy.bootstrap, client, subscribe=topic,
                                           startingOffsets="earliest", maxOffsetsPerTrigger=str(max_rows),
                                           **FETCH))
                  .load().writeStream.format("noop").queryName(_name(client.replace("-", "_"))))
        return (writer.trigger(processingTime=interval) if interval else writer).start()

    b = start(topic_b, "spark-tenant-b", offered_rows, "1 second")
    a: StreamingQuery | None = None
    try:
        wait_until(lambda: len(batches(b)) >= 3, 120, "tenant b's first batches")
        alone_1 = (time.time(), time.time() + 8)
        time.sleep(8)
        a = start(topic_a, "spark-tenant-a", 30, None)
        wait_until(lambda: batches(a), 120, "tenant a's first batch")  # type: ignore[arg-type]
        time.sleep(BURST_S)
        beside = (time.time(), time.time() + 10)
        time.sleep(10)
        a.stop()
        a_batches, a_stopped = batches(a), time.time()
        assert a.exception() is None, a.exception()
        time.sleep(1)
        alone_2 = (time.time(), time.time() + 8)
        time.sleep(8)
    finally:
        if a is not None:
            a.stop()
        b.stop()
    assert b.exception() is None, b.exception()
    b_batches = batches(b)
    runs = [triggered_rate(b_batches, *span) for span in (alone_1, beside, alone_2)]
    alone = (runs[0].rows_per_second + runs[2].rows_per_second) / 2
    a_rate = steady_rate(a_batches, BURST_S, until=a_stopped)
    a_measured = a_rate.rows_per_second * VALUE
    throttles, throttle_s = _throttle_figures(spark_proxy, "consumer_byte_rate", "spark-tenant-a")
    print(f"\n[spark tenants] tenant b (no quota, offers {offered_rows * VALUE:,} B/s): alone "
          f"{runs[0].describe(VALUE)}; beside throttled a {runs[1].describe(VALUE)}; alone again "
          f"{runs[2].describe(VALUE)}; beside/alone = {runs[1].rows_per_second / alone:.3f}\n"
          f"[spark tenants] tenant a (consumer_byte_rate quota {quota:,} B/s): {a_rate.describe(VALUE)} "
          f"= {a_measured / quota:.3f}x the quota; proxy: {throttles:.0f} throttled fetches, "
          f"{throttle_s:.1f} s of throttle time")
    assert alone * VALUE >= 0.9 * offered_rows * VALUE, "tenant b did not get its offered rate even alone"
    assert runs[1].rows_per_second >= 0.9 * alone, "tenant b slowed down beside the throttled tenant"
    assert a_measured <= CEILING * quota, f"tenant a got {a_measured:,.0f} B/s under a {quota:,} B/s quota"
    assert throttles > 0


def test_producer_byte_rate_holds_spark_writer(spark: SparkSession, spark_proxy: QuotaProxy,
                                               tmp_path: Path) -> None:
    """5. writeStream.format("kafka") under a producer_byte_rate quota: held, and every row lands."""
    quota, client = 1_048_576, "spark-writer"
    source = create_topic(spark_proxy.bootstrap, "spark-write-src", PARTITIONS)
    target = create_topic(spark_proxy.bootstrap, "spark-write-dst", PARTITIONS,
                          **{"message.timestamp.type": "LogAppendTime"})
    # ~20 s at the quota: long enough that the sawtooth of 1-s samples averages out
    stored = produce(spark_proxy.bootstrap, source, _bulk(2000, headers=True))
    spark_proxy.set_quotas(f'[[quota]]\nclient_id = "{client}"\nproducer_byte_rate = {quota}')
    query = (spark.readStream.format("kafka")
             .options(**kafka_options(spark_proxy.bootstrap, "spark-writer-source", subscribe=source,
                                      startingOffsets="earliest", includeHeaders="true",
                                      maxOffsetsPerTrigger="60"))
             .load()
             .selectExpr("partition", "key", "value", "headers")
             .writeStream.format("kafka")
             .options(**kafka_options(spark_proxy.bootstrap, client, topic=target))
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    began = time.monotonic()
    await_stop(query, 240)
    elapsed = time.monotonic() - began
    rate = steady_rate(batches(query), BURST_S)
    measured = rate.rows_per_second * VALUE
    written = read_all(spark_proxy.bootstrap, target, PARTITIONS, len(stored))
    appended = _append_rate(written)
    throttles, throttle_s = _throttle_figures(spark_proxy, "producer_byte_rate", client)
    print(f"\n[spark writer] producer_byte_rate quota {quota:,} B/s on client.id {client}: Spark wrote "
          f"{len(written)} of {len(stored)} records of {VALUE:,} B in {elapsed:.1f} s; steady part "
          f"{rate.describe(VALUE)} = {measured / quota:.3f}x the quota; brokers' LogAppendTime over "
          f"the same part: {appended:,.0f} B/s = {appended / quota:.3f}x; proxy: {throttles:.0f} throttled "
          f"produce requests, {throttle_s:.1f} s of throttle time")
    assert measured <= CEILING * quota, f"Spark wrote {measured:,.0f} B/s under a {quota:,} B/s quota"
    assert measured >= FLOOR * quota, f"Spark wrote only {measured:,.0f} B/s under a {quota:,} B/s quota"
    assert throttles > 0 and throttle_s > 0
    # One task per source partition writes it, in order, to the same partition: offsets match too.
    assert _content(written) == _content(stored), _mismatch(written, stored)


def _append_rate(records: list[Record]) -> float:
    """Value bytes per second by the brokers' append times (LogAppendTime), after the first BURST_S."""
    times = sorted(r.timestamp_ms for r in records)
    steady = [t for t in times if t >= times[0] + BURST_S * 1000]
    if len(steady) < 2 or steady[-1] == steady[0]:
        return float("nan")
    return (len(steady) - 1) * VALUE / ((steady[-1] - steady[0]) / 1000)


def _content(records: list[Record]) -> list[tuple[int, int, bytes | None, bytes | None, tuple[Header, ...]]]:
    return sorted((r.partition, r.offset, r.key, r.value, r.headers) for r in records)


def _mismatch(got: list[Record], want: list[Record]) -> str:
    a, b = set(_content(got)), set(_content(want))
    return (f"{len(got)} records in the target, {len(want)} in the source: {len(b - a)} missing, "
            f"{len(a - b)} unexpected, {len(got) - len(a)} duplicates")


@pytest.fixture
def pid_proxy(kafka_cluster: LocalKafka, tmp_path: Path) -> Iterator[QuotaProxy]:
    """A proxy of its own, with producer-id windows of 60 s (3 samples): the padded window is 120 s."""
    workdir = tmp_path / "pid-proxy"
    workdir.mkdir()
    running = QuotaProxy(kafka_cluster.bootstrap, workdir, "producer_id_quota_window_num = 3\n"
                         "producer_id_quota_window_size_seconds = 60")
    try:
        yield running
    finally:
        running.stop()


def test_producer_id_quota_leaves_spark_writer_alone(spark: SparkSession, spark_proxy: QuotaProxy,
                                                     pid_proxy: QuotaProxy, tmp_path: Path) -> None:
    """6. A producer_ids_rate quota on the user does not disturb Spark's idempotent writer.

    The quota, 0.02 new producer ids per second over a padded window of 120 s, lets a user start two
    producers in two minutes; a third is throttled. Spark's writer keeps one idempotent producer per
    executor for all tasks and batches, so it must run untouched, and the proxy must have decoded its
    record batches and counted exactly that one producer id.
    """
    pid_rate, window_s = 0.02, 120
    source = create_topic(spark_proxy.bootstrap, "spark-pid-src", PARTITIONS)
    target = create_topic(spark_proxy.bootstrap, "spark-pid-dst", PARTITIONS)
    stored = produce(spark_proxy.bootstrap, source, _bulk(1200, headers=True))  # not through pid_proxy
    pid_proxy.set_quotas(f'[[quota]]\nuser = "ANONYMOUS"\nproducer_ids_rate = {pid_rate}')
    query = (spark.readStream.format("kafka")
             .options(**kafka_options(pid_proxy.bootstrap, "spark-pid-source", subscribe=source,
                                      startingOffsets="earliest", includeHeaders="true",
                                      maxOffsetsPerTrigger="200"))
             .load()
             .selectExpr("partition", "key", "value", "headers")
             .writeStream.format("kafka")
             .options(**kafka_options(pid_proxy.bootstrap, "spark-pid-writer", topic=target,
                                      **{"kafka.enable.idempotence": "true", "kafka.acks": "all"}))
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    began = time.monotonic()
    await_stop(query, 240)
    elapsed = time.monotonic() - began
    written = read_all(pid_proxy.bootstrap, target, PARTITIONS, len(stored))
    labels = {"quota": "producer_ids_rate", "user": "ANONYMOUS", "client_id": ""}
    counted = pid_proxy.metric("kthrottle_producer_id_rate_per_second", **labels) * window_s
    throttles, throttle_s = _throttle_figures(pid_proxy, "producer_ids_rate", "", user="ANONYMOUS")
    produce_throttled = pid_proxy.metric("kthrottle_throttled_responses_total", api="Produce")
    progress = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    print(f"\n[spark producer ids] producer_ids_rate quota {pid_rate}/s on user ANONYMOUS: Spark wrote "
          f"{len(written)} of {len(stored)} records in {elapsed:.1f} s in batches of {progress}; proxy "
          f"counted {counted:.2f} new producer id(s), {throttles:.0f} producer-id throttles "
          f"({throttle_s:.1f} s), {produce_throttled:.0f} throttled Produce responses")
    assert len(progress) >= 3
    assert 0.5 <= counted <= 1.5, f"the proxy counted {counted:.2f} producer ids for Spark's one writer"
    assert throttles == 0 and produce_throttled == 0
    assert _content(written) == _content(stored), _mismatch(written, stored)
