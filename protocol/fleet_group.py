"""The fleet's own group protocol on the upstream cluster: what a member says when it joins, and the
member list the leader hands everyone. Pure: bytes in, values out.

Why a group: Kafka 4 has no ZooKeeper, and Kafka's group coordinator already tells every member who
else is in a group, as Kafka Connect's workers find each other. The members join a classic group with
``PROTOCOL_TYPE`` (so no consumer can join it by mistake: the coordinator refuses a second protocol
type); each one's metadata carries its advertised UDP address and how far it has read the quota
topic. Only the leader sees every member's metadata, so the assignment carries the whole list, the
same for everyone, with the furthest quota-topic offset any member reported (Connect's config offset):
a member behind it reads the topic that far before it trusts its quotas.

Both documents are small JSON objects: the coordinator keeps them as opaque bytes, and a version field
lets a later format live beside this one. Decoding checks sizes and every field, and raises
``FleetGroupError`` naming what was wrong; a member whose metadata is malformed is left out of the
list, named, and nothing else changes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PROTOCOL_TYPE = "kthrottle-fleet"
PROTOCOL_NAME = "v1"
VERSION = 1
#: What one member's metadata may take: an address and an offset need far less.
MAX_METADATA_BYTES = 1024
#: The assignment lists every member: 64 KiB holds hundreds.
MAX_ASSIGNMENT_BYTES = 64 * 1024
_MAX_HOST = 255


class FleetGroupError(ValueError):
    """Metadata or an assignment that is not this protocol's: the message says what was wrong."""


@dataclass(frozen=True)
class MemberMetadata:
    """What a member says of itself when it joins."""

    host: str
    port: int
    #: The offset after the last quota record it has read (-1: it keeps no quotas in the cluster).
    quota_offset: int

    def encode(self) -> bytes:
        _check_address(self.host, self.port)
        return _dump({"version": VERSION, "host": self.host, "port": self.port,
                      "quota_offset": self.quota_offset})

    @classmethod
    def decode(cls, data: bytes) -> MemberMetadata:
        document = _load(data, MAX_METADATA_BYTES, "member metadata")
        host, port = _address(document, "member metadata")
        return cls(host, port, _offset(document, "member metadata"))


@dataclass(frozen=True)
class Member:
    member_id: str
    host: str
    port: int


@dataclass(frozen=True)
class Assignment:
    """What the leader hands every member: the generation, the leader and the whole list."""

    generation: int
    leader: str
    members: tuple[Member, ...]
    quota_offset: int

    def encode(self) -> bytes:
        for member in self.members:
            _check_address(member.host, member.port)
        data = _dump({"version": VERSION, "generation": self.generation, "leader": self.leader,
                      "quota_offset": self.quota_offset,
                      "members": [[m.member_id, m.host, m.port] for m in self.members]})
        if len(data) > MAX_ASSIGNMENT_BYTES:
            raise FleetGroupError(f"an assignment of {len(self.members)} members takes {len(data)} bytes, "
                                  f"above {MAX_ASSIGNMENT_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> Assignment:
        where = "assignment"
        document = _load(data, MAX_ASSIGNMENT_BYTES, where)
        generation, leader, rows = document.get("generation"), document.get("leader"), document.get("members")
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise FleetGroupError(f"{where}: generation {generation!r} is not a whole number >= 0")
        if not isinstance(leader, str):
            raise FleetGroupError(f"{where}: leader {leader!r} is not a member id")
        if not isinstance(rows, list):
            raise FleetGroupError(f"{where}: members is {type(rows).__name__}, not a list")
        members = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)):
                raise FleetGroupError(f"{where}: member {row!r} is not [member id, host, port]")
            host, port = _address({"host": row[1], "port": row[2]}, f"{where}: member {row[0]!r}")
            members.append(Member(row[0], host, port))
        return cls(generation, leader, tuple(members), _offset(document, where))


def assign(generation: int, leader: str, joined: Sequence[tuple[str, bytes]]
           ) -> tuple[dict[str, bytes], list[str]]:
    """The leader's work: every member gets the same assignment, listing the members whose metadata
    is this protocol's. Returns the assignments by member id, and one line per member left out."""
    members: list[Member] = []
    left_out: list[str] = []
    furthest = -1
    for member_id, data in joined:
        try:
            metadata = MemberMetadata.decode(data)
        except FleetGroupError as exc:
            left_out.append(f"member {member_id!r} left out of the fleet: {exc}")
            continue
        members.append(Member(member_id, metadata.host, metadata.port))
        furthest = max(furthest, metadata.quota_offset)
    members.sort(key=lambda m: m.member_id)
    encoded = Assignment(generation, leader, tuple(members), furthest).encode()
    return {member_id: encoded for member_id, _ in joined}, left_out


def _dump(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _load(data: bytes, limit: int, where: str) -> dict[str, Any]:
    if len(data) > limit:
        raise FleetGroupError(f"{where}: {len(data)} bytes, above the limit of {limit}")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FleetGroupError(f"{where}: not a JSON document ({exc}): {data[:64]!r}") from None
    if not isinstance(document, dict):
        raise FleetGroupError(f"{where}: {type(document).__name__}, not an object")
    if document.get("version") != VERSION:
        raise FleetGroupError(f"{where}: version {document.get('version')!r}, this member speaks {VERSION}")
    return document


def _check_address(host: str, port: int) -> None:
    if not host or len(host) > _MAX_HOST or any(c.isspace() for c in host):
        raise FleetGroupError(f"host {host[:_MAX_HOST]!r} is not a host name or address")
    if not 1 <= port <= 65535:
        raise FleetGroupError(f"port {port} is outside 1..65535")


def _address(document: dict[str, Any], where: str) -> tuple[str, int]:
    host, port = document.get("host"), document.get("port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        raise FleetGroupError(f"{where}: host {host!r} and port {port!r} are not an address")
    try:
        _check_address(host, port)
    except FleetGroupError as exc:
        raise FleetGroupError(f"{where}: {exc}") from None
    return host, port


def _offset(document: dict[str, Any], where: str) -> int:
    offset = document.get("quota_offset")
    if not isinstance(offset, int) or isinstance(offset, bool) or not -1 <= offset < 2**63:
        raise FleetGroupError(f"{where}: quota_offset {offset!r} is not an offset")
    return offset
