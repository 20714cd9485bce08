"""The usage event: its fields and its encoding, one JSON record per active (user, client-id) and
interval (issue 14). No I/O and no thread (only `proxy_identity` reads this process's id): the writer
(proxy/observability/usage_events.py) takes the interval on time and sends the records encoded here.

Event (schema 1; key: the JSON array [user, client_id]):

    {"schema": 1, "proxy": {"host", "listen", "pid", "member", "fleet"},
     "interval": {"start_ms", "end_ms", "seq"}, "user", "client_id", "produce_bytes", "fetch_bytes",
     "requests": {"Produce": 10, ...}, "request_time_ms", "new_producer_ids",
     "throttles": {"producer_byte_rate": {"count", "time_ms"}},
     "capacity_throttles": {"producer_byte_rate": {"count", "time_ms"}},
     "shadow_throttles": {...}, "shadow_capacity_throttles": {...},
     "quotas": {"producer_byte_rate": 1e6}}

`throttles` counts the throttles a quota decided, under that quota's key; `capacity_throttles` the
ones the cluster capacity decided (the tenant was above its fair share), under the direction's
quota key, in the same shape. A response throttled by both is counted once, under the larger
(quotas.engine). Both are `{}` when nothing was throttled. `shadow_throttles` and
`shadow_capacity_throttles`, in the same shape, count the throttles computed for an entity in shadow
(quotas/shadow.py): what enforcing would have given, which the client did not get.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from config.common import Address
from config.settings import ProxySettings
from protocol.apis import api_name
from quotas.engine import QuotaEngine
from quotas.usage import OTHER, EntityUsage, UsageInterval

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class ProxyIdentity:
    """Who wrote an event: this proxy process."""

    host: str
    listen: str
    pid: int
    #: the fleet member id (16 hex digits) and fleet name; None for a lone proxy
    member: str | None = None
    fleet: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"host": self.host, "listen": self.listen, "pid": self.pid, "member": self.member,
                "fleet": self.fleet}


def event_key(user: str, client_id: str) -> bytes:
    """The record key: one entity's events stay on one partition, in order."""
    return json.dumps([user, client_id], ensure_ascii=False, separators=(",", ":")).encode()


def build_event(identity: dict[str, Any], interval: UsageInterval, user: str, client_id: str,
                usage: EntityUsage, quotas: dict[str, float], folded: int = 0) -> dict[str, Any]:
    """One event as a JSON-ready dict (schema 1)."""
    event: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "proxy": identity,
        "interval": {"start_ms": interval.start_ms, "end_ms": interval.end_ms, "seq": interval.seq},
        "user": user or "ANONYMOUS",
        "client_id": client_id,
        "produce_bytes": usage.produce_bytes,
        "fetch_bytes": usage.fetch_bytes,
        "requests": {api_name(key): count for key, count in sorted(usage.requests.items())},
        "request_time_ms": round(usage.request_time_ms, 3),
        "new_producer_ids": usage.new_producer_ids,
        "throttles": {quota_type.value: {"count": count, "time_ms": time_ms}
                      for quota_type, (count, time_ms) in usage.throttles.items()},
        "capacity_throttles": {direction.value: {"count": count, "time_ms": time_ms}
                               for direction, (count, time_ms) in usage.capacity_throttles.items()},
        "shadow_throttles": {quota_type.value: {"count": count, "time_ms": time_ms}
                             for quota_type, (count, time_ms) in usage.shadow_throttles.items()},
        "shadow_capacity_throttles": {
            direction.value: {"count": count, "time_ms": time_ms}
            for direction, (count, time_ms) in usage.shadow_capacity_throttles.items()},
        "quotas": quotas,
    }
    if folded:
        event["folded_entities"] = folded
    return event


def encode_events(engine: QuotaEngine, identity: dict[str, Any], interval: UsageInterval,
                  keys: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Records of `keys` (a slice of the interval's entities), quotas resolved now."""
    records = []
    for user, client_id in keys:
        usage = interval.entities[(user, client_id)]
        if (user, client_id) == (OTHER, OTHER):
            quotas: dict[str, float] = {}
            folded = interval.folded_entities
        else:
            quotas = {quota_type.value: value
                      for quota_type, value in engine.quotas_for(user, client_id).items()}
            folded = 0
        event = build_event(identity, interval, user, client_id, usage, quotas, folded)
        value = json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()
        records.append((event_key(event["user"], client_id), value))
    return records


def proxy_identity(settings: ProxySettings, bootstrap: Address, member: str | None,
                   fleet: str | None) -> ProxyIdentity:
    host, port = bootstrap
    return ProxyIdentity(settings.advertised, f"{host}:{port}", os.getpid(), member, fleet)


__all__ = ["SCHEMA_VERSION", "ProxyIdentity", "build_event", "encode_events", "event_key", "proxy_identity"]
