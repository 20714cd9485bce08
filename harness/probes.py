"""Is a local Kafka node ready? Hand-encoded probes on plain sockets.

Hand-encoded on purpose: the harness's readiness must not depend on the client libraries under test.
"""

from __future__ import annotations

import socket
import ssl
import struct
from pathlib import Path


def metadata_brokers(host: str, port: int, timeout: float) -> list[int]:
    """Send one Metadata v1 request (no topics) and return the node ids the broker lists.

    Hand-encoded on purpose: readiness must not depend on the client library under test.
    """
    client_id = b"kthrottle-harness"
    body = struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", recv_exact(sock, 4))[0]
        data = recv_exact(sock, size)
    pos = 4  # correlation id
    (count,) = struct.unpack_from(">i", data, pos)
    pos += 4
    nodes = []
    for _ in range(count):
        node_id, host_len = struct.unpack_from(">ih", data, pos)
        pos += 6 + host_len + 4  # host, port
        (rack_len,) = struct.unpack_from(">h", data, pos)
        pos += 2 + max(rack_len, 0)
        nodes.append(node_id)
    return sorted(nodes)


def accepts(host: str, port: int) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def handshakes(host: str, port: int, ca: Path) -> bool:
    """True when a TLS handshake on host:port verifies the server against ``ca``, hostname included."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection((host, port), timeout=2.0) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except OSError:  # ssl.SSLError is an OSError
        return False


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes, or ConnectionError if the broker closes first."""
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return bytes(buf)
