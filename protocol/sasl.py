"""Learning the principal from a SASL exchange that passes through untouched.

The proxy never authenticates anyone: the broker does. The name read from the client's first
token is only a *candidate*; it becomes the connection's principal when the broker says the
exchange succeeded. A client can claim any name, only the broker's answer makes it true.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

ANONYMOUS = "ANONYMOUS"

#: SCRAM mechanisms need two round trips; the broker's final message starts with "v=".
SCRAM_MECHANISMS = frozenset({"SCRAM-SHA-256", "SCRAM-SHA-512"})

#: Mechanisms whose last server token is recognisable, so SaslHandshake v0's raw tokens can be followed.
RAW_SASL_MECHANISMS = frozenset({"PLAIN", "OAUTHBEARER", *SCRAM_MECHANISMS})


def _plain_name(token: bytes) -> str | None:
    """RFC 4616: [authzid] NUL authcid NUL passwd; Kafka's principal is the authcid."""
    parts = token.split(b"\x00")
    if len(parts) != 3 or not parts[1]:
        return None
    try:
        return parts[1].decode("utf-8")
    except UnicodeDecodeError:
        return None


def _scram_name(token: bytes) -> str | None:
    """RFC 5802 client-first message: gs2-header, then n=<saslname>,r=<nonce>."""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return None
    fields = text.split(",")
    if len(fields) < 4:
        return None
    for item in fields[2:]:
        if item.startswith("n="):
            return item[2:].replace("=2C", ",").replace("=3D", "=")
    return None


def _oauthbearer_name(token: bytes) -> str | None:
    """RFC 7628 client response: the JWT's `sub` claim (Kafka's default principal claim)."""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return None
    for item in text.split("\x01"):
        if item.startswith("auth=Bearer "):
            jwt = item[len("auth=Bearer "):].strip()
            parts = jwt.split(".")
            if len(parts) < 2:
                return None
            payload = parts[1] + "=" * (-len(parts[1]) % 4)
            try:
                claims = json.loads(base64.urlsafe_b64decode(payload))
            except (binascii.Error, ValueError):
                return None
            sub = claims.get("sub") if isinstance(claims, dict) else None
            return sub if isinstance(sub, str) and sub else None
    return None


_READERS = {"PLAIN": _plain_name, "OAUTHBEARER": _oauthbearer_name}


def candidate_principal(mechanism: str, first_token: bytes) -> str | None:
    """The name the client claims in its first token, or None if this mechanism hides it."""
    if mechanism in SCRAM_MECHANISMS:
        return _scram_name(first_token)
    reader = _READERS.get(mechanism)
    return reader(first_token) if reader else None


@dataclass(slots=True)
class SaslExchange:
    """One SASL authentication in progress on a connection (v1 handshake or v0 raw tokens)."""

    mechanism: str
    candidate: str | None = None
    client_tokens: int = 0
    server_tokens: int = 0

    def client_token(self, token: bytes) -> None:
        if self.client_tokens == 0:
            self.candidate = candidate_principal(self.mechanism, token)
        self.client_tokens += 1

    def server_token(self, token: bytes) -> bool:
        """Record the broker's successful answer; True when authentication is complete.

        PLAIN completes on its first answer; SCRAM on the server-final message ("v=...");
        OAUTHBEARER on an empty success answer (a non-empty one is the error challenge).
        For other mechanisms (GSSAPI) the end of the exchange is not visible in the tokens, so
        the connection keeps the ANONYMOUS principal (a documented limit).
        """
        self.server_tokens += 1
        if self.mechanism in SCRAM_MECHANISMS:
            return token.startswith(b"v=")
        if self.mechanism == "OAUTHBEARER":
            return len(token) == 0
        return self.mechanism == "PLAIN"
