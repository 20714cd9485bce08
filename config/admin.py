"""What DescribeClientQuotas and AlterClientQuotas mean, with Kafka's validation and error codes.

Pure functions over a quota table: the proxy's I/O layer decides who may call them and where a
change is stored. Matching follows Kafka's `ClientQuotasImage.describe`, validation its
`ClientQuotaControlManager` plus the value rules of QUOTA_SEMANTICS.md §9 (values > 0, whole
byte rates, `producer_ids_rate` for users only). An entry with any invalid op changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol.client_quotas import (
    MATCH_DEFAULT,
    MATCH_EXACT,
    MATCH_SPECIFIED,
    AlterQuotas,
    AlterResult,
    DescribedEntry,
    DescribeQuotas,
    EntityParts,
)
from quotas.engine import QuotaTable
from quotas.entity import DEFAULT, QuotaEntity
from quotas.ip_entities import IpEntityError, parse_ip_entity
from quotas.types import CONFIG_KEYS, ConfigKey

from .quotas import QuotaConfigError, check_client_id_prefix, validate_value

#: Kafka error codes the admin quota APIs answer with.
NONE = 0
UNKNOWN_SERVER_ERROR = -1
CLUSTER_AUTHORIZATION_FAILED = 31
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42

USER, CLIENT_ID, IP = "user", "client-id", "ip"
#: Redpanda's entity type for a client-id prefix (kthrottle's extension of Kafka's API)
CLIENT_ID_PREFIX = "client-id-prefix"
#: The entity types the admin API knows.
ENTITY_TYPES = (USER, CLIENT_ID, CLIENT_ID_PREFIX, IP)

#: A change to one entity: a new value, or None to remove the key.
Changes = Mapping[QuotaEntity, Mapping[ConfigKey, float | None]]


class AdminError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def entity_parts(entity: QuotaEntity) -> EntityParts:
    """A configured entity as the wire names it: a default is a null name."""
    parts: list[tuple[str, str | None]] = []
    if entity.ip is not None:
        parts.append((IP, None if entity.ip == DEFAULT else entity.ip))
    if entity.user is not None:
        parts.append((USER, None if entity.user == DEFAULT else entity.user))
    if entity.client_id is not None:
        parts.append((CLIENT_ID, None if entity.client_id == DEFAULT else entity.client_id))
    if entity.client_id_prefix is not None:
        parts.append((CLIENT_ID_PREFIX, entity.client_id_prefix))
    return tuple(parts)


def _as_map(entity: QuotaEntity) -> dict[str, str | None]:
    return dict(entity_parts(entity))


# -- describe ------------------------------------------------------------------------------------


def describe(table: QuotaTable, request: DescribeQuotas) -> list[DescribedEntry]:
    """The entries a filter selects; raises AdminError with Kafka's code for a bad filter."""
    exact: dict[str, str | None] = {}
    specified: set[str] = set()
    for component in request.components:
        kind = component.entity_type
        if not kind:
            raise AdminError(INVALID_REQUEST, "Invalid empty entity type.")
        if kind in exact or kind in specified:
            raise AdminError(INVALID_REQUEST,
                             f"Entity type {kind} cannot appear more than once in the filter.")
        if kind not in ENTITY_TYPES:
            raise AdminError(UNSUPPORTED_VERSION, f"Unsupported entity type {kind}")
        if component.match_type == MATCH_EXACT:
            if component.match is None:
                raise AdminError(INVALID_REQUEST,
                                 "Request specified MATCH_TYPE_EXACT, but set match string to null.")
            exact[kind] = _canonical_ip(component.match) if kind == IP else component.match
        elif component.match_type == MATCH_DEFAULT:
            if component.match is not None:
                raise AdminError(INVALID_REQUEST,
                                 "Request specified MATCH_TYPE_DEFAULT, but also specified a match string.")
            exact[kind] = None
        elif component.match_type == MATCH_SPECIFIED:
            if component.match is not None:
                raise AdminError(INVALID_REQUEST,
                                 "Request specified MATCH_TYPE_SPECIFIED, but also specified a match string.")
            specified.add(kind)
        else:
            raise AdminError(INVALID_REQUEST, f"Unknown match type {component.match_type}")
    if (IP in exact or IP in specified) and ({USER, CLIENT_ID, CLIENT_ID_PREFIX} & (set(exact) | specified)):
        raise AdminError(INVALID_REQUEST, "Invalid entity filter component combination. IP filter component "
                                          "should not be used with user, clientId or clientIdPrefix filter "
                                          "component.")
    found: list[DescribedEntry] = []
    for entity in sorted(table, key=_sort_key):
        values = table[entity]
        if not values:
            continue
        names = _as_map(entity)
        if any(kind not in names or names[kind] != name for kind, name in exact.items()):
            continue
        if any(kind not in names for kind in specified):
            continue
        if request.strict and len(names) != len(exact) + len(specified):
            continue
        found.append(DescribedEntry(entity_parts(entity),
                                    tuple((t.value, v) for t, v in sorted(values.items(), key=_key_name))))
    return found


def _canonical_ip(name: str) -> str:
    """A filter's ip as the entities are stored (an address written another way still matches)."""
    try:
        return parse_ip_entity(name)
    except IpEntityError:
        return name  # matches nothing


def _sort_key(entity: QuotaEntity) -> tuple[str, str, str, str]:
    return (entity.user or "", entity.client_id or "", entity.client_id_prefix or "", entity.ip or "")


def _key_name(item: tuple[ConfigKey, float]) -> str:
    return item[0].value


# -- alter ---------------------------------------------------------------------------------------


def _entity(parts: EntityParts) -> QuotaEntity:
    if not parts:
        raise AdminError(INVALID_REQUEST, "Invalid empty client quota entity")
    names: dict[str, str | None] = {}
    for kind, name in parts:
        if kind in names:
            raise AdminError(INVALID_REQUEST,
                             f"Invalid empty client quota entity, duplicate entity entry {kind}")
        if kind not in ENTITY_TYPES:
            raise AdminError(INVALID_REQUEST, f"Unhandled client quota entity type: {kind}")
        if name is not None and not name:
            raise AdminError(INVALID_REQUEST, f"Empty {kind} not supported")
        names[kind] = name
    def named(kind: str) -> str | None:
        if kind not in names:
            return None
        return names[kind] or DEFAULT  # a null name is the default entity

    if IP in names:
        if len(names) > 1:
            raise AdminError(INVALID_REQUEST, "Invalid quota entity combination, IP entity should not be "
                                              "combined with User or ClientId")
        try:
            ip = parse_ip_entity(named(IP) or DEFAULT)
        except IpEntityError as exc:
            raise AdminError(INVALID_REQUEST,
                             f"{names[IP]} is not a valid IP or resolvable host: {exc}") from exc
        return QuotaEntity(None, None, ip)
    if CLIENT_ID_PREFIX in names:
        prefix = names[CLIENT_ID_PREFIX]
        if prefix is None:
            raise AdminError(INVALID_REQUEST, f"{CLIENT_ID_PREFIX} has no default entity: name a prefix, or "
                                              f"use the default {CLIENT_ID} for every client id")
        if CLIENT_ID in names:
            raise AdminError(INVALID_REQUEST, "Invalid quota entity combination: "
                                              f"{CLIENT_ID_PREFIX}={prefix} cannot be combined with "
                                              f"{CLIENT_ID}={names[CLIENT_ID] or DEFAULT}")
        try:
            check_client_id_prefix(prefix, f"{CLIENT_ID_PREFIX}={prefix}")
        except QuotaConfigError as exc:
            raise AdminError(INVALID_REQUEST, str(exc)) from exc
        return QuotaEntity(named(USER), None, None, prefix)
    return QuotaEntity(named(USER), named(CLIENT_ID))


@dataclass(slots=True)
class AlterPlan:
    """The answer for each entry, and the changes to store (empty for validate_only)."""

    results: list[AlterResult]
    changes: dict[QuotaEntity, dict[ConfigKey, float | None]]


def plan_alter(request: AlterQuotas) -> AlterPlan:
    """Validate every entry; only entries without any error contribute changes."""
    results: list[AlterResult] = []
    changes: dict[QuotaEntity, dict[ConfigKey, float | None]] = {}
    seen: dict[QuotaEntity, int] = {}
    for entry in request.entries:
        try:
            entity = _entity(entry.entity)
            if entity in seen:
                raise AdminError(INVALID_REQUEST, f"Ignoring duplicate entity {entity.describe()}")
            ops: dict[ConfigKey, float | None] = {}
            keys: set[str] = set()
            for op in entry.ops:
                if op.key in keys:
                    raise AdminError(INVALID_REQUEST, f"Duplicate quota key {op.key} not updating quota "
                                                      f"for this entity {entity.describe()}")
                keys.add(op.key)
                if op.remove:
                    ops[_known_key(op.key)] = None
                    continue
                try:
                    quota_type, value = validate_value(entity, op.key, op.value)
                except QuotaConfigError as exc:
                    raise AdminError(INVALID_REQUEST, str(exc)) from exc
                ops[quota_type] = value
        except AdminError as exc:
            results.append(AlterResult(entry.entity, exc.code, exc.message))
            try:
                duplicate = _entity(entry.entity)
            except AdminError:
                continue
            if duplicate in seen:  # the first occurrence is refused too: which one should win?
                first = seen[duplicate]
                results[first] = AlterResult(results[first].entity, INVALID_REQUEST, exc.message)
                changes.pop(duplicate, None)
            continue
        seen[entity] = len(results)
        results.append(AlterResult(entry.entity, NONE, None))
        if ops and not request.validate_only:
            changes[entity] = ops
    return AlterPlan(results, changes)


def _known_key(key: str) -> ConfigKey:
    """Removing a key needs no value check, but an unknown key is still refused."""
    quota_type = CONFIG_KEYS.get(key)
    if quota_type is None:
        raise AdminError(INVALID_REQUEST, f"Invalid configuration key {key}")
    return quota_type


def apply_changes(table: QuotaTable, changes: Changes) -> QuotaTable:
    """The table after `changes`; an entity left without values is gone."""
    result = {entity: dict(values) for entity, values in table.items()}
    for entity, ops in changes.items():
        values = result.setdefault(entity, {})
        for quota_type, value in ops.items():
            if value is None:
                values.pop(quota_type, None)
            else:
                values[quota_type] = value
        if not values:
            del result[entity]
    return result


__all__ = [
    "CLUSTER_AUTHORIZATION_FAILED", "INVALID_REQUEST", "NONE", "UNKNOWN_SERVER_ERROR", "UNSUPPORTED_VERSION",
    "AdminError", "AlterPlan", "Changes", "apply_changes", "describe", "entity_parts", "plan_alter",
]
