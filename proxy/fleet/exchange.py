"""The fleet's I/O: usage datagrams to and from the other members (asyncio-dgram).

What is sent and how it is merged is decided by the pure half (quotas/fleet.py); this module only
moves datagrams and keeps time. One task sends: every `sync_interval_ms` the buckets whose rate
changed (`QuotaEngine.local_usage(changed_only=True)` through a `UsageTracker`), every
`full_sync_interval_ms` all of them, and at once (at most every URGENT_MIN_INTERVAL_MS) when the
hot path says a bucket's rate jumped; with each, the producer ids first seen here. Another task
receives: each datagram is verified and parsed by `decode_usage` and applied by `PeerUsage.accept`;
a rejected one is counted by reason and dropped, never applied. The request path never waits for
either: it reads the PeerUsage the receiver fills.

A member that hears from a new member (a first datagram from an unknown sender id, or a new
address from the membership) sends everything it has at once, so the newcomer starts from its
peers' state instead of from nothing; and a starting member waits (at most one and a half full
syncs) to hear from the members it knows before it opens its listeners.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections import defaultdict
from typing import TYPE_CHECKING, cast

import asyncio_dgram
from prometheus_client import CollectorRegistry, Counter, Gauge

from config.common import Address, SettingsError
from config.fleet import FleetSettings, check_name
from quotas.engine import QuotaEngine
from quotas.fleet import (
    MAX_DATAGRAM_BYTES,
    REJECT_REASONS,
    URGENT_MIN_INTERVAL_MS,
    DatagramRejected,
    PeerUsage,
    UsageEntry,
    UsageTracker,
    decode_usage,
    encode_usage,
)

from .membership import Membership

if TYPE_CHECKING:
    pass

log = logging.getLogger("kthrottle.fleet")

#: Datagrams handled in a row before the receiver lets the event loop serve connections: a burst
#: (a full sync of many entities, or a flood of forged datagrams) never stalls the request path.
RECEIVE_BATCH = 64
#: Datagrams sent in a row before the sender yields to the event loop, for the same reason.
SEND_BATCH = 64
#: Entries encoded in one go (about 10 datagrams, ~2 ms): a full report of many entities goes out
#: in slices, so the request path waits for one slice at most, not for the whole report.
ENCODE_SLICE = 1024
#: Buckets measured per slice of a full report (about 3.5 ms of the loop's time each).
MEASURE_SLICE = 1000
#: Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max): a full sync of 10,000
#: entities is about 200 datagrams per peer at once.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
#: Peer host names are looked up again this often (a member moved to a new address).
RESOLVE_EVERY_S = 30.0
#: Start-up waits this many full syncs at most to hear from the members it knows.
JOIN_WAIT_FULL_SYNCS = 1.5

_URGENT_MIN_INTERVAL_S = URGENT_MIN_INTERVAL_MS / 1000.0


def _show(address: Address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FleetMetrics:
    """The exchange's own metrics (the per-entity fleet rates are read by proxy/observability/metrics.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.members = Gauge("kthrottle_fleet_members",
                             "Fleet members heard from within stale_after_ms (3 full syncs), this one "
                             "included",
                             registry=r)
        self.peers = Gauge("kthrottle_fleet_peer_addresses",
                           "Addresses this member sends its usage to (from the static list or ZooKeeper)",
                           registry=r)
        self.sent = Counter("kthrottle_fleet_datagrams_sent", "Usage datagrams sent (one per peer)",
                            registry=r)
        self.bytes_sent = Counter("kthrottle_fleet_bytes_sent", "UDP payload bytes of the datagrams sent",
                                  registry=r)
        self.received = Counter("kthrottle_fleet_datagrams_received",
                                "Datagrams received on the fleet port (rejected ones included)", registry=r)
        self.bytes_received = Counter("kthrottle_fleet_bytes_received",
                                      "UDP payload bytes received on the fleet port", registry=r)
        self.rejected = Counter("kthrottle_fleet_datagrams_rejected",
                                "Datagrams dropped without being applied, by reason: malformed, bad_mac "
                                "(forged or another secret), replayed (or reordered), stale (clock skew "
                                "over 10 s), other_fleet", ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.send_errors = Counter("kthrottle_fleet_send_errors", "Datagrams the socket refused to send",
                                   registry=r)
        self.staleness = Gauge("kthrottle_fleet_peer_staleness_seconds",
                               "Time since the last datagram from each peer: its incarnation id (new at "
                               "every start) and the address its datagrams come from", ["peer", "address"],
                               registry=r)
        self.peer_entries = Gauge("kthrottle_fleet_peer_entries",
                                  "Usage entries peers reported that this member holds", registry=r)
        self.syncs = Counter("kthrottle_fleet_syncs", "Reports sent, by kind: delta, full, urgent",
                             ["kind"], registry=r)
        self._peer_labels: set[tuple[str, str]] = set()

    def set_staleness(self, by_peer: dict[tuple[str, str], float]) -> None:
        """(peer id, address) -> seconds; peers no longer listed lose their series."""
        for gone in self._peer_labels - by_peer.keys():
            self.staleness.remove(*gone)
        for labels, seconds in by_peer.items():
            self.staleness.labels(*labels).set(seconds)
        self._peer_labels = set(by_peer)


class FleetExchange:
    """One member's side of the usage exchange (see the module docstring)."""

    def __init__(self, engine: QuotaEngine, settings: FleetSettings, name: str, membership: Membership,
                 metrics: FleetMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.name = check_name(name)
        self.membership = membership
        self.metrics = metrics
        #: this incarnation's id: new at every start, so peers tell a restarted member from its past
        self.sender = secrets.randbits(64)
        self.peers = PeerUsage(engine.config.window.history_ms, settings.stale_after_ms,
                               own_sender=self.sender)
        self.tracker = UsageTracker()
        self._secret = settings.secret
        self._seq = 1
        self._stream: asyncio_dgram.aio.DatagramServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._full_now = True  # the first report is a full one: it announces this member
        self._urgent_pending = False
        self._last_urgent = 0.0
        self._next_full = 0.0
        #: membership addresses -> where datagrams go (host names looked up)
        self._targets: dict[Address, Address] = {}
        self._resolved_at = 0.0
        self._resolving: asyncio.Task[None] | None = None
        #: sender id -> the address its datagrams come from (for the staleness metric)
        self._sources: dict[int, str] = {}
        self._heard = asyncio.Event()
        self.bound: Address | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the UDP socket, attach the peers' usage to the engine, start sending and receiving."""
        settings = self.settings
        try:
            if settings.inherited_fd is not None:
                sock = socket.socket(fileno=settings.inherited_fd)
            else:
                host, port = settings.listen
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_DGRAM)
                sock.bind((host, port))
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            sock.setblocking(False)
            # not connected: asyncio-dgram gives a DatagramServer (its send takes an address)
            stream = cast(asyncio_dgram.aio.DatagramServer, await asyncio_dgram.from_socket(sock))
            self._stream = stream
        except OSError as exc:
            raise SettingsError(f"fleet.listen = {_show(settings.listen)!r}: cannot bind the UDP socket: "
                                f"{exc}") from exc
        self.bound = stream.sockname[:2]
        self.engine.attach_fleet(self.peers, on_urgent=self._on_urgent)
        self.membership.on_change = self._membership_changed
        await self.membership.start()
        await self._resolve()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._receive_loop())]
        log.info("fleet %r: member %016x on udp %s (advertised %s), %s membership, %d peer(s) known, "
                 "sync every %d ms, all every %d ms", self.name, self.sender, _show(self.bound),
                 _show(settings.advertised), settings.membership, len(self.membership.addresses),
                 settings.sync_interval_ms, settings.full_sync_interval_ms)

    async def wait_for_peers(self) -> int:
        """Wait until every member known has been heard from (bounded); returns how many were."""
        timeout = JOIN_WAIT_FULL_SYNCS * self.settings.full_sync_interval_ms / 1000.0
        deadline = time.monotonic() + timeout
        while len(self._heard_from()) < len(self.membership.addresses):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._heard.clear()
            try:
                await asyncio.wait_for(self._heard.wait(), left)
            except TimeoutError:
                break
        heard = len(self._heard_from())
        if heard < len(self.membership.addresses):
            log.info("fleet %r: heard from %d of %d peer(s) within %.1f s; going on (the others count "
                     "once they report)", self.name, heard, len(self.membership.addresses), timeout)
        return heard

    def _heard_from(self) -> dict[int, int]:
        return self.peers.members(int(time.monotonic() * 1000))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._resolving is not None:
            self._resolving.cancel()
        if self._stream is not None and self.settings.inherited_fd is None:
            self._stream.close()
        await self.membership.close()

    # -- who to send to ----------------------------------------------------------------------------

    def _membership_changed(self) -> None:
        """A member joined or left: look the addresses up (a newcomer then gets everything)."""
        self.metrics.peers.set(len(self.membership.addresses))
        if self._resolving is not None and not self._resolving.done():
            self._resolving.cancel()
        self._resolving = asyncio.get_running_loop().create_task(self._resolve())

    async def _resolve(self) -> None:
        """Host names to addresses (off the loop's thread); an address stays as it was if a lookup fails."""
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if self.bound is not None and ":" in self.bound[0] else socket.AF_INET
        targets: dict[Address, Address] = {}
        for address in self.membership.addresses:
            host, port = address
            try:
                socket.inet_pton(family, host)
                targets[address] = address
                continue
            except OSError:
                pass
            try:
                infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
                targets[address] = (str(infos[0][4][0]), port)
            except OSError as exc:
                log.warning("fleet: cannot resolve peer %s (%s); %s", _show(address), exc,
                            "keeping its last address" if address in self._targets else "not sent to yet")
                if address in self._targets:
                    targets[address] = self._targets[address]
        if set(targets.values()) - set(self._targets.values()):
            self._full_now = True  # a new member starts from everything this one knows
            self._wake.set()
        self._targets = targets
        self._resolved_at = time.monotonic()
        self.metrics.peers.set(len(self.membership.addresses))

    # -- sending -------------------------------------------------------------------------------

    def _on_urgent(self) -> None:
        """From the hot path: a bucket's rate jumped. No I/O here: wake the sender, no sooner than
        URGENT_MIN_INTERVAL_MS after the previous urgent report."""
        if self._urgent_pending:
            return
        self._urgent_pending = True
        loop = asyncio.get_running_loop()
        delay = self._last_urgent + _URGENT_MIN_INTERVAL_S - loop.time()
        if delay <= 0:
            self._wake.set()
        else:
            loop.call_later(delay, self._wake.set)

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        sync_s = self.settings.sync_interval_ms / 1000.0
        full_s = self.settings.full_sync_interval_ms / 1000.0
        next_sync = loop.time()
        while True:
            delay = next_sync - loop.time()
            if delay > 0 and not self._wake.is_set():
                timer = loop.call_later(delay, self._wake.set)
                await self._wake.wait()
                timer.cancel()
            self._wake.clear()
            now = loop.time()
            # A full report is due on the delta grid: half a sync early rather than one sync late
            # (a tick a little ahead of the full interval would otherwise make it every 1.1 s)
            if self._full_now or now >= self._next_full - sync_s / 2:
                kind = "full"
                self._full_now = False
                self._next_full = now + full_s
            elif now >= next_sync:
                kind = "delta"
            elif self._urgent_pending:
                kind = "urgent"
                self._last_urgent = now
            else:
                continue  # an urgent wake that a periodic report has served already
            if kind != "urgent":
                next_sync = max(next_sync + sync_s, now)
            # A delta or full listing serves any urgent request too (the engine resets it).
            self._urgent_pending = False
            try:
                await self._report(kind)
                if kind == "full":
                    self._housekeeping()
            except Exception:  # the exchange must outlive a bug in one report
                log.exception("fleet: sending a %s report failed", kind)

    async def _report(self, kind: str) -> None:
        """Send a "full" report (every bucket), a "delta" one (those that moved) or an "urgent" one
        (the buckets whose rise asked for it), with the producer ids first seen since the last."""
        if not self._targets:
            self.engine.take_new_producer_ids()  # nobody to tell
            return
        now_ms = int(time.monotonic() * 1000)
        full = kind == "full"
        engine = self.engine
        if full:
            # Measured a slice at a time, the loop serving connections in between: every bucket in
            # one go would hold the request path for ~35 ms per 10,000 buckets.
            usage: list[UsageEntry] = []
            for quota_type, keys in engine.full_listing():
                for start in range(0, len(keys), MEASURE_SLICE):
                    usage += engine.list_usage(quota_type, keys[start:start + MEASURE_SLICE],
                                               int(time.monotonic() * 1000))
                    if start + MEASURE_SLICE < len(keys):
                        await asyncio.sleep(0)
        else:
            usage = engine.urgent_usage(now_ms) if kind == "urgent" else engine.local_usage(now_ms, True)
        entries = self.tracker.due(usage, full)
        pids = engine.take_new_producer_ids()
        if not full and not entries and not pids:
            return
        self.metrics.syncs.labels(kind).inc()
        # Encoded and sent a slice at a time, the loop serving connections in between: one block of
        # 10,000 entries would hold the request path for ~20 ms.
        for start in range(0, max(1, len(entries)), ENCODE_SLICE):
            datagrams = encode_usage(self.name, self.sender, self._seq, int(time.time() * 1000), full,
                                     entries[start:start + ENCODE_SLICE], pids if start == 0 else (),
                                     self._secret, names=self.tracker.names)
            self._seq += len(datagrams)
            if not await self._send(datagrams):
                return
            if start + ENCODE_SLICE < len(entries):
                await asyncio.sleep(0)

    async def _send(self, datagrams: list[bytes]) -> bool:
        """Each datagram to every member; False once the socket is closed."""
        stream = self._stream
        assert stream is not None
        metrics = self.metrics
        sent = 0
        for target in list(self._targets.values()):
            for datagram in datagrams:
                try:
                    await stream.send(datagram, target)
                except OSError as exc:
                    metrics.send_errors.inc()
                    log.warning("fleet: sending to %s failed: %s", _show(target), exc)
                    break
                except asyncio_dgram.TransportClosed:
                    return False
                metrics.sent.inc()
                metrics.bytes_sent.inc(len(datagram))
                sent += 1
                if sent % SEND_BATCH == 0:
                    await asyncio.sleep(0)
        return True

    def _housekeeping(self) -> None:
        """Once a full sync: expire faded peer entries, refresh the metrics, look names up again."""
        now_ms = int(time.monotonic() * 1000)
        self.peers.expire(now_ms)
        members = self.peers.members(now_ms)
        fresh = sum(1 for age in members.values() if age <= self.settings.stale_after_ms)
        self.metrics.members.set(1 + fresh)
        self.metrics.peer_entries.set(len(self.peers))
        for sender in [sender for sender in self._sources if sender not in members]:
            del self._sources[sender]
        self.metrics.set_staleness({(f"{sender:016x}", self._sources.get(sender, "?")): age / 1000.0
                                    for sender, age in members.items()})
        if time.monotonic() - self._resolved_at > RESOLVE_EVERY_S and (
                self._resolving is None or self._resolving.done()):
            self._resolving = asyncio.get_running_loop().create_task(self._resolve())

    # -- receiving -----------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        stream = self._stream
        assert stream is not None
        handled = 0
        while True:
            try:
                data, source = await stream.recv()
            except asyncio_dgram.TransportClosed:
                return
            except OSError as exc:  # an error the socket reported for an earlier send
                log.debug("fleet: socket error %s", exc)
                continue
            try:
                self._receive(data, source)  # type: ignore[arg-type]  # an IP socket's (host, port)
            except Exception:  # nothing a datagram holds may stop the exchange
                log.exception("fleet: handling a datagram from %s failed", source)
            handled += 1
            if handled % RECEIVE_BATCH == 0:
                await asyncio.sleep(0)

    def _receive(self, data: bytes, source: tuple[str, int]) -> None:
        metrics = self.metrics
        metrics.received.inc()
        metrics.bytes_received.inc(len(data))
        now_ms = int(time.monotonic() * 1000)
        try:
            if len(data) > MAX_DATAGRAM_BYTES:
                raise DatagramRejected("malformed", f"{len(data)} bytes, more than {MAX_DATAGRAM_BYTES}")
            report = decode_usage(data, self._secret, self.name, int(time.time() * 1000))
            if report.sender == self.sender:
                return  # its own, sent to an address that turned out to be this member
            new_member = report.sender not in self._sources
            self.peers.accept(report, now_ms)
        except DatagramRejected as exc:
            metrics.rejected.labels(exc.reason).inc()
            log.warning("fleet: dropped a datagram from %s: %s", _show(source), exc)
            return
        self._sources[report.sender] = _show(source)
        if new_member:
            log.info("fleet %r: member %016x reports from %s", self.name, report.sender, _show(source))
            self._full_now = True  # it starts from everything this member knows
            self._wake.set()
            self._heard.set()
        if report.new_producer_ids:
            by_user: dict[str, list[int]] = defaultdict(list)
            for user, pid in report.new_producer_ids:
                by_user[user].append(pid)
            for user, pids in by_user.items():
                self.engine.learn_producer_ids(user, pids, now_ms)
