"""Who shares a quota: Kafka's eight levels of (user, client-id) entities, first match wins.

A quota is configured on an *entity* (a user, a client-id, both, or their `<default>`s); the
traffic of a connection is charged to a *bucket* whose key depends on the level that matched:

| level | entity configured          | bucket key        |
|-------|----------------------------|-------------------|
| 1     | user u, client-id c        | (u, c)            |
| 2     | user u, client <default>   | (u, c)            |
| 3     | user u                     | (u, "")           |
| 4     | user <default>, client c   | (u, c)            |
| 5     | user <default>, <default>  | (u, c)            |
| 6     | user <default>             | (u, "")           |
| 7     | client-id c                | ("", c)           |
| 8     | client-id <default>        | ("", c)           |

Users are matched by their *sanitized* name (as Kafka stores them in ZooKeeper); client-ids raw.
"""

from __future__ import annotations

from typing import NamedTuple

#: The name Kafka's tools and ZooKeeper layout use for a default entity.
DEFAULT = "<default>"

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def sanitize(name: str) -> str:
    """Kafka's `Sanitizer.sanitize`: percent-encode every UTF-8 byte outside [A-Za-z0-9._-]."""
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in name.encode("utf-8"))


def desanitize(name: str) -> str:
    """The inverse of `sanitize`."""
    raw = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%" and i + 3 <= len(name):
            raw.append(int(name[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += name[i].encode("utf-8")
            i += 1
    return raw.decode("utf-8")


class QuotaEntity(NamedTuple):
    """A configured entity: `user` / `client_id` are a name, DEFAULT, or None (not part of it).

    `user` holds the principal's plain name (not sanitized); sanitizing is for storage paths.
    `ip` is KIP-612's client-address entity (an address, a CIDR prefix, or DEFAULT), which Kafka
    keeps apart: an entity with an `ip` has neither user nor client-id.
    """

    user: str | None
    client_id: str | None
    ip: str | None = None

    def describe(self) -> str:
        if self.ip is not None:
            return f"ip={self.ip}"
        parts = []
        if self.user is not None:
            parts.append(f"user={self.user}")
        if self.client_id is not None:
            parts.append(f"client-id={self.client_id}")
        return ", ".join(parts) or "(empty entity)"


class BucketKey(NamedTuple):
    """The (user, client-id) tags of a bucket; "" where the level shares across that dimension."""

    user: str
    client_id: str


def candidate_entities(user: str, client_id: str) -> tuple[tuple[QuotaEntity, BucketKey], ...]:
    """The eight entities that may govern (user, client_id), most specific first, with bucket keys."""
    own = BucketKey(user, client_id)
    user_wide = BucketKey(user, "")
    client_wide = BucketKey("", client_id)
    return (
        (QuotaEntity(user, client_id), own),
        (QuotaEntity(user, DEFAULT), own),
        (QuotaEntity(user, None), user_wide),
        (QuotaEntity(DEFAULT, client_id), own),
        (QuotaEntity(DEFAULT, DEFAULT), own),
        (QuotaEntity(DEFAULT, None), user_wide),
        (QuotaEntity(None, client_id), client_wide),
        (QuotaEntity(None, DEFAULT), client_wide),
    )


def resolve(quotas: dict[QuotaEntity, float], user: str, client_id: str) -> tuple[BucketKey, float] | None:
    """The bucket and bound that apply to (user, client_id), or None when no entity matches."""
    if not quotas:
        return None
    for entity, bucket in candidate_entities(user, client_id):
        bound = quotas.get(entity)
        if bound is not None:
            return bucket, bound
    return None
