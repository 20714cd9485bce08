"""The types of a controller mutation charge (KIP-599), shared by the codec that makes a charge
(`controller_mutations`) and the in-flight record that keeps it until the broker answers
(`in_flight`): a module of its own so those two need not import each other."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

CREATE_TOPICS, DELETE_TOPICS, CREATE_PARTITIONS = 19, 20, 37

#: The first strict version of each API (`strictSinceVersion` in Kafka's ControllerApis:
#: handleCreateTopics 6, handleDeleteTopics 5, handleCreatePartitions 3).
STRICT_SINCE: dict[int, int] = {CREATE_TOPICS: 6, DELETE_TOPICS: 5, CREATE_PARTITIONS: 3}

#: The APIs the controller mutation quota charges.
MUTATION_APIS = frozenset(STRICT_SINCE)


@dataclass(frozen=True, slots=True)
class MutationTopic:
    """One topic of a mutation request, as the client named it."""

    name: str | None
    topic_id: uuid.UUID | None
    #: CreateTopics: partitions it asks for (-1: the broker's default); CreatePartitions: the new
    #: count; DeleteTopics: unused (0)
    count: int
    #: the request itself says the broker will refuse it (a duplicate, counts that make no sense)
    invalid: bool = False


@dataclass(slots=True)
class MutationRequest:
    """A decoded CreateTopics, CreatePartitions or DeleteTopics request."""

    api_key: int
    api_version: int
    message: Any
    topics: list[MutationTopic]

    @property
    def strict(self) -> bool:
        return self.api_version >= STRICT_SINCE[self.api_key]

    @property
    def needs_lookup(self) -> bool:
        """Whether costs depend on partition counts only the broker knows."""
        return self.api_key != CREATE_TOPICS and any(not t.invalid for t in self.topics)

    @property
    def by_id(self) -> bool:
        return any(t.topic_id is not None for t in self.topics)


@dataclass(slots=True)
class PartitionCounts:
    """Partitions of the topics a lookup answered (and the names of those named by id)."""

    by_name: dict[str, int] = field(default_factory=dict)
    by_id: dict[uuid.UUID, tuple[str, int]] = field(default_factory=dict)


@dataclass(slots=True)
class MutationCharge:
    """What a mutation request was charged, kept with it until its answer settles the charge."""

    request: MutationRequest
    #: per topic in the client's order: the estimate charged (0: nothing)
    costs: list[int]
    #: per topic: False where the proxy refused it (strict, bucket in debt)
    accepted: list[bool]
    throttle_ms: int
    #: CreateTopics topics estimated at the default partition count
    default_count: list[bool]
    counts: PartitionCounts | None = None
