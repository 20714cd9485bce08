"""Kafka's Acceptor, for one listening socket: what happens to a connection before a session serves it.

In the order of Kafka's `Acceptor.accept` and `ConnectionQuotas.inc`, and before a byte of the
connection is read or a TLS handshake starts (a storm against a TLS listener costs no handshakes):

1. accept, then wait out the connection-creation rates (`max_connection_creation_rate` for the
   proxy, `listener_max_connection_creation_rate` for this listener): the accept loop pauses, at
   most one quota window, and nothing is refused;
2. on a listener with `proxy_protocol`, take the client's address from the PROXY header, only from a
   trusted load balancer (anything else is closed, with the reason logged);
3. the client address's `connection_creation_rate` (KIP-612): a connection over it is accepted but
   never read, and closed at the first turn of this accept loop after its throttle ends (Kafka's
   DelayedCloseSocket and `closeThrottledConnections`: a turn per accepted connection, or 500 ms
   without one; quotas/throttled_sockets.py); it is un-recorded, so a client that backs off is not
   charged twice. In a fleet, a connection past this member's part of the headroom waits a few
   milliseconds for the peers' next report and is checked again (quotas/connection_quotas.py's
   HEADROOM_SHARE), at most MAX_PEER_WAITING connections at a time;
4. `max_connections` and the per-IP counts (`max_connections_per_ip` and its overrides): refused
   at once with a clean close;
5. the session (`ClientSession`) takes the socket.

The arithmetic is `quotas.connection_quotas` (pure); this module only waits, reads and closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Protocol

from config.common import Address
from config.settings import ProxySettings
from protocol.proxy_header import ProxyHeaderError
from quotas.connection_quotas import PEER_WAITS, ConnectionQuotas
from quotas.shadow import ShadowLog
from quotas.throttled_sockets import ThrottledSockets
from quotas.types import QuotaType

from .client_address.proxy_header import client_from_header, read_proxy_header
from .limits.admission import ConnectionLimits
from .observability.connection_metrics import ConnectionMetrics

log = logging.getLogger("kthrottle.acceptor")


#: Backoff after accept() itself fails (out of descriptors, ENOBUFS): as Kafka's acceptor, log and
#: go on, without spinning on a listener that cannot accept.
ACCEPT_ERROR_BACKOFF_S = 0.1
#: Connections that may wait for the fleet's peers' report at once (each for PEER_WAITS x
#: PEER_WAIT_MS at most); past it a connection is decided by Kafka's formula at once.
MAX_PEER_WAITING = 1024


def listener_name(node_id: int | None) -> str:
    """The listener's name in metrics and in `listener_max_connection_creation_rate`'s accounting."""
    return "bootstrap" if node_id is None else f"broker-{node_id}"


class AcceptorContext(Protocol):
    """What the acceptors share (`ProxyServer` provides it)."""

    settings: ProxySettings
    limits: ConnectionLimits
    connection_quotas: ConnectionQuotas
    connection_metrics: ConnectionMetrics
    background: set[asyncio.Task[None]]
    #: where the proxy in shadow reports the ip throttles it does not apply (quotas/shadow.py)
    shadow_log: ShadowLog


class DelayedClose:
    """The runtime of `quotas.throttled_sockets`: closes what each acceptor turn returns.

    A turn is taken after every connection a listener accepts and, while the listener holds
    throttled connections, when its select would time out (one loop timer per listener, re-armed
    lazily: no task or timer per connection, nothing runs while nothing is held). While a listener's
    accept loop waits out a connection-creation rate, it takes no turn (Kafka's acceptor thread
    blocks in `waitForConnectionSlot`).
    """

    def __init__(self, max_throttled_connections: int) -> None:
        self.sockets: ThrottledSockets[socket.socket] = ThrottledSockets(max_throttled_connections)
        #: listener -> (its select timeout timer, when it is due in ms)
        self._timers: dict[str, tuple[asyncio.TimerHandle, int]] = {}
        self._waiting: set[str] = set()

    def hold(self, listener: str, sock: socket.socket, start_ms: int, throttle_ms: int) -> bool:
        """Keep `sock` (never read) until the first turn after its throttle; False: closed at once,
        the queues being full."""
        if not self.sockets.throttle(listener, sock, start_ms, throttle_ms):
            sock.close()
            return False
        self._arm(listener, _now_ms())
        return True

    def turn(self, listener: str, now_ms: int) -> None:
        """One turn of `listener`'s acceptor loop: close every socket whose throttle has ended."""
        for sock in self.sockets.turn(listener, now_ms):
            sock.close()
        self._arm(listener, now_ms)

    def waiting(self, listener: str, waits: bool) -> None:
        """The listener's accept loop waits out an accept delay (True) or goes on (False)."""
        if waits:
            self._waiting.add(listener)
        else:
            self._waiting.discard(listener)

    def _arm(self, listener: str, now_ms: int) -> None:
        due = self.sockets.next_turn_ms(listener, now_ms)
        armed = self._timers.get(listener)
        if due is None or (armed is not None and armed[1] <= due):
            return  # nothing held, or a timer fires first and re-arms then
        if armed is not None:
            armed[0].cancel()
        loop = asyncio.get_running_loop()
        handle = loop.call_at(loop.time() + (due - now_ms) / 1000.0, self._timeout, listener, due)
        self._timers[listener] = (handle, due)

    def _timeout(self, listener: str, due: int) -> None:
        self._timers.pop(listener, None)
        now_ms = _now_ms()
        if listener in self._waiting:
            return  # the accept loop turns when its wait ends
        if not self.sockets.select_timed_out(listener, due):  # a connection turned the loop since
            self._arm(listener, now_ms)
            return
        # the select timed out at `due` (the loop clock may read a millisecond early)
        self.turn(listener, max(now_ms, due))

    def close_all(self) -> None:
        for handle, _due in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for sock in self.sockets.drain():
            sock.close()

    def __len__(self) -> int:
        return self.sockets.held()


class Acceptor:
    """The accept loop of one listening socket."""

    def __init__(self, context: AcceptorContext, node_id: int | None, sock: socket.socket,
                 new_session: Callable[[Address], asyncio.Protocol], delayed: DelayedClose) -> None:
        self.context = context
        self.listener = listener_name(node_id)
        self.sock = sock
        self._new_session = new_session
        self._delayed = delayed
        client_addresses = context.settings.client_addresses
        self._proxy_versions = client_addresses.proxy_protocol
        self._trusts = client_addresses.trusts
        self._task: asyncio.Task[None] | None = None
        #: connections waiting for the fleet's peers' report, and their timers
        self._peer_waiting: dict[socket.socket, asyncio.TimerHandle] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"acceptor-{self.listener}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for conn, timer in self._peer_waiting.items():
            timer.cancel()
            conn.close()
        self._peer_waiting.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        quotas = self.context.connection_quotas
        metrics = self.context.connection_metrics
        while True:
            try:
                conn, peer = await loop.sock_accept(self.sock)
            except OSError as exc:
                metrics.accept_errors.inc()
                log.warning("listener %s: accept failed (%s); retrying in %g s", self.listener, exc,
                            ACCEPT_ERROR_BACKOFF_S)
                await asyncio.sleep(ACCEPT_ERROR_BACKOFF_S)
                continue
            conn.setblocking(False)
            delay_ms, reason = quotas.accept_delay(self.listener, _now_ms())
            if delay_ms > 0:
                metrics.accept_delayed(self.listener, reason, delay_ms)
                self._delayed.waiting(self.listener, True)
                try:
                    await asyncio.sleep(delay_ms / 1000.0)
                finally:
                    self._delayed.waiting(self.listener, False)
            try:
                self._accepted(conn, (str(peer[0]), int(peer[1])))
            except Exception:  # a bug must cost this connection, never the listener
                log.exception("listener %s: a connection from %s failed before its session",
                              self.listener, peer)
                conn.close()
            # the end of a turn of Kafka's acceptor loop: close the throttled connections whose time came
            self._delayed.turn(self.listener, _now_ms())

    def _accepted(self, conn: socket.socket, peer: Address) -> None:
        if not self._proxy_versions:
            self._admit(conn, peer, peer)
            return
        if not self._trusts(peer[0]):
            self.context.connection_metrics.refused("proxy_header")
            log.warning("listener %s: refused a connection from %s:%d: it is not in proxy_protocol_trusted, "
                        "so a PROXY header from it cannot be believed", self.listener, *peer)
            conn.close()
            return
        task = asyncio.get_running_loop().create_task(self._read_header(conn, peer))
        self.context.background.add(task)
        task.add_done_callback(self.context.background.discard)

    async def _read_header(self, conn: socket.socket, peer: Address) -> None:
        timeout_s = self.context.settings.connection_setup_timeout_ms / 1000.0
        try:
            header = await read_proxy_header(conn, self._proxy_versions, timeout_s)
        except (ProxyHeaderError, OSError) as exc:
            self.context.connection_metrics.refused("proxy_header")
            log.warning("listener %s: closed a connection from %s:%d: %s", self.listener, *peer, exc)
            conn.close()
            return
        self._admit(conn, client_from_header(header, peer), peer)

    def _admit(self, conn: socket.socket, client: Address, peer: Address, waits: int = 0) -> None:
        """Steps 3 to 5 for the connection's client address."""
        context = self.context
        metrics = context.connection_metrics
        ip = client[0]
        now_ms = _now_ms()
        self._peer_waiting.pop(conn, None)
        if context.settings.shadow or len(self._peer_waiting) >= MAX_PEER_WAITING:
            waits = PEER_WAITS  # in shadow nothing is held back; past the bound, Kafka's formula alone
        decision = context.connection_quotas.check_ip(self.listener, ip, now_ms, waits=waits)
        if decision.wait_ms:
            metrics.peer_wait(self.listener)
            self._peer_waiting[conn] = asyncio.get_running_loop().call_later(
                decision.wait_ms / 1000.0, self._admit, conn, client, peer, waits + 1)
            return
        if not decision.accepted and context.settings.shadow:
            # the proxy in shadow: reported as a throttle would be, and served
            metrics.throttled("ip_quota_shadow", self.listener)
            context.shadow_log.add(decision.bucket or ip, "", QuotaType.CONNECTION_CREATION.value,
                                   decision.throttle_ms)
        elif not decision.accepted:
            metrics.throttled("ip_quota", self.listener)
            log.debug("listener %s: %s:%d over its connection_creation_rate %g/s (%s): closed after %d ms",
                      self.listener, *client, decision.bound, decision.bucket, decision.throttle_ms)
            if not self._delayed.hold(self.listener, conn, now_ms, decision.throttle_ms):
                log.warning("listener %s: %d throttled connections already wait to be closed "
                            "(max_connections): closed one from %s:%d at once", self.listener,
                            len(self._delayed), *client)
            return
        refused = context.limits.admit(ip)
        if refused is not None:
            metrics.refused(refused.partition(" ")[0])
            log.warning("refused a connection from %s:%d%s: %s", *client,
                        "" if client == peer else f" (through {peer[0]}:{peer[1]})", refused)
            conn.close()
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve(conn, client))
        context.background.add(task)
        task.add_done_callback(context.background.discard)

    async def _serve(self, conn: socket.socket, client: Address) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(lambda: self._new_session(client), conn)
        except Exception as exc:
            self.context.limits.release(client[0])
            log.warning("listener %s: the connection from %s:%d could not be served: %s", self.listener,
                        *client, exc)
            conn.close()


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


__all__ = ["Acceptor", "AcceptorContext", "DelayedClose", "listener_name"]
