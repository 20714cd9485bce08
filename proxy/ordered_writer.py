"""Chunks to one socket, some of them delayed (a throttled response held in "delay" mode), in order.

A delayed chunk holds back everything written after it until its time comes, so a client never
gets responses out of order whatever the throttles.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


def now_ms() -> float:
    return time.monotonic() * 1000.0


class OrderedWriter:
    """Writes to a transport now or after a delay, never letting a write overtake a held one.

    Used in both directions: responses held in throttle_mode "delay" (or a fetch the partition
    throttles left empty), and requests held while their quota bucket is throttled.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._held: deque[tuple[float, list[bytes]]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def write(self, chunks: list[bytes], delay_ms: int) -> None:
        if delay_ms <= 0 and not self._held:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.writelines(chunks)
            return
        release = max(now_ms() + delay_ms, self._held[-1][0] if self._held else 0.0)
        self._held.append((release, chunks))
        if self._timer is None:
            self._schedule()

    def _schedule(self) -> None:
        delay = max(self._held[0][0] - now_ms(), 0.0) / 1000.0
        self._timer = asyncio.get_running_loop().call_later(delay, self._release)

    def _release(self) -> None:
        self._timer = None
        now = now_ms()
        while self._held and self._held[0][0] <= now + 0.5:
            _, chunks = self._held.popleft()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.writelines(chunks)
        if self._held:
            self._schedule()

    @property
    def holding(self) -> bool:
        """Whether writes are held for a delay."""
        return bool(self._held)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._held.clear()
