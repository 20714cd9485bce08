"""Upstream health: a probe is a Kafka request (ApiVersions), reasons are never empty, and each
change of state is logged once."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import pytest
from kafka.protocol.metadata import ApiVersionsResponse

from proxy.upstream.discovery import discover_brokers
from proxy.upstream.health import UpstreamHealth, answers, describe_error
from proxy.upstream.one_request import UpstreamError


def test_reasons_name_what_happened() -> None:
    assert describe_error(TimeoutError(), 10) == "no answer within 10 s"
    assert describe_error(TimeoutError(), 3, "answer to ApiVersions") == "no answer to ApiVersions within 3 s"
    assert describe_error(ConnectionRefusedError(111, "Connection refused"), 3) == (
        "ConnectionRefusedError: [Errno 111] Connection refused")
    assert describe_error(asyncio.IncompleteReadError(b"", 4), 3) == (
        "the connection closed after 0 of 4 expected bytes")
    assert describe_error(UpstreamError("127.0.0.1:9092: no answer to Metadata within 5 s"), 5) == (
        "127.0.0.1:9092: no answer to Metadata within 5 s")


@pytest.mark.parametrize("exc", [OSError(), ConnectionResetError(), BrokenPipeError(), ConnectionError(),
                                 RuntimeError(), EOFError()])
def test_an_exception_without_a_message_is_named_with_what_happened(exc: BaseException) -> None:
    """str() of these is '': the reason still names the type and says what it means."""
    text = describe_error(exc, 3)
    assert text.startswith(type(exc).__name__) and len(text) > len(type(exc).__name__) + 5, text


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def _server(answer: bool, *, close_at_once: bool = False) -> AsyncIterator[int]:
    """A loopback server: a broker answering ApiVersions v0 (`answer`), one that accepts and never
    answers, or one that reads the request and closes the connection."""
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with suppress(asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            while answer or close_at_once:
                size = int.from_bytes(await reader.readexactly(4), "big")
                request = await reader.readexactly(size)
                if close_at_once:
                    writer.close()
                    return
                body = ApiVersionsResponse(error_code=0, api_keys=[ApiVersionsResponse.ApiVersion(
                    api_key=18, min_version=0, max_version=4)]).encode(version=0)
                response = request[4:8] + bytes(body)  # response header v0: the correlation id
                writer.write(len(response).to_bytes(4, "big") + response)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        for writer in held:
            writer.close()
        server.close()


def test_a_port_that_accepts_and_never_answers_is_down_and_says_so() -> None:
    async def probe() -> tuple[str | None, str | None, float]:
        async with _server(answer=False) as silent, _server(answer=True) as broker:
            began = asyncio.get_running_loop().time()
            down = await answers(("127.0.0.1", silent), timeout_s=0.3)
            took = asyncio.get_running_loop().time() - began
            return down, await answers(("127.0.0.1", broker), timeout_s=0.3), took

    down, up, took = asyncio.run(probe())
    assert down is not None and down.endswith(": no answer to ApiVersions within 0.3 s"), down
    assert took < 1.5
    assert up is None


def test_a_port_that_closes_at_once_is_down_and_says_so() -> None:
    async def probe() -> str | None:
        async with _server(answer=False, close_at_once=True) as closing:
            return await answers(("127.0.0.1", closing), timeout_s=2)

    reason = asyncio.run(probe())
    assert reason is not None and "the connection closed before ApiVersions was answered" in reason, reason


def test_broker_discovery_names_why_it_failed() -> None:
    """It logged "broker discovery skipped (ConnectionError: 127.0.0.1:…: )": TimeoutError's text is ''."""
    async def discover() -> str:
        async with _server(answer=False) as silent:
            try:
                await discover_brokers([("127.0.0.1", silent)], timeout=0.3)
            except UpstreamError as exc:
                return f"broker discovery skipped ({describe_error(exc, 5)})"
        raise AssertionError("discovery from a silent server succeeded")

    line = asyncio.run(discover())
    assert line.endswith(": no answer to Metadata within 0.3 s)"), line
    assert line.startswith("broker discovery skipped (127.0.0.1:"), line


def test_an_outage_is_logged_once_and_the_recovery_once(caplog: pytest.LogCaptureFixture) -> None:
    candidates = [("127.0.0.1", _closed_port())]
    changes: list[bool] = []
    health = UpstreamHealth(lambda: candidates, on_change=changes.append)

    async def probes() -> int:
        for _ in range(3):
            assert not await health.probe()
        async with _server(answer=True) as up_port:
            candidates.append(("127.0.0.1", up_port))
            for _ in range(2):
                assert await health.probe()
        return up_port

    with caplog.at_level(logging.INFO, logger="kthrottle.upstream"):
        up_port = asyncio.run(probes())
    assert changes == [False, True]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "kthrottle.upstream"]
    assert len(errors) == 1 and "ConnectionRefusedError" in errors[0].getMessage()
    assert sum("upstream reachable" in r.getMessage() for r in caplog.records) == 1
    assert health.up and f"127.0.0.1:{up_port} answers ApiVersions" == health.reason
