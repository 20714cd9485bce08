"""Ports for the servers the harness and the tests start: below the kernel's ephemeral range, and one
slice of that range per process that runs tests side by side.

Why: a port is picked free here but bound later, by a JVM or a proxy that takes seconds to start.
- An ephemeral port can be taken meanwhile by any outgoing connection (the storm tests open tens of
  thousands, from 127.0.0.2 ... 127.0.0.9). A port below the ephemeral range is taken only by an
  explicit bind.
- pytest-xdist workers each search their own slice (``KTHROTTLE_PORTS``, set per worker by the root
  conftest.py), so two workers never race for one port.
- Within one process, a random starting point and the set of ports handed out in the last
  ``_HELD_S`` seconds keep two servers of one test from being given the same port before either is
  bound.

Environment variable:
    KTHROTTLE_PORTS   ``LO-HI``, the ports this process may hand out (HI excluded); default
                      ``LOWEST`` up to the first ephemeral port.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
import time
from pathlib import Path

PORTS_ENV = "KTHROTTLE_PORTS"

#: The bottom of the range: above the ports of the services a developer runs beside the tests (Kafka's
#: 9092, ZooKeeper's 2181, Prometheus' 9090, `make run`'s metrics on 9300).
LOWEST = 10_000

#: How long a port handed out stays reserved in this process (a JVM binds its ports within this).
_HELD_S = 300.0
_handed_out: dict[int, float] = {}
#: Held while a search picks and reserves a block: tests start several servers from threads at once
#: (a fleet's members), and two searches once picked one metrics port between check and reservation
#: (h36: "failed to bind to 0.0.0.0:21054 (metrics_port): Address already in use").
_searching = threading.Lock()


def ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def whole_range() -> tuple[int, int]:
    """Every port the harness may use on this machine, before it is split between workers."""
    return LOWEST, ephemeral_low()


def worker_slice(index: int, count: int, within: tuple[int, int]) -> tuple[int, int]:
    """Worker ``index`` of ``count``'s share of the range ``within``: disjoint, contiguous, equal."""
    if not 0 <= index < count:
        raise ValueError(f"worker index {index} is not in 0..{count - 1}")
    low, high = within
    size = (high - low) // count
    return low + index * size, low + (index + 1) * size


def port_range() -> tuple[int, int]:
    """This process's ports: ``KTHROTTLE_PORTS`` if set (checked), else ``whole_range``."""
    given = os.environ.get(PORTS_ENV)
    if not given:
        return whole_range()
    try:
        low_text, high_text = given.split("-")
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise RuntimeError(f"{PORTS_ENV}={given!r} is not LO-HI (two port numbers)") from None
    if not 1024 <= low < high <= 65536:
        raise RuntimeError(f"{PORTS_ENV}={given!r}: need 1024 <= LO < HI <= 65536")
    return low, high


def port_free(port: int, host: str = "0.0.0.0", kind: socket.SocketKind = socket.SOCK_STREAM) -> bool:
    """Can ``host:port`` be bound now (TCP, or UDP with ``kind`` SOCK_DGRAM)? The wildcard address also
    sees a socket bound to any one address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise RuntimeError(f"cannot bind {host}:{port} to test it: {exc}") from exc
    return True


def _held(port: int, now: float) -> bool:
    at = _handed_out.get(port)
    return at is not None and now - at < _HELD_S


def free_port_block(size: int, host: str = "0.0.0.0", kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    """A port P with P .. P+size-1 all free and not handed out recently (a proxy maps node N to
    P + 1 + N). Raises naming the range when none is left."""
    low, high = port_range()
    span = high - low - size
    if span <= 0:
        raise RuntimeError(f"no block of {size} ports fits in {low}-{high} ({PORTS_ENV})")
    with _searching:
        now = time.monotonic()
        first = low + random.randrange(span)
        for base in [*range(first, high - size, size + 1), *range(low, first, size + 1)]:
            block = range(base, base + size)
            if not any(_held(p, now) for p in block) and all(port_free(p, host, kind) for p in block):
                for p in block:
                    _handed_out[p] = now
                return base
    raise RuntimeError(f"no block of {size} free ports in {low}-{high} ({PORTS_ENV})")


def free_ports(count: int, host: str = "0.0.0.0") -> list[int]:
    """``count`` distinct free TCP ports, not necessarily adjacent (a broker's listeners)."""
    return [free_port_block(1, host) for _ in range(count)]


def free_udp_port(host: str = "0.0.0.0") -> int:
    """A free UDP port (a fleet member's datagram address)."""
    return free_port_block(1, host, socket.SOCK_DGRAM)
