"""Whether the cluster behind the proxy can be reached: `kthrottle_upstream_up` and `/ready`.

A proxy whose upstream is unresolvable or refusing still accepts clients, so without this it
would look healthy while every client connection failed. A probe opens a TCP connection to the
known brokers and the bootstrap servers, one at a time, until one accepts; the state changes are
logged once each (an error when the upstream goes away, a line when it is back), not per client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from config.common import Address

log = logging.getLogger("kthrottle.upstream")

#: Time between probes, and how long one connection attempt may take.
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 3.0


def describe_error(exc: BaseException, timeout_s: float) -> str:
    """A reason that is never empty (a TimeoutError's text is '')."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def reachable(address: Address, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `address` accepts a TCP connection, else why not."""
    host, port = address
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as exc:
        return f"{host}:{port}: {describe_error(exc, timeout_s)}"
    writer.close()
    return None


class UpstreamHealth:
    """The latest probe's verdict, and the loop that keeps it fresh."""

    def __init__(self, candidates: Callable[[], list[Address]],
                 on_change: Callable[[bool], None] | None = None) -> None:
        self._candidates = candidates
        self._on_change = on_change
        self.up: bool | None = None  # None until the first probe
        self.reason = "not probed yet"

    async def probe(self) -> bool:
        errors: list[str] = []
        for address in self._candidates():
            error = await reachable(address)
            if error is None:
                self._set(True, f"{address[0]}:{address[1]} accepts connections")
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
