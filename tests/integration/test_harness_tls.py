"""The harness's TLS listeners, proven from outside with real clients straight to the brokers (no proxy).

``LocalKafka(tls=True)`` adds an SSL listener (client certificates requested, mapped to principals by
``ssl.principal.mapping.rules``) and a SASL_SSL listener (PLAIN and SCRAM), from certificates generated at
start. Every later TLS test through the proxy leans on these facts, including what the broker does with
each bad certificate, so the proxy's tests can compare themselves with it.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from cli.quotas import alter
from harness.certificates import TestCertificates
from harness.local_kafka import SASL_USERS, LocalKafka

from .clients import (
    PARTITIONS,
    assert_exact,
    produce_known_records,
    read_all,
    records,
    topic_name,
    wait_for_topic_on_every_broker,
    wait_until,
)

RECORDS = 300
REFUSAL_WAIT_S = 15.0  # how long a client may retry before the refusal it should meet is seen
ALERT_CERTIFICATE_UNKNOWN = "SSLV3_ALERT_CERTIFICATE_UNKNOWN"  # TLS alert 46, what Java sends


@pytest.fixture(scope="module")
def tls_cluster(kafka_cluster: LocalKafka) -> LocalKafka:
    """The session's cluster (it has SSL and SASL_SSL listeners); asserted, so a change there fails here."""
    assert kafka_cluster.ssl_bootstrap and kafka_cluster.sasl_ssl_bootstrap, "the session cluster lacks TLS"
    return kafka_cluster


def _certs(cluster: LocalKafka) -> TestCertificates:
    assert cluster.certificates is not None
    return cluster.certificates


def _topic(cluster: LocalKafka, prefix: str, partitions: int = PARTITIONS) -> str:
    """A new topic, created over PLAINTEXT, known with a leader to every broker before it is used."""
    name = topic_name(prefix)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    admin.create_topics([NewTopic(name, partitions, 3)], operation_timeout=30)[name].result(timeout=60)
    wait_for_topic_on_every_broker(cluster.bootstrap, name, partitions)
    return name


def _ssl(cluster: LocalKafka, client: str | None = None, ca: Path | None = None) -> dict[str, Any]:
    """librdkafka over SSL, verifying the broker's chain and its name (https endpoint identification)."""
    certs = _certs(cluster)
    conf: dict[str, Any] = {
        "bootstrap.servers": cluster.ssl_bootstrap,
        "security.protocol": "SSL",
        "ssl.ca.location": str(ca or certs.ca),
        "ssl.endpoint.identification.algorithm": "https",
    }
    if client is not None:
        issued = getattr(certs, client) if client.endswith("_client") else certs.client(client)
        conf["ssl.certificate.location"] = str(issued.cert)
        conf["ssl.key.location"] = str(issued.key)
    return conf


def _sasl_ssl(cluster: LocalKafka, mechanism: str, user: str, password: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": cluster.sasl_ssl_bootstrap,
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(_certs(cluster).ca),
        "ssl.endpoint.identification.algorithm": "https",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": password,
    }



def _first_leaf_der(path: Path) -> bytes:
    return x509.load_pem_x509_certificates(path.read_bytes())[0].public_bytes(Encoding.DER)


def _api_versions_over_tls(port: int, context: ssl.SSLContext) -> int:
    """Handshake, send ApiVersions v0, return the response's size. TLS 1.3 lets the client finish its
    handshake before the server has checked the client's certificate: a refusal arrives on the first read."""
    body = struct.pack(">hhih", 18, 0, 7, len(b"tls-probe")) + b"tls-probe"
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(struct.pack(">i", len(body)) + body)
        header = tls.recv(4)
        if len(header) < 4:
            raise ConnectionError(f"the broker closed the connection after {len(header)} bytes")
        return int(struct.unpack(">i", header)[0])


def _client_context(
    certs: TestCertificates, cert: Path | None = None, key: Path | None = None
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def _errors_until(conf: dict[str, Any], wanted: str) -> list[str]:
    """Run a producer until its error callback reports ``wanted`` (bounded); return every error seen."""
    errors: list[str] = []
    producer = Producer({**conf, "error_cb": lambda e: errors.append(e.str()), "log_level": 0})
    wait_until(lambda: producer.poll(0.2) >= 0 and any(wanted in e for e in errors), REFUSAL_WAIT_S,
               f"an error saying {wanted!r} (saw {errors[:3]})")
    return errors


# --------------------------------------------------------------------------------------------- listeners


def test_tls_listeners_are_advertised_and_serve_the_generated_certificate(tls_cluster: LocalKafka) -> None:
    certs = _certs(tls_cluster)
    assert tls_cluster.workdir is not None
    assert certs.directory == tls_cluster.workdir / "certificates"
    assert tls_cluster.ssl_bootstrap and tls_cluster.sasl_ssl_bootstrap
    ssl_ports = [tls_cluster.broker_address(n, listener="SSL") for n in tls_cluster.node_ids]
    sasl_ssl_ports = [tls_cluster.broker_address(n, listener="SASL_SSL") for n in tls_cluster.node_ids]
    assert tls_cluster.ssl_bootstrap == ",".join(f"{h}:{p}" for h, p in ssl_ports)
    assert tls_cluster.sasl_ssl_bootstrap == ",".join(f"{h}:{p}" for h, p in sasl_ssl_ports)
    assert tls_cluster.broker_address(1) == tls_cluster.broker_address(1, listener="PLAINTEXT")
    assert tls_cluster.broker_address(1) not in ssl_ports + sasl_ssl_ports
    assert tls_cluster.broker_address(1, listener="SASL_PLAINTEXT") not in ssl_ports + sasl_ssl_ports
    with pytest.raises(ValueError, match="unknown listener"):
        tls_cluster.broker_address(1, listener="TLS")

    served = set()
    for _, port in ssl_ports + sasl_ssl_ports:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            _client_context(certs).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            der = tls.getpeercert(binary_form=True)
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
        served.add(der)
    assert served == {_first_leaf_der(certs.server_cert)}

    # Metadata over SSL names every broker at its SSL address: clients stay on the listener they used.
    metadata = AdminClient(_ssl(tls_cluster)).list_topics(timeout=30)
    assert sorted((b.id, str(b.host), b.port) for b in metadata.brokers.values()) == [
        (n, h, p) for n, (h, p) in zip(tls_cluster.node_ids, ssl_ports, strict=True)
    ]


# --------------------------------------------------------------------------------------------- clients


@pytest.mark.parametrize(
    "how", ["ssl-ca-only", "ssl-client-certificate", "sasl-ssl-scram-sha-256", "sasl-ssl-scram-sha-512"]
)
def test_librdkafka_round_trip(tls_cluster: LocalKafka, how: str) -> None:
    """Every record exactly once and in order per partition, producer and consumer on the same listener."""
    conf = {
        "ssl-ca-only": lambda: _ssl(tls_cluster),
        "ssl-client-certificate": lambda: _ssl(tls_cluster, client="alice"),
        "sasl-ssl-scram-sha-256": lambda: _sasl_ssl(tls_cluster, "SCRAM-SHA-256", "bob", SASL_USERS["bob"]),
        "sasl-ssl-scram-sha-512": lambda: _sasl_ssl(tls_cluster, "SCRAM-SHA-512", "bob", SASL_USERS["bob"]),
    }[how]()
    topic = _topic(tls_cluster, how)
    produce_known_records(conf, topic, RECORDS)
    assert_exact(read_all(conf, topic, RECORDS), RECORDS)


def test_kafka_python_round_trip_over_ssl(tls_cluster: LocalKafka) -> None:
    """kafka-python checks the broker's hostname by default (ssl_check_hostname): 127.0.0.1 is in the SAN."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    certs = _certs(tls_cluster)
    config: dict[str, Any] = {
        "bootstrap_servers": tls_cluster.ssl_bootstrap,
        "security_protocol": "SSL",
        "ssl_cafile": str(certs.ca),
        "ssl_check_hostname": True,
        "ssl_certfile": str(certs.client("bob").cert),
        "ssl_keyfile": str(certs.client("bob").key),
    }
    topic = _topic(tls_cluster, "kafka-python-ssl")
    producer = KafkaProducer(acks="all", linger_ms=5, **config)
    try:
        futures = [producer.send(topic, key=k, value=v, partition=p) for p, k, v in records(RECORDS)]
        producer.flush(60)
        for future in futures:
            future.get(timeout=10)
    finally:
        producer.close()
    consumer = KafkaConsumer(enable_auto_commit=False, **config)
    consumed: dict[int, list[str]] = {}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        consumer.seek_to_beginning()

        def take() -> bool:
            for tp, messages in consumer.poll(timeout_ms=500).items():
                consumed.setdefault(tp.partition, []).extend(m.value.decode() for m in messages)
            return sum(len(v) for v in consumed.values()) >= RECORDS

        wait_until(take, 60, f"{RECORDS} records through kafka-python over SSL", interval=0)
        consumer.poll(timeout_ms=1000)  # a duplicate would show up here
    finally:
        consumer.close()
    assert_exact(consumed, RECORDS)


def test_certificate_subjects_map_to_the_principals_quotas_name(tls_cluster: LocalKafka) -> None:
    """``RULE:^CN=([^,]+),.*$/$1/,DEFAULT``: CN=alice,OU=eng,O=kthrottle is User:alice, a bare CN=carol
    matches no RULE and stays User:CN=carol. Seen from outside through the broker's own quotas: only the
    principals holding a producer_byte_rate quota are throttled. Runs last among the produce tests and
    removes its quotas, which would otherwise slow alice down elsewhere."""
    topic = _topic(tls_cluster, "principals", partitions=1)
    quota = [("producer_byte_rate", 1024.0, False)]
    entries: list[tuple[dict[str, str | None], list[tuple[str, float, bool]]]] = [
        ({"user": "alice"}, quota), ({"user": "CN=carol"}, quota)
    ]
    assert alter(tls_cluster.bootstrap, entries) == [(0, None), (0, None)]

    def throttled(client: str | None) -> bool:
        """Produce 50 kB once with this certificate (None: none) and say whether the broker throttled it."""
        throttles: list[float] = []
        conf = {**_ssl(tls_cluster, client), "throttle_cb": lambda ev: throttles.append(ev.throttle_time)}
        producer = Producer(conf)
        producer.produce(topic, value=b"x" * 50_000, partition=0)
        assert producer.flush(30) == 0
        producer.poll(0.5)
        return bool(throttles)

    try:
        # The quotas reach each broker through the metadata log: wait (bounded) until alice's leader has them.
        wait_until(lambda: throttled("alice"), 30, "alice's certificate to be throttled as User:alice")
        assert throttled("carol"), "CN=carol should be User:CN=carol under the DEFAULT rule"
        assert not throttled("bob"), "User:bob has no quota"
        assert not throttled(None), "a client without a certificate is User:ANONYMOUS, which has no quota"
    finally:
        removal = [(entity, [("producer_byte_rate", 0.0, True)]) for entity, _ in entries]
        alter(tls_cluster.bootstrap, removal)


# --------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("which", ["untrusted_client", "expired_client"])
def test_broker_refuses_a_bad_client_certificate_it_is_shown(tls_cluster: LocalKafka, which: str) -> None:
    """With ssl.client.auth=requested Java still verifies a certificate that *is* presented, and refuses a
    bad one with alert 46 (certificate_unknown). OpenSSL-based Python ssl always presents it."""
    certs = _certs(tls_cluster)
    _, port = tls_cluster.broker_address(1, listener="SSL")
    good = certs.client("alice")
    assert _api_versions_over_tls(port, _client_context(certs, good.cert, good.key)) > 0
    assert _api_versions_over_tls(port, _client_context(certs)) > 0  # no certificate: ANONYMOUS, accepted
    bad = getattr(certs, which)
    with pytest.raises(ssl.SSLError) as refused:
        _api_versions_over_tls(port, _client_context(certs, bad.cert, bad.key))
    assert refused.value.reason == ALERT_CERTIFICATE_UNKNOWN
    log = tls_cluster.log_path(1)
    wait_until(lambda: "SSL handshake failed" in log.read_text(errors="replace"), 10,
               "the broker to log the failed SSL handshake")


def test_librdkafka_refused_with_an_expired_client_certificate(tls_cluster: LocalKafka) -> None:
    errors = _errors_until(_ssl(tls_cluster, "expired_client"), "alert certificate unknown")
    assert all("alert certificate unknown" in e or "brokers are down" in e for e in errors), errors


def test_librdkafka_withholds_a_client_certificate_the_broker_does_not_trust(tls_cluster: LocalKafka) -> None:
    """librdkafka sends its certificate only if its issuer is among the CAs the server names in its
    CertificateRequest; otherwise it connects without one (User:ANONYMOUS on a 'requested' listener).
    So a proxy test of "an untrusted client certificate is refused" needs a client that presents it
    regardless (Python ssl, Java), or a listener with client auth required."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("test_harness_tls.librdkafka")
    logger.addHandler(Collect())
    producer = Producer({**_ssl(tls_cluster, "untrusted_client"), "logger": logger})
    metadata = producer.list_topics(timeout=30)
    assert sorted(metadata.brokers) == tls_cluster.node_ids
    wait_until(lambda: producer.poll(0.1) >= 0 and any("not sending any client certificates" in m
                                                     for m in messages), 10, "librdkafka's warning")


def test_a_client_trusting_only_another_ca_cannot_connect(tls_cluster: LocalKafka) -> None:
    certs = _certs(tls_cluster)
    errors = _errors_until(_ssl(tls_cluster, ca=certs.untrusted_ca), "certificate verify failed")
    assert not any("alert" in e for e in errors), "the client, not the broker, should refuse"
    _, port = tls_cluster.broker_address(2, listener="SASL_SSL")
    context = ssl.create_default_context(cafile=str(certs.untrusted_ca))
    with pytest.raises(ssl.SSLCertVerificationError):
        _api_versions_over_tls(port, context)


def test_sasl_ssl_refuses_a_wrong_password(tls_cluster: LocalKafka) -> None:
    """SASL inside TLS is really enforced: the same user with a wrong password fails authentication."""
    conf = _sasl_ssl(tls_cluster, "SCRAM-SHA-256", "alice", "not-" + SASL_USERS["alice"])
    _errors_until(conf, "Authentication failed")
