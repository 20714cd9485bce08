"""Who is in the fleet: the addresses a member sends its usage to.

Two sources: a static list from the `[fleet]` table, or ZooKeeper, where every member holds an
ephemeral sequential znode under `<chroot>/kthrottle/fleets/<name>/members` whose data is its
advertised "host:port" (kazoo; a ChildrenWatch tells every member when one joins or leaves).

Membership only says where to send. Who counts is decided by the datagrams themselves (a peer's
usage is used while it keeps reporting, and fades out over a quota window when it stops), so
ZooKeeper going away changes nothing at once: the members known stay as they are, the exchange
goes on, and kazoo reconnects by itself; on reconnection the member registers again if its
session expired, and the watch reports whatever changed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.recipe.watchers import ChildrenWatch
from kazoo.retry import KazooRetry

from config.common import Address, SettingsError, parse_address
from quotas.entity import sanitize

log = logging.getLogger("kthrottle.fleet.membership")

#: Where fleets live under the configured chroot (beside Kafka's /config, never inside it).
FLEETS_PATH = "/kthrottle/fleets"
#: Prefix of the members' ephemeral sequential znodes.
MEMBER_PREFIX = "member-"
#: Reconnection back-off cap, as for the quota source (config/zookeeper.py): kazoo's default grows
#: to an hour, far too slow to come back after an outage.
RECONNECT_MAX_DELAY_S = 2.0
#: How long start-up waits for ZooKeeper before refusing to start.
CONNECT_TIMEOUT_S = 10.0


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Membership:
    """The members to send to (this one excluded); `on_change` is called on the event loop."""

    def __init__(self) -> None:
        self.addresses: tuple[Address, ...] = ()
        self.on_change: Callable[[], None] | None = None

    def _set(self, addresses: Iterable[Address]) -> None:
        new = tuple(sorted(set(addresses)))
        if new == self.addresses:
            return
        joined = set(new) - set(self.addresses)
        left = set(self.addresses) - set(new)
        self.addresses = new
        if joined or left:
            log.info("fleet members: %d peer(s)%s%s", len(new),
                     f"; joined {', '.join(map(_show, sorted(joined)))}" if joined else "",
                     f"; left {', '.join(map(_show, sorted(left)))}" if left else "")
        if self.on_change is not None:
            self.on_change()

    async def start(self) -> None:
        """Find the first members (may raise SettingsError naming what is wrong)."""

    async def close(self) -> None:
        """Leave the fleet."""


class StaticMembership(Membership):
    """`fleet.peers`: every member listed, this one's own address skipped."""

    def __init__(self, peers: Iterable[Address], own: Iterable[Address]) -> None:
        super().__init__()
        self._peers = list(peers)
        self._own = set(own)

    async def start(self) -> None:
        self._set(peer for peer in self._peers if peer not in self._own)


class ZooKeeperMembership(Membership):
    """Ephemeral sequential znodes under `<chroot>/kthrottle/fleets/<name>/members`, watched."""

    def __init__(self, hosts: str, chroot: str, fleet_name: str, advertised: Address,
                 timeout: float = CONNECT_TIMEOUT_S) -> None:
        super().__init__()
        self.hosts = hosts
        self.path = f"{chroot.rstrip('/')}{FLEETS_PATH}/{sanitize(fleet_name)}/members"
        self.advertised = advertised
        self.timeout = timeout
        self._client: KazooClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the znode name this member holds (None while it holds none: before start, session lost)
        self._own: str | None = None
        #: child znode -> the address its data names (None: unreadable), so each is read once
        self._known: dict[str, Address | None] = {}
        self._lock = threading.Lock()
        self._watch: ChildrenWatch | None = None
        self._stopping = False

    @property
    def connected(self) -> bool:
        client = self._client
        return client is not None and client.connected

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(None, self._start)

    def _start(self) -> None:
        retry = KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=RECONNECT_MAX_DELAY_S)
        where = f"fleet.zookeeper {self.hosts!r}"
        try:
            client = KazooClient(hosts=self.hosts, timeout=self.timeout, connection_retry=retry)
        except (ValueError, KazooException) as exc:
            raise SettingsError(f"{where} is not a valid connect string: {exc}") from exc
        try:
            client.start(timeout=self.timeout)
        except (KazooTimeoutError, KazooException, OSError) as exc:
            _close_quietly(client)
            raise SettingsError(f"fleet membership: cannot connect to ZooKeeper at {self.hosts} within "
                                f"{self.timeout:g} s: {str(exc) or type(exc).__name__}") from exc
        self._client = client
        try:
            self._register(client)
        except (KazooException, KazooTimeoutError, OSError) as exc:
            self._client = None
            _close_quietly(client)
            raise SettingsError(f"fleet membership: cannot register in ZooKeeper at {self.hosts}{self.path}: "
                                f"{exc!r}") from exc
        client.add_listener(self._on_state)
        log.info("fleet membership in ZooKeeper %s%s as %s (%s)", self.hosts, self.path, self._own,
                 _show(self.advertised))

    def _register(self, client: KazooClient) -> None:
        """Create this member's znode (and the members path), and watch the members."""
        client.ensure_path(self.path)
        created = client.create(f"{self.path}/{MEMBER_PREFIX}", _show(self.advertised).encode(),
                                ephemeral=True, sequence=True)
        with self._lock:
            self._own = created.rsplit("/", 1)[1]
        watch = self._watch
        if watch is None or watch._stopped:  # a deleted members path stops a watch for good
            self._watch = ChildrenWatch(client, self.path, self._on_children)

    def _on_state(self, state: str) -> None:
        """kazoo's connection thread: note a lost session; re-register once connected again."""
        if state == KazooState.LOST:
            with self._lock:
                self._own = None
            log.warning("fleet membership: ZooKeeper session lost; exchanging with the %d member(s) known "
                        "until it is back", len(self.addresses))
        elif state == KazooState.SUSPENDED:
            log.warning("fleet membership: ZooKeeper at %s unreachable; exchanging with the %d member(s) "
                        "known until it is back", self.hosts, len(self.addresses))
        elif state == KazooState.CONNECTED and self._client is not None and not self._stopping:
            if self._own is None:
                self._client.handler.spawn(self._register_again)
            else:
                log.info("fleet membership: ZooKeeper back, same session")

    def _register_again(self) -> None:
        client = self._client
        if client is None or self._stopping:
            return
        try:
            self._register(client)
        except (KazooException, KazooTimeoutError, OSError) as exc:
            log.error("fleet membership: registering again in ZooKeeper failed (%r); retried on the next "
                      "reconnection", exc)
            return
        log.info("fleet membership: ZooKeeper back with a new session; registered again as %s", self._own)

    def _on_children(self, children: list[str]) -> None:
        """kazoo's callback thread: read new members' addresses, hand the list to the loop."""
        client = self._client
        if client is None:
            return
        known = self._known
        for child in children:
            if child in known:
                continue
            try:
                data, _stat = client.get(f"{self.path}/{child}")
                known[child] = parse_address(data.decode("utf-8"), f"fleet member {child}")
            except NoNodeError:
                continue  # left already
            except (SettingsError, UnicodeDecodeError) as exc:
                log.warning("fleet membership: %s/%s is not a member's address (%s); ignored", self.path,
                            child, exc)
                known[child] = None
            except (KazooException, KazooTimeoutError) as exc:
                log.warning("fleet membership: reading %s/%s failed (%r); read again on the next change",
                            self.path, child, exc)
                continue
        current = set(children)
        for gone in [child for child in known if child not in current]:
            del known[gone]
        with self._lock:
            own = self._own
        addresses = [address for child, address in known.items()
                     if address is not None and child != own and address != self.advertised]
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._set, addresses)

    async def close(self) -> None:
        self._stopping = True
        client, self._client = self._client, None
        if client is None:
            return
        client.remove_listener(self._on_state)
        await asyncio.get_running_loop().run_in_executor(None, self._leave, client)

    def _leave(self, client: KazooClient) -> None:
        own = self._own
        if own is not None and client.connected:
            with contextlib.suppress(KazooException, KazooTimeoutError):  # ephemeral: goes anyway
                client.delete(f"{self.path}/{own}")
        _close_quietly(client)


def _close_quietly(client: KazooClient) -> None:
    try:
        client.stop()
        client.close()
    except Exception as exc:  # closing must not hide why we close
        log.debug("closing the ZooKeeper client failed: %r", exc)

