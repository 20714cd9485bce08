"""Issue 3's rate-accuracy runs: clients at full speed for 30 s, the rate over the last 20 s
between 0.9x and 1.05x the quota.

The quota proxies set `quota_window_num = 3`. The algorithm is Kafka's own either way (the
unit tests pin it with Kafka's default of 11 samples), but with 11 samples a greedy client shows a
sawtooth of period ~11 s whose amplitude is ~10 s of quota, so a 20 s measurement swings between
0.85x and 1.15x while the long-run average stays at 1.0x; 3 samples make the period 3 s, so a
20 s measurement shows the average itself.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from statistics import linear_regression

import pytest
from confluent_kafka import Consumer, KafkaException

from harness.local_kafka import SASL_USERS
from tests.integration.conftest import JAVA_PRODUCER_PERF, KafkaJava
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import RunResult, consume_for, produce_for, report
from tests.integration.test_quotas import (
    QUOTA,
    RUN_S,
    _assert_rate,
    _end_offsets,
    _fill,
    _sasl,
    _topic,
    end_offset_sum,
)

#: Rate accuracy against Kafka's formula: clients at full speed must not wait for the CPU.
pytestmark = pytest.mark.quiet

#: Consumer runs read a topic written in record batches of at most 16 KiB (the Java producer's
#: default `batch.size`) with 64 KiB per partition per fetch, so one fetch response is about 5 %
#: of a second of this quota. A fetch quota is granted a whole response at a time, and a throttled
#: response's bytes count in the throttle it reports though they are not sent (Kafka's fetch
#: handling): with librdkafka's default 1 MiB per partition, each response is 0.8 s of quota and
#: the rate over 20 s came out at 0.77-0.93x in record values (README "Limits").
FILL_BATCH_BYTES = 16_384
FETCH_PARTITION_BYTES = 65_536


def test_producer_byte_rate_on_client_id_librdkafka(quota_proxy: QuotaProxy) -> None:
    quota_proxy.set_quotas(f'[[quota]]\nclient_id = "rd-producer"\nproducer_byte_rate = {QUOTA}')
    topic = _topic(quota_proxy.bootstrap, "q-rd")
    result = produce_for(quota_proxy.bootstrap, topic, RUN_S, **{"client.id": "rd-producer"})
    _assert_rate(result, QUOTA, "librdkafka, client-id override")
    assert _end_offsets(quota_proxy.bootstrap, topic) == result.records, "records lost or duplicated"
    labels = {"quota": "producer_byte_rate", "user": "", "client_id": "rd-producer"}
    assert quota_proxy.metric("kthrottle_throttles_total", **labels) > 0
    assert quota_proxy.metric("kthrottle_quota_limit", **labels) == QUOTA


def test_producer_byte_rate_default_client_id_librdkafka(quota_proxy: QuotaProxy) -> None:
    """A `<default>` client-id quota: each client-id gets its own bucket of that size."""
    quota_proxy.set_quotas(f'[[quota]]\nclient_id = "<default>"\nproducer_byte_rate = {QUOTA}')
    topic = _topic(quota_proxy.bootstrap, "q-default")
    result = produce_for(quota_proxy.bootstrap, topic, RUN_S, **{"client.id": "some-app"})
    _assert_rate(result, QUOTA, "librdkafka, client-id default")
    assert _end_offsets(quota_proxy.bootstrap, topic) == result.records
    assert quota_proxy.metric("kthrottle_throttles_total", quota="producer_byte_rate", user="",
                              client_id="some-app") > 0


def test_producer_byte_rate_user_and_client_kafka_python(quota_proxy: QuotaProxy) -> None:
    """Both user and client-id: plaintext connections are the ANONYMOUS user."""
    from kafka import KafkaProducer

    quota_proxy.set_quotas(
        f'[[quota]]\nuser = "ANONYMOUS"\nclient_id = "kpy-producer"\nproducer_byte_rate = {QUOTA}')
    topic = _topic(quota_proxy.bootstrap, "q-kpy")
    producer = KafkaProducer(bootstrap_servers=quota_proxy.bootstrap, client_id="kpy-producer", acks=1,
                             linger_ms=5, batch_size=256 * 1024, max_block_ms=120_000)
    result = RunResult(time.monotonic())
    value = b"y" * 10_000
    futures = []
    try:
        while time.monotonic() < result.started + RUN_S:
            # kafka-python 3 does not bound what send() queues (buffer_memory is not enforced), so
            # a loop at full speed queues minutes of data at the quota: keep about 4 MB outstanding.
            if len(futures) - len(result.events) > 400:
                time.sleep(0.005)
                continue
            future = producer.send(topic, value)
            future.add_callback(lambda _m: result.events.append((time.monotonic(), len(value))))
            futures.append(future)
        producer.flush(120)
    finally:
        producer.close(30)
    assert all(f.succeeded() for f in futures), "a kafka-python send failed"
    result.records = len(result.events)
    _assert_rate(result, QUOTA, "kafka-python, user+client-id override")
    assert _end_offsets(quota_proxy.bootstrap, topic) == len(futures)


def test_producer_byte_rate_on_user_sasl_java(sasl_quota_proxy: QuotaProxy, kafka_java: KafkaJava,
                                              tmp_path: Path) -> None:
    """The user comes from the SASL exchange the broker accepted; the Java client sees the throttle."""
    sasl_quota_proxy.set_quotas(f'[[quota]]\nuser = "alice"\nproducer_byte_rate = {QUOTA}')
    topic = _topic(sasl_quota_proxy.bootstrap, "q-java", **_sasl("admin"))
    config = tmp_path / "alice.properties"
    config.write_text(
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-256\n"
        'sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required '
        f'username="alice" password="{SASL_USERS["alice"]}";\n')
    records = int(QUOTA * 40 / 10_000)  # more than 30 s worth at the quota
    landed: list[tuple[float, int]] = []
    stop = threading.Event()

    def watch() -> None:
        # One consumer for every sample, each stamped at the middle of its ListOffsets round trips:
        # a new SCRAM login per sample took a varying part of a second, which moved the samples
        # against their time stamps.
        consumer = Consumer({"bootstrap.servers": sasl_quota_proxy.bootstrap, "group.id": "offsets",
                             **_sasl("admin")})
        try:
            while not stop.is_set():
                asked = time.monotonic()
                try:
                    count = end_offset_sum(consumer, topic)
                except KafkaException as exc:  # a new topic's leaders settling: no sample this second
                    print(f"end offsets not read this second: {exc}")
                else:
                    landed.append(((asked + time.monotonic()) / 2, count))
                time.sleep(1.0)
        finally:
            consumer.close()

    command = kafka_java.command(
        JAVA_PRODUCER_PERF, "--topic", topic, "--num-records", str(records), "--record-size", "10000",
        "--throughput", "-1", "--print-metrics", "--producer.config", str(config), "--producer-props",
        f"bootstrap.servers={sasl_quota_proxy.bootstrap}", "client.id=java-perf", "acks=1")
    started = time.monotonic()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        stop.set()
        watcher.join(10)
        if process.poll() is None:
            process.kill()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    # Records landed over time: the rate between 10 s and 30 s after the start, the slope
    # of a least-squares line through that span's samples (about 20), so no one late sample moves it.
    span = [(t - started, n) for t, n in landed if RUN_S - 20 <= t - started <= RUN_S]
    assert len(span) >= 10, landed
    rate = linear_regression([t for t, _ in span], [n for _, n in span]).slope * 10_000
    report(f"Java perf producer as alice: quota {QUOTA:,} B/s, measured {rate:,.0f} B/s over 10-30 s")
    assert 0.9 * QUOTA <= rate <= 1.05 * QUOTA
    assert _end_offsets(sasl_quota_proxy.bootstrap, topic, **_sasl("admin")) == records
    throttle_max = re.search(
        r"producer-metrics:produce-throttle-time-max:\{client-id=java-perf\}\s*:\s*([0-9.]+)", text)
    assert throttle_max, "ProducerPerformance printed no produce-throttle-time-max"
    assert float(throttle_max.group(1)) > 0, "the Java client never saw a throttle"
    assert sasl_quota_proxy.metric("kthrottle_throttles_total", quota="producer_byte_rate",
                                   user="alice", client_id="") > 0


def _assert_consumer_rate(proxy: QuotaProxy, prefix: str, what: str, labels: dict[str, str],
                          admin: dict[str, object], **config: object) -> None:
    """A librdkafka consumer at full speed for 30 s: held to the quota, every record once, in order.

    The rate is what the quota limits, the bytes the consumer received (librdkafka's `rxbytes`),
    as Kafka's own quota system test checks a broker's egress bytes. The records' values are
    printed beside it: they are less by the framing and the partial batch that ends each
    partition's data in a fetch response (the client drops it and fetches it again).
    """
    topic = _topic(proxy.bootstrap, prefix, **admin)
    # 100 MB: more than 30 s at the quota
    total = _fill(proxy.bootstrap, topic, 100, **admin, **{"batch.size": FILL_BATCH_BYTES})
    result, offsets = consume_for(proxy.bootstrap, topic, RUN_S,
                                  **{"max.partition.fetch.bytes": FETCH_PARTITION_BYTES, **config})
    assert not result.errors, result.errors[:3]
    received = result.received_rate(RUN_S - 20, RUN_S)
    values = result.rate(RUN_S - 20, RUN_S)
    report(f"{what}: quota {QUOTA:,.0f} B/s, received {received:,.0f} B/s over the last 20 s "
          f"({received / QUOTA:.3f}x; record values {values / QUOTA:.3f}x)")
    assert 0.9 * QUOTA <= received <= 1.05 * QUOTA, f"{what}: {received:,.0f} B/s against {QUOTA:,.0f}"
    assert offsets and result.records < total
    for partition, seen in offsets.items():
        assert seen == list(range(len(seen))), f"partition {partition}: gaps or repeats"
    assert proxy.metric("kthrottle_throttles_total", quota="consumer_byte_rate", **labels) > 0


def test_consumer_byte_rate_on_client_id_librdkafka(quota_proxy: QuotaProxy) -> None:
    quota_proxy.set_quotas(f'[[quota]]\nclient_id = "rd-consumer"\nconsumer_byte_rate = {QUOTA}')
    _assert_consumer_rate(quota_proxy, "q-fetch", "librdkafka consumer, client-id override",
                          {"user": "", "client_id": "rd-consumer"}, {}, **{"client.id": "rd-consumer"})


def test_consumer_byte_rate_default_user_sasl_librdkafka(sasl_quota_proxy: QuotaProxy) -> None:
    """A `<default>` user quota: bob's bucket, from the SASL exchange the broker accepted."""
    sasl_quota_proxy.set_quotas(f'[[quota]]\nuser = "<default>"\nconsumer_byte_rate = {QUOTA}')
    _assert_consumer_rate(sasl_quota_proxy, "q-fetch-bob", "librdkafka consumer, user default (SASL)",
                          {"user": "bob", "client_id": ""}, _sasl("admin"), **_sasl("bob"))


def test_raising_and_deleting_an_override_live(quota_proxy: QuotaProxy) -> None:
    """Raising an override lifts the throttle within a window; deleting it brings the default back."""
    default = f'[[quota]]\nclient_id = "<default>"\nproducer_byte_rate = {QUOTA}'
    quota_proxy.set_quotas(f'{default}\n\n[[quota]]\nclient_id = "live"\nproducer_byte_rate = {QUOTA}')
    topic = _topic(quota_proxy.bootstrap, "live")
    marks: dict[str, float] = {}

    def change() -> None:
        # Throttled for 20 s first: what Kafka's windowed rate bounds is the bytes over a span plus
        # one window (3 s here), so the longer the span the closer its average to the quota:
        # at most (20 + 3) / 20 = 1.15x here, where 12 s allowed 1.25x and measured up to 1.27x.
        time.sleep(20)
        # Raised to 4x, not to "unlimited": deleting it later puts the client back on the default's
        # bucket (same key), which makes it pay the raised burst back in full, as Kafka does; an
        # unbounded burst would take minutes to pay back, and the run's flush could not finish.
        # "asked": before the proxy can apply it, so what was sent before is all under the old
        # quota; "raised": once its log says it applied it (h45 read 1.37x with one mark taken
        # after set_quotas returned, which counted the raised seconds of a slow return as before).
        marks["asked"] = time.monotonic()
        quota_proxy.set_quotas(
            f'{default}\n\n[[quota]]\nclient_id = "live"\nproducer_byte_rate = {4 * QUOTA}')
        marks["raised"] = time.monotonic()
        time.sleep(8)
        quota_proxy.set_quotas(default)
        marks["deleted"] = time.monotonic()

    changer = threading.Thread(target=change)
    changer.start()
    result = produce_for(quota_proxy.bootstrap, topic, 44, **{"client.id": "live"})
    changer.join(30)
    raised = marks["raised"] - result.started
    deleted = marks["deleted"] - result.started
    # Everything sent before the raise over the time it took, not a slope over the last seconds:
    # Kafka's windowed rate bounds what the client sent over a span plus one window, so a slow
    # start on a busy machine leaves room that a 6 s span alone showed as a burst (1.4x once).
    asked = marks["asked"] - result.started
    before = sum(size for at, size in result.events if at < result.started + asked) / asked
    lifted = result.rate(raised + 3, deleted)  # one window (3 s) after the change
    restored = result.rate(deleted + 1, 44)
    report(f"live change: {before:,.0f} B/s throttled, {lifted:,.0f} B/s raised, {restored:,.0f} B/s default "
           f"(the raise applied {raised - asked:.2f} s after it was asked)")
    assert before <= 1.3 * QUOTA
    # Well past the old quota: how far depends on the machine (25 MB/s alone, 7.3 MB/s in one run
    # right after the consumer runs), with 4x the quota as the bound once the burst is spent.
    assert lifted >= 2 * QUOTA, "raising the override did not lift the throttle"
    # The default's bucket has the same key (client-id "live"), so it keeps the raised burst in
    # its history, as Kafka does: the client is held back until that has aged out of the window.
    assert restored <= 1.3 * QUOTA, "deleting the override did not bring the default back"
    assert quota_proxy.metric("kthrottle_quota_limit", quota="producer_byte_rate", user="",
                              client_id="live") == QUOTA
    assert _end_offsets(quota_proxy.bootstrap, topic) == result.records
