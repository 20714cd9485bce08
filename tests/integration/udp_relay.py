"""A lossy UDP relay between fleet members: fault injection in the test, never in the product.

One front port per member: every datagram that arrives on member i's front port goes on to
member i's real fleet port, except those the relay drops; some are held back and sent after the
next one to the same member (reordered). Members list each other's front ports as their peers, so
every datagram between them crosses the relay. It also keeps the last datagrams it passed on, for
a test to replay.
"""

from __future__ import annotations

import random
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

Address = tuple[str, int]

#: A held datagram goes on at the latest this long after it arrived, if no other comes to overtake it.
HOLD_MAX_S = 0.05
#: Datagrams kept per member for replays.
KEEP_RECENT = 32


@dataclass
class RelayCounts:
    forwarded: int = 0
    dropped: int = 0
    reordered: int = 0
    by_target: dict[int, int] = field(default_factory=dict)


class UdpRelay:
    """Relays datagrams to `targets[i]` from `front(i)`, dropping `loss` and reordering `reorder`."""

    def __init__(self, targets: list[Address], loss: float = 0.0, reorder: float = 0.0,
                 seed: int = 11) -> None:
        self.targets = list(targets)
        self.loss = loss
        self.reorder = reorder
        self.counts = RelayCounts()
        self._random = random.Random(seed)
        self._selector = selectors.DefaultSelector()
        self._sockets: list[socket.socket] = []
        for index in range(len(targets)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, index)
            self._sockets.append(sock)
        #: per target: a datagram held back to be sent after the next one, and when it arrived
        self._held: dict[int, tuple[bytes, float]] = {}
        self._recent: dict[int, deque[bytes]] = {i: deque(maxlen=KEEP_RECENT) for i in range(len(targets))}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="udp-relay", daemon=True)
        self._thread.start()

    def front(self, index: int) -> Address:
        host, port = self._sockets[index].getsockname()[:2]
        return str(host), int(port)

    def recent(self, index: int) -> list[bytes]:
        """The last datagrams passed on to member `index`, oldest first."""
        with self._lock:
            return list(self._recent[index])

    def _send(self, index: int, data: bytes) -> None:
        try:
            self._sockets[index].sendto(data, self.targets[index])
        except OSError:
            return  # the member is gone (killed): as the network would, say nothing
        with self._lock:
            self.counts.forwarded += 1
            self.counts.by_target[index] = self.counts.by_target.get(index, 0) + 1
            self._recent[index].append(data)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.01):
                index = key.data
                sock = self._sockets[index]
                while True:
                    try:
                        data, _source = sock.recvfrom(65536)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    self._relay(index, data)
            now = time.monotonic()
            for index, (data, since) in list(self._held.items()):
                if now - since >= HOLD_MAX_S:
                    del self._held[index]
                    self._send(index, data)

    def _relay(self, index: int, data: bytes) -> None:
        draw = self._random.random()
        if draw < self.loss:
            with self._lock:
                self.counts.dropped += 1
            return
        held = self._held.pop(index, None)
        if held is None and draw < self.loss + self.reorder:
            self._held[index] = (data, time.monotonic())
            with self._lock:
                self.counts.reordered += 1
            return
        self._send(index, data)
        if held is not None:
            self._send(index, held[0])  # overtaken

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._sockets:
            self._selector.unregister(sock)
            sock.close()
        self._selector.close()

    def __enter__(self) -> UdpRelay:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
