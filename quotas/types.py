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

    @property
    def integral(self) -> bool:
        """Byte rates are whole numbers in Kafka; the others are doubles."""
        return self in (QuotaType.PRODUCE, QuotaType.FETCH)

    @property
    def user_only(self) -> bool:
        """The KIP-936 draft defines producer-id quotas per user principal only."""
        return self is QuotaType.PRODUCER_IDS

    @property
    def metric_type(self) -> str:
        """The `type` tag of the broker metric users know (kafka.server:type=...)."""
        return {
            QuotaType.PRODUCE: "Produce",
            QuotaType.FETCH: "Fetch",
            QuotaType.REQUEST: "Request",
            QuotaType.CONTROLLER_MUTATION: "ControllerMutation",
            QuotaType.PRODUCER_IDS: "ProducerIds",
        }[self]


QUOTA_KEYS: dict[str, QuotaType] = {t.value: t for t in QuotaType}
