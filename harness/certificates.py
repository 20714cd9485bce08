"""Test certificates generated at test time (never committed): a CA, server and client certificates in PEM.

Why: the TLS tests need a broker certificate that clients verify (hostname included), client certificates
whose subjects map to principals, and the bad cases a real deployment meets (an untrusted CA, an expired
certificate, a certificate for the wrong host). Generating them per run keeps secrets out of the repository
and lets a test issue a *new* server certificate from the same CA to prove rotation.

Keys are EC P-256, unencrypted PKCS#8 ("BEGIN PRIVATE KEY"): fast to generate (about a millisecond each),
and read as is by Java (Kafka's ``ssl.keystore.type=PEM``, KIP-651), OpenSSL (librdkafka) and Python's
``ssl``. Every certificate file holds the chain leaf first, then the CA; a ``*.keystore.pem`` file holds the
key and that chain together, the single-file form Kafka's ``ssl.keystore.location`` wants for PEM.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

CA_SUBJECT = "CN=kthrottle test CA,O=kthrottle"
UNTRUSTED_CA_SUBJECT = "CN=kthrottle untrusted test CA,O=elsewhere"
SERVER_HOSTS = ("localhost", "127.0.0.1")
"""What the brokers' certificate names: the harness advertises 127.0.0.1; ``localhost`` for convenience."""
WRONG_HOSTS = ("wrong.example",)

DEFAULT_CLIENTS: Mapping[str, str] = {
    "alice": "CN=alice,OU=eng,O=kthrottle",
    "bob": "CN=bob,OU=ops,O=kthrottle",
    # A bare CN: ``RULE:^CN=([^,]+),.*$/$1/`` does not match, so Kafka's DEFAULT rule gives "CN=carol".
    "carol": "CN=carol",
}
"""Client certificate subjects (RFC 4514, as Java prints them) by name, signed by the test CA."""

UNTRUSTED_CLIENT_SUBJECT = "CN=mallory,OU=eng,O=kthrottle"
EXPIRED_CLIENT_SUBJECT = "CN=expired,OU=eng,O=kthrottle"

VALIDITY = datetime.timedelta(days=30)
"""Lifetime of every good certificate: the tests run for minutes, so a short life costs nothing."""
BACKDATE = datetime.timedelta(hours=1)
"""notBefore this far in the past, so a clock a little behind still accepts a just-made certificate."""
EXPIRED_AGO = datetime.timedelta(days=1)
"""The expired certificate's notAfter lies this far in the past: no clock skew allowance reaches it."""

_CURVE = ec.SECP256R1()
_SIGNATURE_HASH = hashes.SHA256()


@dataclass(frozen=True)
class IssuedCertificate:
    """One certificate's files: ``cert`` (chain, leaf first), ``key`` (PKCS#8) and ``keystore`` (both)."""

    cert: Path
    key: Path
    keystore: Path
    serial: int
    subject: str
    """The subject as RFC 4514 prints it, which is also how Java (and so Kafka) prints the DN."""


@dataclass(frozen=True)
class TestCertificates:
    """Every file ``generate`` wrote into ``directory``, by role."""

    __test__ = False  # a name pytest would otherwise try to collect

    directory: Path
    ca: Path
    ca_key: Path
    server: IssuedCertificate
    clients: tuple[tuple[str, IssuedCertificate], ...]
    untrusted_ca: Path
    untrusted_client: IssuedCertificate
    expired_client: IssuedCertificate
    wrong_host_server: IssuedCertificate

    @property
    def server_cert(self) -> Path:
        return self.server.cert

    @property
    def server_key(self) -> Path:
        return self.server.key

    @property
    def server_keystore(self) -> Path:
        """Key and chain in one PEM file: Kafka's ``ssl.keystore.location`` with ``ssl.keystore.type=PEM``."""
        return self.server.keystore

    def client(self, name: str) -> IssuedCertificate:
        """The client certificate issued for ``name`` (a key of the ``clients`` given to ``generate``)."""
        for known, issued in self.clients:
            if known == name:
                return issued
        raise KeyError(f"no client certificate named {name!r}; have {[n for n, _ in self.clients]}")

    @classmethod
    def generate(cls, directory: Path, clients: Mapping[str, str] = DEFAULT_CLIENTS) -> TestCertificates:
        """Write a test CA and every certificate the TLS tests use into ``directory`` (created if missing)."""
        directory.mkdir(parents=True, exist_ok=True)
        now = _now()
        ca_key, ca_cert = _write_ca(directory, "ca", CA_SUBJECT, now)
        untrusted_key, untrusted_cert = _write_ca(directory, "untrusted-ca", UNTRUSTED_CA_SUBJECT, now)
        return cls(
            directory=directory,
            ca=directory / "ca.pem",
            ca_key=directory / "ca.key",
            server=_issue(directory, "server", ca_cert, ca_key, "CN=localhost,O=kthrottle", now,
                          hosts=SERVER_HOSTS),
            clients=tuple(
                (name, _issue(directory, f"client-{name}", ca_cert, ca_key, subject, now))
                for name, subject in clients.items()
            ),
            untrusted_ca=directory / "untrusted-ca.pem",
            untrusted_client=_issue(directory, "untrusted-client", untrusted_cert, untrusted_key,
                                    UNTRUSTED_CLIENT_SUBJECT, now),
            expired_client=_issue(directory, "expired-client", ca_cert, ca_key, EXPIRED_CLIENT_SUBJECT,
                                  now - VALIDITY - EXPIRED_AGO),
            wrong_host_server=_issue(directory, "wrong-host-server", ca_cert, ca_key,
                                     "CN=wrong.example,O=kthrottle", now, hosts=WRONG_HOSTS),
        )


def issue_server_certificate(directory: Path, name: str, hosts: Sequence[str]) -> IssuedCertificate:
    """A new server certificate from the CA in ``directory`` (its ``ca.pem``/``ca.key``), as ``<name>.*``.

    Why: rotation tests need a second certificate that the same clients trust but that is told apart from
    the first (a fresh serial and key).
    """
    ca_cert, ca_key = _load_ca(directory)
    return _issue(directory, name, ca_cert, ca_key, f"CN={hosts[0]},O=kthrottle", _now(), hosts=hosts)


def issue_client_certificate(directory: Path, name: str, subject: str) -> IssuedCertificate:
    """A new client certificate for ``subject`` (RFC 4514) from the CA in ``directory``, as ``<name>.*``."""
    ca_cert, ca_key = _load_ca(directory)
    return _issue(directory, name, ca_cert, ca_key, subject, _now())


# --------------------------------------------------------------------------------------------- internals


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _name(subject: str) -> x509.Name:
    """RFC 4514 text to a Name. The string lists the last RDN first, so it prints back exactly as given."""
    return x509.Name.from_rfc4514_string(subject)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_private(path: Path, data: bytes) -> None:
    """Keys are written owner-only, as a real deployment would keep them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_ca(
    directory: Path, name: str, subject: str, now: datetime.datetime
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(_CURVE)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(subject))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, _SIGNATURE_HASH)
    )  # fmt: skip
    _write_private(directory / f"{name}.key", _key_pem(key))
    (directory / f"{name}.pem").write_bytes(_cert_pem(cert))
    return key, cert


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{directory / 'ca.key'} is not an EC key")
    return cert, key


def _issue(
    directory: Path,
    name: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: str,
    not_before: datetime.datetime,
    hosts: Sequence[str] = (),
) -> IssuedCertificate:
    """Sign a leaf for ``subject``; with ``hosts`` it is a server certificate naming them in its SAN.

    Server certificates also carry clientAuth: Kafka checks a listener's keystore at start-up with a
    handshake between two engines of that listener, and with ``ssl.client.auth=requested`` the keystore
    certificate is then presented as a client certificate too.
    """
    key = ec.generate_private_key(_CURVE)
    public = key.public_key()
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if hosts else [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    serial = x509.random_serial_number()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(not_before - BACKDATE)
        .not_valid_after(not_before + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )  # fmt: skip
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                                        critical=False)
    cert = builder.sign(ca_key, _SIGNATURE_HASH)
    chain = _cert_pem(cert) + _cert_pem(ca_cert)
    key_pem = _key_pem(key)
    issued = IssuedCertificate(
        cert=directory / f"{name}.pem",
        key=directory / f"{name}.key",
        keystore=directory / f"{name}.keystore.pem",
        serial=serial,
        subject=cert.subject.rfc4514_string(),
    )
    issued.cert.write_bytes(chain)
    _write_private(issued.key, key_pem)
    _write_private(issued.keystore, key_pem + chain)
    return issued


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
