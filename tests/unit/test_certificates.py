"""The generated test certificates, checked with Python's own TLS stack (OpenSSL): every good certificate
verifies against the test CA (hostname included), each bad one fails for the reason it was made for.

The handshakes run over memory BIOs in one thread: no sockets, no ports, the same result every run.
"""

from __future__ import annotations

import ssl
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from harness.certificates import (
    DEFAULT_CLIENTS,
    IssuedCertificate,
    TestCertificates,
    issue_client_certificate,
    issue_server_certificate,
)

_HANDSHAKE_ROUNDS = 20  # a TLS 1.3 handshake with client certificates needs 3 flights; generous bound


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestCertificates:
    return TestCertificates.generate(tmp_path_factory.mktemp("certs"))


def _chain(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def _server_context(server: IssuedCertificate, client_ca: Path | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server.cert, server.key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _client_context(ca: Path, client: IssuedCertificate | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))  # verifies the chain and the hostname
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def _handshake(
    server_context: ssl.SSLContext, client_context: ssl.SSLContext, hostname: str
) -> tuple[ssl.SSLError | None, ssl.SSLError | None, dict[str, Any] | None]:
    """One handshake between the contexts: (server error, client error, client certificate the server saw)."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    from_server, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, from_client, server_hostname=hostname)
    server = server_context.wrap_bio(to_server, from_server, server_side=True)
    errors: dict[str, ssl.SSLError | None] = {"client": None, "server": None}
    done = {"client": False, "server": False}
    for _ in range(_HANDSHAKE_ROUNDS):
        for side, obj in (("client", client), ("server", server)):
            if done[side] or errors[side] is not None:
                continue
            try:
                obj.do_handshake()
                done[side] = True
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except ssl.SSLError as exc:
                errors[side] = exc
        to_server.write(from_client.read())
        to_client.write(from_server.read())
        if errors["server"] is not None or errors["client"] is not None or all(done.values()):
            break
    if done["server"] and server_context.verify_mode == ssl.CERT_REQUIRED:
        return None, errors["client"], server.getpeercert()
    return errors["server"], errors["client"], None


def test_files_are_pem_with_unencrypted_pkcs8_keys_readable_only_by_the_owner(
    certs: TestCertificates,
) -> None:
    issued = [certs.server, certs.untrusted_client, certs.expired_client, certs.wrong_host_server]
    issued += [certs.client(name) for name in DEFAULT_CLIENTS]
    for item in issued:
        key_pem = item.key.read_bytes()
        assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----\n"), item.key  # PKCS#8, what Kafka parses
        key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert stat.S_IMODE(item.key.stat().st_mode) == 0o600
        assert stat.S_IMODE(item.keystore.stat().st_mode) == 0o600
        # Kafka's PEM keystore: exactly one key and the chain, in one file.
        assert item.keystore.read_bytes() == key_pem + item.cert.read_bytes()
        chain = _chain(item.cert)
        assert len(chain) == 2
        assert chain[0].serial_number == item.serial
        assert chain[0].subject.rfc4514_string() == item.subject
    assert certs.ca_key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----\n")
    assert len({item.serial for item in issued}) == len(issued)


def test_chains_are_signed_by_the_ca_they_claim(certs: TestCertificates) -> None:
    (ca,) = _chain(certs.ca)
    (untrusted_ca,) = _chain(certs.untrusted_ca)
    assert ca.subject != untrusted_ca.subject
    for item in [certs.server, certs.expired_client, certs.wrong_host_server, certs.client("alice")]:
        leaf, issuer = _chain(item.cert)
        assert issuer == ca
        leaf.verify_directly_issued_by(ca)
    leaf, issuer = _chain(certs.untrusted_client.cert)
    assert issuer == untrusted_ca
    leaf.verify_directly_issued_by(untrusted_ca)
    with pytest.raises((ValueError, TypeError)):
        leaf.verify_directly_issued_by(ca)


def test_subjects_print_as_kafka_prints_a_dn(certs: TestCertificates) -> None:
    """Java's X500Principal.getName() (RFC 2253) lists the last RDN first, like RFC 4514: the mapping
    rule ^CN=([^,]+),.*$ sees exactly these strings."""
    assert certs.client("alice").subject == "CN=alice,OU=eng,O=kthrottle"
    assert certs.client("bob").subject == "CN=bob,OU=ops,O=kthrottle"
    assert certs.client("carol").subject == "CN=carol"
    with pytest.raises(KeyError, match="mallory"):
        certs.client("mallory")


def test_server_certificate_verifies_for_its_hosts_only(certs: TestCertificates) -> None:
    for host in ("127.0.0.1", "localhost"):
        server_error, client_error, _ = _handshake(
            _server_context(certs.server), _client_context(certs.ca), host
        )
        assert (server_error, client_error) == (None, None), host
    _, client_error, _ = _handshake(_server_context(certs.server), _client_context(certs.ca), "wrong.example")
    assert isinstance(client_error, ssl.SSLCertVerificationError)
    assert "Hostname mismatch" in str(client_error)
    leaf = _chain(certs.server_cert)[0]
    usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages


def test_wrong_host_certificate_is_from_the_real_ca_but_names_another_host(certs: TestCertificates) -> None:
    server = _server_context(certs.wrong_host_server)
    assert _handshake(server, _client_context(certs.ca), "wrong.example")[:2] == (None, None)
    _, client_error, _ = _handshake(server, _client_context(certs.ca), "127.0.0.1")
    assert isinstance(client_error, ssl.SSLCertVerificationError)
    assert "IP address mismatch" in str(client_error)


def test_a_client_trusting_only_the_untrusted_ca_rejects_the_server(certs: TestCertificates) -> None:
    _, client_error, _ = _handshake(
        _server_context(certs.server), _client_context(certs.untrusted_ca), "127.0.0.1"
    )
    assert isinstance(client_error, ssl.SSLCertVerificationError)
    assert client_error.verify_code == 19  # X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN: our CA, not theirs


@pytest.mark.parametrize("name", sorted(DEFAULT_CLIENTS))
def test_client_certificates_verify_against_the_ca(certs: TestCertificates, name: str) -> None:
    server = _server_context(certs.server, client_ca=certs.ca)
    client = _client_context(certs.ca, certs.client(name))
    server_error, client_error, peer = _handshake(server, client, "localhost")
    assert (server_error, client_error) == (None, None)
    assert peer is not None
    assert peer["subject"][-1] == (("commonName", name),)


@pytest.mark.parametrize(
    ("which", "reason"),
    # The untrusted client sends its own CA in its chain: OpenSSL names that self-signed root.
    [("expired_client", "certificate has expired"), ("untrusted_client", "self-signed certificate in")],
)
def test_bad_client_certificates_fail_verification(certs: TestCertificates, which: str, reason: str) -> None:
    client: IssuedCertificate = getattr(certs, which)
    server = _server_context(certs.server, client_ca=certs.ca)
    server_error, _, peer = _handshake(server, _client_context(certs.ca, client), "localhost")
    assert peer is None
    assert isinstance(server_error, ssl.SSLCertVerificationError)
    assert reason in server_error.verify_message


def test_expired_certificate_is_past_its_not_after(certs: TestCertificates) -> None:
    leaf = _chain(certs.expired_client.cert)[0]
    good = _chain(certs.client("alice").cert)[0]
    assert leaf.not_valid_after_utc < good.not_valid_before_utc


def test_a_new_server_certificate_from_the_same_ca_is_distinguishable(certs: TestCertificates) -> None:
    rotated = issue_server_certificate(certs.directory, "server-rotated", ["localhost", "127.0.0.1"])
    assert rotated.cert == certs.directory / "server-rotated.pem"
    assert rotated.serial != certs.server.serial
    assert rotated.key.read_bytes() != certs.server_key.read_bytes()
    old_leaf, new_leaf = _chain(certs.server_cert)[0], _chain(rotated.cert)[0]
    assert old_leaf.issuer == new_leaf.issuer
    assert old_leaf.public_key() != new_leaf.public_key()
    server_error, client_error, _ = _handshake(
        _server_context(rotated), _client_context(certs.ca), "127.0.0.1"
    )
    assert (server_error, client_error) == (None, None)


def test_a_new_client_certificate_for_any_subject(certs: TestCertificates) -> None:
    dave = issue_client_certificate(certs.directory, "client-dave", "CN=dave,OU=data,O=kthrottle")
    assert dave.subject == "CN=dave,OU=data,O=kthrottle"
    server = _server_context(certs.server, client_ca=certs.ca)
    _, _, peer = _handshake(server, _client_context(certs.ca, dave), "localhost")
    assert peer is not None
    assert peer["subject"] == (
        (("organizationName", "kthrottle"),),
        (("organizationalUnitName", "data"),),
        (("commonName", "dave"),),
    )
