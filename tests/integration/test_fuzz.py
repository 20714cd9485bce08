"""Hostile traffic beside a legitimate producer and consumer, through the real proxy (issue 10).

A proxy in front of a shared cluster is the first thing a misbehaving client hits. For a bounded
time, a seeded fuzzer (tests/integration/fuzz.py) sends mutated real requests, random frames,
hostile sizes, split and half frames and never-read requests from many connections to the proxy's
bootstrap and per-broker ports, while an idempotent librdkafka producer (acks=all) writes keyed,
numbered records through the same proxy and a consumer reads them back. What must hold afterwards:
the pair saw exactly its records (none lost, duplicated or reordered per partition); the proxy is
alive, answers a fresh client and holds no connection its client left; every malformed frame cost
only its own connection, with a clean close naming what was wrong (no traceback, no internal error).

The seed is fixed (KTHROTTLE_FUZZ_SEED overrides it to explore); the summary line prints it with
the frame and connection counts.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

from harness.local_kafka import LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import wait_for_topic_on_every_broker
from .fuzz import ConnectionRecord, Fuzzer, FuzzReport, Target, advertised_versions, explain, topic_id
from .proxies import QuotaProxy

SEED = int(os.environ.get("KTHROTTLE_FUZZ_SEED", "7"))

#: How long the fuzzer runs; the legitimate pair produces and consumes inside this time.
FUZZ_SECONDS = 25.0

#: The legitimate pair: this many numbered records over about PRODUCE_SECONDS, to a topic of
#: LEGIT_PARTITIONS partitions replicated on all three brokers.
RECORDS = 6000
PRODUCE_SECONDS = 18.0
LEGIT_PARTITIONS = 6

#: The `<default>` client-id quotas every connection (the pair and each fuzzing client id) is
#: charged to: 50 MB/s each way, far above what the pair sends, so the quota path runs unthrottled.
QUOTAS = """\
[[quota]]
client_id = "<default>"
producer_byte_rate = 52428800
consumer_byte_rate = 52428800
"""

#: Log lines that mean a malformed frame was not handled as a clean close.
BAD_LOG_MARKERS = ("Traceback", "internal error")


@pytest.fixture(scope="module")
def fuzz_proxy(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """This module's own proxy, so its log and metrics hold only what this test did to it.

    Describing quotas is open to everyone, so fuzzed DescribeClientQuotas requests reach the
    answering code and not only the refusal.
    """
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path_factory.mktemp("fuzz"),
                    'quota_describe = "everyone"') as running:
        running.set_quotas(QUOTAS)
        yield running


@dataclass
class FuzzRun:
    """What one fuzzing run saw, for the tests below to judge one property each."""

    report: FuzzReport
    node_ids: list[int]
    #: record number -> (partition, offset), from the producer's delivery reports
    delivered: dict[int, tuple[int, int]] = field(default_factory=dict)
    producer_errors: list[str] = field(default_factory=list)
    #: partition -> record numbers in the order the consumer got them
    consumed: dict[int, list[int]] = field(default_factory=dict)
    consumer_errors: list[str] = field(default_factory=list)
    scrapes: int = 0
    scrape_failures: list[str] = field(default_factory=list)
    #: open client connections by the proxy's gauge once every client had left
    connections_left: float = -1.0


def _create_topics(bootstrap: str, topics: dict[str, tuple[int, int]]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, partitions, replicas)
                                   for name, (partitions, replicas) in topics.items()])
    for future in futures.values():
        future.result(30)
    for name, (partitions, _) in topics.items():
        wait_for_topic_on_every_broker(bootstrap, name, partitions)


def _fill(bootstrap: str, topic: str, partitions: int) -> None:
    """Records for the fuzzer's Fetch requests to find (written straight to the cluster)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(600):
        producer.produce(topic, value=os.urandom(1000), key=b"%d" % i, partition=i % partitions)
    assert producer.flush(30) == 0


def _consume(run: FuzzRun, bootstrap: str, topic: str, done: threading.Event) -> None:
    """Read every partition from the start until the producer is done and all its records are in,
    then once more for a while, so that a duplicate would show."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "client.id": "legit-consumer",
                         "group.id": f"fuzz-legit-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False,
                         "fetch.wait.max.ms": 100})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(LEGIT_PARTITIONS)])
    total = 0
    deadline = time.monotonic() + FUZZ_SECONDS + 90
    try:
        while time.monotonic() < deadline and not (done.is_set() and total >= len(run.delivered)):
            total += _take(consumer, run, 0.5)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            total += _take(consumer, run, 0.5)
    finally:
        consumer.close()


def _number(message: Message) -> int:
    """The record's sequence number (its value)."""
    return int(message.value() or b"-1")


def _partition(message: Message) -> int:
    partition = message.partition()
    assert partition is not None
    return partition


def _take(consumer: Consumer, run: FuzzRun, timeout: float) -> int:
    got = 0
    for message in consumer.consume(500, timeout=timeout):
        if message.error():
            run.consumer_errors.append(str(message.error()))
            continue
        run.consumed.setdefault(_partition(message), []).append(_number(message))
        got += 1
    return got


def _scrape(run: FuzzRun, proxy: QuotaProxy, stop: threading.Event) -> None:
    """/metrics while new client ids keep arriving: every scrape must answer (issue 10, item 2)."""
    while not stop.wait(0.5):
        run.scrapes += 1
        try:
            proxy.metrics()
        except Exception as exc:  # the failure itself is the finding: keep it for the test
            run.scrape_failures.append(repr(exc))


def _produce(run: FuzzRun, bootstrap: str, topic: str) -> None:
    """Keyed, numbered records, paced over PRODUCE_SECONDS so they cross the whole storm."""
    def delivered(err: KafkaError | None, message: Message) -> None:
        if err is not None:
            run.producer_errors.append(str(err))
        else:
            run.delivered[_number(message)] = (_partition(message), message.offset() or 0)

    producer = Producer({"bootstrap.servers": bootstrap, "client.id": "legit-producer",
                         "enable.idempotence": True, "acks": "all", "linger.ms": 20,
                         "message.timeout.ms": 120_000})
    slices = 60
    per_slice = RECORDS // slices
    for s in range(slices):
        for i in range(s * per_slice, (s + 1) * per_slice):
            producer.produce(topic, key=f"key-{i % 50}".encode(), value=str(i).encode(),
                             on_delivery=delivered)
        producer.poll(PRODUCE_SECONDS / slices)
    left = producer.flush(120)
    if left:
        run.producer_errors.append(f"{left} record(s) still undelivered after flush")


@pytest.fixture(scope="module")
def fuzz_run(kafka_cluster: LocalKafka, fuzz_proxy: QuotaProxy, request: pytest.FixtureRequest) -> FuzzRun:
    legit = f"fuzz-legit-{uuid.uuid4().hex[:8]}"
    target_topic = f"fuzz-target-{uuid.uuid4().hex[:8]}"
    _create_topics(kafka_cluster.bootstrap, {legit: (LEGIT_PARTITIONS, 3), target_topic: (3, 1)})
    _fill(kafka_cluster.bootstrap, target_topic, 3)
    node_ids = sorted(AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
                      .list_topics(timeout=10).brokers)
    target = Target(target_topic, topic_id("127.0.0.1", fuzz_proxy.port, target_topic), 3)
    fuzzer = Fuzzer(SEED, "127.0.0.1", [fuzz_proxy.port, *map(fuzz_proxy.node_port, node_ids)], target,
                    FUZZ_SECONDS, advertised_versions("127.0.0.1", fuzz_proxy.port))

    reports: list[FuzzReport] = []
    fuzzing = threading.Thread(target=lambda: reports.append(fuzzer.run()), name="fuzzer")
    fuzzing.start()
    run = FuzzRun(FuzzReport(SEED, 0.0, [], Counter()), node_ids)
    produced, stop_scraping = threading.Event(), threading.Event()
    consuming = threading.Thread(target=_consume, args=(run, fuzz_proxy.bootstrap, legit, produced))
    scraping = threading.Thread(target=_scrape, args=(run, fuzz_proxy, stop_scraping))
    consuming.start()
    scraping.start()
    try:
        time.sleep(1.0)  # the producer connects in the middle of the storm, not before it
        _produce(run, fuzz_proxy.bootstrap, legit)
    finally:
        produced.set()
        fuzzing.join()
        stop_scraping.set()
        consuming.join()
        scraping.join()
    assert reports, "the fuzzer's thread died (its traceback is on stderr)"
    run.report = reports[0]
    # Every client has left (the producer with _produce's return, the held sockets with the fuzz).
    deadline = time.monotonic() + 30
    while True:
        try:
            run.connections_left = fuzz_proxy.metric("kthrottle_connections")
        except Exception as exc:  # a failed scrape is a finding of its own, not this check's
            run.scrape_failures.append(f"after the fuzz: {exc!r}")
        if run.connections_left == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown even under -q and output capture
            reporter.ensure_newline()
            reporter.write_line(run.report.summary())
    return run


def test_legitimate_pair_sees_exactly_its_records(fuzz_run: FuzzRun) -> None:
    run = fuzz_run
    assert not run.producer_errors, f"the idempotent producer failed: {run.producer_errors[:5]}"
    assert len(run.delivered) == RECORDS, f"{len(run.delivered)} of {RECORDS} records acknowledged"
    assert not run.consumer_errors, f"the consumer saw errors: {run.consumer_errors[:5]}"
    got = Counter(n for numbers in run.consumed.values() for n in numbers)
    lost = sorted(set(run.delivered) - set(got))
    duplicated = sorted(n for n, count in got.items() if count > 1)
    stray = sorted(set(got) - set(run.delivered))
    reordered = {p: sum(1 for a, b in itertools.pairwise(ns) if b < a) for p, ns in run.consumed.items()}
    assert (lost, duplicated, stray) == ([], [], []), (
        f"{len(lost)} lost (first {lost[:10]}), {len(duplicated)} duplicated (first {duplicated[:10]}), "
        f"{len(stray)} never produced (first {stray[:10]}); {run.report.summary()}")
    assert not any(reordered.values()), f"records out of order, per partition: {reordered}"
    # Each partition holds exactly the producer's acknowledged records, in the order of their offsets,
    # which is the order they were produced in (idempotence keeps it across retries).
    for partition in range(LEGIT_PARTITIONS):
        by_offset = [n for n, (p, _) in sorted(run.delivered.items(), key=lambda kv: kv[1]) if p == partition]
        assert by_offset == sorted(by_offset), f"partition {partition}: acknowledged out of production order"
        assert run.consumed.get(partition, []) == by_offset, f"partition {partition} differs from its offsets"
    assert len(run.consumed) == LEGIT_PARTITIONS, f"records landed on partitions {sorted(run.consumed)} only"


def _api_versions(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        body = ApiVersionsRequest[3](client_software_name="fresh", client_software_version="1").encode()
        sock.sendall(frame(encode_request_header(18, 3, 99, "fresh") + bytes(body)))
        head = sock.recv(4, socket.MSG_WAITALL)
        assert len(head) == 4, f"port {port}: closed instead of answering ApiVersions"
        response = sock.recv(struct.unpack(">i", head)[0], socket.MSG_WAITALL)
    assert struct.unpack(">i", response[:4])[0] == 99
    return int(ApiVersionsResponse.decode(response[4:], version=3).error_code)


def test_proxy_survives_and_answers_a_fresh_client(fuzz_run: FuzzRun, fuzz_proxy: QuotaProxy) -> None:
    assert fuzz_proxy.alive(), (
        f"the proxy died (exit {fuzz_proxy.process.returncode}): {fuzz_proxy.log()[-3000:]}")
    brokers = AdminClient({"bootstrap.servers": fuzz_proxy.bootstrap}).list_topics(timeout=15).brokers
    assert sorted(brokers) == fuzz_run.node_ids
    for port in [fuzz_proxy.port, *map(fuzz_proxy.node_port, fuzz_run.node_ids)]:
        assert _api_versions(port) == 0, f"port {port}"


def _anomalies(report: FuzzReport) -> list[ConnectionRecord]:
    return [c for c in report.connections if c.anomaly]


def test_hostile_connections_get_refused_and_valid_requests_answered(fuzz_run: FuzzRun) -> None:
    """Beside the storm, a hostile size is closed at once and a valid first request answered right."""
    report = fuzz_run.report
    assert report.frames > 1000 and report.scenarios["hostile-size"] > 0, report.summary()
    wrong = [f"{c.name} ({c.scenario}): {c.anomaly}" for c in _anomalies(report)]
    assert not wrong, f"{len(wrong)} connection(s) went wrong: {wrong[:10]}"


def test_metrics_answer_every_scrape_during_the_fuzz(fuzz_run: FuzzRun) -> None:
    assert fuzz_run.scrapes > 10
    assert not fuzz_run.scrape_failures, (
        f"{len(fuzz_run.scrape_failures)} of {fuzz_run.scrapes} scrapes failed: "
        f"{fuzz_run.scrape_failures[:5]}")


def test_no_connection_outlives_its_client(fuzz_run: FuzzRun) -> None:
    assert fuzz_run.connections_left == 0, (
        f"the proxy still counts {fuzz_run.connections_left:.0f} open connection(s) after every client left")


def test_every_malformed_frame_is_a_clean_close(fuzz_run: FuzzRun, fuzz_proxy: QuotaProxy) -> None:
    """No traceback, no internal error: each bad frame closes its connection with a reason."""
    log = fuzz_proxy.log()
    assert "client sent bad data" in log, (
        "no malformed frame reached the proxy's parser (the fuzz proved nothing)")
    bad = explain(log, fuzz_run.report, BAD_LOG_MARKERS)
    assert not bad, (f"{len(bad)} log line(s) with {' or '.join(BAD_LOG_MARKERS)} "
                     f"({fuzz_run.report.summary()}):\n" + "\n".join(bad[:12]))
    unexplained = [line for line in log.splitlines() if re.search(r" closed: *$|: \)$", line)]
    assert not unexplained, f"close lines without a reason: {unexplained[:5]}"
