"""Kafka's ssl.principal.mapping.rules (the rules and the Java regular expressions they are written
in), next to the `[tls]` settings that use them."""

from .rules import (
    DEFAULT_MAPPER,
    DEFAULT_SSL_PRINCIPAL_MAPPING_RULES,
    PrincipalMappingError,
    SslPrincipalMapper,
    UnsupportedPrincipalMappingRule,
    principal_from_certificate,
)

__all__ = [
    "DEFAULT_MAPPER",
    "DEFAULT_SSL_PRINCIPAL_MAPPING_RULES",
    "PrincipalMappingError",
    "SslPrincipalMapper",
    "UnsupportedPrincipalMappingRule",
    "principal_from_certificate",
]
