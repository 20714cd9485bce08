"""What one more TCP hop costs this machine, whatever the proxy does with the bytes.

A proxy reads every byte from one socket and writes it to another. On loopback that second hop
costs the kernel about as much CPU again as the first (segments, wake-ups, the receive path of the
next socket), and no user-space trick removes it: splice(2), which keeps the bytes in the kernel,
was measured here to cost the machine the same as recv/send. So when the direct path already keeps
every core busy (consumers reading from the page cache at GB/s on a 2-core machine), a proxy's
throughput ratio has a ceiling below 1 set by the machine, not by the proxy.

This measures that floor: a sender streams a file with sendfile(2) (as a broker serves a fetch)
to a receiver that reads into one buffer (as a consumer does), once directly and once through a
bare uvloop relay that forwards bytes without looking at them, the least any proxy can do.
The figure is whole-machine CPU per MB from /proc/stat, so it counts the kernel's work wherever
it is accounted. Linux only (sendfile, /proc); elsewhere `measure` returns None.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import NamedTuple

from . import cpu

MB = 1_000_000
FILE_BYTES = 64 * MB
RUN_BYTES = 600 * MB
ROUNDS = 7


def _relay_process(listener: socket.socket, target: tuple[str, int], ready: Connection) -> None:
    """Accept one connection and pass its bytes to `target`, as a bare proxy would."""
    import uvloop

    class Forward(asyncio.Protocol):
        def __init__(self) -> None:
            self.peer: asyncio.Transport | None = None
            self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            assert self.peer is not None
            self.peer.write(data)

        def eof_received(self) -> bool:
            assert self.peer is not None
            if not self.peer.is_closing():
                self.peer.write_eof()  # after what is still buffered
            return False

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.done.done():
                self.done.set_result(None)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        ready.send("listening")
        client, _ = await loop.sock_accept(listener)
        inbound = Forward()
        outbound = Forward()
        out_transport, _ = await loop.create_connection(lambda: outbound, *target)
        inbound.peer = out_transport
        in_transport, _ = await loop.connect_accepted_socket(lambda: inbound, client)
        outbound.peer = in_transport
        await outbound.done

    uvloop.run(serve())


def _sender(sock: socket.socket, path: str, total: int) -> None:
    with open(path, "rb") as source:
        sent = 0
        while sent < total:
            offset = sent % FILE_BYTES
            count = min(FILE_BYTES - offset, total - sent)
            sent += os.sendfile(sock.fileno(), source.fileno(), offset, count)
    sock.shutdown(socket.SHUT_WR)


def _receiver(sock: socket.socket, counted: list[int]) -> None:
    view = memoryview(bytearray(1 << 20))
    n = 0
    while chunk := sock.recv_into(view):
        n += chunk
    counted.append(n)


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


class Stream(NamedTuple):
    ms_per_mb: float
    mb_per_s: float


def _one_run(path: str, relay: bool) -> Stream:
    """Whole-machine CPU ms per MB, and MB/s, for one stream of RUN_BYTES."""
    sink = _listener()
    process = None
    if relay:
        front = _listener()
        parent, child = multiprocessing.Pipe()
        process = multiprocessing.get_context("fork").Process(
            target=_relay_process, args=(front, sink.getsockname(), child), daemon=True)
        process.start()
        ready = parent.poll(30)
        address = front.getsockname()
        for end in (front, parent, child):  # the relay process has its own copies
            end.close()
        if not ready:
            process.kill()
            raise RuntimeError("the relay process did not start")
    else:
        address = sink.getsockname()
    out = socket.create_connection(address)
    window = cpu.CpuWindow.open(os.getpid())
    began = time.monotonic()
    accepted, _ = sink.accept()
    counted: list[int] = []
    threads = [threading.Thread(target=_sender, args=(out, path, RUN_BYTES)),
               threading.Thread(target=_receiver, args=(accepted, counted))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    seconds = time.monotonic() - began
    usage = window.close()
    for sock in (out, accepted, sink):
        sock.close()
    if process is not None:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    if counted != [RUN_BYTES]:
        raise RuntimeError(f"the receiver got {counted} bytes, expected {RUN_BYTES}")
    if usage.busy is None:
        raise RuntimeError("/proc/stat gave no reading")
    megabytes = RUN_BYTES / MB
    return Stream(usage.busy * (os.cpu_count() or 1) * seconds * 1000 / megabytes, megabytes / seconds)


@dataclass(frozen=True)
class RelayFloor:
    direct_ms_per_mb: float
    relayed_ms_per_mb: float
    direct_mb_per_s: float
    relayed_mb_per_s: float

    @property
    def hop_ms_per_mb(self) -> float:
        """What the relay's extra hop costs the machine per MB."""
        return self.relayed_ms_per_mb - self.direct_ms_per_mb


def measure() -> RelayFloor | None:
    """Medians of alternating direct and relayed streams."""
    if not hasattr(os, "sendfile") or cpu.machine_ticks() is None:
        return None
    with tempfile.NamedTemporaryFile(prefix="kthrottle-relay-") as blob:
        blob.write(os.urandom(FILE_BYTES))
        blob.flush()
        direct: list[Stream] = []
        relayed: list[Stream] = []
        for _ in range(ROUNDS):
            direct.append(_one_run(blob.name, relay=False))
            relayed.append(_one_run(blob.name, relay=True))
    return RelayFloor(statistics.median(run.ms_per_mb for run in direct),
                      statistics.median(run.ms_per_mb for run in relayed),
                      statistics.median(run.mb_per_s for run in direct),
                      statistics.median(run.mb_per_s for run in relayed))


if __name__ == "__main__":
    floor = measure()
    print(floor, f"hop {floor.hop_ms_per_mb:.3f} ms/MB" if floor else "")
