"""Shadow mode: every decision computed and reported as usual, none applied (issue 28).

An operator who puts the proxy in front of a busy cluster first wants to see what it would do.
In shadow, the quota engine runs the same arithmetic (every byte charged, every throttle time
computed and recorded in the throttle sensors and usage events), and only the last step is skipped:
no `throttle_time_ms`, mute, held response, emptied fetch or capacity throttle reaches the client.
Envoy's rate limiter and Conduktor's audit-only interceptors work the same way.

Two scopes:
- the whole proxy, `[proxy] shadow = true` (read at start; it also covers `ip` entities'
  connection-creation throttles);
- one (user, client-id) entity, `shadow = true` beside its quotas, an entity setting as `share` is
  (`EntitySetting.SHADOW`), set through every quota source and switched live. It resolves with
  Kafka's precedence on its own (client-id prefixes included): the most specific entity that sets
  `shadow` decides, so `shadow =
  true` on user `<default>` shadows every client and `shadow = false` on one entity enforces it
  alone again.

Pure: the I/O layer reads `ShadowLog.take` to write its rate-limited "would throttle" lines.
"""

from __future__ import annotations

from typing import NamedTuple

from .entity import PrefixIndex, QuotaEntity, resolve_entity

#: The entity setting's config name (`EntitySetting.SHADOW`).
SHADOW_KEY = "shadow"

#: (user, client-id) pairs whose resolution is remembered; past it the memory starts again. A
#: request of a new pair then resolves through the eight levels once more (a few dict lookups).
MAX_RESOLVED = 10_000

#: Distinct (user, client-id, what) a ShadowLog keeps between two takes; further ones are counted.
MAX_LOGGED = 1_000


def validate_shadow(value: object, where: str) -> float:
    """The `shadow` setting's one rule: true or false; 1 or 0 where a source carries only numbers
    (the admin API's doubles, Kafka's config form in ZooKeeper and the quota topic). Kept as 1.0 or
    0.0, since entity settings travel as numbers. `where` names the entity first in the message."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float) and value in (0, 1):
        return float(value)
    raise ValueError(f"{where}: {SHADOW_KEY} = {value!r} must be true or false (1 or 0)")


class ShadowPolicy:
    """Who is in shadow: the whole proxy (`everything`) or the entities that say so."""

    __slots__ = ("_entities", "_prefixes", "_resolved", "active", "everything")

    def __init__(self, everything: bool = False) -> None:
        self.everything = everything
        self._entities: dict[QuotaEntity, float] = {}
        self._prefixes = PrefixIndex(())
        self._resolved: dict[tuple[str, str], bool] = {}
        #: whether anything may be in shadow: the hot path's one test when nothing is
        self.active = everything

    def set_entities(self, entities: dict[QuotaEntity, float]) -> None:
        """The entities' `shadow` settings in force (1.0 shadow, 0.0 enforce); takes effect at once."""
        self._entities = dict(entities)
        self._prefixes = PrefixIndex(self._entities)
        self._resolved = {}
        self.active = self.everything or bool(self._entities)

    def shadowed(self, user: str, client_id: str) -> bool:
        """Whether decisions for (user, client-id) are reported only."""
        if self.everything:
            return True
        if not self._entities:
            return False
        key = (user, client_id)
        found = self._resolved.get(key)
        if found is None:
            resolved = resolve_entity(self._entities, self._prefixes, user, client_id)
            found = resolved is not None and resolved[2] == 1.0
            if len(self._resolved) >= MAX_RESOLVED:
                self._resolved = {}
            self._resolved[key] = found
        return found


class WouldThrottle(NamedTuple):
    """The decisions one (user, client-id) got under `what` since the last take, reported only."""

    user: str
    client_id: str
    #: the quota key (`producer_byte_rate`), or `capacity <key>` for the cluster capacity's
    what: str
    #: the largest throttle computed, and how many there were
    largest_ms: int
    decisions: int


class ShadowLog:
    """The would-be throttles since the last `take`, one entry per (user, client-id, what), bounded
    by MAX_LOGGED, so the I/O layer's log stays a few lines per entity per take however busy."""

    __slots__ = ("_entries", "_max", "dropped")

    def __init__(self, max_entries: int = MAX_LOGGED) -> None:
        self._max = max_entries
        self._entries: dict[tuple[str, str, str], list[int]] = {}
        #: decisions of entries past the bound since the last take
        self.dropped = 0

    def add(self, user: str, client_id: str, what: str, throttle_ms: int) -> None:
        """One would-be throttle; an `ip` quota's carries its ip bucket as `user`, client-id ""."""
        key = (user, client_id, what)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self._max:
                self.dropped += 1
                return
            self._entries[key] = [throttle_ms, 1]
        else:
            if throttle_ms > entry[0]:
                entry[0] = throttle_ms
            entry[1] += 1

    def take(self) -> tuple[list[WouldThrottle], int]:
        """The entries since the last take, largest throttle first, and the decisions left out."""
        entries = sorted((WouldThrottle(user, client_id, what, largest, count)
                          for (user, client_id, what), (largest, count) in self._entries.items()),
                         key=lambda entry: -entry.largest_ms)
        dropped = self.dropped
        self._entries = {}
        self.dropped = 0
        return entries, dropped


__all__ = ["MAX_LOGGED", "MAX_RESOLVED", "SHADOW_KEY", "ShadowLog", "ShadowPolicy", "WouldThrottle",
           "validate_shadow"]
