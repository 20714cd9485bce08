"""Which new client connections the proxy takes: Kafka's max.connections and max.connections.per.ip.

A broker past max.connections stops accepting until a connection closes; past
max.connections.per.ip it closes the new connection at once. The proxy closes the new
connection at once in both cases: a client then sees a clean close and retries with its
reconnect backoff, instead of hanging in the listen backlog, and the descriptors stay free for
the connections already open (and for /metrics).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Protocol

#: Descriptors kept free for everything that is not a client connection: listeners, the metrics
#: server and its scrapes, ZooKeeper, upstream probes, log files.
RESERVED_DESCRIPTORS = 64
#: Each client connection holds two descriptors: the client's socket and the broker's.
DESCRIPTORS_PER_CONNECTION = 2


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Kafka's start scripts expect of ulimit);
    returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connections_for_descriptors(descriptor_limit: int) -> int:
    """The most client connections that fit in `descriptor_limit` descriptors."""
    return max((descriptor_limit - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION, 1)


class PerIpCounter(Protocol):
    """Open connections per client address with their limits (`ConnectionQuotas.inc`/`dec`:
    `max_connections_per_ip` and its overrides by address or CIDR prefix)."""

    def inc(self, address: str) -> str | None: ...

    def dec(self, address: str) -> None: ...


@dataclass(slots=True)
class ConnectionLimits:
    """Counts open client connections, in total and per client address.

    The per-address count is `per_ip_counter`'s when one is given (the proxy's connection quotas,
    which know the overrides); otherwise a plain count against `max_connections_per_ip`.
    """

    max_connections: int
    max_connections_per_ip: int | None = None
    total: int = 0
    per_ip: dict[str, int] = field(default_factory=dict)
    per_ip_counter: PerIpCounter | None = None

    def admit(self, ip: str) -> str | None:
        """Count a new connection from `ip`; returns why it is refused (then nothing is counted)."""
        if self.total >= self.max_connections:
            return f"max_connections = {self.max_connections} reached"
        if self.per_ip_counter is not None:
            refused = self.per_ip_counter.inc(ip)
            if refused is not None:
                return refused
            self.total += 1
            return None
        count = self.per_ip.get(ip, 0)
        if self.max_connections_per_ip is not None and count >= self.max_connections_per_ip:
            return f"max_connections_per_ip = {self.max_connections_per_ip} reached for {ip}"
        self.total += 1
        self.per_ip[ip] = count + 1
        return None

    def release(self, ip: str) -> None:
        """A connection `admit` counted has closed."""
        self.total -= 1
        if self.per_ip_counter is not None:
            self.per_ip_counter.dec(ip)
            return
        count = self.per_ip.get(ip, 0) - 1
        if count > 0:
            self.per_ip[ip] = count
        else:
            self.per_ip.pop(ip, None)
