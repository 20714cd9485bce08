"""Kafka's config form for client quotas: entity paths and config documents, as Kafka wrote them.

Why one module: the ZooKeeper source (``config/zookeeper.py``, in Kafka's znode layout:
``config/zookeeper_layout.py``) and the Kafka topic source (``config/kafka_quotas.py``, records keyed by
the same paths) store an entity's quotas the same way, so operators read one format wherever the quotas
live. Pure: strings and bytes in and out.

    users/<user>                              user entity
    users/<user>/clients/<client-id>          (user, client-id) entity
    clients/<client-id>                       client-id entity
    ips/<ip>                                  ip entity (KIP-612), an address or <default>
    client-id-prefix/<prefix>                 client-id prefix entity (kthrottle's extension)
    users/<user>/client-id-prefix/<prefix>    (user, client-id prefix) entity (likewise)

Kafka has no client-id prefix entity; the paths are the ones Redpanda's documentation gives its
``client-id-prefix`` entities, a prefix sanitized as a client id is (so ``<default>`` never names one).

Names are sanitized as Kafka's ``Sanitizer`` does; a CIDR prefix writes its "/" as "%2F". A config
document is ``{"version":1,"config":{"producer_byte_rate":"1024","request_percentage":"50.0"}}``:
every value a string, byte rates written as longs and the other quotas as Java doubles.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from quotas.entity import DEFAULT, QuotaEntity, desanitize, sanitize
from quotas.ip_entities import parse_ip_entity
from quotas.types import CONFIG_KEYS, ConfigKey, QuotaType

from .quotas import QuotaConfigError, validate_value

#: The version field of an entity config document (Kafka's ``ConfigEntityZNode``).
CONFIG_VERSION = 1

#: The path component of client-id prefix entities (Redpanda's name for them).
PREFIXES = "client-id-prefix"

_LONG_MAX = 2**63 - 1
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _path_name(name: str) -> str:
    """One entity name as a path component: ``<default>`` as is, anything else sanitized."""
    if not name:
        raise QuotaConfigError("an entity name must not be empty")
    return name if name == DEFAULT else sanitize(name)


def entity_path(entity: QuotaEntity) -> str:
    """Kafka's sanitized entity path under /config: ``users/alice/clients/app``, ``clients/<default>``."""
    if entity.ip is not None:
        return f"ips/{entity.ip.replace('/', '%2F')}"
    if entity.client_id_prefix is not None:
        if not entity.client_id_prefix:
            raise QuotaConfigError("a client-id prefix must not be empty")
        prefix = f"{PREFIXES}/{sanitize(entity.client_id_prefix)}"
        return prefix if entity.user is None else f"users/{_path_name(entity.user)}/{prefix}"
    if entity.user is not None and entity.client_id is not None:
        return f"users/{_path_name(entity.user)}/clients/{_path_name(entity.client_id)}"
    if entity.user is not None:
        return f"users/{_path_name(entity.user)}"
    if entity.client_id is not None:
        return f"clients/{_path_name(entity.client_id)}"
    raise QuotaConfigError("an entity names neither a user nor a client-id")


def _entity_name(component: str) -> str:
    return DEFAULT if component == DEFAULT else desanitize(component)


def entity_for_path(path: str) -> QuotaEntity:
    """The inverse of ``entity_path``; raises ValueError for a path outside the quota layout."""
    parts = path.split("/")
    if len(parts) == 2 and parts[0] == "users":
        return QuotaEntity(_entity_name(parts[1]), None)
    if len(parts) == 4 and parts[0] == "users" and parts[2] == "clients":
        return QuotaEntity(_entity_name(parts[1]), _entity_name(parts[3]))
    if len(parts) == 2 and parts[0] == "clients":
        return QuotaEntity(None, _entity_name(parts[1]))
    if len(parts) == 2 and parts[0] == PREFIXES and parts[1] not in ("", DEFAULT):
        return QuotaEntity(None, None, None, desanitize(parts[1]))
    if len(parts) == 4 and parts[0] == "users" and parts[2] == PREFIXES and parts[3] not in ("", DEFAULT):
        return QuotaEntity(_entity_name(parts[1]), None, None, desanitize(parts[3]))
    if len(parts) == 2 and parts[0] == "ips":
        return QuotaEntity(None, None, parse_ip_entity(_entity_name(parts[1])))
    raise ValueError(f"{path!r} is not a quota entity path")


def java_double(value: float) -> str:
    """Java's ``Double.toString``, which Kafka used for DOUBLE quota values: "50.0", "0.5", "1.0E7"."""
    if value == 0:
        return "0.0"
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    # repr gives the shortest digits that round-trip, as Java (JDK 19+) prints them.
    _, digit_tuple, exponent = Decimal(repr(magnitude)).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).rstrip("0") or "0"
    power = len(digit_tuple) + exponent - 1  # the decimal exponent of the first digit
    if 1e-3 <= magnitude < 1e7:
        if power >= 0:
            whole = digits[: power + 1].ljust(power + 1, "0")
            fraction = digits[power + 1 :] or "0"
        else:
            whole, fraction = "0", "0" * (-power - 1) + digits
        return f"{sign}{whole}.{fraction}"
    return f"{sign}{digits[0]}.{digits[1:] or '0'}E{power}"


def format_value(quota_type: ConfigKey, value: float) -> str:
    """A quota value as ``ZkAdminManager.alterClientQuotas`` stored it: longs for byte rates, else doubles
    (entity settings too)."""
    if isinstance(quota_type, QuotaType) and quota_type.integral:
        return str(min(int(value + 1e-6), _LONG_MAX))
    return java_double(value)


def encode_config(config: Mapping[str, Any]) -> bytes:
    """Node data as Kafka's ``ConfigEntityZNode.encode`` writes it (Jackson: compact, UTF-8)."""
    document = {"version": CONFIG_VERSION, "config": dict(config)}
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_config(data: bytes | None) -> dict[str, Any]:
    """The ``config`` object of a node; empty for a node without data (a parent Kafka created).

    Raises ValueError for data that is not such a JSON document: Kafka would silently read it as empty,
    which would drop the entity's quotas, so the caller keeps its last good values instead.
    """
    if not data:
        return {}
    document = json.loads(data.decode("utf-8"))
    if not isinstance(document, dict):
        raise ValueError("node data is not a JSON object")
    config = document.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f'"config" is {type(config).__name__}, not an object')
    return config


def parse_quota_config(entity: QuotaEntity, config: Mapping[str, Any]) -> dict[ConfigKey, float]:
    """The quotas kthrottle enforces from one node's config, validated the way the quota file is.

    Keys that are no quota (SCRAM credentials) are skipped silently; every quota key Kafka stores for
    users, client-ids and ips is enforced (``controller_mutation_rate`` included). Raises QuotaConfigError
    naming the entity, key and value for anything invalid.
    """
    values: dict[ConfigKey, float] = {}
    for key, raw in config.items():
        quota_type = CONFIG_KEYS.get(key)
        if quota_type is None:
            continue
        if not isinstance(raw, str) or not _NUMBER.fullmatch(raw.strip()):
            raise QuotaConfigError(
                f"quota for {entity.describe()}: {key} = {raw!r} is not a number written as a string"
            )
        validated_type, number = validate_value(entity, key, float(raw))
        values[validated_type] = number
    return values


def check_value(entity: QuotaEntity, quota_type: ConfigKey, value: float) -> None:
    """Kafka's rules for a value about to be stored."""
    validate_value(entity, quota_type.value, value)
