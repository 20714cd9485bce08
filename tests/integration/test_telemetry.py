"""Client telemetry (KIP-714) through `kthrottle run`, against a broker that takes clients' metrics.

A Kafka broker offers GetTelemetrySubscriptions (71) and PushTelemetry (72) only with a metrics
reporter that takes clients' metrics, so this module starts its own one-node cluster with the
harness's recorder (`LocalKafka(telemetry=True)`, which writes one line per push the broker receives)
and a client-metrics subscription asking every client for every metric each second. The proxy
forwards both APIs opaque. Here: the proxy offers them as the broker does; the Java producer from the
fetched 4.3.1 jars (PLAINTEXT and SASL) and librdkafka's, pointed only at the proxy, push their metrics,
which the broker receives with the producer's client id and principal while every record arrives (a
console producer sends no terminating push when it closes, directly or not, so only periodic pushes
are counted); and both requests are charged to the request quota (`request_percentage`), as Kafka's
`KafkaApis` does (`sendMaybeThrottle` for both), with the throttle written in their `ThrottleTimeMs`
as a broker writes it.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from harness import telemetry
from harness.local_kafka import SASL_USERS, TEST_HEAP_MB, LocalKafka

from .clients import recv_exact, topic_name
from .conftest import _TOOLS_LOG4J2, JAVA_CONFIG_COMMAND, JAVA_CONSOLE_PRODUCER, QUOTA_SETTINGS, KafkaJava
from .proxies import QuotaProxy, RunningProxy

GET_SUBSCRIPTIONS = telemetry.GET_TELEMETRY_SUBSCRIPTIONS
PUSH = telemetry.PUSH_TELEMETRY
#: Periodic (not terminating) pushes a producer must have made through the proxy: more than one
#: shows it went on pushing at the subscription's interval, not only once.
PERIODIC_PUSHES = 2
#: The records' pace: one every 50 ms, for as long as the pushes take (bounded by PRODUCE_BOUND_S).
RECORD_INTERVAL_S = 0.05
PRODUCE_BOUND_S = 120.0
#: A request quota no request can stay under: 0.01% of one thread's time.
TINY_REQUEST_PERCENTAGE = 0.01
QUOTA_CLIENT = "telemetry-quota"
#: Rounds of both requests that must go unthrottled while no quota is set.
CONTROL_ROUNDS = 5
#: Kafka caps a request-quota throttle at one quota window (`ClientRequestQuotaManager.maxThrottleTimeMs`,
#: `quota.window.size.seconds` = 1 by default, and the quota proxy's too).
REQUEST_THROTTLE_CAP_MS = 1000


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalKafka]:
    """One broker with the telemetry recorder and PLAINTEXT and SASL_PLAINTEXT listeners, subscribed."""
    with LocalKafka(brokers=1, sasl=True, telemetry=True, heap_mb=TEST_HEAP_MB, light_jit=True) as running:
        running.subscribe_client_metrics("every-metric", interval_ms=telemetry.PUSH_INTERVAL_MS)
        yield running


@pytest.fixture(scope="module")
def java(cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> KafkaJava:
    log4j2 = tmp_path_factory.mktemp("telemetry-java") / "log4j2-tools.properties"
    log4j2.write_text(_TOOLS_LOG4J2)
    return KafkaJava(log4j2, cluster.bootstrap, cluster.sasl_bootstrap)


@pytest.fixture(scope="module")
def proxy(cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    with QuotaProxy(cluster.bootstrap, tmp_path_factory.mktemp("telemetry-quota"), QUOTA_SETTINGS) as running:
        yield running


@pytest.fixture(scope="module")
def sasl_proxy(cluster: LocalKafka) -> Iterator[RunningProxy]:
    assert cluster.sasl_bootstrap
    with RunningProxy(cluster.sasl_bootstrap) as running:
        yield running


# -- raw requests ----------------------------------------------------------------------------------


def _address(bootstrap: str) -> tuple[str, int]:
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    return host, int(port)


def _exchange(sock: socket.socket, frame: bytes) -> bytes:
    sock.sendall(frame)
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    return recv_exact(sock, size)


def _api_versions(bootstrap: str) -> dict[int, tuple[int, int]]:
    """ApiVersions v0 (no tagged fields, no throttle field): each offered key's (min, max)."""
    client_id = b"telemetry-test"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    with socket.create_connection(_address(bootstrap), timeout=10) as sock:
        frame = _exchange(sock, struct.pack(">i", len(body)) + body)
    correlation, error, count = struct.unpack_from(">ihi", frame, 0)
    assert (correlation, error) == (7, 0)
    return {key: (low, high)
            for key, low, high in (struct.unpack_from(">hhh", frame, 10 + 6 * i) for i in range(count))}


def _push_request(correlation_id: int, client_id: str, instance: uuid.UUID, subscription_id: int) -> bytes:
    """PushTelemetry v0 with an empty, uncompressed metrics payload (PushTelemetryRequest.json)."""
    cid = client_id.encode()
    body = (struct.pack(">hhih", PUSH, 0, correlation_id, len(cid)) + cid + b"\x00"
            + instance.bytes + struct.pack(">ibb", subscription_id, 0, 0) + b"\x01" + b"\x00")
    return struct.pack(">i", len(body)) + body


def _push_throttle(frame: bytes) -> int:
    """A PushTelemetry v0 response's ThrottleTimeMs (after the correlation id and empty header tags)."""
    assert frame[4] == 0, "tagged fields in the response header"
    (throttle,) = struct.unpack_from(">i", frame, 5)
    return int(throttle)


def _throttled_telemetry(bootstrap: str, client_id: str, rounds: int = 500) -> dict[int, int]:
    """GetTelemetrySubscriptions then PushTelemetry, again and again on one connection, until each has
    come back with a throttle; returns the first throttle of each API key (absent: never throttled).

    A throttled client's connection is muted for the throttle (by a broker and by kthrottle alike),
    so each round waits for the last one's throttle to pass: the throttles are what bound this loop.
    """
    first: dict[int, int] = {}
    with socket.create_connection(_address(bootstrap), timeout=60) as sock:
        for correlation in range(0, 2 * rounds, 2):
            got = telemetry.decode_subscription(
                _exchange(sock, telemetry.get_subscriptions_request(correlation, client_id)))
            assert got.error_code == 0, got
            if got.throttle_time_ms > 0:
                first.setdefault(GET_SUBSCRIPTIONS, got.throttle_time_ms)
            throttle = _push_throttle(_exchange(sock, _push_request(correlation + 1, client_id,
                                                                    got.client_instance_id,
                                                                    got.subscription_id)))
            if throttle > 0:
                first.setdefault(PUSH, throttle)
            if len(first) == 2:
                break
    return first


# -- the Java producer ------------------------------------------------------------------------------


def _create_topic(bootstrap: str) -> str:
    topic = topic_name("telemetry")
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the result is in
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    return topic


def _pushes_from(cluster: LocalKafka, client_id: str) -> list[telemetry.Push]:
    return [push for push in cluster.telemetry_pushes() if push.client_id == client_id]


def _produce_while_pushing(cluster: LocalKafka, java: KafkaJava, bootstrap: str, topic: str, client_id: str,
                           workdir: Path, extra_config: str = "") -> int:
    """The console producer writes one record every RECORD_INTERVAL_S until the broker has recorded
    PERIODIC_PUSHES pushes from it, then ends; returns how many records it was given."""
    config = workdir / f"{client_id}.properties"
    # request.timeout.ms: the console producer's own default is 1.5 s, not the producer's 30 s. A busy
    # machine can hold a request that long; the client then drops the connection, and after that the Java
    # client pushes no more telemetry, through the proxy or direct alike (tried: a broker stopped for 35 s).
    config.write_text(f"client.id={client_id}\nacks=all\nlinger.ms=0\nrequest.timeout.ms=30000\n{extra_config}")
    stderr = workdir / f"{client_id}.stderr"
    with open(stderr, "wb") as err:
        producer = subprocess.Popen(
            java.command(JAVA_CONSOLE_PRODUCER, "--bootstrap-server", bootstrap, "--topic", topic,
                         "--command-config", str(config)),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        assert producer.stdin is not None
        sent = 0
        deadline = time.monotonic() + PRODUCE_BOUND_S
        try:
            while sum(not p.terminating for p in _pushes_from(cluster, client_id)) < PERIODIC_PUSHES:
                assert producer.poll() is None, f"the producer exited:\n{stderr.read_text()[-4000:]}"
                assert time.monotonic() < deadline, (
                    f"fewer than {PERIODIC_PUSHES} telemetry pushes from {client_id} in {PRODUCE_BOUND_S}s: "
                    f"{_pushes_from(cluster, client_id)}\n{stderr.read_text()[-4000:]}")
                producer.stdin.write(f"{sent}\n".encode())
                producer.stdin.flush()
                sent += 1
                time.sleep(RECORD_INTERVAL_S)
            producer.stdin.close()  # end of input: the console producer flushes, closes and exits
            assert producer.wait(timeout=60) == 0, stderr.read_text()[-4000:]
        finally:
            if producer.poll() is None:
                producer.kill()
                producer.wait()
    return sent


def _librdkafka_produce_while_pushing(cluster: LocalKafka, bootstrap: str, topic: str, client_id: str) -> int:
    """librdkafka's producer (KIP-714 since librdkafka 2.5), paced like the console producer above."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all",
                         "linger.ms": 0})
    sent = 0
    deadline = time.monotonic() + PRODUCE_BOUND_S
    while sum(not p.terminating for p in _pushes_from(cluster, client_id)) < PERIODIC_PUSHES:
        assert time.monotonic() < deadline, (
            f"fewer than {PERIODIC_PUSHES} telemetry pushes from {client_id} in {PRODUCE_BOUND_S}s: "
            f"{_pushes_from(cluster, client_id)}")
        producer.produce(topic, str(sent).encode())
        producer.poll(0)
        sent += 1
        time.sleep(RECORD_INTERVAL_S)
    assert producer.flush(60) == 0, "records still queued after 60 s"
    return sent


def _read_values(bootstrap: str, topic: str, count: int) -> list[int]:
    """Every record of the topic's one partition, read directly from the broker."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{topic}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[int] = []
        deadline = time.monotonic() + 60
        while len(values) < count and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                value = message.value()
                assert value is not None
                values.append(int(value))
        return values
    finally:
        consumer.close()


# -- tests ----------------------------------------------------------------------------------------


def test_telemetry_apis_are_offered_through_the_proxy_as_the_broker_offers_them(
        cluster: LocalKafka, proxy: QuotaProxy, sasl_proxy: RunningProxy) -> None:
    direct = _api_versions(cluster.bootstrap)
    assert {GET_SUBSCRIPTIONS, PUSH} <= set(direct), "the broker offers no telemetry: the test proves nothing"
    for running in (proxy, sasl_proxy):
        proxied = _api_versions(running.bootstrap)
        assert {key: proxied.get(key) for key in (GET_SUBSCRIPTIONS, PUSH)} == {
            key: direct[key] for key in (GET_SUBSCRIPTIONS, PUSH)}


@pytest.mark.parametrize("listener", ["PLAINTEXT", "SASL_PLAINTEXT"])
def test_java_producer_pushes_its_metrics_through_the_proxy(
        cluster: LocalKafka, java: KafkaJava, proxy: QuotaProxy, sasl_proxy: RunningProxy, tmp_path: Path,
        listener: str) -> None:
    if listener == "PLAINTEXT":
        bootstrap, principal, extra = proxy.bootstrap, "User:ANONYMOUS", ""
    else:
        bootstrap, principal = sasl_proxy.bootstrap, "User:alice"
        extra = ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-256\n"
                 "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
                 f'username="alice" password="{SASL_USERS["alice"]}";\n')
    client_id = f"telemetry-{listener.lower()}-{uuid.uuid4().hex[:6]}"
    topic = _create_topic(cluster.bootstrap)
    pushes_before = proxy.metric("kthrottle_requests_total", api="PushTelemetry")

    sent = _produce_while_pushing(cluster, java, bootstrap, topic, client_id, tmp_path, extra)

    pushes = _pushes_from(cluster, client_id)
    periodic = [push for push in pushes if not push.terminating]
    assert len(periodic) >= PERIODIC_PUSHES, pushes
    assert len({push.client_instance_id for push in pushes}) == 1, pushes  # one producer, one instance
    for push in periodic:
        assert (push.principal, push.listener) == (principal, listener), push
        assert push.payload_bytes > 0, push
        assert push.push_interval_ms == telemetry.PUSH_INTERVAL_MS, push
    if listener == "PLAINTEXT":  # the proxy forwarded them: it counts every request it forwards
        forwarded = proxy.metric("kthrottle_requests_total", api="PushTelemetry") - pushes_before
        assert forwarded >= len(pushes), (forwarded, pushes)
    assert _read_values(cluster.bootstrap, topic, sent) == list(range(sent))


def test_librdkafka_producer_pushes_its_metrics_through_the_proxy(cluster: LocalKafka,
                                                                  proxy: QuotaProxy) -> None:
    client_id = f"telemetry-librdkafka-{uuid.uuid4().hex[:6]}"
    topic = _create_topic(cluster.bootstrap)
    pushes_before = proxy.metric("kthrottle_requests_total", api="PushTelemetry")

    sent = _librdkafka_produce_while_pushing(cluster, proxy.bootstrap, topic, client_id)

    pushes = _pushes_from(cluster, client_id)
    periodic = [push for push in pushes if not push.terminating]
    assert len(periodic) >= PERIODIC_PUSHES, pushes
    for push in periodic:
        assert (push.principal, push.listener) == ("User:ANONYMOUS", "PLAINTEXT"), push
        assert push.payload_bytes > 0, push
    forwarded = proxy.metric("kthrottle_requests_total", api="PushTelemetry") - pushes_before
    assert forwarded >= len(pushes), (forwarded, pushes)
    assert _read_values(cluster.bootstrap, topic, sent) == list(range(sent))


def test_telemetry_requests_are_charged_to_the_request_quota_as_a_broker_charges_them(
        cluster: LocalKafka, java: KafkaJava, proxy: QuotaProxy) -> None:
    # Without a quota neither the proxy nor the broker throttles these requests: any throttle below
    # comes from the request quota, not from KIP-714's own push-interval checks.
    assert _throttled_telemetry(proxy.bootstrap, QUOTA_CLIENT, rounds=CONTROL_ROUNDS) == {}
    assert _throttled_telemetry(cluster.bootstrap, QUOTA_CLIENT, rounds=CONTROL_ROUNDS) == {}

    proxy.set_quotas(f'[[quota]]\nclient_id = "{QUOTA_CLIENT}"\n'
                     f"request_percentage = {TINY_REQUEST_PERCENTAGE}\n")
    before = {api: proxy.metric("kthrottle_throttled_responses_total", api=api)
              for api in ("GetTelemetrySubscriptions", "PushTelemetry")}
    through_proxy = _throttled_telemetry(proxy.bootstrap, QUOTA_CLIENT)
    assert set(through_proxy) == {GET_SUBSCRIPTIONS, PUSH}, through_proxy
    assert all(0 < ms <= REQUEST_THROTTLE_CAP_MS for ms in through_proxy.values()), through_proxy
    for api, count in before.items():
        assert proxy.metric("kthrottle_throttled_responses_total", api=api) > count, api

    # The broker, with the same quota for the same client id, throttles both too.
    done = java.run(JAVA_CONFIG_COMMAND, "--bootstrap-server", cluster.bootstrap, "--alter",
                    "--entity-type", "clients", "--entity-name", QUOTA_CLIENT,
                    "--add-config", f"request_percentage={TINY_REQUEST_PERCENTAGE}")
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    direct = _throttled_telemetry(cluster.bootstrap, QUOTA_CLIENT)
    assert set(direct) == {GET_SUBSCRIPTIONS, PUSH}, direct
    assert all(0 < ms <= REQUEST_THROTTLE_CAP_MS for ms in direct.values()), direct
