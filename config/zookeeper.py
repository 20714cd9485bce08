"""Quotas in ZooKeeper, in Kafka's own znode layout, shared by every proxy pointed at the same ensemble.

The quota source (and the admin API's store) that reads, watches and writes the nodes; where they live
and what they hold is ``config/zookeeper_layout.py`` (paths, change notifications) and
``config/config_form.py`` (entity paths, node data), and what a read of them means (or a write leaves
in one) is ``config/zookeeper_tree.py``.

How changes arrive: every node read sets a one-shot watch; any watch event or reconnection wakes one
background thread, which (after a short debounce) re-reads the whole tree, re-arming every watch, and
calls ``on_change`` when the resulting table differs. A full re-read is simple and cannot miss a change
that happened while watches were being re-armed, since each read arms its watch atomically. While
ZooKeeper is unreachable the last known table stays in force; kazoo reconnects by itself (also with a new
session after expiry) and the reconnection triggers a full resynchronisation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.interfaces import IAsyncResult
from kazoo.protocol.states import WatchedEvent, ZnodeStat
from kazoo.retry import KazooRetry

from quotas.engine import QuotaTable
from quotas.entity import QuotaEntity
from quotas.types import ConfigKey

from .config_form import PREFIXES, check_value, decode_config, encode_config, entity_path
from .zookeeper_layout import (
    CHANGE_PREFIX,
    NOTIFICATION_EXPIRY_S,
    change_notification,
    changes_path,
    client_of_user,
    config_root,
    is_change_notification,
    normalize_chroot,
)
from .zookeeper_tree import QuotaTree, altered_config

log = logging.getLogger("kthrottle.config.zookeeper")

#: Let a burst of watch events (one alter touches a node, its parents and /config/changes) settle into
#: one re-read; small next to the one second within which a change must be live.
DEBOUNCE_S = 0.05
#: Pause before re-reading after a failed read while still connected (a timeout, a node vanishing).
RETRY_S = 0.5
#: Attempts of one entity's read-modify-write when another writer changed it in between.
ALTER_ATTEMPTS = 5
#: Reconnection back-off cap: kazoo's default grows to an hour, far too slow to resynchronise promptly.
RECONNECT_MAX_DELAY_S = 2.0


class ZooKeeperQuotaError(RuntimeError):
    """ZooKeeper could not be reached, read or written; the message names the ensemble."""


class ZooKeeperQuotas:
    """The quota source (and the admin API's store) backed by ZooKeeper in Kafka's znode layout.

    ``on_change(table)`` gets the complete table: once from ``start()`` on the caller's thread, then from
    this object's background thread (not an event loop: marshal it, e.g. ``loop.call_soon_threadsafe``)
    whenever the table read from ZooKeeper differs from the last one delivered. The table passed is never
    mutated afterwards. An entity whose node holds invalid data keeps its last good values (an error names
    the entity, key and value); a node that disappears takes its entity out of the table.
    """

    #: the admin service applies a change at once; the watch confirms it
    applies_own_changes = False

    def __init__(
        self,
        hosts: str,
        chroot: str = "",
        *,
        on_change: Callable[[QuotaTable], None],
        timeout: float = 10.0,
    ) -> None:
        self.hosts = hosts
        self.chroot = normalize_chroot(chroot)
        self.timeout = timeout
        self._on_change = on_change
        self._root = config_root(self.chroot)
        self._where = f"{hosts}{self.chroot}"
        self._client: KazooClient | None = None
        self._lock = threading.Lock()
        self._table: QuotaTable = {}
        self._tree = QuotaTree(self._where, self._root)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_failure = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Connect (within ``timeout``), read every quota, deliver them once, then keep watching."""
        if self._client is not None:
            raise ZooKeeperQuotaError(f"the ZooKeeper quota source for {self._where} is already started")
        retry = KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=RECONNECT_MAX_DELAY_S)
        try:
            client = KazooClient(hosts=self.hosts, timeout=self.timeout, connection_retry=retry)
        except (ValueError, KazooException) as exc:
            raise ZooKeeperQuotaError(f"invalid ZooKeeper connect string {self.hosts!r}: {exc}") from exc
        try:
            client.start(timeout=self.timeout)
        except (KazooTimeoutError, KazooException, OSError) as exc:
            _close_quietly(client)
            reason = str(exc) or type(exc).__name__
            raise ZooKeeperQuotaError(
                f"cannot connect to ZooKeeper at {self.hosts} within {self.timeout:g} s: {reason}"
            ) from exc
        self._client = client
        client.add_listener(self._on_state)
        try:
            table = self._tree.table(self._read_tree(client), self._table)
        except Exception as exc:
            self._client = None
            _close_quietly(client)
            raise ZooKeeperQuotaError(
                f"cannot read the quotas in ZooKeeper at {self._where}: {exc!r}"
            ) from exc
        log.info(
            "ZooKeeper %s: %d quota entit%s loaded",
            self._where,
            len(table),
            "y" if len(table) == 1 else "ies",
        )
        self._deliver(table, force=True)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="kthrottle-zookeeper-quotas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and close the session; the last table stays readable through ``current()``."""
        self._stopping.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout + 5)
        client, self._client = self._client, None
        if client is not None:
            client.remove_listener(self._on_state)
            _close_quietly(client)

    def current(self) -> QuotaTable:
        """The last good table (a copy)."""
        with self._lock:
            return {entity: dict(values) for entity, values in self._table.items()}

    @property
    def connected(self) -> bool:
        """True while the session is connected (the table may be stale otherwise)."""
        client = self._client
        return client is not None and client.connected

    # ------------------------------------------------------------------ writes

    def alter(self, changes: Mapping[QuotaEntity, Mapping[ConfigKey, float | None]]) -> None:
        """Store quota changes (None removes a key) the way Kafka's ``ZkAdminManager`` did; blocking.

        Per entity, one ZooKeeper transaction does the read-modify-write (versioned, retried when another
        writer got in between) and creates the change notification ZooKeeper-mode brokers listen to. Other
        keys in the node (SCRAM credentials) are kept. A node left without config and without children is
        deleted, with its ``clients`` parent and user node when they become empty (Kafka 3.5+); otherwise it
        is written as ``{"version":1,"config":{}}``. Raises QuotaConfigError for an invalid value before
        anything is written, ZooKeeperQuotaError when ZooKeeper fails (entities listed before the failing
        one are stored).
        """
        for entity, ops in changes.items():
            entity_path(entity)
            for quota_type, value in ops.items():
                if value is not None:
                    check_value(entity, quota_type, value)
        client = self._client
        if client is None:
            raise ZooKeeperQuotaError(f"the ZooKeeper quota source for {self._where} is not started")
        if not client.connected:
            raise ZooKeeperQuotaError(f"not connected to ZooKeeper at {self.hosts}: quotas not stored")
        stored: list[str] = []
        for entity, ops in changes.items():
            try:
                self._alter_entity(client, entity, ops)
            except (KazooException, KazooTimeoutError, OSError) as exc:
                done = f" (already stored: {'; '.join(stored)})" if stored else ""
                raise ZooKeeperQuotaError(
                    f"storing quotas for {entity.describe()} in ZooKeeper at {self._where} failed: "
                    f"{exc!r}{done}"
                ) from exc
            stored.append(entity.describe())
        self._purge_notifications(client)

    def _alter_entity(
        self, client: KazooClient, entity: QuotaEntity, ops: Mapping[ConfigKey, float | None]
    ) -> None:
        relative = entity_path(entity)
        path = f"{self._root}/{relative}"
        changes = changes_path(self._root)
        notification = change_notification(relative)
        # No notification for a client-id prefix: a ZooKeeper-mode broker would read
        # users/<u>/client-id-prefix/<p> as client id <p> of user <u>. kthrottle watches the nodes.
        notify = entity.client_id_prefix is None
        for _attempt in range(ALTER_ATTEMPTS):
            data, stat = self._get_or_none(client, path)
            config = altered_config(data, ops, path, self._where)
            if notify:
                self._wait(client.ensure_path_async(changes))
            txn = client.transaction()
            if config or (stat is not None and stat.numChildren > 0):
                if stat is None:
                    self._wait(client.ensure_path_async(path.rsplit("/", 1)[0]))
                    txn.create(path, encode_config(config))
                else:
                    txn.set_data(path, encode_config(config), version=stat.version)
            elif stat is not None:
                for delete_path, version in self._empty_nodes(client, relative, path, stat):
                    txn.delete(delete_path, version=version)
            if notify:
                txn.create(f"{changes}/{CHANGE_PREFIX}", notification, sequence=True)
            results = self._wait(txn.commit_async())
            failures = [r for r in results if isinstance(r, Exception)]
            if not failures:
                return
            conflict = (BadVersionError, NodeExistsError, NoNodeError, NotEmptyError)
            if not any(isinstance(r, conflict) for r in failures):
                raise next((r for r in failures if not isinstance(r, RolledBackError)), failures[0])
            log.info("ZooKeeper %s: %s changed while being written; retrying", self._where, path)
        raise ZooKeeperQuotaError(
            f"storing quotas for {entity.describe()} in ZooKeeper at {self._where} failed: {path} kept "
            f"changing under {ALTER_ATTEMPTS} attempts"
        )

    def _empty_nodes(
        self, client: KazooClient, relative: str, path: str, stat: ZnodeStat
    ) -> list[tuple[str, int]]:
        """Nodes to delete, deepest first, with versions, for an entity left empty (tryCleanQuotaNodes)."""
        doomed = [(path, stat.version)]
        client_id = client_of_user(relative)
        if client_id is not None:  # users/<u>/clients/<c>: the clients node, then the user node, may go too
            # (users/<u>/client-id-prefix/<p> likewise)
            clients_path = path.rsplit("/", 1)[0]
            if self._wait(client.get_children_async(clients_path)) == [client_id]:
                doomed.append((clients_path, -1))
                user_path = clients_path.rsplit("/", 1)[0]
                user_data, user_stat = self._get_or_none(client, user_path)
                try:
                    user_config = decode_config(user_data)
                except ValueError:
                    user_config = {"<invalid>": True}  # unreadable data is no proof of emptiness
                if user_stat is not None and not user_config and user_stat.numChildren == 1:
                    doomed.append((user_path, user_stat.version))
        return doomed

    def _purge_notifications(self, client: KazooClient) -> None:
        """Delete change notifications older than Kafka's expiry, as its brokers would; best effort."""
        changes = changes_path(self._root)
        try:
            names = [n for n in self._wait(client.get_children_async(changes)) if is_change_notification(n)]
            pending = {name: client.exists_async(f"{changes}/{name}") for name in names}
            cutoff_ms = (time.time() - NOTIFICATION_EXPIRY_S) * 1000
            deletes = [
                client.delete_async(f"{changes}/{name}")
                for name, result in pending.items()
                if (stat := self._wait(result)) is not None and stat.ctime < cutoff_ms
            ]
            for result in deletes:
                with contextlib.suppress(NoNodeError):  # a broker purged it first
                    self._wait(result)
        except (KazooException, KazooTimeoutError) as exc:
            log.debug("ZooKeeper %s: purging old change notifications failed: %r", self._where, exc)

    # ------------------------------------------------------------------ reads

    def _wait(self, result: IAsyncResult) -> Any:
        """Every ZooKeeper call is bounded: kazoo's own ``get()`` would wait for a reconnection forever."""
        return result.get(timeout=self.timeout)

    def _get_or_none(self, client: KazooClient, path: str) -> tuple[bytes | None, ZnodeStat | None]:
        try:
            data, stat = self._wait(client.get_async(path))
        except NoNodeError:
            return None, None
        return data, stat

    def _watch(self, _event: WatchedEvent) -> None:
        """Any event on any node read (kazoo's callback thread): schedule a full re-read."""
        self._wake.set()

    def _children(self, client: KazooClient, path: str) -> list[str]:
        """Children of ``path`` with a child watch, or [] with an existence watch when it is missing."""
        for _attempt in range(3):
            try:
                return list(self._wait(client.get_children_async(path, watch=self._watch)))
            except NoNodeError:
                if self._wait(client.exists_async(path, watch=self._watch)) is None:
                    return []
        raise ZooKeeperQuotaError(f"{path} keeps appearing and disappearing")

    def _read_tree(self, client: KazooClient) -> dict[str, bytes]:
        """Data of every entity node, keyed by entity path; requests of one level are pipelined."""
        root = self._root
        watch = self._watch
        data_reads: dict[str, IAsyncResult] = {}
        user_reads: dict[str, IAsyncResult] = {}
        for user in self._children(client, f"{root}/users"):
            data_reads[f"users/{user}"] = client.get_async(f"{root}/users/{user}", watch=watch)
            user_reads[user] = client.get_children_async(f"{root}/users/{user}", watch=watch)
        for client_id in self._children(client, f"{root}/clients"):
            data_reads[f"clients/{client_id}"] = client.get_async(f"{root}/clients/{client_id}", watch=watch)
        for ip in self._children(client, f"{root}/ips"):
            data_reads[f"ips/{ip}"] = client.get_async(f"{root}/ips/{ip}", watch=watch)
        for prefix in self._children(client, f"{root}/{PREFIXES}"):
            relative = f"{PREFIXES}/{prefix}"
            data_reads[relative] = client.get_async(f"{root}/{relative}", watch=watch)
        client_lists: dict[tuple[str, str], IAsyncResult] = {}
        for user, result in user_reads.items():
            try:
                kinds = self._wait(result)
            except NoNodeError:
                continue  # deleted since listed: its watch has already scheduled another read
            for kind in ("clients", PREFIXES):  # client ids, and client-id prefixes (kthrottle's)
                if kind in kinds:
                    client_lists[(user, kind)] = client.get_children_async(
                        f"{root}/users/{user}/{kind}", watch=watch
                    )
        for (user, kind), result in client_lists.items():
            try:
                names = self._wait(result)
            except NoNodeError:
                continue
            for client_id in names:
                relative = f"users/{user}/{kind}/{client_id}"
                data_reads[relative] = client.get_async(f"{root}/{relative}", watch=watch)
        found: dict[str, bytes] = {}
        for relative, result in data_reads.items():
            try:
                data, _stat = self._wait(result)
            except NoNodeError:
                continue
            found[relative] = data or b""
        return found

    # ------------------------------------------------------------------ background thread

    def _on_state(self, state: str) -> None:
        """Connection state changes (kazoo's connection thread: must not block)."""
        if state == KazooState.CONNECTED:
            log.info("ZooKeeper %s: connected; resynchronising quotas", self._where)
            self._wake.set()
        elif state == KazooState.SUSPENDED:
            log.warning(
                "ZooKeeper %s: connection lost; keeping the last known quotas while reconnecting", self._where
            )
        elif state == KazooState.LOST:
            log.warning(
                "ZooKeeper %s: session lost; keeping the last known quotas, reconnecting with a new session",
                self._where,
            )

    def _run(self) -> None:
        """Re-read the tree after each burst of events, while connected; retry a failed read."""
        while not self._stopping.is_set():
            self._wake.wait()
            if self._stopping.wait(DEBOUNCE_S):
                return
            self._wake.clear()
            client = self._client
            if client is None or not client.connected:
                continue  # the CONNECTED state change wakes us again
            try:
                table = self._tree.table(self._read_tree(client), self._table)
            except Exception as exc:  # whatever it was, this thread must live on to resynchronise later
                failure = repr(exc)
                if failure != self._last_failure:
                    expected = isinstance(
                        exc, KazooException | KazooTimeoutError | ZooKeeperQuotaError | OSError
                    )
                    log.log(
                        logging.WARNING if expected else logging.ERROR,
                        "ZooKeeper %s: reading quotas failed (%s); keeping the last known quotas, retrying",
                        self._where,
                        failure,
                        exc_info=not expected,
                    )
                    self._last_failure = failure
                if not self._stopping.wait(RETRY_S):
                    self._wake.set()
                continue
            self._last_failure = ""
            self._deliver(table)

    def _deliver(self, table: QuotaTable, force: bool = False) -> None:
        with self._lock:
            changed = force or table != self._table
            self._table = table
        if not changed:
            return
        if not force:
            log.info(
                "ZooKeeper %s: quotas changed: %d entit%s",
                self._where,
                len(table),
                "y" if len(table) == 1 else "ies",
            )
        try:
            self._on_change(table)
        except Exception:
            log.exception("ZooKeeper %s: the quota change callback failed", self._where)


def _close_quietly(client: KazooClient) -> None:
    try:
        client.stop()
        client.close()
    except Exception as exc:  # closing must never mask the error being reported
        log.debug("closing the ZooKeeper client failed: %r", exc)


__all__ = ["ZooKeeperQuotaError", "ZooKeeperQuotas"]
