"""TLS through the real `kthrottle run`, in front of a real cluster with SSL and SASL_SSL listeners.

The session's 3-node cluster has PLAINTEXT, SSL and SASL_SSL listeners (from certificates the harness
generates at start), so both mixes are tested: TLS towards the clients in front of the
plaintext listener, and TLS on both sides in front of the SSL and SASL_SSL listeners. Clients verify the
proxy's certificate and its name (127.0.0.1), as they would a broker's.

The bad inputs each have their own small proxy, so every log line and refusal counter checked is that
case's own; a good client afterwards shows the proxy kept serving.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from harness.certificates import IssuedCertificate, TestCertificates, issue_server_certificate
from harness.local_kafka import SASL_USERS, LocalKafka

from .clients import (
    PARTITIONS,
    aiokafka_round_trip,
    api_versions_v0,
    assert_exact,
    assert_proxy_addresses,
    kafka_python_round_trip,
    produce_known_records,
    read_all,
    topic_name,
    wait_until,
)
from .conftest import _TOOLS_LOG4J2, JAVA_PRODUCER_PERF, KafkaJava
from .proxies import REPO, RunningProxy, free_port_block

COUNT = 120
#: How long a refusal may take to show in the log (a bound that keeps a broken test from hanging).
LOG_WAIT_S = 15.0


@pytest.fixture(scope="module")
def tls_cluster(kafka_cluster: LocalKafka) -> LocalKafka:
    """The session's cluster, which has SSL and SASL_SSL listeners (asserted, so losing them fails here)."""
    assert kafka_cluster.ssl_bootstrap and kafka_cluster.sasl_ssl_bootstrap, "the session cluster lacks TLS"
    return kafka_cluster


@pytest.fixture(scope="module")
def certs(tls_cluster: LocalKafka) -> TestCertificates:
    assert tls_cluster.certificates is not None
    return tls_cluster.certificates


class TlsProxy(RunningProxy):
    """`kthrottle run --config FILE --metrics-port N`, the file holding `tables` (TOML) after [proxy]."""

    def __init__(self, upstream: str, workdir: Path, tables: str, proxy_settings: str = "") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "kthrottle.toml"
        self.config_path.write_text(f"[proxy]\n{proxy_settings}\n\n{tables}\n")
        self.metrics_port = free_port_block(1)
        super().__init__(upstream, extra_args=["--config", str(self.config_path),
                                               "--metrics-port", str(self.metrics_port)])

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read()
        return [(sample.labels, sample.value) for family in text_string_to_metric_families(text.decode())
                for sample in family.samples if sample.name == name]

    def closed(self, reason: str) -> float:
        return sum(value for labels, value in self.samples("kthrottle_connections_closed_total")
                   if labels.get("reason") == reason)


def listener_table(cert: Path, key: Path, **extra: str | int) -> str:
    lines = [f'certificate = "{cert}"', f'key = "{key}"']
    lines += [f"{name} = {value!r}" if isinstance(value, int) else f'{name} = "{value}"'
              for name, value in extra.items()]
    return "[tls]\n" + "\n".join(lines) + "\n"


def tls_towards_clients(certs: TestCertificates) -> str:
    return listener_table(certs.server.cert, certs.server.key)


def tls_both_sides(certs: TestCertificates, broker_ca: Path | None = None) -> str:
    return tls_towards_clients(certs) + f'\n[upstream_tls]\nca = "{broker_ca or certs.ca}"\n'


def server_files(certs: TestCertificates, directory: Path) -> tuple[Path, Path]:
    """A copy of the server certificate and key the proxy may have rotated under it."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "proxy.pem", directory / "proxy.key"
    shutil.copy(certs.server.cert, cert)
    shutil.copy(certs.server.key, key)
    return cert, key


def ssl_conf(proxy: RunningProxy, certs: TestCertificates, client: IssuedCertificate | None = None
             ) -> dict[str, Any]:
    """librdkafka over SSL to the proxy, verifying its chain and its name as it would a broker's."""
    conf: dict[str, Any] = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                            "ssl.ca.location": str(certs.ca),
                            "ssl.endpoint.identification.algorithm": "https"}
    if client is not None:
        conf["ssl.certificate.location"] = str(client.cert)
        conf["ssl.key.location"] = str(client.key)
    return conf


def create_topic(conf: dict[str, Any], prefix: str) -> str:
    name = topic_name(prefix)
    admin = AdminClient(conf)
    admin.create_topics([NewTopic(name, PARTITIONS, 3)], operation_timeout=30)[name].result(timeout=60)

    def led() -> bool:
        partitions = admin.list_topics(name, timeout=10).topics[name].partitions
        return len(partitions) == PARTITIONS and all(p.leader >= 0 for p in partitions.values())

    wait_until(led, 30, f"topic {name} with leaders")
    return name



def round_trip_librdkafka(conf: dict[str, Any], proxy: RunningProxy, cluster: LocalKafka, real: str) -> None:
    """Produce a known set through the proxy and read it back: exact set, per-partition order, and
    every broker address the client learned is the proxy's."""
    topic = create_topic(conf, "tls")
    produce_known_records(conf, topic, COUNT)
    assert_exact(read_all(conf, topic, COUNT), COUNT)
    brokers = AdminClient(conf).list_topics(timeout=10).brokers.values()
    assert_proxy_addresses([(b.id, str(b.host), b.port) for b in brokers], proxy.port, cluster.node_ids, real)




def tls_client(certs: TestCertificates, client: IssuedCertificate | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def connect_tls(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=LOG_WAIT_S)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def served_serial(sock: ssl.SSLSocket) -> int:
    der = sock.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def read_until_closed(sock: socket.socket) -> None:
    """Read until the peer closes (an alert may come first); a socket timeout fails the test."""
    try:
        while sock.recv(4096):
            pass
    except (ssl.SSLError, ConnectionError):
        pass


# -- clients that work -----------------------------------------------------------------------------


def test_librdkafka_over_tls_to_a_plaintext_cluster(tls_cluster: LocalKafka, certs: TestCertificates,
                                                    tmp_path: Path) -> None:
    """TLS towards the client, plaintext towards the brokers (the mix the README allows)."""
    with TlsProxy(tls_cluster.bootstrap, tmp_path, tls_towards_clients(certs)) as proxy:
        assert "with security.protocol=SSL" in proxy.log()
        round_trip_librdkafka(ssl_conf(proxy, certs), proxy, tls_cluster, tls_cluster.bootstrap)
        assert "Traceback" not in proxy.log()


def test_mtls_on_both_sides_maps_the_principal_and_holds_its_quota(
        tls_cluster: LocalKafka, certs: TestCertificates, tmp_path: Path) -> None:
    """librdkafka with alice's certificate, TLS to the SSL listener: the proxy names her as the broker
    does (the harness's brokers use the same rule) and charges her quota, a small one that throttles."""
    assert tls_cluster.ssl_bootstrap
    tables = (listener_table(certs.server.cert, certs.server.key, ca=str(certs.ca), client_auth="required",
                             principal_mapping_rules="RULE:^CN=([^,]+),.*$/$1/,DEFAULT")
              + f'\n[upstream_tls]\nca = "{certs.ca}"\n'
              + '\n[[quota]]\nuser = "alice"\nproducer_byte_rate = 20000\n')
    with TlsProxy(tls_cluster.ssl_bootstrap, tmp_path, tables) as proxy:
        conf = ssl_conf(proxy, certs, certs.client("alice"))
        topic = create_topic(conf, "mtls")
        big = 2000  # ~200 KB of values at 20 KB/s: throttled for sure
        producer = Producer({**conf, "acks": "all", "linger.ms": 5})
        for i in range(big):
            producer.produce(topic, value=b"%06d" % i + b"x" * 94, partition=i % PARTITIONS)
        assert producer.flush(120) == 0
        assert "authenticated by its TLS certificate as principal 'alice'" in proxy.log()
        limits = [value for labels, value in proxy.samples("kthrottle_quota_limit")
                  if labels["user"] == "alice" and labels["quota"] == "producer_byte_rate"]
        assert limits and all(limit == 20000.0 for limit in limits), limits
        throttles = sum(value for labels, value in proxy.samples("kthrottle_throttles_total")
                        if labels["user"] == "alice")
        assert throttles > 0, "alice's produce quota never throttled"
        consumed = read_all(conf, topic, big)
        assert sum(len(values) for values in consumed.values()) == big
        assert "Traceback" not in proxy.log()


def test_sasl_ssl_scram_through_tls_on_both_sides(tls_cluster: LocalKafka, certs: TestCertificates,
                                                  tmp_path: Path) -> None:
    """SASL inside TLS: the principal is the SCRAM user the broker accepted, as without TLS."""
    assert tls_cluster.sasl_ssl_bootstrap
    with TlsProxy(tls_cluster.sasl_ssl_bootstrap, tmp_path, tls_both_sides(certs)) as proxy:
        conf = {**ssl_conf(proxy, certs), "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.username": "bob", "sasl.password": SASL_USERS["bob"]}
        round_trip_librdkafka(conf, proxy, tls_cluster, tls_cluster.sasl_ssl_bootstrap)
        assert "authenticated as principal 'bob' (SCRAM-SHA-256)" in proxy.log()
        assert "TLS certificate as principal" not in proxy.log()


def test_kafka_python_over_tls_on_both_sides(tls_cluster: LocalKafka, certs: TestCertificates,
                                             tmp_path: Path) -> None:
    assert tls_cluster.ssl_bootstrap
    with TlsProxy(tls_cluster.ssl_bootstrap, tmp_path, tls_both_sides(certs)) as proxy:
        topic = create_topic(ssl_conf(proxy, certs), "tls-kafka-python")
        consumed = kafka_python_round_trip(proxy.bootstrap, topic, COUNT, proxy.port, tls_cluster.node_ids,
                                           tls_cluster.ssl_bootstrap, security_protocol="SSL",
                                           ssl_cafile=str(certs.ca))
        assert_exact(consumed, COUNT)


def test_aiokafka_with_a_client_certificate(tls_cluster: LocalKafka, certs: TestCertificates,
                                            tmp_path: Path) -> None:
    assert tls_cluster.ssl_bootstrap
    tables = listener_table(certs.server.cert, certs.server.key, ca=str(certs.ca), client_auth="required",
                            principal_mapping_rules="RULE:^CN=([^,]+),.*$/$1/,DEFAULT")
    with TlsProxy(tls_cluster.bootstrap, tmp_path, tables) as proxy:
        bob = certs.client("bob")
        topic = create_topic(ssl_conf(proxy, certs, bob), "tls-aiokafka")
        consumed = asyncio.run(aiokafka_round_trip(proxy.bootstrap, topic, COUNT, proxy.port,
                                                   tls_cluster.node_ids, tls_cluster.bootstrap,
                                                   security_protocol="SSL",
                                                   ssl_context=tls_client(certs, bob)))
        assert_exact(consumed, COUNT)
        assert "authenticated by its TLS certificate as principal 'bob'" in proxy.log()


def test_java_producer_with_a_pem_keystore(tls_cluster: LocalKafka, certs: TestCertificates,
                                           tmp_path: Path) -> None:
    """The Java client's own TLS stack (PEM keystore and truststore, KIP-651) through TLS on both sides."""
    assert tls_cluster.ssl_bootstrap
    tables = listener_table(certs.server.cert, certs.server.key, ca=str(certs.ca), client_auth="required",
                            principal_mapping_rules="RULE:^CN=([^,]+),.*$/$1/,DEFAULT")
    tables += f'\n[upstream_tls]\nca = "{certs.ca}"\n'
    log4j2 = tmp_path / "log4j2-tools.properties"
    log4j2.write_text(_TOOLS_LOG4J2)
    java = KafkaJava(log4j2, tls_cluster.bootstrap, None)
    client = tmp_path / "client-ssl.properties"
    client.write_text("security.protocol=SSL\n"
                      f"ssl.truststore.type=PEM\nssl.truststore.location={certs.ca}\n"
                      f"ssl.keystore.type=PEM\nssl.keystore.location={certs.client('alice').keystore}\n")
    count = 3000
    with TlsProxy(tls_cluster.ssl_bootstrap, tmp_path / "proxy", tables) as proxy:
        conf = ssl_conf(proxy, certs, certs.client("alice"))
        topic = create_topic(conf, "tls-java")
        perf = java.run(
            JAVA_PRODUCER_PERF, "--bootstrap-server", proxy.bootstrap, "--topic", topic,
            "--num-records", str(count), "--payload-monotonic", "--throughput", "-1",
            "--command-config", str(client), "--command-property", "acks=all",
            "partitioner.class=org.apache.kafka.clients.producer.RoundRobinPartitioner",
        )  # fmt: skip
        assert perf.returncode == 0, perf.stderr.decode(errors="replace")[-4000:]
        assert f"{count} records sent" in perf.stdout.decode()
        consumed = read_all(conf, topic, count)
        values = sorted(int(v) for vs in consumed.values() for v in vs)
        assert values == list(range(count)), f"{len(values)} records read back, expected {count} distinct"
        for partition, vs in consumed.items():
            assert [int(v) for v in vs] == sorted(int(v) for v in vs), f"partition {partition} out of order"
        log = proxy.log()
        assert log.count("authenticated by its TLS certificate as principal 'alice'") >= 2, log[-3000:]


# -- rotation --------------------------------------------------------------------------------------


def test_rotated_certificate_is_served_to_new_connections(tls_cluster: LocalKafka, certs: TestCertificates,
                                                          tmp_path: Path) -> None:
    """New files are picked up without a restart (watched, then by SIGHUP); a connection made before
    keeps working on its old certificate."""
    cert, key = server_files(certs, tmp_path / "files")
    with TlsProxy(tls_cluster.bootstrap, tmp_path, listener_table(cert, key)) as proxy:
        before = connect_tls(proxy.port, tls_client(certs))
        assert served_serial(before) == certs.server.serial
        assert api_versions_v0(before, 1) == 1

        rotated = issue_server_certificate(certs.directory, "rotated", ["127.0.0.1", "localhost"])
        shutil.copy(rotated.cert, cert)
        shutil.copy(rotated.key, key)
        proxy.wait_for_log(f"new connections get certificate {rotated.subject!r} serial {rotated.serial:x}",
                           timeout=LOG_WAIT_S)
        with connect_tls(proxy.port, tls_client(certs)) as after:
            assert served_serial(after) == rotated.serial
            assert api_versions_v0(after, 2) == 2
        assert api_versions_v0(before, 3) == 3  # the old connection still carries requests

        again = issue_server_certificate(certs.directory, "by-sighup", ["127.0.0.1", "localhost"])
        shutil.copy(again.cert, cert)
        shutil.copy(again.key, key)
        os.kill(proxy.process.pid, signal.SIGHUP)
        proxy.wait_for_log(f"serial {again.serial:x}", timeout=LOG_WAIT_S)
        with connect_tls(proxy.port, tls_client(certs)) as third:
            assert served_serial(third) == again.serial
        assert api_versions_v0(before, 4) == 4
        before.close()

        shutil.copy(certs.client("alice").key, key)  # a key that is not the certificate's
        proxy.wait_for_log("TLS files not reloaded", timeout=LOG_WAIT_S)
        assert str(key) in proxy.log()
        with connect_tls(proxy.port, tls_client(certs)) as fourth:
            assert served_serial(fourth) == again.serial  # the last good one stays
        assert proxy.alive()


# -- bad input -------------------------------------------------------------------------------------


def test_bad_clients_are_refused_with_one_line_each(tls_cluster: LocalKafka, certs: TestCertificates,
                                                    tmp_path: Path) -> None:
    """A plaintext client on the TLS port, an untrusted and an expired certificate, no certificate where
    one is required, a handshake that never finishes: each closed, logged and counted; a good client
    then still works."""
    tables = listener_table(certs.server.cert, certs.server.key, ca=str(certs.ca), client_auth="required",
                            handshake_timeout_ms=1500)
    with TlsProxy(tls_cluster.bootstrap, tmp_path, tables) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=LOG_WAIT_S) as plain:
            body = struct.pack(">hhih", 18, 0, 1, 4) + b"test"
            plain.sendall(struct.pack(">i", len(body)) + body)
            read_until_closed(plain)
        proxy.wait_for_log("not a TLS handshake on a TLS listener (WRONG_VERSION_NUMBER)", timeout=LOG_WAIT_S)

        for client, reason in ((certs.untrusted_client, "self-signed certificate in certificate chain"),
                               (certs.expired_client, "certificate has expired")):
            with (pytest.raises((ssl.SSLError, ConnectionError)),
                  connect_tls(proxy.port, tls_client(certs, client)) as tls):
                api_versions_v0(tls, 1)  # TLS 1.3: the refusal arrives on the first read
            proxy.wait_for_log(f"the client certificate does not verify against tls.ca ({reason})",
                               timeout=LOG_WAIT_S)

        with (pytest.raises((ssl.SSLError, ConnectionError)),
              connect_tls(proxy.port, tls_client(certs)) as tls):
            api_versions_v0(tls, 1)
        proxy.wait_for_log('the client sent no certificate and tls.client_auth = "required"',
                           timeout=LOG_WAIT_S)

        with socket.create_connection(("127.0.0.1", proxy.port), timeout=LOG_WAIT_S) as silent:
            assert silent.recv(100) == b""  # the proxy closed it; the socket timeout only bounds the test
        proxy.wait_for_log("TLS handshake not finished within 1500 ms (tls.handshake_timeout_ms)",
                           timeout=LOG_WAIT_S)

        with connect_tls(proxy.port, tls_client(certs, certs.client("bob"))) as good:
            assert api_versions_v0(good, 9) == 9
        log = proxy.log()
        assert "authenticated by its TLS certificate as principal 'CN=bob,OU=ops,O=kthrottle'" in log
        assert proxy.closed("tls_plaintext_client") == 1
        assert proxy.closed("tls_bad_certificate") == 2
        assert proxy.closed("tls_handshake_timeout") == 1
        assert proxy.closed("tls_no_certificate") == 1
        assert "Traceback" not in log and proxy.alive()


def test_a_certificate_no_rule_maps_is_refused(tls_cluster: LocalKafka, certs: TestCertificates,
                                               tmp_path: Path) -> None:
    """Rules without DEFAULT that match only OU=eng: bob (OU=ops) has no name, as a broker would say."""
    tables = listener_table(certs.server.cert, certs.server.key, ca=str(certs.ca), client_auth="required",
                            principal_mapping_rules="RULE:^CN=([^,]+),OU=eng,.*$/$1/U")
    with TlsProxy(tls_cluster.bootstrap, tmp_path, tables) as proxy:
        with connect_tls(proxy.port, tls_client(certs, certs.client("alice"))) as tls:
            assert api_versions_v0(tls, 1) == 1
        proxy.wait_for_log("authenticated by its TLS certificate as principal 'ALICE'", timeout=LOG_WAIT_S)
        with (connect_tls(proxy.port, tls_client(certs, certs.client("bob"))) as tls,
              pytest.raises((ssl.SSLError, ConnectionError))):
            api_versions_v0(tls, 2)
        proxy.wait_for_log("its certificate's subject matches no rule of tls.principal_mapping_rules",
                           timeout=LOG_WAIT_S)
        assert proxy.closed("tls_no_principal") == 1


def test_tls_client_on_a_plaintext_listener_is_named(tls_cluster: LocalKafka, certs: TestCertificates,
                                                     tmp_path: Path) -> None:
    with TlsProxy(tls_cluster.bootstrap, tmp_path, "") as proxy:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            connect_tls(proxy.port, tls_client(certs)).close()
        proxy.wait_for_log("TLS handshake on a plaintext listener: the bytes 16 03 01", timeout=LOG_WAIT_S)
        assert proxy.closed("tls_on_plaintext") == 1
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=LOG_WAIT_S) as plain:
            assert api_versions_v0(plain, 5) == 5


class WrongHostBroker:
    """A TLS server with a certificate for another host, standing in for a misconfigured broker."""

    def __init__(self, issued: IssuedCertificate) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(issued.cert, issued.key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    with self.context.wrap_socket(conn, server_side=True):
                        self.handshakes += 1
                except (ssl.SSLError, OSError):
                    pass

    def close(self) -> None:
        self.sock.close()


def test_broker_certificates_that_do_not_verify_are_named(tls_cluster: LocalKafka, certs: TestCertificates,
                                                          tmp_path: Path) -> None:
    """A broker certificate for another host, and brokers signed by a CA the proxy does not trust: the
    client's connection is closed and the log names the broker address and the verification error."""
    broker = WrongHostBroker(certs.wrong_host_server)
    try:
        with TlsProxy(f"127.0.0.1:{broker.port}", tmp_path / "wrong-host", tls_both_sides(certs)) as proxy:
            with connect_tls(proxy.port, tls_client(certs)) as tls, pytest.raises(ConnectionError):
                api_versions_v0(tls, 1)
            proxy.wait_for_log(f"127.0.0.1:{broker.port}: the broker's TLS certificate does not verify: "
                               "IP address mismatch, certificate is not valid for '127.0.0.1'",
                               timeout=LOG_WAIT_S)
            assert proxy.closed("upstream_tls") == 1
    finally:
        broker.close()

    assert tls_cluster.ssl_bootstrap
    first = tls_cluster.ssl_bootstrap.split(",")[0]
    with TlsProxy(first, tmp_path / "untrusted", tls_both_sides(certs, certs.untrusted_ca)) as proxy:
        with connect_tls(proxy.port, tls_client(certs)) as tls, pytest.raises(ConnectionError):
            api_versions_v0(tls, 1)
        proxy.wait_for_log(f"{first}: the broker's TLS certificate does not verify: self-signed certificate "
                           "in certificate chain", timeout=LOG_WAIT_S)
        assert proxy.alive()


def test_a_bad_tls_setting_stops_kthrottle_run_naming_it(tls_cluster: LocalKafka, certs: TestCertificates,
                                                         tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f'[tls]\ncertificate = "{certs.server.cert}"\nkey = "{certs.client("alice").key}"\n')
    done = subprocess.run([sys.executable, "-m", "cli", "run", "--upstream", tls_cluster.bootstrap,
                           "--config", str(config)], cwd=REPO, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"tls.key = '{certs.client('alice').key}' does not match tls.certificate" in done.stderr.decode()


def _kthrottle_quotas(bootstrap: str, certs: TestCertificates, client: IssuedCertificate | None,
                      *args: str) -> subprocess.CompletedProcess[str]:
    """`kthrottle quotas` over TLS to the proxy, with `client`'s certificate when given."""
    identity = [] if client is None else ["--tls-certificate", str(client.cert), "--tls-key", str(client.key)]
    return subprocess.run(
        [sys.executable, "-m", "cli", "quotas", "--bootstrap-server", bootstrap,
         "--tls-ca", str(certs.ca), *identity, *args],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO)  # fmt: skip


def test_kthrottle_quotas_over_tls_admits_only_the_admin_certificate(
        tls_cluster: LocalKafka, certs: TestCertificates, tmp_path: Path) -> None:
    """`kthrottle quotas` speaks TLS: alice, an admin by the principal her certificate maps to, sets and
    describes a quota; bob's certificate is refused the change; without a certificate the proxy, which
    requires one, lets nothing through; and the command names a half-given identity."""
    assert tls_cluster.ssl_bootstrap
    tables = (listener_table(certs.server.cert, certs.server.key, ca=str(certs.ca), client_auth="required",
                             principal_mapping_rules="RULE:^CN=([^,]+),.*$/$1/,DEFAULT")
              + f'\n[upstream_tls]\nca = "{certs.ca}"\n')
    with TlsProxy(tls_cluster.ssl_bootstrap, tmp_path, tables,
                  proxy_settings='quota_admins = ["User:alice"]') as proxy:
        alice = certs.client("alice")
        done = _kthrottle_quotas(proxy.bootstrap, certs, alice,
                                 "set", "--client-id", "tls-cli", "producer_byte_rate=4096")
        assert done.returncode == 0, done.stderr
        done = _kthrottle_quotas(proxy.bootstrap, certs, alice, "describe", "--client-id", "tls-cli")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "client-id=tls-cli: producer_byte_rate=4096", done.stdout

        refused = _kthrottle_quotas(proxy.bootstrap, certs, certs.client("bob"),
                                    "set", "--client-id", "tls-cli", "producer_byte_rate=1")
        assert refused.returncode == 1, refused.stderr
        assert "error 31" in refused.stderr and "User:bob may not alter" in refused.stderr, refused.stderr
        anonymous = _kthrottle_quotas(proxy.bootstrap, certs, None, "describe")
        assert anonymous.returncode == 1, anonymous.stdout
        half = subprocess.run(
            [sys.executable, "-m", "cli", "quotas", "--bootstrap-server", proxy.bootstrap,
             "--tls-ca", str(certs.ca), "--tls-certificate", str(alice.cert), "describe"],
            capture_output=True, text=True, timeout=60, check=False, cwd=REPO)  # fmt: skip
        assert half.returncode == 2, half.stderr
        assert "--tls-certificate and --tls-key go together" in half.stderr, half.stderr
        done = _kthrottle_quotas(proxy.bootstrap, certs, alice, "describe", "--client-id", "tls-cli")
        assert done.stdout.strip() == "client-id=tls-cli: producer_byte_rate=4096", done.stdout
        assert "Traceback" not in proxy.log()
