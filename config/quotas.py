"""The quota file: `[[quota]]` tables of DESIGN.md, validated the way Kafka validates quotas.

An invalid file is rejected whole, with a message naming the entity, key and value, so the
proxy keeps running on its last good quotas.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from quotas.engine import QuotaTable
from quotas.entity import DEFAULT, QuotaEntity
from quotas.ip_entities import IpEntityError, parse_ip_entity, validate_connection_creation_rate
from quotas.types import CONFIG_KEYS, ConfigKey, EntitySetting, QuotaType

#: Quota keys kthrottle enforces: every key Kafka has for users, client-ids and ips, plus the KIP-936
#: draft's.
ENFORCED = frozenset(QuotaType)


class QuotaConfigError(ValueError):
    """An invalid quota: the message names the entity, the key and the value."""


def validate_value(entity: QuotaEntity, key: str, value: Any) -> tuple[ConfigKey, float]:
    """Kafka's rules: a known key, a number > 0, whole numbers for byte rates; an entity setting
    (`share`) by its own rule (`EntitySetting.check`), the one every source applies."""
    where = f"quota for {entity.describe()}"
    quota_type = CONFIG_KEYS.get(key)
    if quota_type is None:
        raise QuotaConfigError(f"{where}: unknown quota key {key} = {value!r} "
                               f"(known: {', '.join(sorted(CONFIG_KEYS))})")
    if isinstance(quota_type, EntitySetting):
        if entity.ip is not None:
            raise QuotaConfigError(f"{where}: {key} = {value!r} is not a setting of ip entities "
                                   "(Kafka: Invalid configuration key)")
        try:
            return quota_type, quota_type.check(value, where)
        except ValueError as exc:
            raise QuotaConfigError(str(exc)) from exc
    if quota_type not in ENFORCED:
        raise QuotaConfigError(f"{where}: {key} is not supported by kthrottle yet")
    if quota_type.ip_only != (entity.ip is not None):
        # Kafka's ClientQuotaControlManager: each entity type has its own keys
        kind = "ip" if entity.ip is not None else "user and client-id"
        raise QuotaConfigError(f"{where}: {key} = {value!r} is not a quota of {kind} entities "
                               "(Kafka: Invalid configuration key)")
    if quota_type.ip_only:
        try:
            return quota_type, float(validate_connection_creation_rate(value, entity.ip or ""))
        except IpEntityError as exc:
            raise QuotaConfigError(f"{where}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QuotaConfigError(f"{where}: {key} = {value!r} is not a number")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise QuotaConfigError(f"{where}: {key} = {value!r} must be greater than 0")
    if quota_type.integral and not number.is_integer():
        raise QuotaConfigError(f"{where}: {key} = {value!r} must be a whole number of bytes per second")
    if quota_type.user_only and (entity.user is None or entity.client_id is not None
                                 or entity.client_id_prefix is not None):
        raise QuotaConfigError(f"{where}: {key} = {value!r} applies to user entities only")
    return quota_type, number


#: The keys of a `[[quota]]` table that name its entity rather than a quota.
ENTITY_KEYS = ("user", "client_id", "client_id_prefix", "ip")


def _entity(table: dict[str, Any], index: int) -> QuotaEntity:
    user = table.get("user")
    client_id = table.get("client_id")
    prefix = table.get("client_id_prefix")
    ip = table.get("ip")
    for name, value in (("user", user), ("client_id", client_id), ("client_id_prefix", prefix), ("ip", ip)):
        if value is not None and (not isinstance(value, str) or not value):
            raise QuotaConfigError(f"quota #{index}: {name} = {value!r} must be a non-empty string")
    if ip is not None:
        if user is not None or client_id is not None or prefix is not None:
            raise QuotaConfigError(f"quota #{index}: ip = {ip!r} cannot be combined with user, client_id or "
                                   "client_id_prefix (Kafka: an IP entity is not combined with User or "
                                   "ClientId)")
        return QuotaEntity(None, None, ip_entity_name(ip, f"quota #{index}"))
    if prefix is not None:
        check_client_id_prefix(prefix, f"quota #{index}")
        if client_id is not None:
            raise QuotaConfigError(f"quota #{index}: client_id_prefix = {prefix!r} cannot be combined with "
                                   f"client_id = {client_id!r} (an entity names a client id exactly or by "
                                   "its prefix, not both)")
        return QuotaEntity(user, None, None, prefix)
    if user is None and client_id is None:
        raise QuotaConfigError(f"quota #{index}: names neither a user, a client_id, a client_id_prefix "
                               "nor an ip")
    return QuotaEntity(user, client_id)


def check_client_id_prefix(prefix: str, where: str) -> None:
    """A client-id prefix names some client ids: never empty (it would be every client id, which
    `client_id = "<default>"` already says, at its own level) and never `<default>`."""
    if not prefix:
        raise QuotaConfigError(f"{where}: client_id_prefix = {prefix!r} must not be empty (for every client "
                               'id, write client_id = "<default>")')
    if prefix == DEFAULT:
        raise QuotaConfigError(f"{where}: client_id_prefix = {prefix!r}: a prefix has no default entity "
                               '(for every client id, write client_id = "<default>")')


def ip_entity_name(name: str, where: str) -> str:
    """The canonical name of an `ip` entity (an address, a CIDR prefix or <default>)."""
    try:
        return parse_ip_entity(name)
    except IpEntityError as exc:
        raise QuotaConfigError(f"{where}: {exc}") from exc


def parse_quotas(data: dict[str, Any]) -> QuotaTable:
    """The `[[quota]]` tables of a parsed TOML document."""
    tables = data.get("quota", [])
    if not isinstance(tables, list):
        raise QuotaConfigError("`quota` must be an array of tables: write [[quota]]")
    result: QuotaTable = {}
    for index, table in enumerate(tables, 1):
        if not isinstance(table, dict):
            raise QuotaConfigError(f"quota #{index} is not a table")
        entity = _entity(table, index)
        if entity in result:
            raise QuotaConfigError(f"quota for {entity.describe()} is given twice")
        values: dict[ConfigKey, float] = {}
        for key, value in table.items():
            if key in ENTITY_KEYS:
                continue
            quota_type, number = validate_value(entity, key, value)
            values[quota_type] = number
        result[entity] = values
    return result


def load_quota_file(path: Path) -> QuotaTable:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise QuotaConfigError(f"cannot read quota file {path}: {exc}") from exc
    return parse_quotas(data)


__all__ = [
    "DEFAULT", "QuotaConfigError", "check_client_id_prefix", "ip_entity_name", "load_quota_file",
    "parse_quotas", "validate_value",
]
