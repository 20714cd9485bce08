"""The quota file's `[[partition_throttle]]` tables: KIP-73 partition throttles for consumers.

```toml
[[partition_throttle]]
name = "backfill"            # optional: metrics label, defaults to the topic
topic = "events"
partitions = [0, 1, 2]       # or "*" for every partition of the topic
byte_rate = 5242880          # bytes/s shared by those partitions' records
users = ["etl"]              # optional: only these principals' fetches
client_ids = ["replayer"]    # optional: only these client ids' fetches
```

Validated as Kafka validates `leader.replication.throttled.rate` (a whole, positive number of
bytes per second) and `leader.replication.throttled.replicas` (partition indexes, or `*`). An
invalid table rejects the whole file with a `QuotaConfigError` naming the table and the field,
so the proxy keeps running on its last good configuration.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from quotas.partition_throttle import MAX_PARTITION_THROTTLES, PartitionThrottle

from .quotas import QuotaConfigError

TABLE = "partition_throttle"
_KEYS = ("name", "topic", "partitions", "byte_rate", "users", "client_ids")
#: Kafka's `Topic.validate`: at most 249 characters of [a-zA-Z0-9._-].
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
#: Kafka's partition indexes are int32.
_MAX_PARTITION = 2**31 - 1


def _names(value: Any, where: str, key: str) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise QuotaConfigError(f"{where}: {key} = {value!r} must be a non-empty list of strings")
    for item in value:
        if not isinstance(item, str) or not item:
            raise QuotaConfigError(f"{where}: {key} has {item!r}, which is not a non-empty string")
    return frozenset(value)


def _partitions(value: Any, where: str) -> frozenset[int] | None:
    if value == "*":
        return None
    if not isinstance(value, list) or not value:
        raise QuotaConfigError(f"{where}: partitions = {value!r} must be \"*\" or a non-empty list of "
                               "partition indexes")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= _MAX_PARTITION:
            raise QuotaConfigError(f"{where}: partitions has {item!r}, which is not a partition index "
                                   f"(a whole number from 0 to {_MAX_PARTITION})")
    return frozenset(value)


def _byte_rate(value: Any, where: str) -> float:
    if value is None:
        raise QuotaConfigError(f"{where}: byte_rate is missing (bytes per second, shared by its partitions)")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QuotaConfigError(f"{where}: byte_rate = {value!r} is not a number")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise QuotaConfigError(f"{where}: byte_rate = {value!r} must be greater than 0")
    if not number.is_integer():
        raise QuotaConfigError(f"{where}: byte_rate = {value!r} must be a whole number of bytes per second")
    return number


def _throttle(table: Any, index: int) -> PartitionThrottle:
    where = f"partition_throttle #{index}"
    if not isinstance(table, dict):
        raise QuotaConfigError(f"{where} is not a table")
    for key in table:
        if key not in _KEYS:
            hint = " (write users = [...] or client_ids = [...])" if key in ("user", "client_id") else ""
            raise QuotaConfigError(f"{where}: unknown key {key} = {table[key]!r}{hint} "
                                   f"(known: {', '.join(_KEYS)})")
    topic = table.get("topic")
    if not isinstance(topic, str) or not _TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise QuotaConfigError(f"{where}: topic = {topic!r} must be a Kafka topic name "
                               "(1 to 249 of a-z A-Z 0-9 . _ -)")
    where = f"partition_throttle #{index} (topic {topic})"
    name = table.get("name", topic)
    if not isinstance(name, str) or not name:
        raise QuotaConfigError(f"{where}: name = {name!r} must be a non-empty string")
    return PartitionThrottle(
        name=name, topic=topic, partitions=_partitions(table.get("partitions"), where),
        byte_rate=_byte_rate(table.get("byte_rate"), where),
        users=_names(table.get("users"), where, "users"),
        client_ids=_names(table.get("client_ids"), where, "client_ids"))


def parse_partition_throttles(data: dict[str, Any]) -> list[PartitionThrottle]:
    """The `[[partition_throttle]]` tables of a parsed TOML document (none: an empty list)."""
    tables = data.get(TABLE, [])
    if not isinstance(tables, list):
        raise QuotaConfigError(f"`{TABLE}` must be an array of tables: write [[{TABLE}]]")
    if len(tables) > MAX_PARTITION_THROTTLES:
        raise QuotaConfigError(f"{len(tables)} [[{TABLE}]] tables, more than the {MAX_PARTITION_THROTTLES} "
                               "allowed")
    throttles = [_throttle(table, index) for index, table in enumerate(tables, 1)]
    seen: dict[str, int] = {}
    for index, throttle in enumerate(throttles, 1):
        first = seen.setdefault(throttle.name, index)
        if first != index:
            raise QuotaConfigError(f"partition_throttle #{index}: name {throttle.name!r} is already used by "
                                   f"partition_throttle #{first} (give each a distinct name = ...)")
    return throttles


def load_partition_throttles(path: Path) -> list[PartitionThrottle]:
    """The partition throttles of a quota file."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise QuotaConfigError(f"cannot read quota file {path}: {exc}") from exc
    return parse_partition_throttles(data)


__all__ = ["TABLE", "load_partition_throttles", "parse_partition_throttles"]
