"""How the proxy's own Kafka clients log in to the fronted cluster: the `sasl_*` keys of a table.

The proxy relays its clients' SASL exchanges untouched, so when it talks to the cluster itself (usage
events, the quota topic, the fleet's group) it needs credentials of its own. Every table that makes
such a client (`[usage]`, `[control_plane]`) takes the same three keys, checked here; TLS comes from
`[upstream_tls]`, as for the broker connections.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any

from .common import Address, SettingsError

SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
LOGIN_KEYS = ("sasl_mechanism", "sasl_username", "sasl_password")


@dataclass(frozen=True, slots=True)
class ClusterLogin:
    """SASL credentials for one of the proxy's own clients; mechanism None: no SASL."""

    mechanism: str | None = None
    username: str | None = None
    password: str | None = None


def parse_login(table: str, values: Mapping[str, object], password_env: str,
                environ: Mapping[str, str]) -> ClusterLogin:
    """The `sasl_*` keys of `[table]` (any other key is the caller's), the password from
    `password_env` when the file leaves it out (kept out of files and `ps`)."""
    mechanism = values.get("sasl_mechanism")
    username = values.get("sasl_username")
    password = values.get("sasl_password")
    if mechanism is not None and mechanism not in SASL_MECHANISMS:
        raise SettingsError(f"{table}.sasl_mechanism = {mechanism!r} must be one of "
                            + ", ".join(f'"{m}"' for m in SASL_MECHANISMS))
    if username is not None and (not isinstance(username, str) or not username.strip()):
        raise SettingsError(f"{table}.sasl_username = {username!r} must be a non-empty string")
    if password is not None and (not isinstance(password, str) or not password):
        raise SettingsError(f"{table}.sasl_password must be a non-empty string")
    if mechanism is None:
        if username is not None or password is not None:
            raise SettingsError(f"{table}.sasl_username / {table}.sasl_password are set but "
                                f'{table}.sasl_mechanism is not: set it to "PLAIN", "SCRAM-SHA-256" or '
                                '"SCRAM-SHA-512"')
        return ClusterLogin()
    if username is None:
        raise SettingsError(f'{table}.sasl_mechanism = "{mechanism}" needs {table}.sasl_username')
    if password is None:
        password = environ.get(password_env) or None
    if password is None:
        raise SettingsError(f'{table}.sasl_mechanism = "{mechanism}" needs {table}.sasl_password '
                            f"or ${password_env}")
    assert isinstance(username, str) and isinstance(password, str)
    return ClusterLogin(str(mechanism), username.strip(), password)


def client_configs(bootstrap: list[Address], tls: SSLContext | None, login: ClusterLogin,
                   client_id: str, **extra: Any) -> dict[str, Any]:
    """kafka-python client settings for the cluster at `bootstrap` with this TLS and login."""
    configs: dict[str, Any] = {
        "bootstrap_servers": [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in bootstrap],
        "client_id": client_id,
        **extra,
    }
    if tls is not None:
        configs["ssl_context"] = tls
    protocol = "SSL" if tls is not None else "PLAINTEXT"
    if login.mechanism is not None:
        protocol = "SASL_" + protocol
        configs.update(sasl_mechanism=login.mechanism, sasl_plain_username=login.username,
                       sasl_plain_password=login.password)
    configs["security_protocol"] = protocol
    return configs


__all__ = ["LOGIN_KEYS", "SASL_MECHANISMS", "ClusterLogin", "client_configs", "parse_login"]
