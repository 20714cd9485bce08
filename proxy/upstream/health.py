"""Whether the cluster behind the proxy answers: `kthrottle_upstream_up` and `/ready`.

A proxy whose upstream is unresolvable, refusing or silent still accepts clients, so without this it
would look healthy while every client connection failed. A probe asks the known brokers and the
bootstrap servers, one at a time, for ApiVersions v0 until one answers within PROBE_TIMEOUT_S. A
Kafka request, not only a TCP connection: a port that accepts connections and never answers (a hung
broker, a load balancer with nothing behind it, another service) is down for every client too.
ApiVersions v0 is answered by every broker since Kafka 0.10, before SASL authentication too (KIP-35),
and over TLS when `[upstream_tls]` is set, like client connections. The state changes are logged
once each (an error when the upstream goes away, a line when it is back), not per client.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
from collections.abc import Callable

from kafka.protocol.metadata import ApiVersionsResponse

from config.common import Address
from protocol.apis import ApiKey

from .one_request import UpstreamError, describe_error, request_once

__all__ = ["PROBE_INTERVAL_S", "PROBE_TIMEOUT_S", "UpstreamHealth", "answers", "describe_error"]

log = logging.getLogger("kthrottle.upstream")

#: Time between probes, and how long one probe (connection, TLS handshake, ApiVersions answer) may take.
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 3.0


async def answers(address: Address, tls: ssl.SSLContext | None = None,
                  timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `address` answers ApiVersions v0 within `timeout_s`, else why not."""
    host, port = address
    try:
        answer = await request_once(host, port, ApiKey.API_VERSIONS, 0, b"", tls=tls, timeout_s=timeout_s,
                                    client_id="kthrottle-health")
        ApiVersionsResponse.decode(memoryview(answer)[4:], version=0)  # response header v0
    except UpstreamError as exc:
        return str(exc)
    except (struct.error, IndexError, ValueError) as exc:  # kafka-python on bytes that are not the answer
        return f"{host}:{port}: the answer to ApiVersions does not decode ({describe_error(exc, timeout_s)})"
    return None


class UpstreamHealth:
    """The latest probe's verdict, and the loop that keeps it fresh."""

    def __init__(self, candidates: Callable[[], list[Address]],
                 on_change: Callable[[bool], None] | None = None,
                 tls: Callable[[], ssl.SSLContext | None] = lambda: None) -> None:
        """`tls`: the current context for connections to brokers (None: plaintext), asked per probe
        because certificate files rotate."""
        self._candidates = candidates
        self._on_change = on_change
        self._tls = tls
        self.up: bool | None = None  # None until the first probe
        self.reason = "not probed yet"

    async def probe(self) -> bool:
        errors: list[str] = []
        for address in self._candidates():
            error = await answers(address, self._tls())
            if error is None:
                self._set(True, f"{address[0]}:{address[1]} answers ApiVersions")
                return True
            errors.append(error)
        self._set(False, "; ".join(errors) or "no upstream address configured")
        return False

    def _set(self, up: bool, reason: str) -> None:
        changed = up != self.up
        self.up, self.reason = up, reason
        if not changed:
            return
        if up:
            log.info("upstream reachable: %s", reason)
        else:
            log.error("upstream unreachable, client connections will fail until it is back: %s", reason)
        if self._on_change is not None:
            self._on_change(up)

    async def run(self, interval_s: float = PROBE_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.probe()
