"""Following a connection's SASL exchange as it passes through, to know when it is accepted.

Kept apart from the connection because SASL brings rules of its own: a broker takes only a few
requests while the exchange is in progress, SaslHandshake v0 sends its tokens as bare frames
without a header, and only the broker's answer turns a claimed name into the principal
(`sasl.SaslExchange` reads the names; this module follows the requests and responses).
"""

from __future__ import annotations

from typing import Any

from kafka.protocol.sasl import SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest

from .apis import KNOWN_APIS, ApiKey, api_name
from .charging import REQUEST_QUOTA_EXEMPT
from .errors import MalformedBody, UnsupportedVersion
from .headers import RequestHeader, response_body_offset
from .sasl import RAW_SASL_MECHANISMS, SaslExchange
from .skim import decode_strict

#: The only requests a broker takes while a SASL exchange is in progress (Kafka's
#: SaslServerAuthenticator closes the connection on any other): another request means the client
#: saw the exchange succeed.
SASL_SETUP_APIS = REQUEST_QUOTA_EXEMPT


def _decode_request(frame: bytes, header: RequestHeader) -> Any:
    cls = {ApiKey.SASL_HANDSHAKE: SaslHandshakeRequest,
           ApiKey.SASL_AUTHENTICATE: SaslAuthenticateRequest}[ApiKey(header.api_key)]
    # Strict: a null mechanism or token (length -1) is refused as a broker refuses it.
    return decode_strict(cls, frame, header.body_offset, header.api_version,
                         f"{api_name(header.api_key)} v{header.api_version} request")


def _response_error_code(frame: bytes, api_key: int, version: int) -> tuple[int, int]:
    """The response's body offset and its first field, the error code."""
    start = response_body_offset(frame, KNOWN_APIS[api_key].response_header_version(version))
    return start, int.from_bytes(frame[start : start + 2], "big", signed=True)


class SaslTracking:
    """The SASL state of one connection; the connection reads its fields on the hot path."""

    __slots__ = ("exchange", "in_progress", "raw", "raw_possible", "settled")

    def __init__(self) -> None:
        self.exchange: SaslExchange | None = None
        #: SaslHandshake v0: tokens travel as bare frames until this exchange completes
        self.raw: SaslExchange | None = None
        #: the connection's first SASL exchange has started and not yet been accepted; and
        #: whether one ever was (a re-authentication, KIP-368, does not undo `established`)
        self.in_progress = False
        self.settled = False
        #: a SaslHandshake v0 awaits its answer: the client's next frame may be a raw token
        self.raw_possible = False

    def settle(self) -> None:
        """The exchange is over: accepted by the broker, or seen to be by the client's requests."""
        self.settled, self.in_progress = True, False

    def handshake_request(self, frame: bytes, header: RequestHeader) -> None:
        self.exchange = SaslExchange(_decode_request(frame, header).mechanism)
        self.in_progress = not self.settled
        self.raw_possible = header.api_version == 0

    def authenticate_request(self, frame: bytes, header: RequestHeader) -> None:
        if self.exchange is None:
            raise MalformedBody("SaslAuthenticate without a SaslHandshake first")
        self.exchange.client_token(bytes(_decode_request(frame, header).auth_bytes))

    def raw_server_token(self, frame: bytes) -> SaslExchange | None:
        """A v0 raw token from the broker; the exchange once it is accepted, else None."""
        exchange = self.raw
        assert exchange is not None
        if exchange.server_token(frame):
            self.raw = None
            return exchange
        return None

    def handshake_response(self, frame: bytes, version: int) -> None:
        """After a successful SaslHandshake v0 the tokens travel raw: follow them if possible."""
        self.raw_possible = False
        _, error_code = _response_error_code(frame, ApiKey.SASL_HANDSHAKE, version)
        if error_code == 0 and version == 0 and self.exchange is not None:
            if self.exchange.mechanism not in RAW_SASL_MECHANISMS:
                # Raw tokens have no framing of their own: without knowing where the exchange
                # ends, the proxy could no longer tell tokens from Kafka requests.
                raise UnsupportedVersion(
                    f"SaslHandshake v0 with mechanism {self.exchange.mechanism}: the proxy cannot tell "
                    "where its raw tokens end (clients since Kafka 1.0 use v1, which works)")
            self.raw = self.exchange

    def authenticate_response(self, frame: bytes, version: int) -> SaslExchange | None:
        """The broker's SaslAuthenticate answer; the exchange once it is accepted, else None."""
        if self.exchange is None:
            return None
        start = response_body_offset(
            frame, KNOWN_APIS[ApiKey.SASL_AUTHENTICATE].response_header_version(version))
        answer = decode_strict(SaslAuthenticateResponse, frame, start, version,
                               f"SaslAuthenticate v{version} response")
        if answer.error_code != 0:
            self.exchange = None  # the broker closes the connection after a failed exchange
            return None
        return self.exchange if self.exchange.server_token(bytes(answer.auth_bytes)) else None


__all__ = ["SASL_SETUP_APIS", "SaslTracking"]
