"""Who shares a quota: Kafka's eight levels of (user, client-id) entities, plus Redpanda's
client-id prefixes, first match wins.

A quota is configured on an *entity* (a user, a client-id, a client-id prefix, a user with one of
those, or their `<default>`s); the traffic of a connection is charged to a *bucket* whose key
depends on the level that matched. Kafka's eight levels are 1, 3, 4, 5, 7, 8, 9 and 11 here; the
prefix levels (2, 6, 10) sit where Redpanda documents them: an exact client id beats a prefix, a
prefix beats `<default>` at the same user level.

| level | entity configured              | bucket key        |
|-------|--------------------------------|-------------------|
| 1     | user u, client-id c            | (u, c)            |
| 2     | user u, client-id-prefix p     | (u, p*)           |
| 3     | user u, client <default>       | (u, c)            |
| 4     | user u                         | (u, "")           |
| 5     | user <default>, client c       | (u, c)            |
| 6     | user <default>, prefix p       | (u, p*)           |
| 7     | user <default>, <default>      | (u, c)            |
| 8     | user <default>                 | (u, "")           |
| 9     | client-id c                    | ("", c)           |
| 10    | client-id-prefix p             | ("", p*)          |
| 11    | client-id <default>            | ("", c)           |

Among several prefixes configured at one level, the longest that the client id starts with wins.
`p*` is `prefix_bucket_client_id(p)`: every client id with that prefix shares one bucket, as
Redpanda's tracker key (user, client-id-prefix) does.

Users are matched by their *sanitized* name (as Kafka stores them in ZooKeeper); client-ids raw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple, TypeVar

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
    #: Redpanda's `client-id-prefix` entity: every client id starting with it (never empty, never
    #: DEFAULT, never with `client_id` or `ip`: the config sources refuse those)
    client_id_prefix: str | None = None

    def describe(self) -> str:
        if self.ip is not None:
            return f"ip={self.ip}"
        parts = []
        if self.user is not None:
            parts.append(f"user={self.user}")
        if self.client_id is not None:
            parts.append(f"client-id={self.client_id}")
        if self.client_id_prefix is not None:
            parts.append(f"client-id-prefix={self.client_id_prefix}")
        return ", ".join(parts) or "(empty entity)"


class BucketKey(NamedTuple):
    """The (user, client-id) tags of a bucket; "" where the level shares across that dimension."""

    user: str
    client_id: str


#: Marks the client-id part of a prefix bucket's key. A client id is free text, so no marker is
#: beyond a client's reach; a NUL is beyond any real one's. A client that names itself so shares
#: that prefix's bucket, which it could as well by taking a name with the prefix: client ids are
#: not authenticated, so this gives it nothing new.
PREFIX_BUCKET_MARK = "\x00"


def prefix_bucket_client_id(prefix: str) -> str:
    """The client-id part of the bucket every client id starting with `prefix` shares."""
    return f"{PREFIX_BUCKET_MARK}{prefix}*"


def bucket_prefix(client_id: str) -> str | None:
    """The prefix of a prefix bucket's client-id part (`prefix_bucket_client_id`), else None."""
    if client_id[:1] == PREFIX_BUCKET_MARK and client_id[-1:] == "*":
        return client_id[1:-1]
    return None


def client_id_label(client_id: str) -> str:
    """A bucket's client-id as metrics and logs show it: a prefix bucket as `etl-*`."""
    return client_id[1:] if client_id[:1] == PREFIX_BUCKET_MARK else client_id


class PrefixIndex:
    """The client-id prefixes configured per user part (a user, DEFAULT, or None for no user).

    Longest-prefix matching tries only the lengths some prefix has, longest first: a set lookup
    each, however many prefixes there are. It runs once per new (user, client-id), whose
    resolution the managers cache.
    """

    __slots__ = ("_by_user",)

    def __init__(self, entities: Iterable[QuotaEntity]) -> None:
        found: dict[str | None, set[str]] = {}
        for entity in entities:
            if entity.client_id_prefix is not None and entity.ip is None:
                found.setdefault(entity.user, set()).add(entity.client_id_prefix)
        self._by_user: dict[str | None, tuple[frozenset[str], tuple[int, ...]]] = {
            user: (frozenset(prefixes), tuple(sorted({len(p) for p in prefixes}, reverse=True)))
            for user, prefixes in found.items()}

    def __bool__(self) -> bool:
        return bool(self._by_user)

    def longest(self, user: str | None, client_id: str) -> str | None:
        """The longest prefix configured for `user` that `client_id` starts with, else None."""
        found = self._by_user.get(user)
        if found is None:
            return None
        prefixes, lengths = found
        for length in lengths:
            if length <= len(client_id) and client_id[:length] in prefixes:
                return client_id[:length]
        return None


_V = TypeVar("_V")


def resolve_entity(quotas: Mapping[QuotaEntity, _V], prefixes: PrefixIndex, user: str,
                   client_id: str) -> tuple[QuotaEntity, BucketKey, _V] | None:
    """The entity that governs (user, client_id) with its bucket key and value (see the table
    above); None when none does. Each entity is built once and only the key returned is built:
    this runs for every new (user, client-id), a flood of client ids included."""
    if not quotas:
        return None
    get = quotas.get
    for entity_user in (user, DEFAULT):
        # levels 1-4, then 5-8
        entity = QuotaEntity(entity_user, client_id)
        value = get(entity)
        if value is not None:
            return entity, BucketKey(user, client_id), value
        if prefixes:
            prefix = prefixes.longest(entity_user, client_id)
            if prefix is not None:
                entity = QuotaEntity(entity_user, None, None, prefix)
                value = get(entity)
                if value is not None:
                    return entity, BucketKey(user, prefix_bucket_client_id(prefix)), value
        entity = QuotaEntity(entity_user, DEFAULT)
        value = get(entity)
        if value is not None:
            return entity, BucketKey(user, client_id), value
        entity = QuotaEntity(entity_user, None)
        value = get(entity)
        if value is not None:
            return entity, BucketKey(user, ""), value
    # levels 9-11
    entity = QuotaEntity(None, client_id)
    value = get(entity)
    if value is not None:
        return entity, BucketKey("", client_id), value
    if prefixes:
        prefix = prefixes.longest(None, client_id)
        if prefix is not None:
            entity = QuotaEntity(None, None, None, prefix)
            value = get(entity)
            if value is not None:
                return entity, BucketKey("", prefix_bucket_client_id(prefix)), value
    entity = QuotaEntity(None, DEFAULT)
    value = get(entity)
    if value is not None:
        return entity, BucketKey("", client_id), value
    return None


def prefix_bucket_entities(key: BucketKey) -> tuple[QuotaEntity, ...]:
    """The entities that can have led to a prefix bucket's key, most specific first (empty for
    another key): for a caller that knows a bucket by its key only (a peer's, or one whose
    settings changed) and needs the entity's value."""
    prefix = bucket_prefix(key.client_id)
    if prefix is None:
        return ()
    if not key.user:
        return (QuotaEntity(None, None, None, prefix),)
    return (QuotaEntity(key.user, None, None, prefix), QuotaEntity(DEFAULT, None, None, prefix))


def candidate_entities(user: str, client_id: str) -> tuple[tuple[QuotaEntity, BucketKey], ...]:
    """Kafka's eight entities that may govern (user, client_id), most specific first, with bucket
    keys (the prefix levels between them depend on what is configured: see `resolve_entity`)."""
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


def resolve(quotas: Mapping[QuotaEntity, float], user: str, client_id: str,
            prefixes: PrefixIndex | None = None) -> tuple[BucketKey, float] | None:
    """The bucket and bound that apply to (user, client_id), or None when no entity matches.

    `prefixes`: `PrefixIndex(quotas)`, for a caller that resolves many pairs against one table."""
    if not quotas:
        return None
    found = resolve_entity(quotas, PrefixIndex(quotas) if prefixes is None else prefixes, user, client_id)
    return None if found is None else (found[1], found[2])
