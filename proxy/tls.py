"""TLS on both sides of the proxy: the SSL contexts, their rotation, and the client handshake.

Why the client handshake is driven here (`start_server_tls`) instead of giving the listeners
`ssl=`: with `loop.create_server(ssl=...)` a failed handshake is silent (uvloop's SSL protocol
logs it only in debug mode and never tells the application), so a plaintext client on a TLS port,
an untrusted certificate or a handshake that never finishes could not be named in one log line
and counted. The listeners therefore accept plain TCP and each connection upgrades itself with
`loop.start_tls`, which returns the TLS transport or raises the handshake's error. The bytes then
flow through the same uvloop SSL protocol `ssl=` would use, so the hot path is the same.

Rotation follows from that: each new connection takes the context that is current when it is
accepted (`RotatingContext.current`), and a connection keeps the context it started with, so new
connections get a new certificate while existing ones keep working. (The other usual trick, one
listener context whose `sni_callback` sets `ssl_object.context` to the current one, also works
under uvloop, with or without SNI from the client; it is not needed here.)
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import ssl
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from config.common import SettingsError
from config.principal_mapping import principal_from_certificate
from config.tls import ListenerTls, UpstreamTls, read_ca, read_certificate_pair

log = logging.getLogger("kthrottle.tls")

_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}

#: Kafka's ssl.client.auth values and the verify mode each means. A certificate that is presented
#: must verify in both "requested" and "required" (OpenSSL fails the handshake otherwise), so a
#: certificate the proxy sees after a handshake is always a verified one.
VERIFY_MODES = {"none": ssl.CERT_NONE, "requested": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def server_context(settings: ListenerTls) -> ssl.SSLContext:
    """The listeners' context: the proxy's certificate, and client certificates per client_auth."""
    files = read_certificate_pair("tls", settings.certificate, settings.key)
    if settings.ca is not None:
        read_ca("tls", settings.ca)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[settings.min_version]
    context.options |= ssl.OP_NO_RENEGOTIATION  # a client could make the proxy pay handshakes at will
    try:
        context.load_cert_chain(settings.certificate, settings.key)
        if settings.ca is not None:
            context.load_verify_locations(cafile=settings.ca)
    except (ssl.SSLError, OSError) as exc:
        raise SettingsError(f"tls.certificate = {str(settings.certificate)!r} / tls.key = "
                            f"{str(settings.key)!r}: OpenSSL refused them: {exc}") from exc
    context.verify_mode = VERIFY_MODES[settings.client_auth]
    _warn_if_expired("tls.certificate", files.certificate, files.not_after)
    return context


def upstream_context(settings: UpstreamTls) -> ssl.SSLContext:
    """The brokers' context: verify their certificates (and hostnames), present ours if any."""
    if settings.ca is not None:
        read_ca("upstream_tls", settings.ca)
    try:
        context = ssl.create_default_context(cafile=settings.ca)
    except (ssl.SSLError, OSError) as exc:
        raise SettingsError(f"upstream_tls.ca = {str(settings.ca)!r}: OpenSSL refused it: {exc}") from exc
    context.minimum_version = _VERSIONS[settings.min_version]
    context.check_hostname = settings.check_hostname
    if settings.certificate is not None and settings.key is not None:
        files = read_certificate_pair("upstream_tls", settings.certificate, settings.key)
        try:
            context.load_cert_chain(settings.certificate, settings.key)
        except (ssl.SSLError, OSError) as exc:
            raise SettingsError(f"upstream_tls.certificate = {str(settings.certificate)!r}: OpenSSL refused "
                                f"it: {exc}") from exc
        _warn_if_expired("upstream_tls.certificate", files.certificate, files.not_after)
    return context


def _warn_if_expired(setting: str, path: Path, not_after: datetime.datetime) -> None:
    if not_after < datetime.datetime.now(datetime.UTC):
        log.warning("%s = %s expired on %s: peers will refuse it", setting, path, not_after.isoformat())


FileStamp = tuple[int, int, int, int] | None


def _stamp(path: Path) -> FileStamp:
    """What changes when a file is replaced: device, inode, size, mtime (symlinks followed, so a
    Kubernetes secret volume's atomic `..data` swap counts as a change)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class RotatingContext:
    """One side's SSL context, rebuilt when the files it came from change.

    `poll` (every housekeeping second) applies a change once the files have looked the same for
    two checks in a row, so a certificate and a key written one after the other are read
    together; `poll(force=True)` (SIGHUP) reads them at once. New files that do not load leave
    the previous context in use, with one log line naming the file and the error, and are tried
    again when they change again.
    """

    def __init__(self, side: str, files: Sequence[Path], build: Callable[[], ssl.SSLContext],
                 describe: Callable[[], str]) -> None:
        self.side = side
        self._files = tuple(files)
        self._build = build
        self._describe = describe
        self._applied = self._stamps()
        self.current = build()
        self._seen = self._applied
        #: how many times new files were put in use, and refused (for tests and metrics)
        self.reloads = 0
        self.failures = 0

    def _stamps(self) -> tuple[FileStamp, ...]:
        return tuple(_stamp(path) for path in self._files)

    def poll(self, *, force: bool = False) -> bool:
        """Rebuild if the files changed (and settled); True when a new context is in use."""
        stamps = self._stamps()
        settled = stamps == self._seen
        self._seen = stamps
        if stamps == self._applied and not force:
            return False
        if not (settled or force):
            return False
        self._applied = stamps  # a bad file is reported once, and tried again when it changes
        try:
            context = self._build()
        except SettingsError as exc:
            self.failures += 1
            log.error("%s TLS files not reloaded, the previous certificate stays in use: %s", self.side, exc)
            return False
        self.current = context
        self.reloads += 1
        log.info("%s TLS files reloaded: new connections get %s", self.side, self._describe())
        return True


class TlsContexts:
    """Both sides' contexts (each None when its side is plaintext); SettingsError at start."""

    def __init__(self, listener: ListenerTls | None, upstream: UpstreamTls | None) -> None:
        self.listener = listener
        self.upstream_settings = upstream
        self.server: RotatingContext | None = None
        self.upstream: RotatingContext | None = None
        if listener is not None:
            self.server = RotatingContext(
                "listener", listener.files, lambda: server_context(listener),
                lambda: _describe("tls", listener.certificate, listener.key))
        if upstream is not None:
            self.upstream = RotatingContext(
                "upstream", upstream.files, lambda: upstream_context(upstream),
                lambda: _describe("upstream_tls", upstream.certificate, upstream.key))

    def poll(self, *, force: bool = False) -> None:
        for side in (self.server, self.upstream):
            if side is not None:
                side.poll(force=force)


def _describe(table: str, certificate: Path | None, key: Path | None) -> str:
    if certificate is None or key is None:
        return "the new CA bundle"
    try:
        files = read_certificate_pair(table, certificate, key)
    except SettingsError:
        return f"{certificate}"
    return f"certificate {files.subject!r} serial {files.serial:x} (expires {files.not_after:%Y-%m-%d})"


# -- the client handshake ---------------------------------------------------------------------------

HandshakeDone = Callable[[asyncio.BaseTransport | None, BaseException | None], None]


def start_server_tls(transport: asyncio.BaseTransport, protocol: asyncio.BaseProtocol,
                     context: ssl.SSLContext, timeout_s: float, done: HandshakeDone) -> None:
    """Upgrade an accepted connection to TLS; `done(tls_transport, None)` or `done(None, error)`.

    Call it from `connection_made`. The part of `loop.start_tls` that swaps the transport's
    protocol for the SSL one runs before this returns (a task would run it one loop iteration
    later, and uvloop starts reading as soon as `connection_made` returns, so the ClientHello
    could reach the plain protocol and be lost). Bytes that arrive before the SSL protocol's own
    `connection_made` wait in its incoming buffer for the handshake.
    """
    loop = asyncio.get_running_loop()
    coroutine = loop.start_tls(transport, protocol, context,  # type: ignore[arg-type]
                               server_side=True, ssl_handshake_timeout=timeout_s)
    _step(loop, coroutine, done)


def _step(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, asyncio.BaseTransport | None],
          done: HandshakeDone) -> None:
    """Run `coroutine` until it waits, and again each time what it waits for is done (what a task
    does, but starting now instead of at the next loop iteration)."""
    try:
        awaited = coroutine.send(None)
    except StopIteration as stop:
        done(stop.value, None)
        return
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the handshake's own error, or its cancellation
        done(None, exc)
        return
    if isinstance(awaited, asyncio.Future):
        awaited.add_done_callback(lambda _future: _step(loop, coroutine, done))
    else:  # a bare yield (asyncio.sleep(0)): go on at the next iteration
        loop.call_soon(_step, loop, coroutine, done)


#: OpenSSL's reasons for a first record that is not TLS at all: a plaintext client on a TLS port.
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL",
                              "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTPS_PROXY_REQUEST"})


#: OpenSSL's reasons for a client whose TLS versions are all below the listener's minimum.
_VERSION_REASONS = frozenset({"UNSUPPORTED_PROTOCOL", "NO_PROTOCOLS_AVAILABLE",
                              "TLSV1_ALERT_PROTOCOL_VERSION"})


class CertificateRefused(Exception):
    """A verified client certificate that gives no principal: `kind` labels the close metric."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def client_certificate_principal(transport: asyncio.BaseTransport, listener: ListenerTls) -> str | None:
    """The principal a client's TLS certificate maps to by `tls.principal_mapping_rules`, as a broker
    maps it; None when it presented none or the listener does not ask for one (client_auth none).

    Only a verified certificate gets here: OpenSSL fails the handshake on a presented certificate
    that does not verify. Raises CertificateRefused when no rule maps its subject.
    """
    ssl_object = transport.get_extra_info("ssl_object")
    certificate = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if certificate is None or listener.client_auth == "none":
        return None
    principal = principal_from_certificate(certificate, listener.principal_mapper)
    if principal is None:
        raise CertificateRefused("its certificate's subject matches no rule of tls.principal_mapping_rules "
                                 f"({listener.principal_mapping_rules!r}), so it has no principal",
                                 "tls_no_principal")
    return principal


def describe_handshake_error(exc: BaseException, timeout_ms: int) -> tuple[str, str]:
    """(metric label, log text) for a client handshake that failed."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ("tls_bad_certificate",
                f"TLS handshake refused: the client certificate does not verify against tls.ca "
                f"({exc.verify_message or exc.reason})")
    if isinstance(exc, ssl.SSLError) and exc.reason in _NOT_TLS_REASONS:
        return ("tls_plaintext_client",
                f"not a TLS handshake on a TLS listener ({exc.reason}): the client speaks plaintext "
                "(it needs security.protocol=SSL or SASL_SSL)")
    if isinstance(exc, ssl.SSLError) and exc.reason in _VERSION_REASONS:
        return ("tls_handshake_failed",
                "TLS handshake refused: the client offers no TLS version the listener accepts "
                f"({exc.reason}; see tls.min_version)")
    if isinstance(exc, ssl.SSLError) and exc.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return ("tls_no_certificate",
                'TLS handshake refused: the client sent no certificate and tls.client_auth = "required"')
    if isinstance(exc, ssl.SSLError):
        return "tls_handshake_failed", f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, ConnectionAbortedError) and "longer than" in str(exc):
        return ("tls_handshake_timeout",
                f"TLS handshake not finished within {timeout_ms} ms (tls.handshake_timeout_ms)")
    if isinstance(exc, ConnectionResetError):
        return "tls_handshake_eof", "the client closed its connection during the TLS handshake"
    return "tls_handshake_failed", f"TLS handshake failed: {str(exc) or type(exc).__name__}"


def describe_upstream_error(exc: BaseException) -> str | None:
    """The log text for a broker TLS failure, or None when `exc` is not about TLS.

    A plaintext broker listener reads the ClientHello as a Kafka size prefix far above its
    socket.request.max.bytes and closes the connection: the handshake ends with a reset or EOF.
    """
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the broker's TLS certificate does not verify: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        hint = " (is that a plaintext listener?)" if exc.reason in _NOT_TLS_REASONS else ""
        return f"TLS handshake with the broker failed: {exc.reason or exc}{hint}"
    if isinstance(exc, ConnectionResetError):
        return "the broker closed the connection during the TLS handshake (is that a plaintext listener?)"
    return None
