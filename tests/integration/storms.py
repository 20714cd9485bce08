"""Connection storms from one client address: what the tests of per-IP connection quotas drive.

Kafka keys `connection_creation_rate` (KIP-612, entity `ip`) and the broker-wide
`max.connection.creation.rate` on new connections, so these clients measure connections, not bytes:
each one connects from a chosen source address (loopback aliases 127.0.0.2, 127.0.0.3 ... need no
setup on Linux; `::1` for IPv6), sends one ApiVersions v0 request and waits, bounded, for its answer.

What a connection's outcome means against Kafka's semantics:

- served: the ApiVersions answer arrived with error 0.
- closed: the peer closed (EOF or RST) before answering. Over its IP's rate, a connection is accepted,
  never served, and closed after a throttle of up to one quota window (1 s by default), at the
  acceptor's next turn: a storm shows many connections held about half a second or a second, then
  closed. `Attempt.finished - Attempt.connected` says how long each was held (`StormResult.holds`).
- timed_out: neither within the bound.
- connect_failed: connect() failed or did not complete in time (refused, or no free local port).
- bad_answer: a frame came back but it is not a well-formed ApiVersions answer with error 0.

Two shapes: `storm` (as many connections as `concurrency` in-flight attempts allow, for a duration,
with each answer's time kept so `served_rate(skip_s)` can leave the first burst out) and `burst`
(count connections all connected before any request is sent, then every answer awaited: "every
connection of a 200-connection burst is eventually served").

One asyncio loop on one thread, because a 2-core box also runs the brokers and the proxy. Every
socket is closed whatever happens; both shapes stop by themselves (bounded in count and in time).
The sync functions may be called from inside a running loop (an async test): they then run on a
helper thread. `storm_async` and `burst_async` are the same for a caller that prefers to await.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import itertools
import socket
import struct
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from kafka.protocol.metadata import ApiVersionsRequest

from protocol.frames import frame
from protocol.headers import encode_request_header

Address = tuple[str, int]
T = TypeVar("T")

API_VERSIONS_KEY = 18
CLIENT_ID = "storm"

#: Linux's IP_BIND_ADDRESS_NO_PORT (linux/in.h; Python does not export it): bind() only fixes the
#: source address and the port is chosen by connect(), for the whole 4-tuple, where loopback's
#: TIME_WAIT reuse (net.ipv4.tcp_tw_reuse=2, the default) applies. Without it bind() must find a port
#: free for the address alone among ~28,000 that TIME_WAIT holds for 60 s: measured against one
#: broker over 10 s, 650 connections/s instead of 7,400/s, and it runs out on a longer storm.
_IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)

#: Largest answer accepted: an ApiVersions v0 answer is a few hundred bytes.
_MAX_ANSWER_BYTES = 1 << 20

#: Bound on a burst's size: each connection holds a descriptor until the end.
MAX_BURST = 4096


class Outcome(StrEnum):
    SERVED = "served"
    CLOSED = "closed"
    TIMED_OUT = "timed_out"
    CONNECT_FAILED = "connect_failed"
    BAD_ANSWER = "bad_answer"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One connection. Times are seconds since the storm or burst started (monotonic clock).

    `connected` is None when connect() failed; `finished` is when the outcome was known (the
    answer, the close, the timeout). `detail` says what went wrong, empty when served.
    """

    outcome: Outcome
    started: float
    connected: float | None
    finished: float
    detail: str = ""

    @property
    def held(self) -> float | None:
        """How long the connection was open before its outcome (e.g. a throttled close's delay)."""
        return None if self.connected is None else self.finished - self.connected


@dataclass(slots=True)
class StormResult:
    """Every attempt of a storm; `duration_s` is how long new attempts were started."""

    duration_s: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def counts(self) -> Counter[Outcome]:
        return Counter(a.outcome for a in self.attempts)

    @property
    def total(self) -> int:
        return len(self.attempts)

    @property
    def served(self) -> int:
        return self.counts[Outcome.SERVED]

    @property
    def closed(self) -> int:
        return self.counts[Outcome.CLOSED]

    @property
    def timed_out(self) -> int:
        return self.counts[Outcome.TIMED_OUT]

    @property
    def connect_failed(self) -> int:
        return self.counts[Outcome.CONNECT_FAILED]

    @property
    def bad_answer(self) -> int:
        return self.counts[Outcome.BAD_ANSWER]

    def served_times(self) -> list[float]:
        """When each served connection got its answer, sorted."""
        return sorted(a.finished for a in self.attempts if a.outcome is Outcome.SERVED)

    def served_rate(self, skip_s: float = 0.0, until_s: float | None = None) -> float:
        """Answers per second over [skip_s, until_s] (until_s: the end of the storm by default).

        Answers that arrive after the storm stopped starting attempts are left out, so the window
        is exactly as long as its divisor.
        """
        end = self.duration_s if until_s is None else until_s
        if not 0 <= skip_s < end:
            raise ValueError(f"served_rate: window [{skip_s}, {end}] is empty or negative")
        inside = sum(1 for t in self.served_times() if skip_s <= t <= end)
        return inside / (end - skip_s)

    def holds(self) -> list[float]:
        """How long each closed connection was held open before its close (seconds), sorted: against
        an IP quota, how long a throttled connection is kept before the client may try again."""
        return sorted(held for a in self.attempts
                      if a.outcome is Outcome.CLOSED and (held := a.held) is not None)

    def hold_quantile(self, q: float) -> float:
        """The `q` quantile of `holds` (nearest rank; 0.0 when nothing was closed)."""
        holds = self.holds()
        return holds[round(q * (len(holds) - 1))] if holds else 0.0

    def hold_p50(self) -> float:
        return self.hold_quantile(0.5)

    def hold_mean(self) -> float:
        holds = self.holds()
        return sum(holds) / len(holds) if holds else 0.0

    def details(self) -> Counter[str]:
        """How many attempts failed for each reason (e.g. "closed after 0 bytes": the throttle)."""
        return Counter(f"{a.outcome}: {a.detail}" for a in self.attempts if a.outcome is not Outcome.SERVED)

    def summary(self) -> str:
        counts = ", ".join(f"{o.value}={self.counts[o]}" for o in Outcome if self.counts[o])
        return f"{self.total} connections in {self.duration_s:.1f}s ({counts or 'none'})"


def api_versions_request(correlation_id: int) -> bytes:
    """A framed ApiVersions v0 request (header v1, empty body): what every storm connection sends."""
    body = bytes(ApiVersionsRequest[0]().encode())
    return frame(encode_request_header(API_VERSIONS_KEY, 0, correlation_id, CLIENT_ID) + body)


def _family_of(source_ip: str, family: socket.AddressFamily | None) -> socket.AddressFamily:
    if family is not None:
        return family
    return socket.AF_INET6 if ":" in source_ip else socket.AF_INET


def _check_source(source_ip: str, family: socket.AddressFamily) -> None:
    """Fail the whole run at once on an address this host cannot send from, naming it."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((source_ip, 0))
    except OSError as exc:
        raise ValueError(f"cannot send from {source_ip!r} ({family.name}): {exc}") from exc


def _client_socket(source_ip: str, family: socket.AddressFamily) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((source_ip, 0))
    except BaseException:
        sock.close()
        raise
    return sock


async def _connect(loop: asyncio.AbstractEventLoop, sock: socket.socket, target: Address,
                   timeout: float) -> tuple[Outcome | None, str]:
    """(None, "") once connected, else the outcome and why.

    ECONNRESET here means the handshake completed and the peer reset the connection before the
    loop saw it connected (a listener that accepts and resets at once): CLOSED, not CONNECT_FAILED,
    which is for connections never established (ECONNREFUSED, no free port, no SYN-ACK in time).
    """
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, target)
    except TimeoutError:
        return Outcome.CONNECT_FAILED, f"connect took over {timeout:g}s"
    except OSError as exc:  # asyncio's message names the address, not the error: add its name
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        outcome = Outcome.CLOSED if exc.errno in (errno.ECONNRESET, errno.EPIPE) else Outcome.CONNECT_FAILED
        return outcome, f"connect: {name}"
    return None, ""


async def _answer(loop: asyncio.AbstractEventLoop, sock: socket.socket, correlation_id: int,
                  deadline: float) -> tuple[Outcome, str]:
    """Read one answer frame by the monotonic `deadline` and judge it."""
    buf = bytearray()
    need = 4
    try:
        async with asyncio.timeout_at(_loop_time(loop, deadline)):
            while len(buf) < need:
                chunk = await loop.sock_recv(sock, max(need - len(buf), 4096))
                if not chunk:
                    return Outcome.CLOSED, f"closed after {len(buf)} bytes"
                buf += chunk
                if need == 4 and len(buf) >= 4:
                    size = struct.unpack_from(">i", buf)[0]
                    if not 6 <= size <= _MAX_ANSWER_BYTES:
                        return Outcome.BAD_ANSWER, f"answer size {size}"
                    need = 4 + size
    except TimeoutError:
        return Outcome.TIMED_OUT, f"no answer ({len(buf)} bytes) in time"
    except OSError as exc:  # reset by the peer
        return Outcome.CLOSED, f"{exc.strerror or exc} after {len(buf)} bytes"
    got_id, error_code = struct.unpack_from(">ih", buf, 4)
    if got_id != correlation_id:
        return Outcome.BAD_ANSWER, f"correlation id {got_id}, expected {correlation_id}"
    if error_code != 0:
        return Outcome.BAD_ANSWER, f"error code {error_code}"
    if len(buf) > need:
        return Outcome.BAD_ANSWER, f"{len(buf) - need} bytes after the answer"
    return Outcome.SERVED, ""


def _loop_time(loop: asyncio.AbstractEventLoop, monotonic_deadline: float) -> float:
    return loop.time() + (monotonic_deadline - time.monotonic())


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, correlation_id: int) -> str:
    try:
        await loop.sock_sendall(sock, api_versions_request(correlation_id))
    except OSError as exc:
        return f"send: {exc.strerror or exc}"
    return ""


async def _one(loop: asyncio.AbstractEventLoop, target: Address, source_ip: str,
               family: socket.AddressFamily, t0: float, correlation_id: int,
               connect_timeout: float, answer_timeout: float) -> Attempt:
    started = time.monotonic() - t0
    try:
        sock = _client_socket(source_ip, family)
    except OSError as exc:
        return Attempt(Outcome.CONNECT_FAILED, started, None, time.monotonic() - t0, f"bind: {exc}")
    with sock:
        outcome, failure = await _connect(loop, sock, target, connect_timeout)
        connected = time.monotonic() - t0
        if outcome is not None:
            return Attempt(outcome, started, None if outcome is Outcome.CONNECT_FAILED else connected,
                           connected, failure)
        failure = await _send(loop, sock, correlation_id)
        if failure:  # the peer closed before the request could be written
            return Attempt(Outcome.CLOSED, started, connected, time.monotonic() - t0, failure)
        outcome, detail = await _answer(loop, sock, correlation_id, time.monotonic() + answer_timeout)
        return Attempt(outcome, started, connected, time.monotonic() - t0, detail)


async def storm_async(target: Address, source_ip: str, duration_s: float, *, concurrency: int = 32,
                      family: socket.AddressFamily | None = None, answer_timeout: float = 3.0,
                      connect_timeout: float = 3.0, max_connections: int = 200_000) -> StormResult:
    """See `storm`."""
    if duration_s <= 0 or concurrency < 1 or max_connections < 1:
        raise ValueError(f"storm: duration_s={duration_s}, concurrency={concurrency}, "
                         f"max_connections={max_connections}: all must be positive")
    family = _family_of(source_ip, family)
    _check_source(source_ip, family)
    loop = asyncio.get_running_loop()
    ids = itertools.count(1)
    result = StormResult(duration_s)
    t0 = time.monotonic()
    end = t0 + duration_s

    async def worker() -> None:
        while time.monotonic() < end:
            correlation_id = next(ids)
            if correlation_id > max_connections:
                return
            result.attempts.append(await _one(loop, target, source_ip, family, t0, correlation_id,
                                              connect_timeout, answer_timeout))

    # Each attempt is bounded by its two timeouts, so this outer bound is only a safety net.
    async with asyncio.timeout(duration_s + connect_timeout + answer_timeout + 10):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


def storm(target: Address, source_ip: str, duration_s: float, *, concurrency: int = 32,
          family: socket.AddressFamily | None = None, answer_timeout: float = 3.0,
          connect_timeout: float = 3.0, max_connections: int = 200_000) -> StormResult:
    """Open connections to `target` from `source_ip` as fast as `concurrency` attempts in flight allow,
    for `duration_s` seconds; each sends ApiVersions v0 and waits up to `answer_timeout` for the answer.

    `family` defaults to the one of `source_ip` (IPv6 when it has a colon). Returns once every attempt
    has an outcome: at most duration_s + connect_timeout + answer_timeout later. `max_connections`
    bounds how many are started. Raises ValueError at once if `source_ip` cannot be bound.
    """
    return _run(storm_async(target, source_ip, duration_s, concurrency=concurrency, family=family,
                            answer_timeout=answer_timeout, connect_timeout=connect_timeout,
                            max_connections=max_connections))


async def burst_async(target: Address, source_ip: str, count: int, *,
                      family: socket.AddressFamily | None = None, timeout: float = 60.0) -> list[Attempt]:
    """See `burst`."""
    if not 1 <= count <= MAX_BURST:
        raise ValueError(f"burst: count {count} is outside 1..{MAX_BURST}")
    family = _family_of(source_ip, family)
    _check_source(source_ip, family)
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    deadline = t0 + timeout
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(_client_socket(source_ip, family))
        # Phase 1: every connection connected (as far as TCP is concerned: the kernel completes the
        # handshake into the listener's backlog even while the proxy delays accepting).
        failures = await asyncio.gather(*(_connect(loop, s, target, deadline - time.monotonic())
                                          for s in socks))
        connected_at = time.monotonic() - t0
        # Phase 2: one request on each, then every answer by the deadline.

        async def finish(index: int, sock: socket.socket, connect: tuple[Outcome | None, str]) -> Attempt:
            outcome, failure = connect
            if outcome is not None:
                return Attempt(outcome, 0.0, None if outcome is Outcome.CONNECT_FAILED else connected_at,
                               connected_at, failure)
            failure = await _send(loop, sock, index + 1)
            if failure:
                return Attempt(Outcome.CLOSED, 0.0, connected_at, time.monotonic() - t0, failure)
            outcome, detail = await _answer(loop, sock, index + 1, deadline)
            return Attempt(outcome, 0.0, connected_at, time.monotonic() - t0, detail)

        return list(await asyncio.gather(*(finish(i, s, f) for i, (s, f) in
                                           enumerate(zip(socks, failures, strict=True)))))
    finally:
        for sock in socks:
            sock.close()


def burst(target: Address, source_ip: str, count: int, *, family: socket.AddressFamily | None = None,
          timeout: float = 60.0) -> list[Attempt]:
    """Open `count` connections from `source_ip` at once, all connected before any request is sent,
    then send ApiVersions v0 on each and wait for every answer, all within `timeout` seconds.

    One `Attempt` per connection, in order; `outcome` is the outcome ("served" ...), `finished` when
    it was known, `connected` when the last connect completed (the end of phase 1).
    """
    return _run(burst_async(target, source_ip, count, family=family, timeout=timeout))


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, or on a helper thread when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="storm") as pool:
        return pool.submit(asyncio.run, coro).result()
