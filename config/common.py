"""What every settings module shares: the error a bad value raises and the (host, port) type with
its parser. A module of its own, so the `[proxy]` settings and the tables they contain (`[fleet]`,
`[tls]`, `[usage]`) need not import each other."""

from __future__ import annotations

import os

__all__ = ["Address", "BindError", "SettingsError", "parse_address", "parse_address_list"]


class SettingsError(ValueError):
    """A setting with a bad value; the message names the setting and the value."""


Address = tuple[str, int]


class BindError(Exception):
    """A port a setting names cannot be bound: another process holds it, or the host is not this
    machine's. One line like a broker's ("Socket server failed to bind to 127.0.0.1:9092: Address
    already in use"), plus the setting to change, since the proxy binds several ports."""

    def __init__(self, address: Address, setting: str, error: OSError) -> None:
        host, port = address
        reason = os.strerror(error.errno) if error.errno else str(error) or type(error).__name__
        shown = f"[{host}]" if ":" in host else host
        super().__init__(f"failed to bind to {shown}:{port} ({setting}): {reason}")
        self.address = address
        self.setting = setting


def parse_address(text: str, what: str) -> Address:
    """'host:port' (or '[v6]:port') with a port in 1..65535."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SettingsError(f"{what} {text!r} is not HOST:PORT")
    number = int(port)
    if not 0 <= number <= 65535:
        raise SettingsError(f"{what} {text!r} has port {number} outside 0..65535")
    return host.strip("[]"), number


def parse_address_list(text: str, what: str) -> list[Address]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise SettingsError(f"{what} {text!r} names no HOST:PORT")
    return [parse_address(item, what) for item in items]
