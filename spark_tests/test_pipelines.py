"""Spark's own Kafka source, streaming and batch, through the proxy: every record exactly once, intact.

The records are written by librdkafka and compared with what Spark read field by field: partition,
offset, key, value, headers (repeated names, empty and null values) and timestamp. Keys and values
include nulls and empty and non-UTF-8 bytes, and the topic's six partitions have leaders on several
brokers, so Spark's executors fetch through more than one of the proxy's broker ports.
"""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession

from tests.integration.proxies import QuotaProxy

from .kafka import Header, Record, create_topic, end_offsets, leaders, produce
from .spark import await_stop, kafka_options

PARTITIONS = 6
BASE_TS = 1_700_000_000_000


def _records(first: int, count: int) -> list[tuple[int, bytes | None, bytes | None, list[Header], int]]:
    """Varied records: null keys, null/empty/binary values, no/one/repeated/null-valued headers."""
    made = []
    for i in range(first, first + count):
        key = None if i % 7 == 0 else f"k{i}".encode()
        value = None if i % 97 == 5 else bytes((i * 31 + j) % 256 for j in range(i % 300))
        headers: list[Header] = [
            [],
            [("trace", f"t{i}".encode())],
            [("dup", b"1"), ("dup", b"2"), ("empty", b""), ("null", None)],
        ][i % 3]
        made.append((i % PARTITIONS, key, value, headers, BASE_TS + i))
    return made


def _as_records(frame: DataFrame) -> list[Record]:
    """Spark rows -> Record, with Spark's bytearrays as bytes and a missing header array as none."""
    rows = frame.selectExpr("partition", "offset", "key", "value", "headers",
                            "unix_millis(timestamp) AS ts").collect()

    def blob(value: bytearray | None) -> bytes | None:
        return None if value is None else bytes(value)

    return sorted(Record(r.partition, r.offset, blob(r.key), blob(r.value),
                         tuple((h.key, blob(h.value)) for h in (r.headers or [])), r.ts) for r in rows)


def _diff(got: list[Record], want: list[Record]) -> str:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    dupes = len(got) - len(set(got))
    return (f"{len(got)} records read, {len(want)} produced; {len(missing)} missing (first {missing[:2]}), "
            f"{len(extra)} unexpected (first {extra[:2]}), {dupes} duplicates")


def test_stream_reads_every_record_exactly_once(spark: SparkSession, spark_proxy: QuotaProxy,
                                                tmp_path: Path) -> None:
    """readStream -> parquet with a checkpoint, in two runs: the restart neither drops nor repeats."""
    topic = create_topic(spark_proxy.bootstrap, "spark-exact", PARTITIONS)
    spread = set(leaders(spark_proxy.bootstrap, topic).values())
    assert len(spread) >= 2, f"all partitions of {topic} are led by broker(s) {spread}"
    want = produce(spark_proxy.bootstrap, topic, _records(0, 1500))
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"

    def run() -> list[int]:
        source = (spark.readStream.format("kafka")
                  .options(**kafka_options(spark_proxy.bootstrap, "spark-exact", subscribe=topic,
                                           startingOffsets="earliest", includeHeaders="true",
                                           maxOffsetsPerTrigger="400"))
                  .load())
        query = (source.writeStream.format("parquet").option("path", str(sink))
                 .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
        await_stop(query, 180)
        return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]

    first = run()
    want += produce(spark_proxy.bootstrap, topic, _records(1500, 1500))
    second = run()
    got = _as_records(spark.read.parquet(str(sink)))
    print(f"\n[spark exactly-once] {len(want)} records on {PARTITIONS} partitions led by brokers "
          f"{sorted(spread)}; first run batches {first}, after restart {second}; read {len(got)}")
    assert len(first) >= 2 and len(second) >= 2, "maxOffsetsPerTrigger should have split each run"
    assert sum(first) == 1500 and sum(second) == 1500, (first, second)
    assert got == sorted(want), _diff(got, sorted(want))


def test_batch_read_returns_exactly_the_offset_range(spark: SparkSession, spark_proxy: QuotaProxy) -> None:
    """read.format("kafka") with per-partition starting and ending offsets: that range, nothing else."""
    topic = create_topic(spark_proxy.bootstrap, "spark-range", PARTITIONS)
    stored = produce(spark_proxy.bootstrap, topic, _records(0, 1200))
    ends = end_offsets(spark_proxy.bootstrap, topic, PARTITIONS)
    assert sum(ends.values()) == 1200, ends
    starting = {str(p): 10 + 7 * p for p in range(PARTITIONS)}
    ending = {str(p): ends[p] - 5 * p - 3 for p in range(PARTITIONS)}
    ending["5"] = -1  # "latest" for one partition
    frame = (spark.read.format("kafka")
             .options(**kafka_options(spark_proxy.bootstrap, "spark-range", subscribe=topic,
                                      includeHeaders="true",
                                      startingOffsets=json.dumps({topic: starting}),
                                      endingOffsets=json.dumps({topic: ending})))
             .load())
    got = _as_records(frame)
    resolved = {p: (ends[p] if ending[str(p)] == -1 else ending[str(p)]) for p in range(PARTITIONS)}
    want = [r for r in stored if starting[str(r.partition)] <= r.offset < resolved[r.partition]]
    print(f"\n[spark batch range] starting {starting}, ending {ending} (end offsets {ends}): "
          f"{len(got)} records read, {len(want)} expected")
    assert 0 < len(want) < len(stored)
    assert got == want, _diff(got, want)
