"""Upstream reachability: reasons are never empty, and each change of state is logged once."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from proxy.upstream.health import UpstreamHealth, describe_error


def test_reasons_name_what_happened() -> None:
    assert describe_error(TimeoutError(), 10) == "no answer within 10 s"
    assert describe_error(ConnectionRefusedError(111, "Connection refused"), 3) == (
        "ConnectionRefusedError: [Errno 111] Connection refused")
    assert describe_error(OSError(), 3) == "OSError"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_outage_is_logged_once_and_the_recovery_once(caplog: pytest.LogCaptureFixture) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    up_port = listener.getsockname()[1]
    candidates = [("127.0.0.1", _closed_port())]
    changes: list[bool] = []
    health = UpstreamHealth(lambda: candidates, on_change=changes.append)

    async def probes() -> None:
        for _ in range(3):
            assert not await health.probe()
        candidates.append(("127.0.0.1", up_port))
        for _ in range(2):
            assert await health.probe()

    with caplog.at_level(logging.INFO, logger="kthrottle.upstream"):
        asyncio.run(probes())
    listener.close()
    assert changes == [False, True]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "ConnectionRefusedError" in errors[0].getMessage()
    assert sum("upstream reachable" in r.getMessage() for r in caplog.records) == 1
    assert health.up and f"127.0.0.1:{up_port} accepts connections" == health.reason
