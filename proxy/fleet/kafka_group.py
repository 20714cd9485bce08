"""Fleet membership through the upstream cluster's group protocol (``membership = "kafka"``, issue 26).

Why: Kafka 4 has no ZooKeeper, and the cluster's group coordinator already does what a fleet needs:
it knows who is alive (heartbeats within the session timeout), and tells everyone when someone joins
or leaves (a rebalance). Kafka Connect's workers find each other the same way. The members join a
classic group of their own protocol type (``protocol.fleet_group``); the leader hands everyone the
whole member list with each one's advertised UDP address.

kafka-python's ``BaseCoordinator`` speaks the group protocol (JoinGroup, SyncGroup, Heartbeat,
LeaveGroup) on its client's I/O thread; its hooks run there and must not block. One driver thread of
ours keeps it joined: it rejoins when the coordinator asks (a member came or went) and tells the
coordinator it is alive (``poll_heartbeat``) well within the rebalance timeout. The list reaches the
event loop with ``call_soon_threadsafe``. While the cluster is away, the members known stay as they
are, as with ZooKeeper: who counts is decided by the signed datagrams, not by membership.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kafka.coordinator.base import BaseCoordinator

from config.common import Address, SettingsError
from protocol.fleet_group import (
    PROTOCOL_NAME,
    PROTOCOL_TYPE,
    Assignment,
    FleetGroupError,
    MemberMetadata,
    assign,
)

from .membership import Membership

log = logging.getLogger("kthrottle.fleet.membership")

#: Connect's session timeout: the coordinator drops a member killed with -9 at most this long after
#: its last heartbeat. Heartbeats every second (Connect: 3 s), so the others hear of the rebalance,
#: and have the new list, at most a second after that.
SESSION_TIMEOUT_MS = 10_000
HEARTBEAT_INTERVAL_MS = 1_000
#: How long a rebalance waits for every member to rejoin (Connect: 60 s); the driver rejoins at once.
REBALANCE_TIMEOUT_MS = 30_000
#: How often the driver looks whether the coordinator asked for a rejoin (a member came or went):
#: the others' new list is late by at most this, after the coordinator's own decision.
DRIVE_INTERVAL_S = 0.25
#: How long start-up waits to be in the group before refusing to start.
JOIN_TIMEOUT_S = 30.0
#: The group's name is this plus the fleet's: proxies in front of one cluster with one fleet name meet.
GROUP_PREFIX = "kthrottle-fleet."


def group_id(fleet_name: str) -> str:
    """The fleet's group on the upstream cluster."""
    return GROUP_PREFIX + fleet_name


class FleetCoordinator(BaseCoordinator):  # type: ignore[misc]
    """kafka-python's group member, with the fleet's protocol."""

    def __init__(self, client: Any, metadata: Callable[[], MemberMetadata],
                 on_assignment: Callable[[str, Assignment], None], **configs: Any) -> None:
        super().__init__(client, **configs)
        self._metadata = metadata
        self._on_assignment = on_assignment

    def protocol_type(self) -> str:
        return PROTOCOL_TYPE

    def group_protocols(self) -> list[tuple[str, bytes]]:
        return [(PROTOCOL_NAME, self._metadata().encode())]

    def _perform_assignment(self, leader_id: str, protocol: str, members: list[Any]) -> dict[str, bytes]:
        generation = self._generation.generation_id if self._generation is not None else 0
        joined = [(member.member_id, bytes(member.metadata)) for member in members]
        assignments, left_out = assign(generation, leader_id, joined)
        for line in left_out:
            log.warning("fleet membership: %s", line)
        return assignments

    async def _on_join_complete_async(self, generation: int, member_id: str, protocol: str,
                                      member_assignment_bytes: bytes) -> None:
        try:
            assignment = Assignment.decode(bytes(member_assignment_bytes))
        except FleetGroupError as exc:
            log.error("fleet membership: the leader's assignment is not this protocol's (%s); the members "
                      "known stay", exc)
            return
        self._on_assignment(member_id, assignment)


class KafkaMembership(Membership):
    """The members of the group ``group_id`` on the upstream cluster, this one excluded."""

    def __init__(self, client_configs: Mapping[str, Any], group_id: str, advertised: Address,
                 quota_offset: Callable[[], int] = lambda: -1) -> None:
        super().__init__()
        self._configs = dict(client_configs)
        self.group_id = group_id
        self.advertised = advertised
        self._quota_offset = quota_offset
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._coordinator: FleetCoordinator | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._joined = threading.Event()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(None, self._start)

    def _start(self) -> None:
        from kafka.errors import KafkaError
        from kafka.net.compat import KafkaNetClient

        where = f"fleet membership in group {self.group_id!r} at {self._configs.get('bootstrap_servers')}"
        try:
            client = KafkaNetClient(**self._configs)
            client._net.start()  # the I/O thread the heartbeats run on
            client._manager.bootstrap(int(JOIN_TIMEOUT_S * 1000))
            self._client = client
            self._coordinator = FleetCoordinator(
                client, self._metadata, self._assigned, group_id=self.group_id,
                session_timeout_ms=SESSION_TIMEOUT_MS, heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
                max_poll_interval_ms=REBALANCE_TIMEOUT_MS, api_version=client._manager.broker_version)
            if not self._coordinator.ensure_active_group(timeout_ms=int(JOIN_TIMEOUT_S * 1000)):
                raise SettingsError(f"{where}: not in the group within {JOIN_TIMEOUT_S:g} s")
        except KafkaError as exc:
            self._close()
            raise SettingsError(f"{where}: {exc!r} (the principal needs Group READ on "
                                f"{self.group_id!r})") from exc
        except BaseException:
            self._close()
            raise
        log.info("fleet membership in group %s as %s", self.group_id, _show(self.advertised))
        self._thread = threading.Thread(target=self._drive, name="kthrottle-fleet-group", daemon=True)
        self._thread.start()

    def _metadata(self) -> MemberMetadata:
        host, port = self.advertised
        return MemberMetadata(host, port, self._quota_offset())

    def _assigned(self, member_id: str, assignment: Assignment) -> None:
        """The I/O thread: the new list, handed to the event loop."""
        others = [(m.host, m.port) for m in assignment.members if m.member_id != member_id]
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._set, others)

    def _drive(self) -> None:
        """Rejoin when asked, report liveness, until closed; the cluster away is only logged."""
        from kafka.errors import KafkaError

        coordinator = self._coordinator
        assert coordinator is not None
        interval = DRIVE_INTERVAL_S
        away = False
        while not self._stopping.wait(interval):
            try:
                if coordinator.coordinator_unknown() or coordinator.need_rejoin():
                    coordinator.ensure_active_group(timeout_ms=REBALANCE_TIMEOUT_MS)
                coordinator.poll_heartbeat()
                if away:
                    log.info("fleet membership: back in group %s", self.group_id)
                away = False
            except KafkaError as exc:
                if not away:
                    log.warning("fleet membership: group %s unreachable (%r); exchanging with the %d "
                                "member(s) known until it is back", self.group_id, exc, len(self.addresses))
                away = True

    async def close(self) -> None:
        self._stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    def _close(self) -> None:
        if self._thread is not None:
            self._thread.join(REBALANCE_TIMEOUT_MS / 1000)
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            try:
                coordinator.close(timeout_ms=5000)  # LeaveGroup: the others rebalance at once
            except Exception as exc:  # leaving at shutdown: the session timeout removes it anyway
                log.debug("fleet membership: leaving the group: %r", exc)
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
