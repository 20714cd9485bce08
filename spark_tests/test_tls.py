"""Spark's own Kafka source through a proxy that speaks TLS on both sides (issue 12).

`kthrottle run` terminates TLS from Spark with the harness's server certificate (which names 127.0.0.1)
and opens TLS to the cluster's SSL listener, verifying the brokers against the test CA. Spark's
kafka-clients (3.9, bundled with the connector) trusts the proxy through a PEM truststore
(`ssl.truststore.type=PEM`, KIP-651) with hostname verification on, exactly as a user would point it at
TLS brokers. The proxy's listeners speak TLS only, so every read below went through a handshake Spark
verified; the records were produced over TLS through the proxy too, by librdkafka, and each one's
partition and offset come from its delivery report.

Both of Spark's read paths are checked record for record (key, value, header, timestamp, partition,
offset; hence also per-partition order): a batch read of an exact per-partition offset range, and a
streaming query (availableNow, split into several micro-batches). The streaming query's client id has
a consumer_byte_rate quota, so the ingest is throttled through TLS too, and the batch read's client id,
without a quota, is not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql import DataFrame, SparkSession

from harness.certificates import TestCertificates
from harness.local_kafka import LocalKafka
from tests.integration.clients import wait_until
from tests.integration.proxies import QuotaProxy

from .kafka import Record
from .spark import await_stop, kafka_options

PARTITIONS = 6
COUNT = 600
VALUE = 2_000  # bytes per record value: 600 records are 1.2 MB, several seconds of QUOTA
STREAM_CLIENT = "spark-tls-stream"
BATCH_CLIENT = "spark-tls-batch"
#: The streaming query's consumer_byte_rate (Kafka's quota of the same name, bytes per second per
#: client id): well under what the query would otherwise read, so it is throttled whatever the load.
QUOTA = 262_144
#: Kafka's quota.window.num = 3 (of 1 s), as spark_tests/conftest.py sets it: a new client's burst
#: allowance is then two windows, so QUOTA is reached within the run.
SETTINGS = "quota_window_num = 3"
#: Spark's consumers fetch at most this per partition and request (Kafka's default is 1 MiB, which would
#: take the whole topic in one fetch per partition, so the quota would act on one response only).
FETCH = {"kafka.max.partition.fetch.bytes": "65536"}


@pytest.fixture(scope="module")
def certs(kafka_cluster: LocalKafka) -> TestCertificates:
    assert kafka_cluster.certificates is not None and kafka_cluster.ssl_bootstrap is not None, \
        "the session cluster has no SSL listener"
    return kafka_cluster.certificates


@pytest.fixture(scope="module")
def tls_proxy(kafka_cluster: LocalKafka, certs: TestCertificates,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """`kthrottle run` with [tls] (the harness's server certificate) and [upstream_tls] (the test CA)
    in front of the cluster's SSL listener, and a consumer_byte_rate quota on STREAM_CLIENT."""
    assert kafka_cluster.ssl_bootstrap is not None
    tables = (f'{SETTINGS}\n\n[tls]\ncertificate = "{certs.server.cert}"\nkey = "{certs.server.key}"\n\n'
              f'[upstream_tls]\nca = "{certs.ca}"\ncheck_hostname = true\n\n'
              f'[[quota]]\nclient_id = "{STREAM_CLIENT}"\nconsumer_byte_rate = {QUOTA}\n')
    with QuotaProxy(kafka_cluster.ssl_bootstrap, tmp_path_factory.mktemp("spark-tls-proxy"), tables) as proxy:
        proxy.wait_for_log("(TLS), upstream", timeout=30)
        yield proxy


def _librdkafka(proxy: QuotaProxy, certs: TestCertificates) -> dict[str, Any]:
    """librdkafka over SSL to the proxy, verifying its chain and its name as it would a broker's."""
    return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
            "ssl.ca.location": str(certs.ca), "ssl.endpoint.identification.algorithm": "https"}


def _spark_tls(certs: TestCertificates) -> dict[str, str]:
    """What a Spark user sets to reach TLS brokers with a PEM CA file (no JKS conversion)."""
    return {"kafka.security.protocol": "SSL", "kafka.ssl.truststore.type": "PEM",
            "kafka.ssl.truststore.location": str(certs.ca),
            "kafka.ssl.endpoint.identification.algorithm": "https"}


def _produce(conf: dict[str, Any], topic: str) -> list[Record]:
    """COUNT records, round-robin over the partitions, each value starting with its number."""
    producer = Producer({**conf, "client.id": "spark-tls-loader", "enable.idempotence": True,
                         "linger.ms": 5, "batch.size": 32768})
    stored: list[Record] = []
    errors: list[str] = []

    def reporter(seq: int) -> Any:
        def report(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                errors.append(str(err))
                return
            partition, offset = msg.partition(), msg.offset()
            assert partition is not None and offset is not None, "a delivery report without a place"
            stored.append(Record(partition, offset, f"k{seq}".encode(), msg.value(),
                                 (("seq", str(seq).encode()),), msg.timestamp()[1]))
        return report

    pad = b"v" * (VALUE - 7)
    # Timestamps of now (each record its own, so a mix-up shows): a fixed date in the past would put
    # the records outside the broker's 7-day retention, and the next retention check (every 5 min)
    # deletes them mid-test, which Spark reports as data loss.
    base_ts = int(time.time() * 1000)
    for seq in range(COUNT):
        while True:
            try:
                producer.produce(topic, f"{seq:06d}|".encode() + pad, f"k{seq}".encode(),
                                 partition=seq % PARTITIONS, headers=[("seq", str(seq).encode())],
                                 timestamp=base_ts + seq, on_delivery=reporter(seq))
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(60) == 0 and not errors, f"undelivered through the TLS proxy: {errors[:3]}"
    assert len(stored) == COUNT
    return sorted(stored)


@pytest.fixture(scope="module")
def loaded(tls_proxy: QuotaProxy, certs: TestCertificates, kafka_cluster: LocalKafka
           ) -> tuple[str, list[Record]]:
    """A fresh topic, made and filled over TLS through the proxy; its partitions led by several brokers."""
    conf = _librdkafka(tls_proxy, certs)
    topic = f"spark-tls-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(conf)
    # retention.ms = -1: nothing the broker's retention check could delete while the test reads.
    admin.create_topics([NewTopic(topic, PARTITIONS, 1, config={"retention.ms": "-1"})],
                        operation_timeout=30)[topic].result(60)

    def led() -> bool:
        found = admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
        return len(found) == PARTITIONS and all(p.leader >= 0 for p in found)

    wait_until(led, 30, f"{topic} with leaders")
    metadata = admin.list_topics(topic, timeout=10)
    spread = {p.leader for p in metadata.topics[topic].partitions.values()}
    assert len(spread) >= 2, f"all partitions of {topic} are led by broker(s) {spread}"
    # Every broker address a client learns is one of the proxy's TLS listeners, never a broker's own.
    addresses: set[tuple[int, object, int]] = {(b.id, b.host, b.port) for b in metadata.brokers.values()}
    assert addresses == {(n, "127.0.0.1", tls_proxy.node_port(n)) for n in kafka_cluster.node_ids}, addresses
    return topic, _produce(conf, topic)


def _as_records(frame: DataFrame) -> list[Record]:
    rows = frame.selectExpr("partition", "offset", "key", "value", "headers",
                            "unix_millis(timestamp) AS ts").collect()
    return [Record(r.partition, r.offset, bytes(r.key), bytes(r.value),
                   tuple((h.key, None if h.value is None else bytes(h.value)) for h in (r.headers or [])),
                   r.ts) for r in rows]


def _check(got: list[Record], want: list[Record]) -> None:
    """The exact set, nothing twice, and within each partition the order the records were produced in."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert len(got) == len(set(got)) and not missing and not extra, (
        f"{len(got)} read, {len(want)} expected: {len(got) - len(set(got))} duplicates, {len(missing)} "
        f"missing (first {missing[:1]}), {len(extra)} unexpected (first {extra[:1]})")
    for partition in range(PARTITIONS):
        in_offset_order = [int(r.value[:6]) for r in sorted(got) if r.partition == partition and r.value]
        assert in_offset_order == sorted(in_offset_order), f"partition {partition} out of produce order"


def _throttles(proxy: QuotaProxy, client_id: str) -> tuple[float, float]:
    labels = {"quota": "consumer_byte_rate", "user": "", "client_id": client_id}
    return (proxy.metric("kthrottle_throttles_total", **labels),
            proxy.metric("kthrottle_throttle_time_seconds_total", **labels))


def test_batch_read_over_tls_returns_exactly_the_offset_range(
        spark: SparkSession, tls_proxy: QuotaProxy, certs: TestCertificates,
        loaded: tuple[str, list[Record]]) -> None:
    """read.format("kafka") over TLS with per-partition starting and ending offsets: that range only."""
    topic, stored = loaded
    ends = {p: 1 + max(r.offset for r in stored if r.partition == p) for p in range(PARTITIONS)}
    assert all(ends[p] == COUNT // PARTITIONS for p in ends), ends  # contiguous offsets from 0
    starting = {str(p): 3 + p for p in range(PARTITIONS)}
    ending = {str(p): ends[p] - 2 * p - 1 for p in range(PARTITIONS)}
    frame = (spark.read.format("kafka")
             .options(**kafka_options(tls_proxy.bootstrap, BATCH_CLIENT, subscribe=topic,
                                      includeHeaders="true", startingOffsets=json.dumps({topic: starting}),
                                      endingOffsets=json.dumps({topic: ending}),
                                      **_spark_tls(certs)))
             .load())
    got = _as_records(frame)
    want = [r for r in stored if starting[str(r.partition)] <= r.offset < ending[str(r.partition)]]
    print(f"\n[spark tls batch] offsets {starting} .. {ending}: {len(got)} records read, "
          f"{len(want)} expected")
    assert 0 < len(want) < len(stored)
    _check(got, want)
    assert _throttles(tls_proxy, BATCH_CLIENT) == (0.0, 0.0), "a client id without a quota was throttled"


def test_stream_over_tls_reads_every_record_exactly_once_under_a_quota(
        spark: SparkSession, tls_proxy: QuotaProxy, certs: TestCertificates,
        loaded: tuple[str, list[Record]], tmp_path: Path) -> None:
    """readStream over TLS (availableNow, several micro-batches, a checkpoint): every record once, the
    fetches throttled by STREAM_CLIENT's consumer_byte_rate."""
    topic, stored = loaded
    table = f"spark_tls_{uuid.uuid4().hex[:8]}"
    query = (spark.readStream.format("kafka")
             .options(**kafka_options(tls_proxy.bootstrap, STREAM_CLIENT, subscribe=topic,
                                      startingOffsets="earliest", includeHeaders="true",
                                      maxOffsetsPerTrigger="200", **FETCH, **_spark_tls(certs)))
             .load()
             .writeStream.format("memory").queryName(table)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    await_stop(query, 120)
    rows = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    throttles, throttle_s = _throttles(tls_proxy, STREAM_CLIENT)
    got = _as_records(spark.table(table))
    print(f"\n[spark tls stream] {len(got)} records in batches {rows}; consumer_byte_rate {QUOTA:,} B/s on "
          f"{STREAM_CLIENT}: {throttles:.0f} throttled fetches, {throttle_s:.1f} s of throttle time")
    assert len(rows) >= 2 and sum(rows) == COUNT, rows
    _check(got, stored)
    assert throttles > 0 and throttle_s > 0, "the quota did not act on Spark's fetches through TLS"
