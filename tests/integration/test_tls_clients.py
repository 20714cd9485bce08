"""Every client family through the real `kthrottle run` over TLS on both sides, and who they are there.

Two proxies for the module, both speaking TLS to clients and verifying the brokers over TLS:

- ``mtls_proxy`` in front of the session cluster's SSL listener, with client certificates requested and
  mapped by the broker's own ``ssl.principal.mapping.rules``: the Java client, librdkafka, kafka-python and
  aiokafka round trips; a certificate's principal held to that user's quota; a bare DN under DEFAULT; bad
  certificates refused; a client without a certificate is ANONYMOUS whatever its client.id says.
- ``sasl_ssl_proxy`` in front of the SASL_SSL listener: SCRAM inside TLS, and the quota of the user the
  broker authenticated.

SASL sent inside an SSL connection does not name it either (the SSL listener refuses SASL).

Every client verifies the proxy's certificate and its name (127.0.0.1), as it would a broker's. Quotas are
checked from outside twice: the client is told it was throttled (librdkafka's throttle callback), and the
proxy's per-user metrics name the user the quota was charged to.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kafka.partitioner.default import murmur2

from harness.certificates import IssuedCertificate, TestCertificates
from harness.local_kafka import SASL_USERS, LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import (
    PARTITIONS,
    acks0_produce_body,
    aiokafka_round_trip,
    api_versions_v0,
    assert_exact,
    assert_proxy_addresses,
    kafka_python_round_trip,
    produce_known_records,
    read_all,
    recv_exact,
    topic_name,
    wait_for_topic_on_every_broker,
    wait_until,
)
from .conftest import (
    JAVA_CONSOLE_CONSUMER,
    JAVA_CONSOLE_PRODUCER,
    QUOTA_SETTINGS,
    KafkaJava,
)
from .proxies import QuotaProxy
from .quota_runs import produce_for, report

JAVA_BROKER_API_VERSIONS = "org.apache.kafka.tools.BrokerApiVersionsCommand"

COUNT = 120
JAVA_COUNT = 300

#: The broker's own rule (harness/local_kafka.py): CN=alice,OU=eng,... is alice; a bare CN=carol matches no
#: RULE and DEFAULT keeps the DN as Java prints it.
MAPPING_RULES = "RULE:^CN=([^,]+),.*$/$1/,DEFAULT"

#: producer_byte_rate of the users held to a quota (bytes/s): small enough that a greedy librdkafka
#: producer is throttled within a second, large enough for ten 10 kB records per second.
USER_QUOTA = 100_000
#: Every other principal's bound: never reached here, but it gives each principal its own quota bucket,
#: so the proxy's metrics name who every byte was charged to (ANONYMOUS, bob, ...). The proxy's log
#: cannot say it for every connection: it passes 5 lines of a kind per 10 s and summarises the rest
#: (proxy/observability/logs.py), so its login lines are checked only for naming nobody else.
UNREACHED_QUOTA = 1_000_000_000

#: A client id with a bucket of its own per principal ((user, client-id), Kafka's level 4), except for
#: alice, whose user quota comes first (level 3): what one probe connection is charged to is then
#: told apart from everything else in the module.
PROBE_CLIENT_ID = "identity-probe"

QUOTAS = f"""
[[quota]]
user = "alice"
producer_byte_rate = {USER_QUOTA}

[[quota]]
user = "CN=carol"
producer_byte_rate = {USER_QUOTA}

[[quota]]
user = "<default>"
producer_byte_rate = {UNREACHED_QUOTA}
consumer_byte_rate = {UNREACHED_QUOTA}

[[quota]]
user = "<default>"
client_id = "{PROBE_CLIENT_ID}"
producer_byte_rate = {UNREACHED_QUOTA}
"""

SASL_QUOTAS = f"""
[[quota]]
user = "bob"
producer_byte_rate = {USER_QUOTA}

[[quota]]
user = "<default>"
consumer_byte_rate = {UNREACHED_QUOTA}
"""

#: How long a greedy producer runs against a quota, and the span its rate is measured over: with
#: 3 windows of 1 s (QUOTA_SETTINGS) the first seconds' burst has been paid back after ~3 s.
RATE_RUN_S = 12.0
RATE_FROM_S = 4.0
#: How long a refusal or a log line may take to show (a bound that keeps a broken test from hanging).
WAIT_S = 15.0

PRODUCE_RATE = "kthrottle_produce_byte_rate_bytes_per_second"
FETCH_RATE = "kthrottle_fetch_byte_rate_bytes_per_second"
#: Kafka's Errors.ILLEGAL_SASL_STATE.
ILLEGAL_SASL_STATE = 34
#: What the proxy's summary of suppressed log lines says (proxy/observability/logs.py), with one
#: earlier line's text.
SUMMARY = "more line(s) like this"
#: librdkafka's in-flight bytes for the quota runs: its default (4 MB, 1 MB requests) would be a 10 s
#: throttle per request at 100 kB/s and 40 s of draining after a run.
QUOTA_RUN_CLIENT = {"queue.buffering.max.kbytes": 256, "batch.size": 32_768}


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def certs(kafka_cluster: LocalKafka) -> TestCertificates:
    assert kafka_cluster.ssl_bootstrap and kafka_cluster.sasl_ssl_bootstrap, "the session cluster lacks TLS"
    assert kafka_cluster.certificates is not None
    return kafka_cluster.certificates


def _tls_tables(certs: TestCertificates, *, client_auth: str) -> str:
    """`[tls]` (the harness's server certificate: 127.0.0.1 is in its SAN) and `[upstream_tls]`."""
    listener = [f'certificate = "{certs.server.cert}"', f'key = "{certs.server.key}"']
    if client_auth != "none":
        listener += [f'ca = "{certs.ca}"', f'client_auth = "{client_auth}"',
                     f'principal_mapping_rules = "{MAPPING_RULES}"']
    return "\n[tls]\n" + "\n".join(listener) + f'\n\n[upstream_tls]\nca = "{certs.ca}"\n'


@pytest.fixture(scope="module")
def mtls_proxy(kafka_cluster: LocalKafka, certs: TestCertificates,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """TLS both sides in front of the SSL listener; client certificates requested, mapped like the broker's.

    QuotaProxy keeps its `settings` text at the top of the config file: the `[proxy]` values, then (TOML
    allows any table after them) `[tls]` and `[upstream_tls]`; the `[[quota]]` tables follow on reload.
    """
    assert kafka_cluster.ssl_bootstrap
    settings = QUOTA_SETTINGS + "\n" + _tls_tables(certs, client_auth="requested")
    with QuotaProxy(kafka_cluster.ssl_bootstrap, tmp_path_factory.mktemp("mtls"), settings) as running:
        running.set_quotas(QUOTAS)
        yield running
        assert running.alive(), f"the proxy died:\n{running.log()[-3000:]}"


@pytest.fixture(scope="module")
def sasl_ssl_proxy(kafka_cluster: LocalKafka, certs: TestCertificates,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuotaProxy]:
    """TLS both sides in front of the SASL_SSL listener (no client certificates: SASL names the user)."""
    assert kafka_cluster.sasl_ssl_bootstrap
    settings = QUOTA_SETTINGS + "\n" + _tls_tables(certs, client_auth="none")
    with QuotaProxy(kafka_cluster.sasl_ssl_bootstrap, tmp_path_factory.mktemp("sasl-ssl"),
                    settings) as running:
        running.set_quotas(SASL_QUOTAS)
        yield running
        assert running.alive(), f"the proxy died:\n{running.log()[-3000:]}"


# --------------------------------------------------------------------------------------------- helpers


def _topic(cluster: LocalKafka, prefix: str, partitions: int = PARTITIONS) -> str:
    """A new topic, created over PLAINTEXT (not through the proxy), led on every broker before use."""
    name = topic_name(prefix)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    admin.create_topics([NewTopic(name, partitions, 3)], operation_timeout=30)[name].result(timeout=60)
    wait_for_topic_on_every_broker(cluster.bootstrap, name, partitions)
    return name


def _ssl(proxy: QuotaProxy, certs: TestCertificates,
         client: IssuedCertificate | None = None) -> dict[str, Any]:
    """librdkafka over SSL to the proxy, verifying its chain and its name as it would a broker's."""
    conf: dict[str, Any] = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                            "ssl.ca.location": str(certs.ca),
                            "ssl.endpoint.identification.algorithm": "https"}
    if client is not None:
        conf["ssl.certificate.location"] = str(client.cert)
        conf["ssl.key.location"] = str(client.key)
    return conf


def _sasl_ssl(proxy: QuotaProxy, certs: TestCertificates, mechanism: str, user: str) -> dict[str, Any]:
    return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_SSL",
            "ssl.ca.location": str(certs.ca), "ssl.endpoint.identification.algorithm": "https",
            "sasl.mechanism": mechanism, "sasl.username": user, "sasl.password": SASL_USERS[user]}



def _librdkafka_round_trip(conf: dict[str, Any], cluster: LocalKafka, proxy: QuotaProxy, real: str,
                           prefix: str) -> None:
    """A known record set through the proxy and back (exact, per-partition order); every broker the
    client learned is one of the proxy's addresses, none of the real ones."""
    topic = _topic(cluster, prefix)
    produce_known_records(conf, topic, COUNT)
    assert_exact(read_all(conf, topic, COUNT), COUNT)
    brokers = AdminClient(conf).list_topics(timeout=10).brokers.values()
    assert_proxy_addresses([(b.id, str(b.host), b.port) for b in brokers], proxy.port, cluster.node_ids, real)


def _labels(user: str, quota: str = "producer_byte_rate") -> dict[str, str]:
    """The labels of a user-wide quota bucket (Kafka's user="u", client-id="" tags)."""
    return {"quota": quota, "user": user, "client_id": ""}


def _fetched_by(proxy: QuotaProxy, user: str) -> float:
    """The fetch byte rate charged to `user`: above 0 for about 3 s (the quota window) after it fetched."""
    return proxy.metric(FETCH_RATE, **_labels(user, "consumer_byte_rate"))


def _throttles(proxy: QuotaProxy, user: str) -> float:
    return proxy.metric("kthrottle_throttles_total", **_labels(user))


def _log_since(proxy: QuotaProxy, start: int) -> str:
    return proxy.log()[start:]


def _cert_logins(log: str) -> list[str]:
    """Principals the proxy gave connections from their certificates, as far as its log shows them.

    Summary lines are left out: they report earlier lines (an earlier test's clients), late."""
    return [match[1] for line in log.splitlines() if SUMMARY not in line
            for match in re.finditer(r"authenticated by its TLS certificate as principal '([^']*)'", line)]


def _greedy_with_certificate(proxy: QuotaProxy, certs: TestCertificates, cluster: LocalKafka,
                             client: IssuedCertificate, seconds: float, prefix: str
                             ) -> tuple[float, list[float]]:
    """librdkafka with `client`'s certificate at full speed for `seconds`: (rate after RATE_FROM_S or over
    the whole run if shorter, throttle times the client was told, in seconds)."""
    topic = _topic(cluster, prefix, partitions=1)
    throttled: list[float] = []
    conf = {**_ssl(proxy, certs, client), **QUOTA_RUN_CLIENT,
            "throttle_cb": lambda event: throttled.append(event.throttle_time)}
    result = produce_for(proxy.bootstrap, topic, seconds, **conf)
    start = RATE_FROM_S if seconds > RATE_FROM_S + 2 else 0.0
    return result.rate(start, seconds), throttled


# --------------------------------------------------------------------------------------------- 1. clients


def test_librdkafka_round_trip(kafka_cluster: LocalKafka, certs: TestCertificates,
                               mtls_proxy: QuotaProxy) -> None:
    assert kafka_cluster.ssl_bootstrap
    _librdkafka_round_trip(_ssl(mtls_proxy, certs), kafka_cluster, mtls_proxy, kafka_cluster.ssl_bootstrap,
                           "tls-rdkafka")


def _key_for_partition(index: int) -> str:
    """A key that the Java client's default partitioner (murmur2) puts in partition index % 6."""
    suffix = 0
    while (murmur2(f"k{index}-{suffix}".encode()) & 0x7FFFFFFF) % PARTITIONS != index % PARTITIONS:
        suffix += 1
    return f"k{index}-{suffix}"


def _java_ok(done: subprocess.CompletedProcess[bytes]) -> str:
    assert done.returncode == 0, (
        f"{done.args[-8:]} exited with {done.returncode}:\n{done.stderr.decode(errors='replace')[-4000:]}")
    return done.stdout.decode(errors="replace")


def test_java_client_round_trip(kafka_cluster: LocalKafka, certs: TestCertificates, mtls_proxy: QuotaProxy,
                                kafka_java: KafkaJava, tmp_path: Path) -> None:
    """Kafka's console producer and group consumer over SSL with PEM files (KIP-651), presenting bob's
    certificate from a PEM keystore: exact records per partition in order, the proxy names the client
    bob from that certificate, and the Java admin client sees only the proxy's addresses."""
    assert kafka_cluster.ssl_bootstrap
    client_config = tmp_path / "ssl.properties"
    client_config.write_text(
        "security.protocol=SSL\n"
        f"ssl.truststore.type=PEM\nssl.truststore.location={certs.ca}\n"
        f"ssl.keystore.type=PEM\nssl.keystore.location={certs.client('bob').keystore}\n")
    topic, group = _topic(kafka_cluster, "tls-java"), topic_name("tls-java-group")
    keys = [_key_for_partition(i) for i in range(JAVA_COUNT)]
    start = len(mtls_proxy.log())
    _java_ok(kafka_java.run(
        JAVA_CONSOLE_PRODUCER, "--bootstrap-server", mtls_proxy.bootstrap, "--topic", topic,
        "--command-config", str(client_config), "--command-property", "acks=all",
        "--reader-property", "parse.key=true", "--reader-property", "key.separator=:",
        input="".join(f"{keys[i]}:v{i}\n" for i in range(JAVA_COUNT)).encode(),
    ))  # fmt: skip
    out = _java_ok(kafka_java.run(
        JAVA_CONSOLE_CONSUMER, "--bootstrap-server", mtls_proxy.bootstrap, "--topic", topic,
        "--group", group, "--command-config", str(client_config), "--from-beginning",
        "--max-messages", str(JAVA_COUNT), "--timeout-ms", "60000",
        "--formatter-property", "print.partition=true", "--formatter-property", "print.key=true",
    ))  # fmt: skip
    consumed: dict[int, list[str]] = {}
    for line in out.splitlines():
        partition_field, key, value = line.split("\t")
        index = int(value.removeprefix("v"))
        assert key == keys[index], f"record {value} came back with key {key}, sent with {keys[index]}"
        consumed.setdefault(int(partition_field.removeprefix("Partition:")), []).append(value)
    assert_exact(consumed, JAVA_COUNT)
    assert _fetched_by(mtls_proxy, "bob") > 0, "the Java consumer's fetches were not charged to bob"
    logins = _cert_logins(_log_since(mtls_proxy, start))
    assert set(logins) <= {"bob"}, f"the Java client's connections were named {logins}"

    versions = _java_ok(kafka_java.run(JAVA_BROKER_API_VERSIONS, "--bootstrap-server", mtls_proxy.bootstrap,
                                       "--command-config", str(client_config)))
    headers = re.findall(r"^(\S+):(\d+) \(id: (\d+) rack: [^)]*\) -> \(", versions, re.MULTILINE)
    assert_proxy_addresses([(int(node), host, int(port)) for host, port, node in headers], mtls_proxy.port,
                           kafka_cluster.node_ids, kafka_cluster.ssl_bootstrap)
    for real in (kafka_cluster.ssl_bootstrap + "," + kafka_cluster.bootstrap).split(","):
        assert real not in versions, f"a real broker address {real} appears:\n{versions}"


def test_kafka_python_round_trip(kafka_cluster: LocalKafka, certs: TestCertificates,
                                 mtls_proxy: QuotaProxy) -> None:
    """kafka-python checks the proxy's name (ssl_check_hostname); a group consumer finds its coordinator
    at the proxy's port for that broker."""
    assert kafka_cluster.ssl_bootstrap
    topic = _topic(kafka_cluster, "tls-kafka-python")
    consumed = kafka_python_round_trip(
        mtls_proxy.bootstrap, topic, COUNT, mtls_proxy.port, kafka_cluster.node_ids,
        kafka_cluster.ssl_bootstrap, security_protocol="SSL", ssl_cafile=str(certs.ca),
        ssl_check_hostname=True)
    assert_exact(consumed, COUNT)


def test_aiokafka_round_trip(kafka_cluster: LocalKafka, certs: TestCertificates,
                             mtls_proxy: QuotaProxy) -> None:
    """aiokafka (idempotent producer, group consumer) with an ssl.SSLContext that checks the hostname."""
    from aiokafka.helpers import create_ssl_context

    assert kafka_cluster.ssl_bootstrap
    topic = _topic(kafka_cluster, "tls-aiokafka")
    context = create_ssl_context(cafile=str(certs.ca))
    assert context.check_hostname
    consumed = asyncio.run(aiokafka_round_trip(
        mtls_proxy.bootstrap, topic, COUNT, mtls_proxy.port, kafka_cluster.node_ids,
        kafka_cluster.ssl_bootstrap, security_protocol="SSL", ssl_context=context))
    assert_exact(consumed, COUNT)


# --------------------------------------------------------------------------------------------- 2. SASL_SSL


@pytest.mark.parametrize("client", ["librdkafka-scram-sha-256", "kafka-python-scram-sha-512"])
def test_sasl_ssl_scram_round_trip(kafka_cluster: LocalKafka, certs: TestCertificates,
                                   sasl_ssl_proxy: QuotaProxy, client: str) -> None:
    """SCRAM inside TLS to the proxy, and inside TLS again to the broker's SASL_SSL listener: the broker
    authenticates alice and the proxy names her once it has."""
    real = kafka_cluster.sasl_ssl_bootstrap
    assert real
    mechanism = "SCRAM-SHA-256" if client.endswith("256") else "SCRAM-SHA-512"
    start = len(sasl_ssl_proxy.log())
    if client.startswith("librdkafka"):
        _librdkafka_round_trip(_sasl_ssl(sasl_ssl_proxy, certs, mechanism, "alice"), kafka_cluster,
                               sasl_ssl_proxy, real, "tls-scram")
    else:
        topic = _topic(kafka_cluster, "tls-scram-kp")
        consumed = kafka_python_round_trip(
            sasl_ssl_proxy.bootstrap, topic, COUNT, sasl_ssl_proxy.port, kafka_cluster.node_ids, real,
            security_protocol="SASL_SSL", ssl_cafile=str(certs.ca), ssl_check_hostname=True,
            sasl_mechanism=mechanism, sasl_plain_username="alice", sasl_plain_password=SASL_USERS["alice"])
        assert_exact(consumed, COUNT)
    assert _fetched_by(sasl_ssl_proxy, "alice") > 0, "the consumer's fetches were not charged to alice"
    log = "\n".join(line for line in _log_since(sasl_ssl_proxy, start).splitlines() if SUMMARY not in line)
    logins = re.findall(r"authenticated as principal '([^']*)' \(([^)]*)\)", log)
    assert set(logins) <= {("alice", mechanism)}, logins


def test_sasl_ssl_user_quota_applies(kafka_cluster: LocalKafka, certs: TestCertificates,
                                     sasl_ssl_proxy: QuotaProxy) -> None:
    """bob, authenticated with SCRAM-SHA-256 inside TLS, is held to his producer_byte_rate in the proxy's
    quota file: the client is told (throttle callback) and the proxy's metrics charge user bob."""
    topic = _topic(kafka_cluster, "tls-scram-quota", partitions=1)
    throttled: list[float] = []
    conf = {**_sasl_ssl(sasl_ssl_proxy, certs, "SCRAM-SHA-256", "bob"), **QUOTA_RUN_CLIENT,
            "throttle_cb": lambda event: throttled.append(event.throttle_time)}
    seconds = 8.0
    result = produce_for(sasl_ssl_proxy.bootstrap, topic, seconds, **conf)
    rate = result.rate(3.0, seconds)
    report(f"SASL_SSL SCRAM-SHA-256 bob through the TLS proxy: quota {USER_QUOTA:,} B/s, measured "
           f"{rate:,.0f} B/s over 3-{seconds:.0f} s ({rate / USER_QUOTA:.3f}x), {len(throttled)} throttles "
           f"told to the client (max {max(throttled, default=0):.2f} s)")
    assert throttled and max(throttled) > 0, "librdkafka was never told it was throttled"
    assert _throttles(sasl_ssl_proxy, "bob") > 0
    assert sasl_ssl_proxy.metric("kthrottle_quota_limit", **_labels("bob")) == USER_QUOTA
    # Everything bob sent was acknowledged (produce_for checks it): throttled, not refused.
    assert result.records > 0 and not result.errors


# --------------------------------------------------------------------------------------------- 3. mTLS


def test_certificate_principal_is_held_to_its_users_quota(kafka_cluster: LocalKafka, certs: TestCertificates,
                                                          mtls_proxy: QuotaProxy) -> None:
    """alice's certificate (CN=alice,OU=eng,O=kthrottle -> alice by the RULE) is held to alice's quota:
    the measured rate, the throttle the client is told, and the proxy's metrics for user alice."""
    start = len(mtls_proxy.log())
    rate, throttled = _greedy_with_certificate(mtls_proxy, certs, kafka_cluster, certs.client("alice"),
                                               RATE_RUN_S, "tls-alice")
    report(f"mTLS alice (CN=alice,OU=eng,O=kthrottle) through the TLS proxy: quota {USER_QUOTA:,} B/s, "
           f"measured {rate:,.0f} B/s over {RATE_FROM_S:.0f}-{RATE_RUN_S:.0f} s ({rate / USER_QUOTA:.3f}x), "
           f"{len(throttled)} throttles told to the client")
    assert set(_cert_logins(_log_since(mtls_proxy, start))) <= {"alice"}
    assert throttled and max(throttled) > 0, "librdkafka was never told it was throttled"
    assert _throttles(mtls_proxy, "alice") > 0
    assert mtls_proxy.metric("kthrottle_quota_limit", **_labels("alice")) == USER_QUOTA
    assert 0.7 * USER_QUOTA <= rate <= 1.3 * USER_QUOTA, f"alice got {rate:,.0f} B/s, quota {USER_QUOTA:,}"


def test_certificate_without_a_quota_is_not_throttled(kafka_cluster: LocalKafka, certs: TestCertificates,
                                                      mtls_proxy: QuotaProxy) -> None:
    """bob's certificate is bob, under the unreachable default bound: a burst far above alice's quota
    (its 3-window allowance is ~300 kB) goes through unthrottled and is charged to bob."""
    start = len(mtls_proxy.log())
    topic = _topic(kafka_cluster, "tls-bob", partitions=1)
    throttled: list[float] = []
    producer = Producer({**_ssl(mtls_proxy, certs, certs.client("bob")), "linger.ms": 5,
                         "throttle_cb": lambda event: throttled.append(event.throttle_time)})
    value = b"b" * 10_000
    for _ in range(150):  # 1.5 MB, as fast as the client goes
        producer.produce(topic, value)
        producer.poll(0)
    assert producer.flush(60) == 0
    # Kafka's rate covers its last 11 one-second samples: read it while the burst is in them
    charged = mtls_proxy.metric(PRODUCE_RATE, **_labels("bob"))
    producer.poll(0.5)
    assert set(_cert_logins(_log_since(mtls_proxy, start))) <= {"bob"}
    assert not [t for t in throttled if t > 0], f"bob was throttled: {throttled}"
    assert _throttles(mtls_proxy, "bob") == 0
    assert charged > 0, "bob's bytes were charged elsewhere"


def test_certificate_matching_no_rule_is_its_dn(kafka_cluster: LocalKafka, certs: TestCertificates,
                                                mtls_proxy: QuotaProxy) -> None:
    """CN=carol matches no RULE: DEFAULT makes the principal the DN itself, which the quota for user
    "CN=carol" holds (as the broker's own quotas do, test_harness_tls)."""
    start = len(mtls_proxy.log())
    rate, throttled = _greedy_with_certificate(mtls_proxy, certs, kafka_cluster, certs.client("carol"),
                                               4.0, "tls-carol")
    assert set(_cert_logins(_log_since(mtls_proxy, start))) <= {"CN=carol"}
    assert throttled and max(throttled) > 0, f"CN=carol was not throttled ({rate:,.0f} B/s)"
    assert _throttles(mtls_proxy, "CN=carol") > 0
    assert _throttles(mtls_proxy, "carol") == 0


# --------------------------------------------------------------------------------------------- 4. refusals




def _connect(port: int, certs: TestCertificates, client: IssuedCertificate | None) -> ssl.SSLSocket:
    """A TLS socket the test drives itself (one request at a time, its own local port for the log).

    Python's ssl presents its certificate whatever CAs the server names. librdkafka withholds one whose
    issuer the brokers do not name in their CertificateRequest (test_harness_tls); the proxy names no
    CAs there (Python's ssl cannot), so librdkafka presents an untrusted certificate to it and is refused,
    where the brokers would take it as ANONYMOUS."""
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    raw = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


@pytest.mark.parametrize("which", ["untrusted_client", "expired_client"])
def test_bad_client_certificate_is_refused(certs: TestCertificates, mtls_proxy: QuotaProxy,
                                           which: str) -> None:
    """A presented certificate must verify even with client_auth = "requested": an untrusted issuer and an
    expired certificate are refused, each with one log line saying why, while a client connected at the
    same time goes on on its own connection."""
    bad: IssuedCertificate = getattr(certs, which)
    # The untrusted file holds its own CA after the leaf, so OpenSSL meets a self-signed certificate.
    reason = {"untrusted_client": "self-signed certificate in certificate chain",
              "expired_client": "certificate has expired"}[which]
    with _connect(mtls_proxy.port, certs, certs.client("bob")) as good:
        assert api_versions_v0(good, 1) == 1
        closed_before = mtls_proxy.metric("kthrottle_connections_closed_total", reason="tls_bad_certificate")
        open_before = mtls_proxy.metric("kthrottle_connections")
        assert open_before >= 1
        start = len(mtls_proxy.log())
        # TLS 1.3: the client's side of the handshake ends before the proxy has checked the certificate,
        # so the refusal (an alert, or the connection closing) arrives on the first read.
        with pytest.raises((ssl.SSLError, ConnectionError)), _connect(mtls_proxy.port, certs, bad) as refused:
            port = refused.getsockname()[1]
            api_versions_v0(refused, 2)
        lines = wait_until(lambda: [line for line in _log_since(mtls_proxy, start).splitlines()
                                    if f"127.0.0.1:{port} " in line], WAIT_S, "the refusal's log line")
        assert len(lines) == 1, lines
        assert "TLS handshake refused: the client certificate does not verify against tls.ca" in lines[0]
        assert reason in lines[0], lines[0]
        assert mtls_proxy.metric("kthrottle_connections_closed_total",
                                 reason="tls_bad_certificate") == closed_before + 1
        # The refused connection gave back its place (kthrottle_connections counts the good one still).
        wait_until(lambda: mtls_proxy.metric("kthrottle_connections") == open_before, WAIT_S,
                   f"kthrottle_connections back to {open_before}")
        assert api_versions_v0(good, 3) == 3  # the other client's connection never noticed
    assert mtls_proxy.alive()


# --------------------------------------------------------------------------------------------- 5. security


def test_no_certificate_is_anonymous_whatever_the_client_id_says(kafka_cluster: LocalKafka,
                                                                 certs: TestCertificates,
                                                                 mtls_proxy: QuotaProxy) -> None:
    """A client over SSL without a certificate is ANONYMOUS: client.id = "alice" gives it neither alice's
    name nor her quota. If it did, 1.5 MB at once would be throttled (alice may send ~300 kB per 3 s)."""
    start = len(mtls_proxy.log())
    # A rate, not alice's throttle count: her bucket may expire meanwhile (its window passed), which
    # takes the count with it. An idle bucket's windowed rate only falls.
    alice_before = mtls_proxy.metric(PRODUCE_RATE, **_labels("alice"))
    topic = _topic(kafka_cluster, "tls-anon", partitions=1)
    throttled: list[float] = []
    producer = Producer({**_ssl(mtls_proxy, certs), "client.id": "alice", "linger.ms": 5,
                         "throttle_cb": lambda event: throttled.append(event.throttle_time)})
    value = b"a" * 10_000
    # ANONYMOUS's rate is read while the burst runs, not after it: read after the flush it was 0 in
    # h29, on a machine busy enough that the burst may have left the 3 s window by then
    anonymous: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            anonymous.append(mtls_proxy.metric(PRODUCE_RATE, **_labels("ANONYMOUS")))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(150):
            producer.produce(topic, value)
            producer.poll(0)
        assert producer.flush(60) == 0
        producer.poll(0.5)
    finally:
        done.set()
        watcher.join(10)
    assert _cert_logins(_log_since(mtls_proxy, start)) == [], "a client without a certificate was named"
    assert not [t for t in throttled if t > 0], f"the anonymous client was throttled: {throttled}"
    assert mtls_proxy.metric(PRODUCE_RATE, **_labels("alice")) <= alice_before, "alice was charged"
    assert max(anonymous, default=0.0) > 0, f"ANONYMOUS was not charged: {anonymous}"
    assert mtls_proxy.metric(PRODUCE_RATE, quota="producer_byte_rate", user="alice", client_id="alice") == 0


def _request(sock: socket.socket, api_key: int, version: int, correlation_id: int, body: bytes) -> bytes:
    """One request on `sock` and its response body (after the v0 response header)."""
    sock.sendall(frame(encode_request_header(api_key, version, correlation_id, PROBE_CLIENT_ID) + body))
    size, got = struct.unpack(">ii", recv_exact(sock, 8))
    assert got == correlation_id
    return recv_exact(sock, size - 4)


def _kafka_bytes(data: bytes) -> bytes:
    return struct.pack(">i", len(data)) + data


def test_sasl_inside_an_ssl_connection_does_not_name_it(kafka_cluster: LocalKafka, certs: TestCertificates,
                                                        mtls_proxy: QuotaProxy) -> None:
    """A client without a certificate that sends alice's PLAIN credentials in SaslHandshake/SaslAuthenticate
    on the SSL listener is not alice: the broker's SSL listener takes no SASL (it answers with an error),
    and the proxy names a SASL principal only once the broker accepted it. Its next Produce (acks=0, 50 kB,
    charged at once) is charged to ANONYMOUS."""
    topic = _topic(kafka_cluster, "tls-sasl-spoof", partitions=1)
    probe = _labels("ANONYMOUS") | {"client_id": PROBE_CLIENT_ID}
    alice_before = mtls_proxy.metric(PRODUCE_RATE, **_labels("alice"))
    with _connect(mtls_proxy.port, certs, None) as sock:
        handshake = _request(sock, 17, 1, 1, struct.pack(">h", 5) + b"PLAIN")  # SaslHandshake v1
        (handshake_error,) = struct.unpack(">h", handshake[:2])
        authenticate = _request(sock, 36, 1, 2, _kafka_bytes(b"\0alice\0" + SASL_USERS["alice"].encode()))
        (authenticate_error,) = struct.unpack(">h", authenticate[:2])
        # Kafka answers SASL on a listener without it with ILLEGAL_SASL_STATE and keeps the connection.
        assert (handshake_error, authenticate_error) == (ILLEGAL_SASL_STATE, ILLEGAL_SASL_STATE)
        sock.sendall(frame(encode_request_header(0, 9, 3, PROBE_CLIENT_ID)
                           + acks0_produce_body(topic, b"s" * 50_000)))
        wait_until(lambda: mtls_proxy.metric(PRODUCE_RATE, **probe) > 0, WAIT_S,
                   "the probe's Produce to be charged to ANONYMOUS")
    assert mtls_proxy.metric(PRODUCE_RATE, **_labels("alice")) <= alice_before, "alice was charged"
    assert mtls_proxy.metric(PRODUCE_RATE, **(_labels("alice") | {"client_id": PROBE_CLIENT_ID})) == 0
