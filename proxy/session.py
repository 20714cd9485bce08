"""One client connection and its upstream broker connection, on asyncio: the I/O half of a session.

`ClientSession` moves bytes between the two sockets and carries out what its
`protocol.connection.ProxyConnection` decides (forward, answer, mute, close); `OrderedWriter` keeps
delayed and immediate chunks to one socket in order. Listeners and what all sessions share are in
server.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable, Hashable, Iterable

from protocol.apis import api_name
from protocol.connection import (
    Action,
    Authenticated,
    AwaitSlot,
    BrokersSeen,
    Close,
    Mute,
    ProxyConnection,
    QuotaAdmin,
    Throttled,
    ToBroker,
    ToClient,
)
from protocol.frames import TLS_ON_PLAINTEXT
from quotas.recent_traffic import RecentTraffic

from .acceptor import listener_name
from .observability.connection_row import ConnectionRow
from .ordered_writer import OrderedWriter, now_ms
from .session_context import SessionContext
from .tls import (
    CertificateRefused,
    client_certificate_principal,
    describe_handshake_error,
    describe_upstream_error,
    start_server_tls,
)
from .upstream.health import describe_error

log = logging.getLogger("kthrottle.proxy")

#: How long connecting to a broker may take (TCP); a TLS handshake gets its own timeout on top.
UPSTREAM_CONNECT_TIMEOUT_S = 10.0



class _Upstream(asyncio.Protocol):
    """The broker side of one proxied connection."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self.transport.set_write_buffer_limits(high=self.session.server.settings.connection_buffer_bytes)

    def data_received(self, data: bytes) -> None:
        self.session.on_broker_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.session.on_broker_lost(exc)

    def pause_writing(self) -> None:
        backlog = self.transport.get_write_buffer_size() if self.transport is not None else 0
        self.session.pause_client_reading(backlog)

    def resume_writing(self) -> None:
        self.session.resume_client_reading()


class ClientSession(asyncio.Protocol):
    """The client side of one proxied connection, bound to one broker (or a bootstrap server)."""

    _ids = itertools.count(1)

    def __init__(self, server: SessionContext, node_id: int | None, client: tuple[str, int]) -> None:
        """`client` is the address the acceptor admitted the connection under (and counted in the
        connection limits): the socket's peer, or the one a trusted PROXY header named."""
        self.server = server
        self.node_id = node_id
        self.id = next(self._ids)
        self.transport: asyncio.Transport | None = None
        self.upstream: _Upstream | None = None
        #: this session's side of its broker's concurrency limit (bootstrap connections,
        #: bound to no one broker, have none)
        self._slots = (server.broker_limits.for_session(node_id, self._slot_granted)
                       if node_id is not None else None)
        self.conn = ProxyConnection(server.advertise, max_request_bytes=server.settings.max_request_bytes,
                                    name=f"conn-{self.id}", policy=server.engine,
                                    throttle_mode=server.settings.throttle_mode,  # type: ignore[arg-type]
                                    observer=server.metrics.exchange,
                                    known_brokers=lambda: server.directory.addresses,
                                    partition_throttles=server.partition_throttles,
                                    topic_names=server.topic_names,
                                    health=(server.broker_health.observer(node_id)
                                            if server.broker_health is not None else None),
                                    admission=self._slots)
        self._pending: list[bytes] = []  # client bytes that arrived before the upstream was ready
        self._connecting: asyncio.Task[None] | None = None
        self._closing = False
        #: the client closed its side (as opposed to the proxy closing it for a reason)
        self._client_gone = False
        self._peer = f"[{client[0]}]:{client[1]}" if ":" in client[0] else f"{client[0]}:{client[1]}"
        #: why the client is not being read: "connecting", "backpressure", "throttle"
        self._read_blocks: set[str] = set()
        self._muted_until = 0.0
        self._unmute: asyncio.TimerHandle | None = None
        self._to_client = OrderedWriter()
        self._to_broker = OrderedWriter()
        self._ip = client[0]
        self._port = client[1]
        #: bytes each way over the last few seconds, for /connections (a few integer operations per read)
        self.traffic = RecentTraffic(now_ms())
        #: the throttle time last decided for this connection (ms), for /connections
        self._last_throttle_ms = 0
        #: counted by the connection limits (the acceptor admitted it; released once, when it ends)
        self._admitted = True
        self._setup_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        #: last traffic either way (now_ms), for connections_max_idle_ms
        self._last_active = 0.0
        #: request bytes queued for the broker while its connection is not taking them
        self._upstream_backlog = 0
        #: the client's TLS handshake is under way (its outcome, not connection_lost, ends it)
        self._handshaking = False
        self._lost_in_handshake = False

    # -- client side ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.sessions.add(self)
        self.server.metrics.connections.inc()
        tls = self.server.tls
        if tls is not None and tls.server is not None and tls.listener is not None:
            # The context current now serves this connection for its whole life (rotation).
            self._handshaking = True
            start_server_tls(transport, self, tls.server.current, tls.listener.handshake_timeout_ms / 1000.0,
                             self._tls_handshake_done)
            return
        self._start()

    def _tls_handshake_done(self, transport: asyncio.BaseTransport | None, exc: BaseException | None) -> None:
        """The client's TLS handshake ended: go on as a plaintext connection does, or say why not."""
        self._handshaking = False
        listener = self.server.tls.listener if self.server.tls is not None else None
        if transport is None or listener is None:
            if not self._closing:
                kind, text = describe_handshake_error(exc or ConnectionResetError(),
                                                      listener.handshake_timeout_ms if listener else 0)
                # A TCP probe (load balancer health check) connects and leaves: not worth a warning.
                self.close(text, kind=kind,
                           level=logging.DEBUG if kind == "tls_handshake_eof" else logging.WARNING)
            self.connection_lost(None)  # the SSL layer does not always report a failed handshake's end
            return
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        if self._lost_in_handshake or self._closing:
            transport.close()
            self.connection_lost(None)
            return
        try:
            principal = client_certificate_principal(transport, listener)
        except CertificateRefused as refused:
            self.close(refused.reason, kind=refused.kind)
            return
        except Exception:  # a bug must cost this connection, never leave it half-open
            log.exception("%s from %s: reading its certificate's principal failed",
                          self.conn.name, self._peer)
            self.close("its certificate's principal could not be read", kind="internal_error")
            return
        if principal is not None:
            self.conn.principal = principal
            log.info("%s from %s authenticated by its TLS certificate as principal %r",
                     self.conn.name, self._peer, principal)
        self._start()

    def _start(self) -> None:
        """Serve the connection (after its TLS handshake, if any): timers, then the broker connection."""
        settings = self.server.settings
        assert self.transport is not None
        self.transport.set_write_buffer_limits(high=settings.connection_buffer_bytes)
        self._to_client.transport = self.transport
        self._block("connecting")
        loop = asyncio.get_running_loop()
        self._last_active = now_ms()
        setup_s = settings.connection_setup_timeout_ms / 1000.0
        self._setup_timer = loop.call_later(setup_s, self._setup_expired)
        self._idle_timer = loop.call_later(settings.connections_max_idle_ms / 1000.0, self._idle_check)
        self._connecting = loop.create_task(self._connect_upstream())

    def _setup_expired(self) -> None:
        """connection_setup_timeout_ms: a connection must get going, or give its place back."""
        self._setup_timer = None
        if self._closing or self.conn.established:
            return
        timeout = self.server.settings.connection_setup_timeout_ms
        if self.upstream is None:  # still connecting to the broker: that has its own timeout
            self._setup_timer = asyncio.get_running_loop().call_later(timeout / 1000.0, self._setup_expired)
            return
        what = "finish its SASL exchange" if self.conn.sasl_in_progress else "send a complete request"
        self.close(f"did not {what} within {timeout} ms of connecting (connection_setup_timeout_ms)",
                   kind="setup_timeout")

    def _idle_check(self) -> None:
        """connections_max_idle_ms: close a connection nothing has used for that long."""
        self._idle_timer = None
        if self._closing:
            return
        idle_ms = self.server.settings.connections_max_idle_ms
        quiet = now_ms() - self._last_active
        busy = (self.conn.in_flight or self.conn.waiting_requests or self._unmute is not None
                or self._to_client.holding or self._to_broker.holding)
        if quiet >= idle_ms and not busy:
            self.close(f"idle for {quiet / 1000:.0f} s (connections_max_idle_ms = {idle_ms})",
                       kind="idle", level=logging.INFO)
            return
        wait = idle_ms - quiet if quiet < idle_ms else idle_ms
        self._idle_timer = asyncio.get_running_loop().call_later(max(wait, 1.0) / 1000.0, self._idle_check)

    async def _connect_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        tls_failed = False
        tls = self.server.tls
        upstream_tls = tls.upstream if tls is not None else None
        for host, port in self.server.upstream_for(self.node_id):
            timeout = UPSTREAM_CONNECT_TIMEOUT_S
            if upstream_tls is not None and tls is not None and tls.upstream_settings is not None:
                # server_hostname: the host the broker advertises (or the bootstrap entry), which is
                # what Kafka's ssl.endpoint.identification.algorithm=https checks too.
                handshake_s = tls.upstream_settings.handshake_timeout_ms / 1000.0
                timeout += handshake_s
                connecting = loop.create_connection(lambda: _Upstream(self), host, port,
                                                    ssl=upstream_tls.current, server_hostname=host,
                                                    ssl_handshake_timeout=handshake_s)
            else:
                connecting = loop.create_connection(lambda: _Upstream(self), host, port)
            try:
                _, protocol = await asyncio.wait_for(connecting, timeout=timeout)
            except (TimeoutError, OSError) as exc:
                tls_error = describe_upstream_error(exc) if upstream_tls is not None else None
                tls_failed = tls_failed or tls_error is not None
                errors.append(f"{host}:{port}: {tls_error or describe_error(exc, timeout)}")
                continue
            if self._closing and not self._client_gone:  # closed for a reason: nothing goes on
                protocol.transport.close()  # type: ignore[attr-defined]
                return
            self.upstream = protocol  # type: ignore[assignment]
            self._to_broker.transport = protocol.transport  # type: ignore[attr-defined]
            sock = protocol.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._pending:
                pending, self._pending = self._pending, []
                for data in pending:
                    self._feed(self.conn.receive_from_client, data, "client")
                self._account()
            if self._client_gone:
                # The client left before the broker connection was up: what it sent still goes
                # (an acks=0 Produce has no other chance), then this side closes too.
                protocol.transport.close()  # type: ignore[attr-defined]
                return
            self._unblock("connecting")
            return
        target = "bootstrap" if self.node_id is None else f"broker {self.node_id}"
        broker_health = self.server.broker_health
        if broker_health is not None and self.node_id is not None and errors and not tls_failed:
            broker_health.unreachable(self.node_id)  # the broker's own state: no client can fake it
        # While the upstream is known to be down, that was said once (upstream_health); not per client.
        level = logging.DEBUG if self.server.health.up is False and not tls_failed else logging.WARNING
        self.close(f"cannot reach {target} upstream ({'; '.join(errors) or 'address unknown'})",
                   kind="upstream_tls" if tls_failed else "upstream_unreachable", level=level)

    def data_received(self, data: bytes) -> None:
        if self._closing and not self._admitted:
            return
        if self.upstream is None:
            # uvloop starts reading after connection_made returns, whatever it asked: pause here,
            # so what waits for the broker connection is one read, not everything the client sends.
            self._pending.append(data)
            self.traffic.received(len(data), now_ms())
            if self.transport is not None:
                self.transport.pause_reading()
            return
        self._feed(self.conn.receive_from_client, data, "client")
        self.traffic.received(len(data), self._last_active)
        self._account()

    def _feed(self, receive: Callable[[bytes, float], list[Action]], data: bytes, side: str) -> None:
        now = self._last_active = now_ms()
        try:
            actions = receive(data, now)
        except Exception as exc:  # a bug must cost one connection, never the proxy
            log.exception("%s: unexpected error on %s data", self.conn.name, side)
            self.close(f"internal error on {side} data: {exc!r}", kind="internal_error")
            return
        self._execute(actions)

    # -- memory (queued_max_request_bytes) -------------------------------------------------------

    def _account(self) -> None:
        """Tell the pool what this connection holds and wants; stop reading if it must wait."""
        if self._closing:
            return
        pool = self.server.memory
        want = self.conn.request_memory_need + self._upstream_backlog
        if want == pool.held(self) and "memory" not in self._read_blocks:
            return
        holding = self.conn.request_bytes_held + self._upstream_backlog
        if pool.request(self, want, holding, self._memory_granted):
            self._unblock("memory")
        else:
            self._block("memory")

    def _memory_granted(self) -> None:
        self._unblock("memory")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshaking:  # the handshake's outcome ends the connection (_tls_handshake_done)
            self._lost_in_handshake = True
            return
        if not self._admitted:
            return
        self._admitted = False
        self.server.limits.release(self._ip)
        self.server.memory.release(self)
        for timer in (self._setup_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._setup_timer = self._idle_timer = None
        self.server.sessions.discard(self)
        self.server.metrics.connections.dec()
        if self._unmute is not None:
            self._unmute.cancel()
            self._unmute = None
            self.server.metrics.muted.dec()
        self._to_client.close()
        self._closing = True
        self._client_gone = True
        self._give_back_slots()
        if self.conn.waiting_requests and self.upstream is not None:
            # Requests read while muted still go on once the mute has passed, as a broker reads
            # what a closed connection sent before it: an acks=0 Produce has no other chance.
            self._drain_after_client_left()
            return
        self._to_broker.close()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()

    def _drain_after_client_left(self) -> None:
        upstream = self.upstream
        if upstream is None or upstream.transport is None or upstream.transport.is_closing():
            return
        actions = self.conn.resume(now_ms())
        for action in actions:
            if isinstance(action, ToBroker):
                self._to_broker.write(action.chunks, action.delay_ms)
        wait = max((a.ms for a in actions if isinstance(a, Mute)), default=0)
        if self.conn.waiting_requests and wait > 0:
            asyncio.get_running_loop().call_later(wait / 1000.0, self._drain_after_client_left)
            return
        upstream.transport.close()  # after the writes above: close() flushes the write buffer

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # -- broker side ----------------------------------------------------------------------------

    def on_broker_data(self, data: bytes) -> None:
        self._feed(self.conn.receive_from_broker, data, "broker")

    def on_broker_lost(self, exc: Exception | None) -> None:
        if self._closing:
            return
        # The client sees its connection drop, as if the broker had gone, and retries.
        detail = f": {exc}" if exc else ""
        if self.conn.in_flight:
            log.info("%s %s: broker closed with %d request(s) in flight%s",
                     self.conn.name, self._peer, self.conn.in_flight, detail)
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def pause_client_reading(self, backlog: int) -> None:
        self._block("backpressure")
        self._upstream_backlog = backlog
        self._account()

    def resume_client_reading(self) -> None:
        self._unblock("backpressure")
        self._upstream_backlog = 0
        self._account()

    def _block(self, reason: str) -> None:
        if not self._read_blocks and self.transport is not None:
            self.transport.pause_reading()
        self._read_blocks.add(reason)

    def _unblock(self, reason: str) -> None:
        self._read_blocks.discard(reason)
        if not self._read_blocks and self.transport is not None and not self._closing:
            self.transport.resume_reading()

    # -- throttling ----------------------------------------------------------------------------

    # -- the broker's concurrency limit -------------------------------------------------

    def _slot_granted(self, ticket: Hashable) -> None:
        """A Produce that waited for its broker's slot has it (a later loop turn than the grant)."""
        if self._slots is None:
            return
        if self._closing or not self.conn.awaiting_slot:
            self._slots.done(ticket, None)  # nobody to use it
            return
        self._unblock("slot")
        self._feed(lambda _data, now: self.conn.slot_granted(ticket, now), b"", "client")
        self._account()

    def _give_back_slots(self) -> None:
        """The client left or was closed: its slots go back, and it waits for none."""
        if self._slots is None:
            return
        self._slots.close()
        for ticket in self.conn.release_slots():
            self._slots.done(ticket, None)

    def _mute(self, ms: int) -> None:
        """KIP-219: the response went out at once; now stop reading until the throttle passes."""
        if self._client_gone:
            return
        until = now_ms() + ms
        if until <= self._muted_until:
            return
        self._muted_until = until
        if self._unmute is None:
            self.server.metrics.muted.inc()
        else:
            self._unmute.cancel()
        self._block("throttle")
        self._unmute = asyncio.get_running_loop().call_later(ms / 1000.0, self._end_mute)

    def _end_mute(self) -> None:
        self._unmute = None
        self.server.metrics.muted.dec()
        self._muted_until = 0.0
        self._unblock("throttle")
        # Requests read before the mute began now go on (or re-arm the mute if it fired early).
        self._feed(lambda _data, now: self.conn.resume(now), b"", "client")
        self._account()

    # -- actions --------------------------------------------------------------------------------

    def _execute(self, actions: Iterable[object]) -> None:
        for action in actions:
            if isinstance(action, ToBroker):
                self._to_broker.write(action.chunks, action.delay_ms)
            elif isinstance(action, ToClient):
                self._to_client.write(action.chunks, action.delay_ms)
                self.traffic.sent(sum(map(len, action.chunks)), self._last_active)
            elif isinstance(action, Mute):
                self._mute(action.ms)
            elif isinstance(action, AwaitSlot):
                self._block("slot")
            elif isinstance(action, Throttled):
                self.server.metrics.throttled.labels(api_name(action.api_key)).inc()
                self._last_throttle_ms = action.throttle_ms
                log.debug("%s throttled %s for %d ms (principal %r, client id %r)", self.conn.name,
                          api_name(action.api_key), action.throttle_ms, self.conn.principal,
                          self.conn.client_id)
            elif isinstance(action, BrokersSeen):
                self.server.learn(action.addresses)
            elif isinstance(action, Authenticated):
                log.info("%s from %s authenticated as principal %r (%s)",
                         self.conn.name, self._peer, action.principal, action.mechanism)
            elif isinstance(action, QuotaAdmin):
                # Later requests wait inside the connection; stop reading meanwhile (bounded memory).
                self._block("quota-admin")
                task = asyncio.get_running_loop().create_task(self._answer_quota_admin(action))
                self.server.background.add(task)
                task.add_done_callback(self.server.background.discard)
            elif isinstance(action, Close):
                self.close(action.reason, kind="tls_on_plaintext" if TLS_ON_PLAINTEXT in action.reason
                           else "bad_data")

    async def _answer_quota_admin(self, request: QuotaAdmin) -> None:
        try:
            response = await self.server.quota_admin.answer(request)
        except Exception as exc:  # a bug must cost one connection, never the proxy
            log.exception("%s: answering %s failed", self.conn.name, api_name(request.api_key))
            self.close(f"internal error answering {api_name(request.api_key)}: {exc!r}",
                       kind="internal_error")
            return
        if self._closing:
            return
        self._execute(self.conn.answer_quota_admin(response, now_ms()))
        self._unblock("quota-admin")
        self._account()

    # -- /connections ---------------------------------------------------------------------------

    def describe(self, now: float) -> ConnectionRow:
        """This connection as /connections shows it (read on the event loop, between callbacks)."""
        conn = self.conn
        software = conn.client_software
        bytes_in, bytes_out = self.traffic.rates(now)
        return ConnectionRow(
            connection=conn.name, address=self._ip, port=self._port, listener=listener_name(self.node_id),
            principal=conn.principal, client_id=conn.client_id,
            software_name=software.name if software is not None else None,
            software_version=software.version if software is not None else None,
            age_seconds=max(now - self.traffic.started_ms, 0.0) / 1000.0,
            bytes_in_per_second=bytes_in, bytes_out_per_second=bytes_out,
            throttle_ms=max(int(self._muted_until - now), 0) if self._unmute is not None else 0,
            last_throttle_ms=self._last_throttle_ms)

    def close(self, reason: str, *, kind: str = "other", level: int = logging.WARNING) -> None:
        """Close both sides; `kind` labels kthrottle_connections_closed, `reason` is logged."""
        if self._closing:
            return
        log.log(level, "%s from %s closed: %s", self.conn.name, self._peer, reason)
        self.server.metrics.closed.labels(kind).inc()
        self._closing = True
        self._give_back_slots()
        self.server.memory.release(self)
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self.transport is not None:
            self.transport.close()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
