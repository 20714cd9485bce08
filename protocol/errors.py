"""Errors raised by the pure protocol code.

Each names the offending value, so the proxy can log one clear line and close only the
connection that sent it.
"""


class ProtocolError(Exception):
    """Bytes that cannot be a valid Kafka exchange; the connection that sent them is closed."""


class FrameSizeError(ProtocolError):
    """A length prefix that is negative or above the configured maximum."""


class MalformedHeader(ProtocolError):
    """A request or response header that is truncated or inconsistent."""


class MalformedBody(ProtocolError):
    """A body the proxy must decode (for a rewrite or SASL) that does not parse."""


class UnsupportedVersion(ProtocolError):
    """A request version the proxy cannot decode where it must (the client ignored ApiVersions)."""
