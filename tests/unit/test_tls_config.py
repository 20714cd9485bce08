"""The `[tls]` and `[upstream_tls]` tables, the contexts built from them, their rotation, and the
client handshake as the proxy drives it.

Certificates come from the harness (generated per run, never committed). The handshakes are real
ones over loopback sockets this test opens itself, on uvloop as the proxy runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import pytest
import uvloop
from cryptography import x509

from config.settings import SettingsError, load_settings
from config.tls import (
    DEFAULT_HANDSHAKE_TIMEOUT_MS,
    ListenerTls,
    UpstreamTls,
    parse_tls_table,
    parse_upstream_tls_table,
)
from harness.certificates import TestCertificates, issue_server_certificate
from proxy.tls import (
    RotatingContext,
    TlsContexts,
    describe_handshake_error,
    describe_upstream_error,
    server_context,
    start_server_tls,
    upstream_context,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestCertificates:
    return TestCertificates.generate(tmp_path_factory.mktemp("certs"))


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kthrottle.toml"
    path.write_text(text)
    return path


def listener_table(certs: TestCertificates, **extra: object) -> dict[str, object]:
    return {"certificate": str(certs.server.cert), "key": str(certs.server.key), **extra}


# -- the tables ------------------------------------------------------------------------------------


def test_no_tables_means_plaintext_on_both_sides(tmp_path: Path) -> None:
    settings = load_settings(write_config(tmp_path, "[proxy]\nupstream = 'b:9092'\n"))
    assert settings.tls is None and settings.upstream_tls is None


def test_tables_read_with_defaults_and_paths_relative_to_the_config_file(
        tmp_path: Path, certs: TestCertificates) -> None:
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(certs.directory / name, tmp_path / name)
    settings = load_settings(write_config(tmp_path, """
[proxy]
upstream = "b:9093"

[tls]
certificate = "server.pem"
key = "server.key"

[upstream_tls]
ca = "ca.pem"
"""))
    assert settings.tls is not None
    assert (settings.tls.certificate, settings.tls.key, settings.tls.ca) == (
        tmp_path / "server.pem", tmp_path / "server.key", None)
    assert (settings.tls.client_auth, settings.tls.min_version, settings.tls.principal_mapping_rules,
            settings.tls.handshake_timeout_ms) == ("none", "TLSv1.2", "DEFAULT", DEFAULT_HANDSHAKE_TIMEOUT_MS)
    assert settings.upstream_tls == UpstreamTls(ca=tmp_path / "ca.pem")
    assert settings.upstream_tls.check_hostname is True


def test_every_listener_setting(certs: TestCertificates) -> None:
    tls = parse_tls_table(listener_table(
        certs, ca=str(certs.ca), client_auth="required", min_version="TLSv1.3", handshake_timeout_ms=2500,
        principal_mapping_rules="RULE:^CN=([^,]+),.*$/$1/L,DEFAULT"))
    assert (tls.ca, tls.client_auth, tls.min_version, tls.handshake_timeout_ms) == (
        certs.ca, "required", "TLSv1.3", 2500)
    assert tls.principal_mapping_rules == "RULE:^CN=([^,]+),.*$/$1/L,DEFAULT"
    assert tls.files == (certs.server.cert, certs.server.key, certs.ca)


def test_rules_may_be_a_list(certs: TestCertificates) -> None:
    rules = ["RULE:^CN=([^,]+),.*$/$1/", "DEFAULT"]
    tls = parse_tls_table(listener_table(certs, principal_mapping_rules=rules))
    assert tls.principal_mapping_rules == "RULE:^CN=([^,]+),.*$/$1/,DEFAULT"


def test_upstream_table_may_be_empty_and_takes_a_client_certificate(certs: TestCertificates) -> None:
    assert parse_upstream_tls_table({}) == UpstreamTls()
    alice = certs.client("alice")
    upstream = parse_upstream_tls_table({"certificate": str(alice.cert), "key": str(alice.key),
                                         "check_hostname": False, "min_version": "TLSv1.3"})
    assert (upstream.certificate, upstream.key, upstream.check_hostname, upstream.min_version) == (
        alice.cert, alice.key, False, "TLSv1.3")
    assert upstream.files == (alice.cert, alice.key)


@pytest.mark.parametrize(("extra", "message"), [
    ({"client_auth": "want"}, "tls.client_auth = 'want' must be"),
    ({"client_auth": "required"}, 'tls.client_auth = "required" needs tls.ca'),
    ({"client_auth": "requested"}, 'tls.client_auth = "requested" needs tls.ca'),
    ({"ca": "CA"}, 'tls.ca is set but tls.client_auth = "none"'),
    ({"min_version": "TLSv1.1"}, "tls.min_version = 'TLSv1.1' must be"),
    ({"handshake_timeout_ms": 0}, "tls.handshake_timeout_ms = 0 must be"),
    ({"handshake_timeout_ms": True}, "tls.handshake_timeout_ms = True must be"),
    ({"handshake_timeout_ms": 300_001}, "tls.handshake_timeout_ms = 300001 must be"),
    ({"principal_mapping_rules": "RULE:^CN=(.*)$"},
     "tls.principal_mapping_rules = 'RULE:^CN=(.*)$' is not valid"),
    ({"principal_mapping_rules": 7}, "tls.principal_mapping_rules = 7 must be"),
    ({"cipher_suites": "x"}, "unknown setting tls.cipher_suites"),
])
def test_bad_listener_values_name_the_setting(certs: TestCertificates, extra: dict[str, object],
                                              message: str) -> None:
    if extra.get("ca") == "CA":
        extra = {**extra, "ca": str(certs.ca)}
    with pytest.raises(SettingsError) as raised:
        parse_tls_table(listener_table(certs, **extra))
    assert message in str(raised.value)


def test_missing_files_name_the_setting_and_the_path(certs: TestCertificates, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pem"
    with pytest.raises(SettingsError, match=r"tls.certificate = '.*nowhere.pem' cannot be read: No such"):
        parse_tls_table({"certificate": str(missing), "key": str(certs.server.key)})
    with pytest.raises(SettingsError, match=r"tls.key = '.*nowhere.pem' cannot be read"):
        parse_tls_table({"certificate": str(certs.server.cert), "key": str(missing)})
    with pytest.raises(SettingsError, match=r"tls.ca = '.*nowhere.pem' cannot be read"):
        parse_tls_table(listener_table(certs, ca=str(missing), client_auth="required"))
    with pytest.raises(SettingsError, match=r"upstream_tls.ca = '.*nowhere.pem' cannot be read"):
        parse_upstream_tls_table({"ca": str(missing)})
    with pytest.raises(SettingsError, match=r"tls\.key is required"):
        parse_tls_table({"certificate": str(certs.server.cert)})


def test_a_key_that_is_not_the_certificates_is_refused(certs: TestCertificates) -> None:
    with pytest.raises(SettingsError) as raised:
        parse_tls_table({"certificate": str(certs.server.cert), "key": str(certs.client("alice").key)})
    text = str(raised.value)
    assert "tls.key" in text and "does not match tls.certificate" in text and str(certs.server.cert) in text


def test_files_that_are_not_pem_are_refused(certs: TestCertificates, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(SettingsError, match=r"tls.certificate = '.*garbage.pem' holds no PEM certificate"):
        parse_tls_table({"certificate": str(garbage), "key": str(certs.server.key)})
    with pytest.raises(SettingsError, match=r"tls.key = '.*garbage.pem' holds no usable PEM private key"):
        parse_tls_table({"certificate": str(certs.server.cert), "key": str(garbage)})
    with pytest.raises(SettingsError, match=r"upstream_tls.ca = '.*garbage.pem' holds no PEM certificate"):
        parse_upstream_tls_table({"ca": str(garbage)})


def test_an_encrypted_key_is_refused_with_the_reason(certs: TestCertificates, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(certs.server.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(SettingsError, match=r"tls.key = '.*encrypted.key' is encrypted"):
        parse_tls_table({"certificate": str(certs.server.cert), "key": str(encrypted)})


@pytest.mark.parametrize(("table", "message"), [
    ({"check_hostname": "yes"}, "upstream_tls.check_hostname = 'yes' must be true or false"),
    ({"certificate": "CERT"}, "upstream_tls.certificate is set without upstream_tls.key"),
    ({"key": "KEY"}, "upstream_tls.key is set without upstream_tls.certificate"),
    ({"min_version": "SSLv3"}, "upstream_tls.min_version = 'SSLv3' must be"),
    ({"verify": False}, "unknown setting upstream_tls.verify"),
])
def test_bad_upstream_values_name_the_setting(certs: TestCertificates, table: dict[str, object],
                                              message: str) -> None:
    table = {k: (str(certs.client("alice").cert) if v == "CERT" else str(certs.client("alice").key)
                 if v == "KEY" else v) for k, v in table.items()}
    with pytest.raises(SettingsError) as raised:
        parse_upstream_tls_table(table)
    assert message in str(raised.value)


def test_a_bad_table_stops_load_settings(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"tls\.certificate is required"):
        load_settings(write_config(tmp_path, "[tls]\nkey = 'k.pem'\n"))
    with pytest.raises(SettingsError, match="must be a table"):
        load_settings(write_config(tmp_path, "tls = 3\n"))


# -- the contexts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("client_auth", "mode"), [
    ("none", ssl.CERT_NONE), ("requested", ssl.CERT_OPTIONAL), ("required", ssl.CERT_REQUIRED)])
def test_server_context_asks_for_client_certificates_as_kafka_does(
        certs: TestCertificates, client_auth: str, mode: ssl.VerifyMode) -> None:
    extra = {} if client_auth == "none" else {"ca": str(certs.ca)}
    context = server_context(parse_tls_table(listener_table(certs, client_auth=client_auth, **extra)))
    assert context.verify_mode == mode
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_RENEGOTIATION


def test_upstream_context_verifies_and_checks_hostnames_by_default(certs: TestCertificates) -> None:
    context = upstream_context(parse_upstream_tls_table({"ca": str(certs.ca), "min_version": "TLSv1.3"}))
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_3
    loose = upstream_context(parse_upstream_tls_table({"ca": str(certs.ca), "check_hostname": False}))
    assert loose.verify_mode == ssl.CERT_REQUIRED and not loose.check_hostname


# -- handshakes over loopback ----------------------------------------------------------------------


class Handshakes:
    """A listener that upgrades each connection with `start_server_tls`, echoes, and records outcomes."""

    def __init__(self, context: Callable[[], ssl.SSLContext], timeout_s: float = 5.0) -> None:
        self.context = context
        self.timeout_s = timeout_s
        self.outcomes: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def __aenter__(self) -> Handshakes:
        handshakes = self

        class Echo(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                start_server_tls(transport, self, handshakes.context(), handshakes.timeout_s, self.done)

            def done(self, transport: asyncio.BaseTransport | None, exc: BaseException | None) -> None:
                # uvloop's transports are not asyncio.WriteTransport subclasses, only alike
                self.transport = cast("asyncio.WriteTransport | None", transport)
                if transport is None:
                    assert exc is not None
                    handshakes.outcomes.put_nowait(("failed", exc))
                    return
                ssl_object = transport.get_extra_info("ssl_object")
                handshakes.outcomes.put_nowait(("ok", ssl_object.getpeercert(binary_form=True)))

            def data_received(self, data: bytes) -> None:
                assert self.transport is not None
                self.transport.write(data)

        self.server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def connect(self, context: ssl.SSLContext, hostname: str = "localhost"
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, ssl=context, server_hostname=hostname)


def run(coroutine: Callable[[], Coroutine[Any, Any, None]]) -> None:
    uvloop.run(coroutine())


def client_context(certs: TestCertificates, name: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs.ca)
    if name is not None:
        issued = certs.client(name) if name in dict(certs.clients) else getattr(certs, name)
        context.load_cert_chain(issued.cert, issued.key)
    return context


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    got = await reader.readexactly(len(data))
    return got


def test_handshakes_that_arrive_at_once_all_complete(certs: TestCertificates) -> None:
    """The ClientHello often arrives before the upgrade could start in a task: none may be lost."""
    context = server_context(parse_tls_table(listener_table(certs)))

    async def main() -> None:
        async with Handshakes(lambda: context) as server:
            connections = await asyncio.gather(*(server.connect(client_context(certs)) for _ in range(30)))
            for reader, writer in connections:
                assert await echo(reader, writer, b"x" * 70_000) == b"x" * 70_000
                writer.close()
            outcomes = [await server.outcomes.get() for _ in connections]
            assert outcomes == [("ok", None)] * 30
    run(main)


def test_a_verified_client_certificate_is_seen_after_the_handshake(certs: TestCertificates) -> None:
    context = server_context(parse_tls_table(listener_table(certs, ca=str(certs.ca),
                                                            client_auth="requested")))

    async def main() -> None:
        async with Handshakes(lambda: context) as server:
            reader, writer = await server.connect(client_context(certs, "alice"))
            assert await echo(reader, writer, b"hello") == b"hello"
            kind, der = await server.outcomes.get()
            assert kind == "ok"
            subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
            assert subject == certs.client("alice").subject
            writer.close()
            reader, writer = await server.connect(client_context(certs))  # requested: none is fine
            assert await echo(reader, writer, b"hi") == b"hi"
            assert await server.outcomes.get() == ("ok", None)
            writer.close()
    run(main)


@pytest.mark.parametrize(("client", "verify_message"), [
    # the harness's files carry the chain up to their CA, which the proxy does not trust
    ("untrusted_client", "self-signed certificate in certificate chain"),
    ("expired_client", "certificate has expired"),
])
def test_untrusted_and_expired_client_certificates_are_refused(
        certs: TestCertificates, client: str, verify_message: str) -> None:
    context = server_context(parse_tls_table(listener_table(certs, ca=str(certs.ca),
                                                            client_auth="requested")))

    async def main() -> None:
        async with Handshakes(lambda: context) as server:
            reader, writer = await server.connect(client_context(certs, client))
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError, ssl.SSLError)):
                await echo(reader, writer, b"hello")  # TLS 1.3: the refusal comes after the client's Finished
            kind, exc = await server.outcomes.get()
            assert kind == "failed"
            label, text = describe_handshake_error(exc, 5000)
            assert label == "tls_bad_certificate"
            assert verify_message in text
            writer.close()
    run(main)


def test_a_required_certificate_must_be_presented(certs: TestCertificates) -> None:
    context = server_context(parse_tls_table(listener_table(certs, ca=str(certs.ca), client_auth="required")))

    async def main() -> None:
        async with Handshakes(lambda: context) as server:
            reader, writer = await server.connect(client_context(certs))
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError, ssl.SSLError)):
                await echo(reader, writer, b"hello")
            kind, exc = await server.outcomes.get()
            assert kind == "failed"
            assert describe_handshake_error(exc, 5000) == (
                "tls_no_certificate",
                'TLS handshake refused: the client sent no certificate and tls.client_auth = "required"')
            writer.close()
    run(main)


def test_a_client_below_min_version_is_named(certs: TestCertificates) -> None:
    context = server_context(parse_tls_table(listener_table(certs, min_version="TLSv1.3")))
    old_client = client_context(certs)
    old_client.maximum_version = ssl.TLSVersion.TLSv1_2

    async def main() -> None:
        async with Handshakes(lambda: context) as server:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await server.connect(old_client)
            kind, exc = await server.outcomes.get()
            assert kind == "failed"
            label, text = describe_handshake_error(exc, 5000)
            assert label == "tls_handshake_failed" and "no TLS version the listener accepts" in text
    run(main)


def test_a_plaintext_kafka_client_on_a_tls_listener_is_named(certs: TestCertificates) -> None:
    context = server_context(parse_tls_table(listener_table(certs)))
    api_versions = bytes.fromhex("00000015" "0012" "0003" "00000001" "0007" "6b61666b612d6a" "00")

    async def main() -> None:
        async with Handshakes(lambda: context) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(api_versions)
            answer = await reader.read(1000)  # a TLS alert at most, then the close
            assert not answer.startswith(b"\x00\x00")
            assert await reader.read(1000) == b""
            kind, exc = await server.outcomes.get()
            assert kind == "failed"
            label, text = describe_handshake_error(exc, 5000)
            assert label == "tls_plaintext_client"
            assert "security.protocol=SSL" in text
            writer.close()
    run(main)


def test_a_silent_connection_is_closed_by_the_handshake_timeout(certs: TestCertificates) -> None:
    context = server_context(parse_tls_table(listener_table(certs)))

    async def main() -> None:
        async with Handshakes(lambda: context, timeout_s=0.2) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            assert await reader.read(100) == b""  # closed by the proxy's side, never answered
            kind, exc = await server.outcomes.get()
            assert kind == "failed"
            assert describe_handshake_error(exc, 200) == (
                "tls_handshake_timeout",
                "TLS handshake not finished within 200 ms (tls.handshake_timeout_ms)")
            writer.close()
    run(main)


def test_a_broker_certificate_for_another_host_is_named(certs: TestCertificates) -> None:
    wrong = parse_tls_table({"certificate": str(certs.wrong_host_server.cert),
                             "key": str(certs.wrong_host_server.key)})
    strict = upstream_context(parse_upstream_tls_table({"ca": str(certs.ca)}))
    loose = upstream_context(parse_upstream_tls_table({"ca": str(certs.ca), "check_hostname": False}))
    untrusting = upstream_context(parse_upstream_tls_table({"ca": str(certs.untrusted_ca)}))

    async def main() -> None:
        async with Handshakes(lambda: server_context(wrong)) as server:
            with pytest.raises(ssl.SSLCertVerificationError) as raised:
                await server.connect(strict, hostname="127.0.0.1")
            text = describe_upstream_error(raised.value)
            assert text is not None and "does not verify" in text and "127.0.0.1" in text
            assert (await server.outcomes.get())[0] == "failed"
            reader, writer = await server.connect(loose, hostname="127.0.0.1")  # chain still verified
            assert await echo(reader, writer, b"ok") == b"ok"
            writer.close()
            assert await server.outcomes.get() == ("ok", None)
            with pytest.raises(ssl.SSLCertVerificationError) as raised:
                await server.connect(untrusting, hostname="wrong.example")
            text = describe_upstream_error(raised.value)
            assert text is not None and "self-signed certificate in certificate chain" in text
    run(main)


def test_a_plaintext_broker_is_named_when_the_proxy_speaks_tls(certs: TestCertificates) -> None:
    strict = upstream_context(parse_upstream_tls_table({"ca": str(certs.ca)}))

    async def main() -> None:
        async def kafka_like(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(4)  # a size far above socket.request.max.bytes: the broker closes
            writer.close()

        server = await asyncio.start_server(kafka_like, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(OSError) as raised:
            await asyncio.open_connection("127.0.0.1", port, ssl=strict, server_hostname="127.0.0.1")
        text = describe_upstream_error(raised.value)
        assert text is not None and "plaintext listener" in text
        server.close()
    run(main)


# -- rotation --------------------------------------------------------------------------------------


def serial_of(writer: asyncio.StreamWriter) -> int:
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def test_rotation_serves_new_connections_the_new_certificate(certs: TestCertificates, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    cert, key = tmp_path / "proxy.pem", tmp_path / "proxy.key"
    shutil.copy(certs.server.cert, cert)
    shutil.copy(certs.server.key, key)
    contexts = TlsContexts(parse_tls_table({"certificate": str(cert), "key": str(key)}), None)
    rotating = contexts.server
    assert rotating is not None
    new = issue_server_certificate(certs.directory, "rotated", ["localhost", "127.0.0.1"])
    caplog.set_level(logging.INFO, "kthrottle.tls")

    async def main() -> None:
        async with Handshakes(lambda: rotating.current) as server:
            old_reader, old_writer = await server.connect(client_context(certs))
            assert serial_of(old_writer) == certs.server.serial
            contexts.poll()
            assert rotating.reloads == 0  # nothing changed
            shutil.copy(new.cert, cert)
            shutil.copy(new.key, key)
            contexts.poll()
            assert rotating.reloads == 0  # changed just now: wait one check for the pair to settle
            contexts.poll()
            assert rotating.reloads == 1
            _, writer = await server.connect(client_context(certs))
            assert serial_of(writer) == new.serial
            assert await echo(old_reader, old_writer, b"still here") == b"still here"
            assert serial_of(old_writer) == certs.server.serial
            writer.close()
            old_writer.close()
    run(main)
    assert f"serial {new.serial:x}" in caplog.text


def test_bad_new_files_keep_the_old_certificate(certs: TestCertificates, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    cert, key = tmp_path / "proxy.pem", tmp_path / "proxy.key"
    shutil.copy(certs.server.cert, cert)
    shutil.copy(certs.server.key, key)
    rotating = TlsContexts(parse_tls_table({"certificate": str(cert), "key": str(key)}), None).server
    assert rotating is not None
    before = rotating.current
    new = issue_server_certificate(certs.directory, "half-written", ["localhost"])
    shutil.copy(new.cert, cert)  # the certificate is new, the key still the old one
    caplog.set_level(logging.INFO, "kthrottle.tls")
    assert rotating.poll(force=True) is False  # SIGHUP: at once, no settling
    assert rotating.current is before and rotating.failures == 1
    assert "does not match tls.certificate" in caplog.text and str(key) in caplog.text
    assert caplog.text.count("not reloaded") == 1
    rotating.poll()
    rotating.poll()
    assert rotating.failures == 1  # reported once; nothing changed since
    shutil.copy(new.key, key)
    rotating.poll()
    assert rotating.poll() is True
    assert rotating.current is not before and rotating.reloads == 1


def test_a_deleted_file_is_a_failed_reload_not_a_crash(certs: TestCertificates, tmp_path: Path) -> None:
    cert, key = tmp_path / "proxy.pem", tmp_path / "proxy.key"
    shutil.copy(certs.server.cert, cert)
    shutil.copy(certs.server.key, key)
    rotating = RotatingContext("listener", (cert, key), lambda: server_context(
        ListenerTls(certificate=cert, key=key)), lambda: "it")
    before = rotating.current
    os.unlink(key)
    rotating.poll()
    rotating.poll()
    assert rotating.current is before and rotating.failures == 1


def test_upstream_context_rotates_its_ca(certs: TestCertificates, tmp_path: Path) -> None:
    ca = tmp_path / "brokers-ca.pem"
    shutil.copy(certs.untrusted_ca, ca)
    contexts = TlsContexts(None, parse_upstream_tls_table({"ca": str(ca)}))
    upstream = contexts.upstream
    assert upstream is not None and contexts.server is None
    listener = server_context(parse_tls_table(listener_table(certs)))

    async def main() -> None:
        async with Handshakes(lambda: listener) as server:
            with pytest.raises(ssl.SSLCertVerificationError):
                await server.connect(upstream.current, hostname="127.0.0.1")
            shutil.copy(certs.ca, ca)
            contexts.poll(force=True)
            reader, writer = await server.connect(upstream.current, hostname="127.0.0.1")
            assert await echo(reader, writer, b"ok") == b"ok"
            writer.close()
    run(main)
