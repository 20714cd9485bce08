"""The quota keys kthrottle enforces, named as in Kafka's configs."""

from __future__ import annotations

from enum import Enum


class QuotaType(Enum):
    """One quota key; `value` is its config name (`kafka-configs --add-config <name>=...`)."""

    PRODUCE = "producer_byte_rate"
    FETCH = "consumer_byte_rate"
    REQUEST = "request_percentage"
    CONTROLLER_MUTATION = "controller_mutation_rate"
    PRODUCER_IDS = "producer_ids_rate"
    #: KIP-612: new connections per second from one client address (`ip` entities only)
    CONNECTION_CREATION = "connection_creation_rate"
    #: kthrottle's weight of a tenant when the cluster capacity is shared (capacity.py); not a
    #: rate, never charged, resolved with Kafka's precedence like the others
    SHARE = "share"

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
            QuotaType.SHARE: "Share",
        }[self]


QUOTA_KEYS: dict[str, QuotaType] = {t.value: t for t in QuotaType}

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
