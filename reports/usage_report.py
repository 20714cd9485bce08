"""The usage report (issue 14): the proxy's usage topic -> per-tenant, per-hour aggregates, on Spark.

    python -m reports.usage_report --bootstrap-server H:P [--topic T] [--from ISO] [--to ISO]
                                   [--output DIR] [--stream --checkpoint DIR]

runs Spark in local mode; `spark-submit --packages org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0
reports/usage_report.py ...` runs the same module on a cluster. It reads the topic with Spark's Kafka
source (through a kthrottle proxy or directly), as a batch over a time range or as a streaming query
with a checkpoint, and writes under --output:

    hourly/hour=YYYY-MM-DDTHH/*.parquet  one row per tenant and hour (columns: reports/aggregate.py)
    report.txt                           the text table, also printed on stdout
    report.html                          the same with SVG charts of the top tenants over time
    events/hour=.../*.parquet            --stream only: the events read so far, the report's input

Malformed records are skipped and counted, never fatal. The definitions of every figure are in
reports/aggregate.py's docstring.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

if not __package__:  # run as a file (spark-submit reports/usage_report.py): make `reports` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_TOPIC = "__kthrottle_usage"
DEFAULT_CLIENT_ID = "kthrottle-usage-report"
"""The report's own client.id, so a proxy in the path can give it a quota like any other tenant."""

TIMESTAMP_SLACK_MS = 15 * 60 * 1000
"""How far outside [--from, --to) the Kafka read starts and ends, by record timestamp. An event is
written after its interval ends (a slow cluster delays it; the broker's clock may differ from the
proxy's under LogAppendTime), so a record's timestamp only approximates its interval: the read takes
a margin and the filter on the interval's start does the exact cut."""

STOP_WAIT_S = 300.0
"""On SIGINT/SIGTERM, how long a running micro-batch may take to finish before the query is stopped."""

LOCAL_MASTER = "local[2]"
CONNECTOR = "org.apache.spark:spark-sql-kafka-0-10_2.13"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options, for `python -m reports.usage_report` and `kthrottle usage-report`."""
    parser.add_argument("--bootstrap-server", required=True,
                        help="the cluster's or a kthrottle proxy's bootstrap address, H:P[,H:P...]")
    parser.add_argument("--topic", default=DEFAULT_TOPIC, help=f"usage topic (default {DEFAULT_TOPIC})")
    parser.add_argument("--from", dest="from_", metavar="ISO", type=parse_time,
                        help="first hour: intervals starting at or after this time (UTC unless an offset "
                             "is given), e.g. 2026-11-23T15:00")
    parser.add_argument("--to", metavar="ISO", type=parse_time,
                        help="intervals starting before this time")
    parser.add_argument("--output", type=Path, default=Path("usage-report"),
                        help="directory for hourly/ (Parquet), report.txt and report.html "
                             "(default ./usage-report)")
    parser.add_argument("--top", type=int, default=5,
                        help="top talkers shown per hour and charted (default 5)")
    parser.add_argument("--throttled-share", type=float, default=0.5,
                        help="a tenant throttled for more than this share of an hour is flagged "
                             "(default 0.5)")
    parser.add_argument("--client-id", default=DEFAULT_CLIENT_ID,
                        help=f"kafka client.id of the report's consumers (default {DEFAULT_CLIENT_ID})")
    parser.add_argument("--kafka-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Kafka client setting, e.g. security.protocol=SASL_SSL (repeatable)")
    parser.add_argument("--stream", action="store_true",
                        help="read as a streaming query with a checkpoint: each run reads what is new")
    parser.add_argument("--checkpoint", type=Path, help="the streaming query's checkpoint (with --stream)")
    parser.add_argument("--trigger-seconds", type=float,
                        help="with --stream: keep running, a micro-batch this often (default: read what "
                             "is there and stop, Spark's availableNow)")
    parser.add_argument("--master", default=None,
                        help=f"Spark master when not under spark-submit (default {LOCAL_MASTER})")
    parser.add_argument("--jars", default=None,
                        help="comma-separated Kafka connector jars for local mode (default: `make spark`'s "
                             "cache if present, else Maven coordinates resolved by Spark)")


def parse_time(text: str) -> int:
    """ISO 8601 -> unix ms; a time without an offset is UTC."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


@dataclass
class Report:
    """What one run produced, for callers and tests."""

    rows: list[dict[str, Any]]
    skipped: dict[str, tuple[int, str]]
    events: int
    text: str
    output: Path
    series: list[dict[str, Any]] = field(default_factory=list)


def kafka_options(args: argparse.Namespace) -> dict[str, str]:
    options = {"kafka.bootstrap.servers": args.bootstrap_server, "kafka.client.id": args.client_id,
               "subscribe": args.topic}
    for item in args.kafka_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--kafka-option {item!r}: expected KEY=VALUE")
        options[key if key.startswith("kafka.") else f"kafka.{key}"] = value
    return options


def read_batch(spark: SparkSession, args: argparse.Namespace) -> DataFrame:
    """The topic's records that can hold intervals starting in [--from, --to), as one batch."""
    reader = spark.read.format("kafka").options(**kafka_options(args))
    if args.from_ is not None:
        reader = (reader.option("startingTimestamp", str(max(args.from_ - TIMESTAMP_SLACK_MS, 0)))
                  # a partition with nothing that recent starts at its end instead of failing the job
                  .option("startingOffsetsByTimestampStrategy", "latest"))
    else:
        reader = reader.option("startingOffsets", "earliest")
    if args.to is not None:
        # no record at or after that time: the partition's end
        reader = reader.option("endingTimestamp", str(args.to + TIMESTAMP_SLACK_MS))
    else:
        reader = reader.option("endingOffsets", "latest")
    return reader.load()


def build(spark: SparkSession, events: DataFrame, skipped: dict[str, tuple[int, str]],
          args: argparse.Namespace, quiet: bool = False) -> Report:
    """Aggregate the valid events, write Parquet, text and HTML; print the text unless `quiet`."""
    from pyspark.sql import functions as F

    from reports import aggregate, render

    events = events.persist()
    try:
        count = events.count()
        hourly = aggregate.hourly(events, args.throttled_share)
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (hourly.repartition("hour").write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
         .partitionBy("hour").parquet(str(out / "hourly")))
        rows = [r.asDict() for r in hourly.drop("hour_start").collect()]
        totals: dict[tuple[str, str], int] = {}
        for r in rows:
            key = (r["user"], r["client_id"])
            totals[key] = totals.get(key, 0) + r["bytes_in"] + r["bytes_out"]
        top = sorted(totals, key=lambda k: (-totals[k], k))[:args.top]
        first, last, longest = events.agg(F.min("start_ms"), F.max("end_ms"),
                                          F.max(F.col("end_ms") - F.col("start_ms"))).collect()[0]
        bucket_ms = aggregate.chart_bucket_ms((last or 0) - (first or 0), longest or 0)
        series = [r.asDict() for r in aggregate.series(events, top, bucket_ms).collect()]
    finally:
        events.unpersist()
    summary = render.Summary(args.topic, args.from_, args.to, count, skipped, args.top, args.throttled_share)
    text = render.text(rows, summary)
    (out / "report.txt").write_text(text)
    (out / "report.html").write_text(render.page(rows, summary, series, bucket_ms))
    if not quiet:
        print(text, end="", flush=True)
    return Report(rows, skipped, count, text, out, series)


def run_batch(spark: SparkSession, args: argparse.Namespace) -> Report:
    from reports import aggregate

    parsed = aggregate.parse(read_batch(spark, args)).persist()
    try:
        skipped = aggregate.problems(parsed)
        return build(spark, aggregate.valid(parsed, args.from_, args.to), skipped, args)
    finally:
        parsed.unpersist()


def run_stream(spark: SparkSession, args: argparse.Namespace) -> Report | None:
    """Ingest new records into `events/` (deduplicated by offset), then report over what is stored.

    The checkpoint makes each run start where the last one stopped; the report is recomputed from the
    stored events, so an hour that spans two runs is whole. With --trigger-seconds the report is
    rewritten after every micro-batch until the query is stopped.
    """
    from pyspark.sql import functions as F

    from reports import aggregate

    if args.checkpoint is None:
        raise SystemExit("--stream needs --checkpoint DIR")
    out = Path(args.output)
    events_path = str(out / "events")
    skipped: dict[str, tuple[int, str]] = {}
    reports: list[Report] = []

    def stored() -> DataFrame:
        events = spark.read.parquet(events_path).dropDuplicates(["topic", "partition", "offset"])
        return aggregate.valid(events, args.from_, args.to)

    def ingest(batch: DataFrame, batch_id: int) -> None:
        parsed = aggregate.parse(batch).persist()
        try:
            for reason, (n, first) in aggregate.problems(parsed).items():
                before = skipped.get(reason, (0, first))
                skipped[reason] = (before[0] + n, before[1])
            (parsed.where(F.col("problem").isNull())
             .withColumn("hour", F.date_format(F.timestamp_millis(F.col("hour_ms")), "yyyy-MM-dd'T'HH"))
             .write.mode("append").partitionBy("hour").parquet(events_path))
        finally:
            parsed.unpersist()
        if args.trigger_seconds is not None:
            reports.append(build(spark, stored(), dict(skipped), args))

    options = kafka_options(args)
    if args.from_ is not None:
        options.update(startingTimestamp=str(max(args.from_ - TIMESTAMP_SLACK_MS, 0)),
                       startingOffsetsByTimestampStrategy="latest")
    else:
        options["startingOffsets"] = "earliest"
    writer = (spark.readStream.format("kafka").options(**options).load()
              .writeStream.foreachBatch(ingest).option("checkpointLocation", str(args.checkpoint)))
    if args.trigger_seconds is not None:
        writer = writer.trigger(processingTime=f"{args.trigger_seconds} seconds")
    else:
        writer = writer.trigger(availableNow=True)
    query = writer.queryName("kthrottle-usage-report").start()
    if args.trigger_seconds is None:
        query.awaitTermination()  # availableNow stops by itself (raises if the query failed)
    else:
        _run_until_signalled(query)
    if args.trigger_seconds is not None:
        return reports[-1] if reports else None
    if not Path(events_path).exists():
        print(f"no usage events in {args.topic} yet", flush=True)
        return None
    return build(spark, stored(), skipped, args)


def _run_until_signalled(query: StreamingQuery) -> None:
    """Run a --trigger-seconds query until SIGINT or SIGTERM, then stop it between micro-batches.

    A KeyboardInterrupt inside a py4j call would interrupt the running batch's Spark jobs half way
    (its report half written, a stack of JVM errors); a flag set by the handler lets the loop stop
    the query once its current batch is done.
    """
    stop = threading.Event()
    main_thread = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if main_thread:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        while query.isActive and not stop.is_set():
            query.awaitTermination(1)  # raises if the query failed
        deadline = time.monotonic() + STOP_WAIT_S
        while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
            time.sleep(0.2)
        query.stop()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run(spark: SparkSession, args: argparse.Namespace) -> Report | None:
    """Run the report on an existing session (what main() and the tests call)."""
    if args.from_ is not None and args.to is not None and args.from_ >= args.to:
        raise SystemExit("--from must be before --to")
    spark.conf.set("spark.sql.session.timeZone", "UTC")  # hour labels are UTC
    return run_stream(spark, args) if args.stream else run_batch(spark, args)


def _local_jars(explicit: str | None, version: str) -> tuple[str, str]:
    """("spark.jars", list) when connector jars are at hand, else ("spark.jars.packages", coordinates)."""
    if explicit:
        return "spark.jars", explicit
    folder = os.environ.get("KTHROTTLE_SPARK_JARS")
    if folder is None:
        cache = Path(os.environ.get("KTHROTTLE_CACHE") or Path.home() / ".cache" / "kthrottle").expanduser()
        folder = str(cache / f"spark-{version}" / "jars")
    jars = sorted(Path(folder).expanduser().glob("*.jar"))
    if any(jar.name.startswith("spark-sql-kafka-0-10_") for jar in jars):
        return "spark.jars", ",".join(str(jar) for jar in jars)
    return "spark.jars.packages", f"{CONNECTOR}:{version}"


def session(args: argparse.Namespace) -> SparkSession:
    """Under spark-submit, the session it configured; otherwise a small local one with the connector."""
    try:
        import pyspark
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise SystemExit("the usage report needs pyspark: pip install 'kthrottle[spark]'") from exc
    builder = SparkSession.builder.appName("kthrottle-usage-report")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        key, value = _local_jars(args.jars, pyspark.__version__)
        builder = (builder.master(args.master or LOCAL_MASTER).config(key, value)
                   .config("spark.driver.memory", "1g")
                   .config("spark.sql.shuffle.partitions", "2")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1"))
    spark = builder.config("spark.sql.session.timeZone", "UTC").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kthrottle usage-report",
                                     description="Per-tenant, per-hour usage from kthrottle's usage topic, "
                                                 "on Spark (local mode, or the cluster of spark-submit)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.stream and args.checkpoint is None:
        parser.error("--stream needs --checkpoint DIR")
    if args.from_ is not None and args.to is not None and args.from_ >= args.to:
        parser.error("--from must be before --to")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_command(parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Start Spark, run the report, stop Spark; the exit status (for `kthrottle usage-report` too)."""
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its INFO lines are every gateway call
    spark = session(args)
    try:
        run(spark, args)
    except Exception as exc:
        from pyspark.errors import PySparkException

        if not isinstance(exc, PySparkException):
            raise
        # Spark's message first line names the cause (e.g. UnknownTopicOrPartitionException for a
        # topic the proxy has not created yet); the JVM stack trace is in Spark's log above.
        print(f"kthrottle usage-report: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
