"""The `[usage]` table: usage events written to a topic of the fronted cluster (issue 14).

Without the table no events are written and the quota engine counts nothing for them. With it,
every `interval_ms` the proxy writes one JSON event per active (user, client-id) to `topic`
(proxy/observability/usage_events.py; the event's schema: proxy/observability/usage_event_schema.py,
described in docs/usage-history.md):

```toml
[usage]
interval_ms = 10000                 # one event per active entity this often
topic = "__kthrottle_usage"         # created if missing, with the settings below
retention_ms = 604800000            # the topic's retention.ms when the proxy creates it (7 days)
partitions = 3                      # when created; -1: the brokers' num.partitions
replication_factor = 3              # when created, at most the brokers there are; -1: the brokers' default
bootstrap_servers = ["kafka1:9092"] # default: proxy.upstream (the proxy's producer goes straight there)
buffer_memory = 33554432            # event bytes waiting for the cluster, at most (Kafka's buffer.memory)
max_pending_intervals = 30          # intervals waiting for the cluster, at most; the oldest is dropped
sasl_mechanism = "SCRAM-SHA-512"    # for a SASL listener: "PLAIN", "SCRAM-SHA-256" or "SCRAM-SHA-512"
sasl_username = "kthrottle"
sasl_password = "..."               # or $KTHROTTLE_USAGE_SASL_PASSWORD
```

TLS towards the cluster is the `[upstream_tls]` table's, as for the proxy's broker connections.
Every value is checked at start and an error names the key and the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .cluster_login import LOGIN_KEYS, SASL_MECHANISMS, ClusterLogin, parse_login
from .common import Address, SettingsError, parse_address

#: How often events are written by default: often enough for an hourly report to see a tenant's
#: shape, rarely enough that 10,000 tenants cost ~1,000 small records a second.
DEFAULT_INTERVAL_MS = 10_000
#: Shorter intervals only multiply events (tests use 1000 ms).
MIN_INTERVAL_MS = 100
#: Longer ones lose too much on a restart (at most the current interval is lost).
MAX_INTERVAL_MS = 3_600_000
DEFAULT_TOPIC = "__kthrottle_usage"
#: Kafka's retention.ms default (log.retention.hours = 168).
DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
#: Enough for a few report consumers to share the reading; one tenant stays on one partition.
DEFAULT_PARTITIONS = 3
#: Kafka's internal topics' default (offsets.topic.replication.factor = 3), capped at the brokers there are.
DEFAULT_REPLICATION_FACTOR = 3
#: Kafka's producer buffer.memory default: event bytes queued or in flight to the cluster, at most.
DEFAULT_BUFFER_MEMORY = 32 * 1024 * 1024
#: Intervals waiting for a slow or absent cluster (5 minutes at the default interval); past it the
#: oldest is dropped and its events counted as dropped. Kafka has no equivalent: its producer
#: blocks `send` (max.block.ms) instead, which a proxy must not do.
DEFAULT_MAX_PENDING_INTERVALS = 30
#: The producer's password when `sasl_password` is not in the file (kept out of files and `ps`).
SASL_PASSWORD_ENV = "KTHROTTLE_USAGE_SASL_PASSWORD"
#: Kafka's topic name rule (Topic.validate): at most 249 of [a-zA-Z0-9._-].
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


@dataclass(slots=True)
class UsageSettings:
    """A checked `[usage]` table (see the module docstring)."""

    interval_ms: int = DEFAULT_INTERVAL_MS
    topic: str = DEFAULT_TOPIC
    #: retention.ms of a topic the proxy creates; -1: kept for ever (Kafka's meaning)
    retention_ms: int = DEFAULT_RETENTION_MS
    #: -1: the brokers' num.partitions (KIP-464, Kafka >= 2.4)
    partitions: int = DEFAULT_PARTITIONS
    #: capped at the brokers the cluster has; -1: the brokers' default.replication.factor
    replication_factor: int = DEFAULT_REPLICATION_FACTOR
    #: where the proxy's producer bootstraps; empty: proxy.upstream
    bootstrap_servers: list[Address] = field(default_factory=list)
    buffer_memory: int = DEFAULT_BUFFER_MEMORY
    max_pending_intervals: int = DEFAULT_MAX_PENDING_INTERVALS
    #: the producer's SASL login (config/cluster_login.py); none by default
    login: ClusterLogin = field(default_factory=ClusterLogin)


def _int(key: str, value: object, low: int, high: int | None = None, also: tuple[int, ...] = ()) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SettingsError(f"usage.{key} = {value!r} must be an integer")
    if value in also:
        return value
    if value < low or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f"at least {low}"
        extra = "".join(f" (or {v})" for v in also)
        raise SettingsError(f"usage.{key} = {value!r} must be {span}{extra}")
    return value


def parse_usage_table(table: object, environ: Mapping[str, str] | None = None) -> UsageSettings:
    """A `[usage]` table, checked."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"usage = {table!r} must be a table ([usage])")
    environ = os.environ if environ is None else environ
    usage = UsageSettings()
    for key, value in dict(table).items():
        if key == "interval_ms":
            usage.interval_ms = _int(key, value, MIN_INTERVAL_MS, MAX_INTERVAL_MS)
        elif key == "topic":
            if not isinstance(value, str) or not _TOPIC.fullmatch(value) or value in (".", ".."):
                raise SettingsError(f"usage.topic = {value!r} is not a Kafka topic name "
                                    "(1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')")
            usage.topic = value
        elif key == "retention_ms":
            usage.retention_ms = _int(key, value, 1, also=(-1,))
        elif key == "partitions":
            usage.partitions = _int(key, value, 1, also=(-1,))
        elif key == "replication_factor":
            usage.replication_factor = _int(key, value, 1, 32767, also=(-1,))
        elif key == "bootstrap_servers":
            items = value if isinstance(value, list) else [value]
            if not items or not all(isinstance(item, str) for item in items):
                raise SettingsError(
                    f'usage.bootstrap_servers = {value!r} must be a list of "host:port" strings')
            usage.bootstrap_servers = [parse_address(item, "usage.bootstrap_servers entry")
                                       for text in items for item in text.split(",") if item.strip()]
            if not usage.bootstrap_servers:
                raise SettingsError(f"usage.bootstrap_servers = {value!r} names no host:port")
        elif key == "buffer_memory":
            usage.buffer_memory = _int(key, value, 1024)
        elif key == "max_pending_intervals":
            usage.max_pending_intervals = _int(key, value, 1)
        elif key in LOGIN_KEYS:
            pass  # parse_login, below
        else:
            raise SettingsError(f"unknown setting usage.{key}")
    usage.login = parse_login("usage", dict(table), SASL_PASSWORD_ENV, environ)
    return usage


__all__ = ["DEFAULT_TOPIC", "SASL_MECHANISMS", "UsageSettings", "parse_usage_table"]
