"""Reading a PROXY protocol header (v1/v2) off an accepted socket, and nothing more.

The header is read with MSG_PEEK and then exactly its own length is consumed, so every byte after
it (a TLS ClientHello, the first Kafka request) stays in the kernel for whoever reads the socket
next: the TLS layer or the session. Nothing after the header is ever read here, so nothing can be
lost or need handing over. The parsing is `protocol.proxy_header`'s (pure); this module only waits
for bytes, within a deadline.
"""

from __future__ import annotations

import asyncio
import socket

from protocol.proxy_header import (
    MAX_V1_LENGTH,
    MAX_V2_LENGTH,
    ProxyHeader,
    ProxyHeaderError,
    ProxyHeaderReader,
)
from quotas.ip_entities import normalize_address

#: The most bytes a header can take: a peek never asks for more.
MAX_HEADER_BYTES = max(MAX_V1_LENGTH, MAX_V2_LENGTH)
#: A header split over segments: wait this long before peeking again (the socket stays readable
#: while its first bytes are unread, so waiting for readability alone would spin).
REPEEK_INTERVAL_S = 0.005


class ProxyHeaderTimeout(ProxyHeaderError):
    """No complete PROXY header within the deadline."""


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _read(sock: socket.socket, versions: frozenset[int]) -> ProxyHeader:
    loop = asyncio.get_running_loop()
    reader = ProxyHeaderReader(versions)
    seen = 0
    while True:
        await _readable(loop, sock)
        try:
            data = sock.recv(MAX_HEADER_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        if not data:
            raise ProxyHeaderError(f"the connection closed after {seen} bytes, before its PROXY header ended")
        if len(data) > seen:
            header = reader.feed(data[seen:])
            seen = len(data)
            if header is not None:
                consumed = sock.recv(header.length)  # peeked, so all of it is there
                if len(consumed) != header.length:
                    raise ProxyHeaderError(f"PROXY header of {header.length} bytes, {len(consumed)} read")
                return header
        await asyncio.sleep(REPEEK_INTERVAL_S)


async def read_proxy_header(sock: socket.socket, versions: frozenset[int], timeout_s: float) -> ProxyHeader:
    """The header at the start of `sock` (non-blocking); ProxyHeaderError naming what was wrong."""
    try:
        return await asyncio.wait_for(_read(sock, versions), timeout_s)
    except TimeoutError:
        raise ProxyHeaderTimeout(f"no complete PROXY header within {timeout_s:g} s") from None


def client_from_header(header: ProxyHeader, peer: tuple[str, int]) -> tuple[str, int]:
    """The client a header names; a LOCAL header (a load balancer's own health check) or one without
    addresses leaves the peer. An IPv4-mapped IPv6 source is the IPv4 client it maps."""
    if header.command != "PROXY" or header.source is None:
        return peer
    host, port = header.source
    return str(normalize_address(host)), port


__all__ = ["ProxyHeaderTimeout", "client_from_header", "read_proxy_header"]
