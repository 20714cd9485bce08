"""The usage report (reports/usage_report.py) on real Spark, reading a real topic through the proxy.

Synthetic schema-v1 events with known sums: several tenants, intervals on both sides of an hour
boundary, two proxies reporting the same interval, unknown fields, and malformed records. The job's
aggregates are compared exactly with the sums worked out by hand from those events.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer
from pyspark.sql import SparkSession

from harness.local_kafka import LocalKafka
from reports import aggregate, usage_report
from tests.integration.proxies import REPO, QuotaProxy

from .kafka import create_topic, produce

HOUR = 3_600_000
S = 1000
# The hour boundary the events straddle: the start of the current hour, so the records' timestamps are
# recent (the read by --from/--to goes by record timestamp, and old ones could meet retention).
BOUNDARY = (int(time.time() * 1000) // HOUR) * HOUR


def _label(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H", time.gmtime(ms / 1000))


EARLY, BEFORE, AFTER = _label(BOUNDARY - 2 * HOUR), _label(BOUNDARY - HOUR), _label(BOUNDARY)


def _event(user: str, client_id: str, start: int, seconds: int = 10, *, proxy: int = 1,
           **fields: Any) -> dict[str, Any]:
    return {"schema": 1, "proxy": {"host": "127.0.0.1", "listen": f"127.0.0.1:{9000 + proxy}",
                                   "pid": 100 + proxy, "member": None},
            "interval": {"start_ms": start, "end_ms": start + seconds * S},
            "user": user, "client_id": client_id, "produce_bytes": 0, "fetch_bytes": 0, "requests": {},
            "request_time_ms": 0.0, "new_producer_ids": 0, "throttles": {}, "quotas": {}, **fields}


ALICE_QUOTAS = {"producer_byte_rate": 1000.0}
BOB_QUOTAS = {"consumer_byte_rate": 4000.0}
EVENTS = [
    # alice/etl produces under a 1000 B/s quota: 5000, 12000 (throttled) before the boundary, 8000, 3000 after
    _event("alice", "etl", BOUNDARY - 20 * S, produce_bytes=5000, requests={"Produce": 10},
           quotas=ALICE_QUOTAS, future_field={"ignored": [1, 2]}),
    _event("alice", "etl", BOUNDARY - 10 * S, produce_bytes=12000, requests={"Produce": 10, "Metadata": 1},
           quotas=ALICE_QUOTAS, throttles={"producer_byte_rate": {"count": 3, "time_ms": 2500}}),
    _event("alice", "etl", BOUNDARY, produce_bytes=8000, requests={"Produce": 10}, quotas=ALICE_QUOTAS),
    _event("alice", "etl", BOUNDARY + 10 * S, produce_bytes=3000, requests={"Produce": 4},
           quotas=ALICE_QUOTAS),
    # bob/reader fetches under 4000 B/s through two proxies: both report [B, B+10s) (30000 + 20000)
    _event("bob", "reader", BOUNDARY, proxy=1, fetch_bytes=30000, requests={"Fetch": 7}, quotas=BOB_QUOTAS,
           throttles={"consumer_byte_rate": {"count": 30, "time_ms": 1_500_000.0},
                      "producer_byte_rate": {"count": 1, "time_ms": 100_000}}),
    _event("bob", "reader", BOUNDARY, proxy=2, fetch_bytes=20000, requests={"Fetch": 5}, quotas=BOB_QUOTAS,
           throttles={"consumer_byte_rate": {"count": 10, "time_ms": 400_000.0}}),
    _event("bob", "reader", BOUNDARY + 10 * S, proxy=1, fetch_bytes=10000, requests={"Fetch": 3},
           quotas=BOB_QUOTAS, throttles={"a_future_quota": {"count": 2, "time_ms": 50}}),
    # ANONYMOUS with no client id: requests only, under request_percentage 10 (1 % used: 100 ms in 10 s)
    _event("ANONYMOUS", "", BOUNDARY + 30 * S, requests={"Metadata": 2, "ApiVersions": 1},
           request_time_ms=100.0, quotas={"request_percentage": 10.0}),
    # two hours earlier: in the full read, outside --from/--to
    _event("alice", "etl", BOUNDARY - 2 * HOUR + 5 * S, produce_bytes=777, requests={"Produce": 1}),
]
MALFORMED: list[bytes | None] = [
    b"this is not json",
    json.dumps({**EVENTS[0], "schema": 2}).encode(),
    json.dumps({k: v for k, v in EVENTS[0].items() if k != "user"}).encode(),
    json.dumps({**EVENTS[0], "produce_bytes": "lots"}).encode(),
    None,  # a tombstone
]


def _records(events: list[dict[str, Any]], malformed: list[bytes | None]) -> list[Any]:
    """(partition, key, value, headers, timestamp): keyed by entity, stamped when the interval ends."""
    made: list[Any] = []
    for event in events:
        key = json.dumps([event["user"], event["client_id"]]).encode()
        made.append((None, key, json.dumps(event).encode(), [], event["interval"]["end_ms"]))
    made += [(None, b"junk", value, [], BOUNDARY) for value in malformed]
    return [(hash(r[1]) % 3 if r[0] is None else r[0], *r[1:]) for r in made]


def _args(proxy: QuotaProxy, topic: str, output: Path, *extra: str) -> Any:
    return usage_report.parse_args(["--bootstrap-server", proxy.bootstrap, "--topic", topic,
                                    "--output", str(output), "--top", "2", *extra])


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["hour"], r["user"], r["client_id"]): r for r in rows}


EXPECTED: dict[tuple[str, str, str], dict[str, Any]] = {
    (EARLY, "alice", "etl"): dict(bytes_in=777, bytes_out=0, requests=1, rank=1, active_seconds=10.0,
                                  producer_byte_rate=None, producer_byte_rate_share_peak=None,
                                  throttle_count=0, throttled_ms=0.0, throttled_most=False),
    (BEFORE, "alice", "etl"): dict(
        bytes_in=17000, bytes_out=0, requests=21, rank=1, intervals=2, events=2, proxies=1,
        active_seconds=20.0, producer_byte_rate=1000.0,
        producer_byte_rate_share_avg=17000 / (1000 * 20), producer_byte_rate_share_hour=17000 / (1000 * 3600),
        producer_byte_rate_share_peak=1.2, consumer_byte_rate=None, consumer_byte_rate_share_avg=None,
        producer_byte_rate_throttle_count=3, producer_byte_rate_throttle_ms=2500.0,
        throttle_count=3, throttle_time_ms=2500.0, throttled_ms=2500.0, throttled_most=False),
    (AFTER, "alice", "etl"): dict(
        bytes_in=11000, bytes_out=0, requests=14, rank=2, intervals=2, active_seconds=20.0,
        producer_byte_rate_share_avg=11000 / (1000 * 20), producer_byte_rate_share_peak=0.8,
        throttle_count=0, throttled_most=False),
    (AFTER, "bob", "reader"): dict(
        bytes_in=0, bytes_out=60000, requests=15, rank=1, intervals=2, events=3, proxies=2,
        active_seconds=20.0, consumer_byte_rate=4000.0,
        consumer_byte_rate_share_avg=60000 / (4000 * 20), consumer_byte_rate_share_hour=60000 / (4000 * 3600),
        consumer_byte_rate_share_peak=50000 / 10 / 4000, producer_byte_rate=None,
        producer_byte_rate_share_avg=None,
        consumer_byte_rate_throttle_count=40, consumer_byte_rate_throttle_ms=1_900_000.0,
        producer_byte_rate_throttle_count=1, producer_byte_rate_throttle_ms=100_000.0,
        throttle_count=43, throttle_time_ms=2_000_050.0, throttled_ms=1_900_000.0,
        throttled_share=1_900_000 / HOUR, throttled_most=True),
    (AFTER, "ANONYMOUS", ""): dict(
        bytes_in=0, bytes_out=0, requests=3, rank=3, request_time_ms=100.0, request_percentage=10.0,
        request_percentage_share_avg=0.1, request_percentage_share_peak=0.1,
        request_percentage_share_hour=0.1 * 10 / 3600, throttled_most=False),
}


def _check(rows: list[dict[str, Any]], keys: set[tuple[str, str, str]]) -> None:
    got = _by_key(rows)
    assert set(got) == keys, sorted(got)
    for key in keys:
        for column, want in EXPECTED[key].items():
            value = got[key][column]
            if isinstance(want, float):
                assert value == pytest.approx(want, rel=1e-12), (key, column, value, want)
            else:
                assert value == want, (key, column, value, want)


@pytest.fixture(scope="module")
def usage_topic(spark_proxy: QuotaProxy) -> str:
    topic = create_topic(spark_proxy.bootstrap, "usage", 3, **{"retention.ms": "-1"})
    produce(spark_proxy.bootstrap, topic, _records(EVENTS, MALFORMED))
    return topic


def test_batch_report_sums_exactly(spark: SparkSession, spark_proxy: QuotaProxy, usage_topic: str,
                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole topic, then a --from/--to range: exact sums, shares, throttles, ranks, files."""
    report = usage_report.run(spark, _args(spark_proxy, usage_topic, tmp_path / "all"))
    assert report is not None
    printed = capsys.readouterr().out
    print(printed)
    assert report.events == len(EVENTS)
    assert report.skipped == {
        "not JSON of the v1 layout": (2, report.skipped["not JSON of the v1 layout"][1]),
        "schema 2": (1, report.skipped["schema 2"][1]),
        "missing user, client_id or interval": (1, report.skipped["missing user, client_id or interval"][1]),
        "no value": (1, report.skipped["no value"][1]),
    }
    _check(report.rows, set(EXPECTED))

    # The Parquet output: one partition per hour, holding the same rows.
    hourly = tmp_path / "all" / "hourly"
    assert sorted(p.name for p in hourly.iterdir() if p.is_dir()) == [
        f"hour={EARLY}", f"hour={BEFORE}", f"hour={AFTER}"]
    stored = [r.asDict() for r in spark.read.option("basePath", str(hourly)).parquet(
        *[str(hourly / f"hour={h}") for h in (EARLY, BEFORE, AFTER)]).collect()]
    for row in stored:
        row["hour"] = _label(int(row["hour_start"].timestamp() * 1000))
    _check(stored, set(EXPECTED))

    # The text: top 2 per hour plus bob (throttled most of the hour); ANONYMOUS (rank 3) left out.
    after = printed.split(f"{AFTER.replace('T', ' ')}:00 UTC")[1]
    assert "3 tenants, 1 throttled most of the hour" in after
    assert "bob" in after and "1,900.0 s (53%) *" in after and "alice" in after
    assert "ANONYMOUS" not in after and "... and 1 more tenant " in after
    assert "skipped 2: not JSON of the v1 layout" in printed
    assert (tmp_path / "all" / "report.txt").read_text() == printed

    # The HTML: a chart per direction, the top tenants in it, every tenant in the tables.
    page = (tmp_path / "all" / "report.html").read_text()
    assert page.count("<svg") == 2 and "alice / etl" in page and "bob / reader" in page
    assert "ANONYMOUS" in page and 'class="throttled"' in page

    # A range: the hours around the boundary only (the early event is before the read starts).
    ranged = usage_report.run(spark, _args(
        spark_proxy, usage_topic, tmp_path / "range", "--from", _iso(BOUNDARY - HOUR), "--to",
        _iso(BOUNDARY + HOUR)))
    capsys.readouterr()
    assert ranged is not None and ranged.events == len(EVENTS) - 1
    _check(ranged.rows, set(EXPECTED) - {(EARLY, "alice", "etl")})
    assert sorted(p.name for p in (tmp_path / "range" / "hourly").iterdir() if p.is_dir()) == [
        f"hour={BEFORE}", f"hour={AFTER}"]


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def test_stream_report_resumes_from_its_checkpoint(spark: SparkSession, spark_proxy: QuotaProxy,
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--stream in two runs over a growing topic: the second run adds to the first's hours, exactly."""
    topic = create_topic(spark_proxy.bootstrap, "usage-stream", 3, **{"retention.ms": "-1"})
    # The split falls inside hours (alice's first event, bob's second proxy): each run sees part of them.
    first, second = EVENTS[:1] + EVENTS[4:5], EVENTS[1:4] + EVENTS[5:]
    produce(spark_proxy.bootstrap, topic, _records(first, MALFORMED[:1]))
    args = _args(spark_proxy, topic, tmp_path / "out", "--stream", "--checkpoint", str(tmp_path / "ckpt"))
    one = usage_report.run(spark, args)
    assert one is not None and one.events == 2 and one.skipped == {
        "not JSON of the v1 layout": (1, one.skipped["not JSON of the v1 layout"][1])}
    assert _by_key(one.rows)[(AFTER, "bob", "reader")]["bytes_out"] == 30000
    produce(spark_proxy.bootstrap, topic, _records(second, []))
    two = usage_report.run(spark, args)
    capsys.readouterr()
    assert two is not None and two.events == len(EVENTS) and two.skipped == {}
    _check(two.rows, set(EXPECTED))


# -- end to end: a real `kthrottle run` with [usage], known traffic, the job over what it wrote ------------

SLOW_QUOTA = 20_000  # bytes/s: the tenant over its quota
RECORD = b"r" * 1000


def _produce_through(bootstrap: str, client_id: str, topic: str, count: int) -> None:
    """`count` records of 1000 B with acks=all (every Produce answered, so counted by the proxy)."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all",
                         "linger.ms": 5, "batch.size": 4000})
    failures: list[str] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(str(err))

    for i in range(count):
        producer.produce(topic, value=RECORD, key=str(i).encode(), on_delivery=delivered)
        producer.poll(0)
    assert producer.flush(120) == 0 and failures == [], f"{client_id}: undelivered, {failures[:3]}"


def _consume_through(bootstrap: str, client_id: str, topic: str, count: int) -> int:
    """Read `count` records from the beginning; the bytes of their values."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "client.id": client_id,
                         "group.id": f"usage-e2e-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    got = 0
    value_bytes = 0
    deadline = time.monotonic() + 120
    try:
        while got < count:
            assert time.monotonic() < deadline, f"{client_id}: {got} of {count} records read"
            for message in consumer.consume(500, timeout=1.0):
                if message.error() is None:
                    got += 1
                    value_bytes += len(message.value() or b"")
    finally:
        consumer.close()
    return value_bytes


def _delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_report_matches_what_the_proxy_counted(spark: SparkSession, spark_proxy: QuotaProxy,
                                               kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """Three tenants through a real proxy writing usage events (one over its quota), then the job
    (`python -m reports.usage_report`) over the usage topic, read through another proxy: bytes in
    exactly as the proxy's counters, the throttle count as kthrottle_throttles_total, fetch bytes
    between the values read and the bytes the proxy sent back."""
    usage_topic = f"usage-e2e-{uuid.uuid4().hex[:8]}"
    data_topic = create_topic(kafka_cluster.bootstrap, "usage-e2e-data", 3)
    settings = (f'quota_window_num = 3\n\n[usage]\ninterval_ms = 1000\ntopic = "{usage_topic}"\n'
                f'retention_ms = -1\n\n[[quota]]\nclient_id = "slow"\nproducer_byte_rate = {SLOW_QUOTA}\n')
    proxy = QuotaProxy(kafka_cluster.bootstrap, tmp_path, settings)
    try:
        proxy.wait_for_log("usage events every 1000 ms")
        charged: dict[str, float] = {}
        for client_id, count in (("fast", 300), ("slow", 150)):
            before = proxy.metrics()
            _produce_through(proxy.bootstrap, client_id, data_topic, count)
            charged[client_id] = _delta(before, proxy.metrics(), "kthrottle_request_bytes_total",
                                        api="Produce")
        before = proxy.metrics()
        values_read = _consume_through(proxy.bootstrap, "reader", data_topic, 450)
        after = proxy.metrics()
        sent_back = (_delta(before, after, "kthrottle_response_bytes_total", api="Fetch")
                     + 4 * _delta(before, after, "kthrottle_requests_total", api="Fetch"))
        slow = {"quota": "producer_byte_rate", "user": "", "client_id": "slow",
                "mode": "enforced"}
        throttles = after.get(("kthrottle_throttles_total", tuple(sorted(slow.items()))), 0.0)
        throttle_s = after.get(("kthrottle_throttle_time_seconds_total", tuple(sorted(slow.items()))), 0.0)
        assert throttles > 0, "the slow tenant was never throttled: the test would prove nothing"
    finally:
        proxy.stop()  # SIGINT: the proxy writes its current interval before it exits
    assert proxy.process.returncode == 0, proxy.log()[-3000:]

    # The command as users run it (its own local Spark), reading through the session's other proxy.
    output = tmp_path / "report"
    command = subprocess.run(
        [sys.executable, "-m", "reports.usage_report", "--bootstrap-server", spark_proxy.bootstrap,
         "--topic", usage_topic, "--output", str(output)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert command.returncode == 0, command.stderr[-4000:]
    print(command.stdout)
    assert "0 records skipped" in command.stdout
    assert command.stdout == (output / "report.txt").read_text()
    rows = [r.asDict() for r in spark.read.parquet(str(output / "hourly")).collect()]
    tenants: dict[str, dict[str, float]] = {}
    for row in rows:
        assert row["user"] == "ANONYMOUS", row
        mine = tenants.setdefault(row["client_id"], {})
        for column in ("bytes_in", "bytes_out", "producer_byte_rate_throttle_count",
                       "producer_byte_rate_throttle_ms", "throttle_count"):
            mine[column] = mine.get(column, 0) + row[column]
        mine["peak"] = max(mine.get("peak", 0.0), row["producer_byte_rate_share_peak"] or 0.0)
        mine["quota"] = row["producer_byte_rate"] or 0.0
    assert {"fast", "slow", "reader"} <= set(tenants), sorted(tenants)
    assert tenants["fast"]["bytes_in"] == charged["fast"] and tenants["fast"]["bytes_out"] == 0
    assert tenants["slow"]["bytes_in"] == charged["slow"] and tenants["slow"]["bytes_out"] == 0
    assert tenants["reader"]["bytes_in"] == 0
    assert values_read <= tenants["reader"]["bytes_out"] <= sent_back, (values_read, sent_back)
    assert tenants["slow"]["producer_byte_rate_throttle_count"] == throttles
    assert tenants["slow"]["throttle_count"] == throttles
    assert tenants["slow"]["producer_byte_rate_throttle_ms"] == pytest.approx(throttle_s * 1000, abs=0.5)
    assert tenants["fast"]["throttle_count"] == 0 and tenants["reader"]["throttle_count"] == 0
    assert tenants["slow"]["quota"] == SLOW_QUOTA
    # The quota allows a burst of about 3 windows' worth: one 1 s interval held well over its quota.
    assert tenants["slow"]["peak"] > 1.0, tenants["slow"]
    print(f"[usage report e2e] fast {charged['fast']:.0f} B, slow {charged['slow']:.0f} B in "
          f"(= the proxy's Produce request bytes); reader {tenants['reader']['bytes_out']:.0f} B out "
          f"(values {values_read}, sent {sent_back:.0f}); slow throttled {throttles:.0f} times "
          f"({throttle_s:.1f} s), peak {tenants['slow']['peak']:.2f}x its quota")


def test_chart_steps_hold_whole_intervals() -> None:
    """A chart step is a whole number of event intervals (else steps hold one interval more or less in
    turn and the line saws), even when a late timer made the longest interval a few ms long."""
    assert aggregate.chart_bucket_ms(110_000, 2_003) == 2_000  # 2 s events: 2 s steps, not 5 s
    assert aggregate.chart_bucket_ms(3_600_000, 2_000) == 30_000  # an hour: 120 points of 15 intervals
    assert aggregate.chart_bucket_ms(3_600_000, 7_000) == 35_000  # 30 s rounded up to 5 intervals
    assert aggregate.chart_bucket_ms(10_000, 10_000) == 10_000  # never shorter than one interval
