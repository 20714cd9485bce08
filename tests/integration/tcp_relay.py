"""A TCP relay a test can cut: fault injection between a proxy and ZooKeeper, outside the product.

`cut()` closes every relayed connection and, until `restore()`, closes each new one at once, so
the client behind it sees the server as gone while the server itself keeps running (and expires
the client's session once its timeout passes, which stopping the server would not do).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

Address = tuple[str, int]


class TcpRelay:
    """Relays connections from `address` to `target` until cut."""

    def __init__(self, target: Address) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        #: socket -> its other end
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="tcp-relay", daemon=True)
        self._thread.start()

    @property
    def address(self) -> Address:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for sock in list(self._pairs):
                self._drop(sock)

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for sock in list(self._pairs):
                self._drop(sock)
        self._listener.close()
        self._selector.close()

    def _drop(self, sock: socket.socket) -> None:
        other = self._pairs.pop(sock, None)
        for end in (sock, other):
            if end is None:
                continue
            self._pairs.pop(end, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(end)
            end.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                with self._lock:
                    if key.data is None:
                        self._accept()
                    else:
                        self._pipe(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        if self._cut.is_set():
            self.refused += 1
            client.close()
            return
        try:
            server = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.close()
            return
        for end in (client, server):
            end.setblocking(False)
        self._pairs[client] = server
        self._pairs[server] = client
        self._selector.register(client, selectors.EVENT_READ, True)
        self._selector.register(server, selectors.EVENT_READ, True)

    def _pipe(self, sock: socket.socket) -> None:
        other = self._pairs.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(65536)
            if data:
                other.setblocking(True)
                other.sendall(data)
                other.setblocking(False)
                return
        except OSError:
            pass
        self._drop(sock)
