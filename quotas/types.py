"""The quota keys kthrottle enforces, named as in Kafka's configs, and the entity settings beside them."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from .fair_share import validate_share
from .shadow import validate_shadow


class QuotaType(Enum):
    """One quota key; `value` is its config name (`kafka-configs --add-config <name>=...`)."""

    PRODUCE = "producer_byte_rate"
    FETCH = "consumer_byte_rate"
    REQUEST = "request_percentage"
    CONTROLLER_MUTATION = "controller_mutation_rate"
    PRODUCER_IDS = "producer_ids_rate"
    #: KIP-612: new connections per second from one client address (`ip` entities only)
    CONNECTION_CREATION = "connection_creation_rate"

    @property
    def integral(self) -> bool:
        """Byte rates are whole numbers in Kafka; the others are doubles."""
        return self in (QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.CONNECTION_CREATION)

    @property
    def user_only(self) -> bool:
        """The KIP-936 draft defines producer-id quotas per user principal only."""
        return self is QuotaType.PRODUCER_IDS

    @property
    def ip_only(self) -> bool:
        """KIP-612: `connection_creation_rate` is the one key of an `ip` entity, and only of it."""
        return self is QuotaType.CONNECTION_CREATION

    @property
    def metric_type(self) -> str:
        """The `type` tag of the broker metric users know (kafka.server:type=...)."""
        return {
            QuotaType.PRODUCE: "Produce",
            QuotaType.FETCH: "Fetch",
            QuotaType.REQUEST: "Request",
            QuotaType.CONTROLLER_MUTATION: "ControllerMutation",
            QuotaType.PRODUCER_IDS: "ProducerIds",
            QuotaType.CONNECTION_CREATION: "ConnectionCreation",
        }[self]


QUOTA_KEYS: dict[str, QuotaType] = {t.value: t for t in QuotaType}


class EntitySetting(Enum):
    """A setting of a (user, client-id) entity that is not a quota: never charged, metered nor
    exchanged by the fleet, yet kept with the entity's quotas, set through every quota source as a
    quota key is (the file, the admin API, ZooKeeper, the quota topic) and resolved with Kafka's
    precedence. `value` is its config name. A new one needs a member and its rule (SETTING_RULES)."""

    #: kthrottle's weight of a tenant when the cluster capacity is shared (capacity.py)
    SHARE = "share"
    #: decisions for the entity are computed and reported, not applied (shadow.py); 1.0 or 0.0
    SHADOW = "shadow"

    def check(self, value: object, where: str) -> float:
        """The value, checked by the setting's one rule (ValueError names `where`, key and value)."""
        return SETTING_RULES[self](value, where)


#: Each setting's rule: (value, where) -> the value to keep, or ValueError naming both.
SETTING_RULES: dict[EntitySetting, Callable[[object, str], float]] = {
    EntitySetting.SHARE: validate_share,
    EntitySetting.SHADOW: validate_shadow,
}

#: What an entity's config may hold: its quotas and its settings.
ConfigKey = QuotaType | EntitySetting

#: Every key an entity's config may hold, by config name.
CONFIG_KEYS: dict[str, ConfigKey] = {**QUOTA_KEYS, **{s.value: s for s in EntitySetting}}

#: The keys of (user, client-id) entities: every key but the `ip` entity's.
CLIENT_QUOTA_TYPES: tuple[QuotaType, ...] = tuple(t for t in QuotaType if not t.ip_only)


class CapacityStream(Enum):
    """What the fleet exchange carries for capacity sharing (capacity.py): each tenant's own rate
    per direction, and each member's adaptive factor. Member names differ from QuotaType's: the
    exchange keys both by name."""

    CAPACITY_PRODUCE = "capacity:producer_byte_rate"
    CAPACITY_FETCH = "capacity:consumer_byte_rate"
    CAPACITY_REQUEST = "capacity:request_percentage"
    CAPACITY_FACTOR = "capacity:adaptive_factor"


#: The stream of each direction a capacity can be given for.
CAPACITY_STREAMS: dict[QuotaType, CapacityStream] = {
    QuotaType.PRODUCE: CapacityStream.CAPACITY_PRODUCE,
    QuotaType.FETCH: CapacityStream.CAPACITY_FETCH,
    QuotaType.REQUEST: CapacityStream.CAPACITY_REQUEST,
}

#: What one fleet usage entry is about: a quota's bucket, or a capacity stream.
UsageKind = QuotaType | CapacityStream
