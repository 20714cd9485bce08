"""Usage events (schema v1, /work/notes/usage_schema.md) parsed and summed per tenant and hour, in Spark.

The definitions the report's columns follow, in one place:

- An event belongs to the clock hour (UTC) in which its interval starts. Intervals are a few seconds
  long, so an interval that crosses an hour boundary is counted whole in the earlier hour: sums stay
  exact (an event is never split or counted twice), at the price of a few seconds' shift at the edge.
- A *slot* is one (user, client id, interval): the events of several proxies (a fleet, or workers)
  for the same interval are summed first, so a per-interval rate is the tenant's rate over the fleet.
- The share of a quota used in one slot is (usage per second, in the quota's unit) / quota, with the
  quota in force at the end of that interval (the event's `quotas`). Per hour:
  `<quota>_share_avg`  = time-weighted mean of the slots' shares, over the seconds the tenant was
                         active (had an event) under that quota: bytes / (quota x seconds active) when
                         the quota did not change;
  `<quota>_share_hour` = the same sum over the whole hour (3600 s): bytes / (quota x 3600), the part of
                         the hour's allowance used (for chargeback);
  `<quota>_share_peak` = the highest slot's share (the highest per-interval rate / quota).
  They are null when no quota applied to the tenant in that hour.
- Throttle counts and times are per quota key, as the proxy reports them (kthrottle_throttles_total,
  kthrottle_throttle_time_seconds_total). `throttled_ms` is the largest of them: a response throttled
  by two quotas at once waits once. `throttled_share` = throttled_ms / 3600 s; a tenant whose
  throttled_share exceeds the threshold (0.5 by default) "spent most of the hour throttled". Throttle
  time adds up over a tenant's connections, as Kafka's throttle-time sensor does, so a tenant with
  several throttled connections can exceed 100 %.
- `rank` orders the hour's tenants by bytes in + out (ties by user, client id): the top talkers.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

SCHEMA_VERSION = 1
"""The event layout this job reads; an event with another `schema` is skipped and counted."""

HOUR_MS = 3_600_000
CORRUPT = "_corrupt_record"
"""Spark's own name for the raw text of a record its JSON reader could not fit to the schema."""

THROTTLED_MOST_SHARE = 0.5
"""Default: a tenant throttled for more than half of an hour spent "most of the hour throttled"."""

QUOTA_KEYS = ("producer_byte_rate", "consumer_byte_rate", "request_percentage",
              "controller_mutation_rate", "producer_ids_rate")
"""Kafka's quota config names (kafka-configs --add-config), as the events and the metrics name them."""

MEASURED: dict[str, tuple[str, float]] = {
    # quota key -> (the event's usage field, factor from usage per second to the quota's unit)
    "producer_byte_rate": ("produce_bytes", 1.0),  # bytes/s
    "consumer_byte_rate": ("fetch_bytes", 1.0),  # bytes/s
    # % of one thread: Kafka's request sensor records nanos x 100 / 1e9 per second = ms x 0.1
    "request_percentage": ("request_time_ms", 0.1),
    "producer_ids_rate": ("new_producer_ids", 1.0),  # new producer ids/s (KIP-936 draft)
}
"""The quotas whose usage the events carry (controller mutations have no usage field in v1)."""

_THROTTLE = T.StructType([T.StructField("count", T.LongType()), T.StructField("time_ms", T.DoubleType())])

EVENT_SCHEMA = T.StructType([
    T.StructField("schema", T.LongType()),
    T.StructField("proxy", T.StructType([
        T.StructField("host", T.StringType()), T.StructField("listen", T.StringType()),
        T.StructField("pid", T.LongType()), T.StructField("member", T.StringType())])),
    T.StructField("interval", T.StructType([
        T.StructField("start_ms", T.LongType()), T.StructField("end_ms", T.LongType())])),
    T.StructField("user", T.StringType()),
    T.StructField("client_id", T.StringType()),
    T.StructField("produce_bytes", T.LongType()),
    T.StructField("fetch_bytes", T.LongType()),
    T.StructField("requests", T.MapType(T.StringType(), T.LongType())),
    T.StructField("request_time_ms", T.DoubleType()),
    T.StructField("new_producer_ids", T.LongType()),
    T.StructField("throttles", T.MapType(T.StringType(), _THROTTLE)),
    T.StructField("quotas", T.MapType(T.StringType(), T.DoubleType())),
    T.StructField(CORRUPT, T.StringType()),
])
"""Schema v1. Fields not listed are ignored; a listed field of the wrong type makes the record malformed."""


def parse(kafka: DataFrame) -> DataFrame:
    """Rows of Spark's Kafka source -> one row per record: the event's fields, and `problem`.

    `problem` is null for a usable event, else why the record is skipped. A bad record never fails
    the job: it is counted (see `problems`) and left out.
    """
    e = F.from_json(F.col("value").cast("string"), EVENT_SCHEMA,
                    {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT})
    rows = kafka.select("topic", "partition", "offset", e.alias("e"))
    start, end = F.col("e.interval.start_ms"), F.col("e.interval.end_ms")
    problem = (F.when(F.col("e").isNull(), F.lit("no value"))
               .when(F.col(f"e.{CORRUPT}").isNotNull(), F.lit("not JSON of the v1 layout"))
               .when(F.col("e.schema").isNull(), F.lit("no schema field"))
               .when(F.col("e.schema") != SCHEMA_VERSION,
                     F.concat(F.lit("schema "), F.col("e.schema").cast("string")))
               .when(F.col("e.user").isNull() | F.col("e.client_id").isNull() | start.isNull() | end.isNull(),
                     F.lit("missing user, client_id or interval"))
               .when(end <= start, F.lit("empty interval")))
    zero = F.lit(0)
    return rows.select(
        "topic", "partition", "offset", problem.alias("problem"),
        F.col("e.user").alias("user"), F.col("e.client_id").alias("client_id"),
        start.alias("start_ms"), end.alias("end_ms"),
        F.coalesce(F.col("e.produce_bytes"), zero).alias("produce_bytes"),
        F.coalesce(F.col("e.fetch_bytes"), zero).alias("fetch_bytes"),
        F.coalesce(F.aggregate(F.map_values(F.col("e.requests")), F.lit(0).cast("long"),
                               lambda acc, n: acc + F.coalesce(n, zero)), zero).alias("requests"),
        F.coalesce(F.col("e.request_time_ms"), zero.cast("double")).alias("request_time_ms"),
        F.coalesce(F.col("e.new_producer_ids"), zero).alias("new_producer_ids"),
        F.col("e.throttles").alias("throttles"), F.col("e.quotas").alias("quotas"),
        F.concat_ws("/", F.col("e.proxy.host"), F.col("e.proxy.listen"),
                    F.col("e.proxy.pid").cast("string")).alias("proxy"),
        F.floor(start / HOUR_MS).cast("long").alias("hour_ms"),
    ).withColumn("hour_ms", F.col("hour_ms") * HOUR_MS)


def valid(parsed: DataFrame, from_ms: int | None = None, to_ms: int | None = None) -> DataFrame:
    """The usable events whose interval starts in [from_ms, to_ms)."""
    events = parsed.where(F.col("problem").isNull())
    if from_ms is not None:
        events = events.where(F.col("start_ms") >= from_ms)
    if to_ms is not None:
        events = events.where(F.col("start_ms") < to_ms)
    return events


def problems(parsed: DataFrame) -> dict[str, tuple[int, str]]:
    """Skipped records by reason: (count, where the first one is, as topic/partition@offset)."""
    rows = (parsed.where(F.col("problem").isNotNull()).groupBy("problem")
            .agg(F.count(F.lit(1)).alias("n"),
                 F.min(F.struct("topic", "partition", "offset")).alias("first")).collect())
    return {r.problem: (int(r.n), f"{r.first.topic}/{r.first.partition}@{r.first.offset}") for r in rows}


def _throttle(key: str, field: str) -> Column:
    value = F.col("throttles").getItem(key).getField(field)
    return F.coalesce(value, F.lit(0).cast("long" if field == "count" else "double"))


def slots(events: DataFrame) -> DataFrame:
    """One row per (user, client id, interval): the events of all proxies for that interval summed."""
    total_count = F.aggregate(F.map_values(F.col("throttles")), F.lit(0).cast("long"),
                              lambda acc, t: acc + F.coalesce(t.getField("count"), F.lit(0).cast("long")))
    total_ms = F.aggregate(F.map_values(F.col("throttles")), F.lit(0.0),
                           lambda acc, t: acc + F.coalesce(t.getField("time_ms"), F.lit(0.0)))
    sums = [F.sum(c).alias(c) for c in ("produce_bytes", "fetch_bytes", "requests", "request_time_ms",
                                        "new_producer_ids")]
    throttles = [agg for key in QUOTA_KEYS for agg in (
        F.sum(_throttle(key, "count")).alias(f"{key}_throttle_count"),
        F.sum(_throttle(key, "time_ms")).alias(f"{key}_throttle_ms"))]
    quotas = [F.max(F.col("quotas").getItem(key)).alias(key) for key in QUOTA_KEYS]
    return (events.groupBy("hour_ms", "user", "client_id", "start_ms", "end_ms")
            .agg(*sums, *throttles, *quotas,
                 F.sum(F.coalesce(total_count, F.lit(0).cast("long"))).alias("throttle_count"),
                 F.sum(F.coalesce(total_ms, F.lit(0.0))).alias("throttle_time_ms"),
                 F.count(F.lit(1)).alias("events"), F.collect_set("proxy").alias("proxies")))


def hourly(events: DataFrame, throttled_most_share: float = THROTTLED_MOST_SHARE) -> DataFrame:
    """Per (hour, user, client id): the report's columns (see the module's docstring), `hour` as
    `yyyy-MM-ddTHH` (UTC) for partitioning."""
    s = slots(events).withColumn("seconds", (F.col("end_ms") - F.col("start_ms")) / 1000.0)
    for key, (usage, factor) in MEASURED.items():
        quota = F.col(key)
        s = s.withColumn(f"{key}_share", F.when(
            quota > 0, F.col(usage) * factor / F.col("seconds") / quota))
    share_aggs = []
    for key in MEASURED:
        share = F.col(f"{key}_share")
        weighted = F.sum(share * F.col("seconds"))
        share_aggs += [
            F.max_by(key, F.when(F.col(key).isNotNull(), F.col("end_ms"))).alias(key),
            (weighted / F.sum(F.when(share.isNotNull(), F.col("seconds")))).alias(f"{key}_share_avg"),
            (weighted / (HOUR_MS / 1000)).alias(f"{key}_share_hour"),
            F.max(share).alias(f"{key}_share_peak"),
        ]
    other_quotas = [F.max_by(key, F.when(F.col(key).isNotNull(), F.col("end_ms"))).alias(key)
                    for key in QUOTA_KEYS if key not in MEASURED]
    throttle_aggs = [F.sum(f"{key}_{what}").alias(f"{key}_{what}")
                     for key in QUOTA_KEYS for what in ("throttle_count", "throttle_ms")]
    h = (s.groupBy("hour_ms", "user", "client_id").agg(
        F.sum("produce_bytes").alias("bytes_in"), F.sum("fetch_bytes").alias("bytes_out"),
        F.sum("requests").alias("requests"), F.sum("request_time_ms").alias("request_time_ms"),
        F.sum("new_producer_ids").alias("new_producer_ids"),
        F.sum("seconds").alias("active_seconds"), F.count(F.lit(1)).alias("intervals"),
        F.sum("events").alias("events"), F.size(F.array_distinct(F.flatten(F.collect_list("proxies"))))
        .alias("proxies"),
        *share_aggs, *other_quotas, *throttle_aggs,
        F.sum("throttle_count").alias("throttle_count"), F.sum("throttle_time_ms").alias("throttle_time_ms")))
    throttled_ms = F.greatest(*[F.col(f"{key}_throttle_ms") for key in QUOTA_KEYS])
    by_hour = Window.partitionBy("hour_ms").orderBy(
        (F.col("bytes_in") + F.col("bytes_out")).desc(), F.col("user"), F.col("client_id"))
    return (h.withColumn("throttled_ms", throttled_ms)
            .withColumn("throttled_share", F.col("throttled_ms") / HOUR_MS)
            .withColumn("throttled_most", F.col("throttled_share") > throttled_most_share)
            .withColumn("rank", F.row_number().over(by_hour))
            .withColumn("hour_start", F.timestamp_millis(F.col("hour_ms")))
            .withColumn("hour", F.date_format(F.col("hour_start"), "yyyy-MM-dd'T'HH"))
            .drop("hour_ms"))


def chart_bucket_ms(span_ms: int, interval_ms: int, max_points: int = 240) -> int:
    """The chart's time step: a whole number of event intervals, the smallest round step giving at
    most `max_points` points. Shorter than an interval, a step would show its bytes as a spike and
    gaps; not a whole number of intervals, steps would hold one interval more or less in turn and the
    line would saw (2 s events in 5 s steps: 0.8x, 1.2x, ...). `interval_ms` is the longest interval
    seen; the writer's timer can end one a few ms late, so it is rounded to the whole second."""
    interval = max(1000, round(interval_ms / 1000) * 1000)
    for step_s in (1, 2, 5, 10, 30, 60, 300, 900, 3600, 6 * 3600, 24 * 3600):
        step = -(-step_s * 1000 // interval) * interval  # rounded up to whole intervals
        if span_ms / step <= max_points:
            return step
    return -(-7 * 24 * 3600 * 1000 // interval) * interval


def series(events: DataFrame, tenants: list[tuple[str, str]], bucket_ms: int) -> DataFrame:
    """Bytes in and out per chart step for the given tenants (by the step their interval starts in)."""
    if not tenants:
        return events.limit(0).select(F.lit(0).alias("bucket_ms"), "user", "client_id",
                                      F.lit(0).alias("bytes_in"), F.lit(0).alias("bytes_out"))
    wanted = F.lit(False)
    for user, client_id in tenants:
        wanted = wanted | ((F.col("user") == user) & (F.col("client_id") == client_id))
    return (events.where(wanted)
            .withColumn("bucket_ms", F.floor(F.col("start_ms") / bucket_ms).cast("long") * bucket_ms)
            .groupBy("bucket_ms", "user", "client_id")
            .agg(F.sum("produce_bytes").alias("bytes_in"), F.sum("fetch_bytes").alias("bytes_out")))
