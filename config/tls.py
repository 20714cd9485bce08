"""The `[tls]` and `[upstream_tls]` tables: TLS towards clients and towards brokers (issue 12).

Each side is on when its table is present, independently of the other: TLS towards clients in
front of a plaintext cluster, or plaintext clients on a trusted network in front of a TLS cluster,
are both allowed. The names follow Kafka's own settings, so an operator can carry them over:

```toml
[tls]                                   # the bootstrap and every broker listener speak TLS
certificate = "/etc/kthrottle/proxy.crt"   # PEM, leaf first then intermediates (ssl.keystore.*)
key = "/etc/kthrottle/proxy.key"           # PEM, unencrypted
ca = "/etc/kthrottle/clients-ca.crt"       # who may present client certificates (ssl.truststore.*)
client_auth = "required"                # Kafka's ssl.client.auth: "none", "requested", "required"
principal_mapping_rules = "RULE:^CN=([^,]+),.*$/$1/L,DEFAULT"   # Kafka's ssl.principal.mapping.rules
min_version = "TLSv1.2"                 # or "TLSv1.3" (Kafka's ssl.enabled.protocols)
handshake_timeout_ms = 10000

[upstream_tls]                          # the proxy connects to the brokers over TLS
ca = "/etc/kthrottle/brokers-ca.crt"    # default: the system's trusted CAs
check_hostname = true                   # ssl.endpoint.identification.algorithm=https
certificate = "/etc/kthrottle/proxy-client.crt"   # for brokers that require client certificates
key = "/etc/kthrottle/proxy-client.key"
```

Every value is checked here, at start, and the files are read and checked too (a key that does not
match its certificate, a CA file without a certificate), so a typo stops `kthrottle run` with one
line naming the setting instead of failing every handshake later. The same checks run again when
the files change while the proxy runs (proxy/tls.py), where a bad file is logged and the previous
certificate stays in use.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .common import SettingsError
from .principal_mapping import PrincipalMappingError, SslPrincipalMapper

#: Kafka's ssl.client.auth values. "requested" asks for a certificate and accepts a connection
#: without one (its principal is then ANONYMOUS); a certificate that is presented must verify.
CLIENT_AUTH_MODES = ("none", "requested", "required")

#: The TLS versions a listener or upstream may be limited to. Kafka's default ssl.enabled.protocols
#: is TLSv1.2,TLSv1.3; older versions are broken and refused outright.
TLS_VERSIONS = ("TLSv1.2", "TLSv1.3")

#: How long a client may take to finish its TLS handshake. Kafka's clients give up on a connection
#: that is not ready within socket.connection.setup.timeout.ms (10 s by default, the handshake
#: included); a proxy that waited longer would only hold a descriptor for a client that has left.
DEFAULT_HANDSHAKE_TIMEOUT_MS = 10_000
#: Above this a handshake timeout stops protecting anything (asyncio's own default is 60 s).
MAX_HANDSHAKE_TIMEOUT_MS = 300_000


@dataclass(frozen=True, slots=True)
class CertificateFiles:
    """A certificate (chain) and its key as read and checked, for logging what is being served."""

    certificate: Path
    key: Path
    serial: int
    subject: str
    not_after: datetime.datetime


@dataclass(frozen=True, slots=True)
class ListenerTls:
    """A checked `[tls]` table: TLS on the bootstrap and every broker listener."""

    certificate: Path
    key: Path
    #: CA bundle client certificates are verified against; required unless client_auth = "none".
    ca: Path | None = None
    client_auth: str = "none"
    #: The rules as written (Kafka's syntax), and parsed.
    principal_mapping_rules: str = "DEFAULT"
    principal_mapper: SslPrincipalMapper | None = None
    min_version: str = "TLSv1.2"
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file the listeners' context is built from (watched for rotation)."""
        return (self.certificate, self.key) + ((self.ca,) if self.ca is not None else ())


@dataclass(frozen=True, slots=True)
class UpstreamTls:
    """A checked `[upstream_tls]` table: TLS on every connection to a broker."""

    #: CA bundle the brokers' certificates are verified against; None: the system's trusted CAs.
    ca: Path | None = None
    #: Kafka's ssl.endpoint.identification.algorithm=https: the broker's certificate must name the
    #: host the proxy connects to, which is the host the broker advertises (or the bootstrap entry).
    check_hostname: bool = True
    #: A client certificate for brokers with ssl.client.auth=required (the broker then sees the
    #: proxy's identity on every connection, whoever the client is).
    certificate: Path | None = None
    key: Path | None = None
    min_version: str = "TLSv1.2"
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file the upstream context is built from (watched for rotation)."""
        return tuple(path for path in (self.ca, self.certificate, self.key) if path is not None)


def _path(table: str, key: str, value: object, config_path: Path | None) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"{table}.{key} = {value!r} must be the path of a PEM file")
    path = Path(value.strip()).expanduser()
    if not path.is_absolute() and config_path is not None:
        path = config_path.parent / path  # relative to the config file, not to where it was started
    return path


def _read(table: str, key: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SettingsError(f"{table}.{key} = {str(path)!r} cannot be read: {exc.strerror or exc}") from exc


def _version(table: str, value: object) -> str:
    if value not in TLS_VERSIONS:
        raise SettingsError(f'{table}.min_version = {value!r} must be "TLSv1.2" or "TLSv1.3"')
    return str(value)


def _timeout(table: str, value: object) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or value <= 0
            or value > MAX_HANDSHAKE_TIMEOUT_MS):
        raise SettingsError(f"{table}.handshake_timeout_ms = {value!r} must be a whole number of "
                            f"milliseconds in 1..{MAX_HANDSHAKE_TIMEOUT_MS}")
    return value


def read_ca(table: str, path: Path) -> list[x509.Certificate]:
    """The certificates of a CA bundle; one at least, or it trusts nobody."""
    data = _read(table, "ca", path)
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise SettingsError(f"{table}.ca = {str(path)!r} holds no PEM certificate: {exc}") from exc
    return certificates


def read_certificate_pair(table: str, certificate: Path, key: Path) -> CertificateFiles:
    """A certificate chain and its private key, checked to belong together.

    `ssl.SSLContext.load_cert_chain` would refuse a mismatch too, but with OpenSSL's words and
    without saying which file; this names the setting and the file.
    """
    chain_pem = _read(table, "certificate", certificate)
    key_pem = _read(table, "key", key)
    try:
        chain = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as exc:
        raise SettingsError(f"{table}.certificate = {str(certificate)!r} holds no PEM certificate: "
                            f"{exc}") from exc
    try:
        private_key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError as exc:  # encrypted: Kafka's ssl.key.password has no equivalent here
        raise SettingsError(f"{table}.key = {str(key)!r} is encrypted; kthrottle reads unencrypted PEM "
                            "keys only (protect the file with its permissions instead)") from exc
    except (ValueError, NotImplementedError) as exc:
        raise SettingsError(f"{table}.key = {str(key)!r} holds no usable PEM private key: {exc}") from exc
    leaf = chain[0]
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if (leaf.public_key().public_bytes(serialization.Encoding.DER, spki)
            != private_key.public_key().public_bytes(serialization.Encoding.DER, spki)):
        raise SettingsError(f"{table}.key = {str(key)!r} does not match {table}.certificate = "
                            f"{str(certificate)!r} (subject {leaf.subject.rfc4514_string()!r}): "
                            "the first certificate in the file must be the key's own")
    return CertificateFiles(certificate, key, leaf.serial_number, leaf.subject.rfc4514_string(),
                            leaf.not_valid_after_utc)


def _rules(value: object) -> tuple[str, SslPrincipalMapper]:
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        text = ",".join(value)  # a list reads better in TOML; Kafka's own form is one string
    elif isinstance(value, str):
        text = value
    else:
        raise SettingsError(f"tls.principal_mapping_rules = {value!r} must be a string (or a list of "
                            'rules) in Kafka\'s ssl.principal.mapping.rules syntax, e.g. "DEFAULT"')
    try:
        return text, SslPrincipalMapper.parse(text)
    except PrincipalMappingError as exc:
        raise SettingsError(f"tls.principal_mapping_rules = {text!r} is not valid: {exc}") from exc


def parse_tls_table(table: object, config_path: Path | None = None) -> ListenerTls:
    """A `[tls]` table, checked and its files read; `config_path` anchors relative paths."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"tls = {table!r} must be a table ([tls])")
    values = dict(table)
    for required in ("certificate", "key"):
        if required not in values:
            raise SettingsError(f"tls.{required} is required: the PEM {required} the listeners present "
                                "to clients")
    certificate = _path("tls", "certificate", values.pop("certificate"), config_path)
    key = _path("tls", "key", values.pop("key"), config_path)
    ca: Path | None = None
    client_auth = "none"
    rules, mapper = _rules("DEFAULT")
    min_version = "TLSv1.2"
    timeout = DEFAULT_HANDSHAKE_TIMEOUT_MS
    for name, value in values.items():
        if name == "ca":
            ca = _path("tls", name, value, config_path)
        elif name == "client_auth":
            if value not in CLIENT_AUTH_MODES:
                raise SettingsError(f'tls.client_auth = {value!r} must be "none", "requested" or "required" '
                                    "(Kafka's ssl.client.auth)")
            client_auth = str(value)
        elif name == "principal_mapping_rules":
            rules, mapper = _rules(value)
        elif name == "min_version":
            min_version = _version("tls", value)
        elif name == "handshake_timeout_ms":
            timeout = _timeout("tls", value)
        else:
            raise SettingsError(f"unknown setting tls.{name}")
    if client_auth != "none" and ca is None:
        raise SettingsError(f'tls.client_auth = "{client_auth}" needs tls.ca: the CA bundle client '
                            "certificates are verified against")
    if client_auth == "none" and ca is not None:
        raise SettingsError('tls.ca is set but tls.client_auth = "none": client certificates are not '
                            'asked for; set client_auth = "requested" or "required", or remove tls.ca')
    read_certificate_pair("tls", certificate, key)
    if ca is not None:
        read_ca("tls", ca)
    return ListenerTls(certificate=certificate, key=key, ca=ca, client_auth=client_auth,
                       principal_mapping_rules=rules, principal_mapper=mapper, min_version=min_version,
                       handshake_timeout_ms=timeout)


def parse_upstream_tls_table(table: object, config_path: Path | None = None) -> UpstreamTls:
    """An `[upstream_tls]` table (it may be empty: TLS with the system's CAs), checked."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"upstream_tls = {table!r} must be a table ([upstream_tls])")
    ca: Path | None = None
    certificate: Path | None = None
    key: Path | None = None
    check_hostname = True
    min_version = "TLSv1.2"
    timeout = DEFAULT_HANDSHAKE_TIMEOUT_MS
    for name, value in dict(table).items():
        if name in ("ca", "certificate", "key"):
            path = _path("upstream_tls", name, value, config_path)
            if name == "ca":
                ca = path
            elif name == "certificate":
                certificate = path
            else:
                key = path
        elif name == "check_hostname":
            if not isinstance(value, bool):
                raise SettingsError(f"upstream_tls.check_hostname = {value!r} must be true or false")
            check_hostname = value
        elif name == "min_version":
            min_version = _version("upstream_tls", value)
        elif name == "handshake_timeout_ms":
            timeout = _timeout("upstream_tls", value)
        else:
            raise SettingsError(f"unknown setting upstream_tls.{name}")
    if (certificate is None) != (key is None):
        have, missing = ("certificate", "key") if key is None else ("key", "certificate")
        raise SettingsError(f"upstream_tls.{have} is set without upstream_tls.{missing}: a client "
                            "certificate needs both")
    if certificate is not None and key is not None:
        read_certificate_pair("upstream_tls", certificate, key)
    if ca is not None:
        read_ca("upstream_tls", ca)
    return UpstreamTls(ca=ca, check_hostname=check_hostname, certificate=certificate, key=key,
                       min_version=min_version, handshake_timeout_ms=timeout)
