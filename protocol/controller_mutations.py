"""CreateTopics, CreatePartitions and DeleteTopics under the controller mutation quota (KIP-599).

Pure: frames in, plain values and frames out; the quota arithmetic is `quotas.controller_mutation`
and the connection (`connection.py`) only calls what is here.

What a topic costs is what Kafka's controller charges (`ReplicationControlManager`): the partitions
a CreateTopics topic creates, the partitions a CreatePartitions topic adds (new count minus the
current one), the partitions of a topic DeleteTopics deletes. Kafka charges a topic only once it has
passed its checks (it exists or not as needed, the principal may act on it, the counts make sense),
just before applying it; a topic refused for any other reason costs nothing. The proxy cannot run
those checks before forwarding, so it works in two steps:

1. On arrival, each topic is *estimated* from the request and from the partition counts of the
   topics the request names, which the proxy asks the broker for with its own Metadata request on
   the client's upstream connection (`lookup_request`; the client's own principal, so it learns only
   what the client may describe). Topics the lookup does not show (unknown, not describable) are
   estimated at 0, as Kafka charges nothing for them. A CreateTopics topic asking for the broker's
   default partition count (-1, no assignments) is estimated at the default learned from earlier
   answers (Kafka's num.partitions default, 1, until one is seen). The quota is charged with the
   estimates, in request order, strict or permissive by version (see quotas/controller_mutation.py);
   a strict request's refused topics are cut from the request (`without_refused`) and answered by
   the proxy, or the whole request is answered by the proxy if no topic is left (`refusal_response`).
2. The broker's answer settles the charge (`settle_response`): a topic the broker refused gives its
   estimate back, and a default-count topic is charged what the answer says it got (CreateTopics v5+
   reports `num_partitions`). The proxy's refusals are merged into the answer in the client's order.

Validate-only CreateTopics and CreatePartitions are charged exactly like real ones, as Kafka's KRaft
controller does: `ReplicationControlManager.createTopic` calls `context.applyPartitionChangeQuota`
before `createTopics` drops the records of a validate-only request, and
`QuorumController.createPartitions` runs `replicationControl.createPartitions` (which charges) and
only then returns `result.withoutRecords()` for validateOnly. (ZooKeeper-mode brokers, gone since
Kafka 4.0, skipped the charge for validate-only requests.) DeleteTopics has no validate-only flag.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kafka.protocol.admin import (
    CreatePartitionsRequest,
    CreatePartitionsResponse,
    CreateTopicsRequest,
    CreateTopicsResponse,
    DeleteTopicsRequest,
    DeleteTopicsResponse,
)
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from .apis import KNOWN_APIS
from .headers import RequestHeader, encode_request_header, encode_response_header, response_body_offset
from .in_flight import InFlight
from .mutation_charge import (
    CREATE_PARTITIONS,
    CREATE_TOPICS,
    DELETE_TOPICS,
    MUTATION_APIS,
    STRICT_SINCE,
    MutationCharge,
    MutationRequest,
    MutationTopic,
    PartitionCounts,
)
from .skim import decode_strict

#: Kafka's Errors.THROTTLING_QUOTA_EXCEEDED, and the message its ThrottlingQuotaExceededException carries.
THROTTLING_QUOTA_EXCEEDED = 89
THROTTLING_QUOTA_EXCEEDED_MESSAGE = "The throttling quota has been exceeded."

#: DeleteTopics names topics by id from this version (KIP-516).
DELETE_TOPICS_BY_ID = 6

#: Metadata versions of the proxy's own lookup: v9 (Kafka 2.4+, still served by Kafka 4) for topics
#: named, v10 (Kafka 2.8+, the first to answer topic ids) when a DeleteTopics names topics by id, for
#: which it asks for every topic the client may describe (v10 and v11 cannot ask by id).
LOOKUP_VERSION_BY_NAME = 9
LOOKUP_VERSION_BY_ID = 10

#: Correlation id of the proxy's own lookup: Kafka's clients count theirs up from 0 (wrapping only
#: after 2^31 requests), one lookup at most is in flight per connection (the client's requests
#: wait behind it), and responses are matched in order anyway.
LOOKUP_CORRELATION_ID = -2

_ZERO_UUID = uuid.UUID(int=0)

_REQUESTS: dict[int, Any] = {
    CREATE_TOPICS: CreateTopicsRequest, DELETE_TOPICS: DeleteTopicsRequest,
    CREATE_PARTITIONS: CreatePartitionsRequest,
}
_RESPONSES: dict[int, Any] = {
    CREATE_TOPICS: CreateTopicsResponse, DELETE_TOPICS: DeleteTopicsResponse,
    CREATE_PARTITIONS: CreatePartitionsResponse,
}


def _decode(cls: Any, frame: bytes, start: int, version: int, what: str) -> Any:
    return decode_strict(cls, frame, start, version, f"{what} v{version}")


def _encode(message: Any, version: int) -> bytes:
    """Re-encode a decoded message (kafka-python's decoder leaves its header slot unset, which
    `encode` reads)."""
    try:
        message.header  # noqa: B018
    except AttributeError:
        message._header = None
    return bytes(message.encode(version=version))


def decode_mutation(frame: bytes, header: RequestHeader) -> MutationRequest:
    """A CreateTopics, CreatePartitions or DeleteTopics request; MalformedBody if it does not parse."""
    key, version = header.api_key, header.api_version
    cls = _REQUESTS[key]
    message = _decode(cls, frame, header.body_offset, version, cls.__name__)
    topics: list[MutationTopic] = []
    if key == CREATE_TOPICS:
        for topic in message.topics or ():
            topics.append(_creatable(topic))
    elif key == CREATE_PARTITIONS:
        for topic in message.topics or ():
            # a count below the current one (every topic has at least one partition) is refused
            topics.append(MutationTopic(topic.name, None, topic.count, invalid=topic.count <= 1))
    elif version >= DELETE_TOPICS_BY_ID:
        for state in message.topics or ():
            topic_id = state.topic_id if state.topic_id not in (None, _ZERO_UUID) else None
            # Kafka refuses a topic with neither or both (INVALID_REQUEST) and charges nothing
            invalid = (state.name is None) == (topic_id is None)
            topics.append(MutationTopic(state.name, topic_id, 0, invalid=invalid))
    else:
        topics = [MutationTopic(name, None, 0) for name in message.topic_names or ()]
    _mark_duplicates(topics)
    return MutationRequest(key, version, message, topics)


def _creatable(topic: Any) -> MutationTopic:
    """Kafka's checks in `ReplicationControlManager.createTopic` that refuse a topic before it is charged."""
    assignments = topic.assignments or []
    if assignments:
        indexes = {a.partition_index for a in assignments}
        invalid = (topic.num_partitions != -1 or topic.replication_factor != -1
                   or len(indexes) != len(assignments) or indexes != set(range(len(indexes))))
        return MutationTopic(topic.name, None, len(assignments), invalid=invalid)
    invalid = (topic.num_partitions == 0 or topic.num_partitions < -1
               or topic.replication_factor == 0 or topic.replication_factor < -1)
    return MutationTopic(topic.name, None, topic.num_partitions, invalid=invalid)


def _mark_duplicates(topics: list[MutationTopic]) -> None:
    """Kafka answers every copy of a duplicated topic with INVALID_REQUEST and charges none."""
    seen: dict[object, int] = {}
    for topic in topics:
        key = topic.topic_id if topic.topic_id is not None else topic.name
        seen[key] = seen.get(key, 0) + 1
    for index, topic in enumerate(topics):
        key = topic.topic_id if topic.topic_id is not None else topic.name
        if seen[key] > 1 and not topic.invalid:
            topics[index] = MutationTopic(topic.name, topic.topic_id, topic.count, invalid=True)


# -- the partition counts lookup ------------------------------------------------------------------


def lookup_request(request: MutationRequest, client_id: str | None) -> tuple[bytes, int]:
    """The proxy's own Metadata request for the partition counts a mutation needs: (frame, version).

    Topics named: those names (auto-creation off). Any named by id: every topic the client may
    describe, since only Metadata v12+ asks by id and brokers before Kafka 3.1 lack it.
    """
    if request.by_id:
        version = LOOKUP_VERSION_BY_ID
        message = MetadataRequest(topics=None, allow_auto_topic_creation=False,
                                  include_topic_authorized_operations=False)
    else:
        version = LOOKUP_VERSION_BY_NAME
        names = sorted({t.name for t in request.topics if t.name is not None and not t.invalid})
        message = MetadataRequest(
            topics=[MetadataRequest.MetadataRequestTopic(name=name) for name in names],
            allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    head = encode_request_header(MetadataRequest.API_KEY, version, LOOKUP_CORRELATION_ID, client_id)
    return head + bytes(message.encode(version=version)), version


def lookup(request: MutationRequest, header: RequestHeader) -> tuple[InFlight, bytes]:
    """The lookup for a mutation request, in flight like the client's own requests: its queue
    entry (answered by the proxy, not the client) and its frame, with the client's client id."""
    frame, version = lookup_request(request, header.client_id)
    entry = InFlight(LOOKUP_CORRELATION_ID, MetadataRequest.API_KEY, version, header.client_id,
                     lookup_for=header.correlation_id)
    return entry, frame


def lookup_counts(frame: bytes, version: int) -> PartitionCounts:
    """Partition counts from the lookup's answer; topics answered with an error are left out."""
    start = response_body_offset(frame, KNOWN_APIS[MetadataResponse.API_KEY].response_header_version(version))
    message = _decode(MetadataResponse, frame, start, version, "Metadata response")
    counts = PartitionCounts()
    for topic in message.topics or ():
        if topic.error_code != 0 or topic.name is None:
            continue
        partitions = len(topic.partitions or ())
        counts.by_name[topic.name] = partitions
        topic_id = getattr(topic, "topic_id", None)
        if topic_id is not None and topic_id != _ZERO_UUID:
            counts.by_id[topic_id] = (topic.name, partitions)
    return counts


# -- what each topic costs ------------------------------------------------------------------------


def estimate_costs(request: MutationRequest, counts: PartitionCounts | None,
                   default_partitions: int) -> tuple[list[int], list[bool]]:
    """Partitions each topic is charged on arrival, and which were estimated at the default count."""
    costs: list[int] = []
    defaults: list[bool] = []
    for topic in request.topics:
        cost, default = _estimate(request.api_key, topic, counts, default_partitions)
        costs.append(cost)
        defaults.append(default)
    return costs, defaults


def _estimate(api_key: int, topic: MutationTopic, counts: PartitionCounts | None,
              default_partitions: int) -> tuple[int, bool]:
    if topic.invalid:
        return 0, False
    if api_key == CREATE_TOPICS:
        if topic.count == -1:
            return max(default_partitions, 1), True
        return topic.count, False
    current = _current(topic, counts)
    if current is None:
        return 0, False  # unknown or not describable: Kafka charges nothing for it
    if api_key == DELETE_TOPICS:
        return current, False
    return max(topic.count - current, 0), False


def _current(topic: MutationTopic, counts: PartitionCounts | None) -> int | None:
    if counts is None:
        return None
    if topic.topic_id is not None:
        found = counts.by_id.get(topic.topic_id)
        return None if found is None else found[1]
    return counts.by_name.get(topic.name) if topic.name is not None else None


# -- the strict split: what goes to the broker, what the proxy answers ----------------------------


def without_refused(frame: bytes, header: RequestHeader, charge: MutationCharge) -> bytes:
    """The request frame with only the accepted topics (same header, so the same correlation id)."""
    request = charge.request
    message = request.message
    kept = [index for index, accepted in enumerate(charge.accepted) if accepted]
    if request.api_key == DELETE_TOPICS and request.api_version < DELETE_TOPICS_BY_ID:
        message.topic_names = [message.topic_names[i] for i in kept]
    else:
        message.topics = [message.topics[i] for i in kept]
    return bytes(frame[:header.body_offset]) + _encode(message, request.api_version)


def _refusal(api_key: int, topic: MutationTopic, charge: MutationCharge) -> Any:
    cls = _RESPONSES[api_key]
    if api_key == CREATE_TOPICS:
        return cls.CreatableTopicResult(name=topic.name, error_code=THROTTLING_QUOTA_EXCEEDED,
                                        error_message=THROTTLING_QUOTA_EXCEEDED_MESSAGE, configs=[])
    if api_key == CREATE_PARTITIONS:
        return cls.CreatePartitionsTopicResult(name=topic.name, error_code=THROTTLING_QUOTA_EXCEEDED,
                                               error_message=THROTTLING_QUOTA_EXCEEDED_MESSAGE)
    name = topic.name
    if name is None and topic.topic_id is not None and charge.counts is not None:
        found = charge.counts.by_id.get(topic.topic_id)
        name = None if found is None else found[0]
    return cls.DeletableTopicResult(name=name, topic_id=topic.topic_id, error_code=THROTTLING_QUOTA_EXCEEDED,
                                    error_message=THROTTLING_QUOTA_EXCEEDED_MESSAGE)


def _results_field(api_key: int) -> str:
    return {CREATE_TOPICS: "topics", DELETE_TOPICS: "responses", CREATE_PARTITIONS: "results"}[api_key]


def refusal_response(correlation_id: int, charge: MutationCharge) -> bytes:
    """The proxy's whole answer when every topic was refused (header and body, no size prefix)."""
    request = charge.request
    cls = _RESPONSES[request.api_key]
    results = [_refusal(request.api_key, topic, charge) for topic in request.topics]
    message = cls(throttle_time_ms=charge.throttle_ms, **{_results_field(request.api_key): results})
    header_version = KNOWN_APIS[request.api_key].response_header_version(request.api_version)
    body = bytes(message.encode(version=request.api_version))
    return encode_response_header(correlation_id, header_version) + body


def route(frame: bytes, header: RequestHeader, charge: MutationCharge) -> tuple[bytes, bytes | None]:
    """Where a charged request goes: (the frame to forward, None), or (b"", the proxy's answer) when
    every topic was refused; a strict request with some refused forwards only the accepted ones."""
    if charge.accepted and not any(charge.accepted):
        return b"", refusal_response(header.correlation_id, charge)
    return (frame if all(charge.accepted) else without_refused(frame, header, charge)), None


class _Results:
    """The broker's results, each taken once, found by the name or the id the client used.

    DeleteTopics v6 answers a topic named by name with its id too, and one named by id with its
    name when the client may describe it, so both indexes are kept.
    """

    def __init__(self, api_key: int, results: list[Any]) -> None:
        self.results = results
        self.taken = [False] * len(results)
        self.by_name: dict[str, deque[int]] = {}
        self.by_id: dict[uuid.UUID, deque[int]] = {}
        for index, result in enumerate(results):
            if result.name is not None:
                self.by_name.setdefault(result.name, deque()).append(index)
            topic_id = getattr(result, "topic_id", None) if api_key == DELETE_TOPICS else None
            if topic_id is not None and topic_id != _ZERO_UUID:
                self.by_id.setdefault(topic_id, deque()).append(index)

    def take(self, topic: MutationTopic) -> Any:
        if topic.topic_id is not None:
            found = self.by_id.get(topic.topic_id)
        else:
            found = self.by_name.get(topic.name) if topic.name is not None else None
        while found:
            index = found.popleft()
            if not self.taken[index]:
                self.taken[index] = True
                return self.results[index]
        return None

    def rest(self) -> list[Any]:
        return [result for result, taken in zip(self.results, self.taken, strict=True) if not taken]


@dataclass(frozen=True, slots=True)
class Settlement:
    """What the broker's answer says about a charged mutation request."""

    #: the frame for the client (the proxy's refusals merged in, or the broker's own)
    frame: bytes
    #: partitions to give back (< 0) or charge on top (> 0)
    correction: int
    #: partitions a default-count CreateTopics topic got (None: the answer did not say)
    default_partitions: int | None


def settle_response(frame: bytes, body_offset: int, charge: MutationCharge) -> Settlement:
    """Settle a mutation's charge with the broker's answer, and merge the proxy's refusals into it.

    Merged in the client's order: each topic forwarded takes the broker's result that names it,
    each refused one the proxy's THROTTLING_QUOTA_EXCEEDED; broker results matching no topic
    (Kafka's own duplicate refusals) follow at the end.
    """
    request = charge.request
    api_key, version = request.api_key, request.api_version
    cls = _RESPONSES[api_key]
    message = _decode(cls, frame, body_offset, version, cls.__name__)
    field_name = _results_field(api_key)
    results = _Results(api_key, list(getattr(message, field_name) or ()))
    correction = 0
    learned: int | None = None
    merged: list[Any] = []
    for index, topic in enumerate(request.topics):
        if not charge.accepted[index]:
            merged.append(_refusal(api_key, topic, charge))
            continue
        result = results.take(topic)
        if result is not None:
            merged.append(result)
        cost = charge.costs[index]
        if cost <= 0:
            continue
        if result is None or result.error_code != 0:
            correction -= cost  # refused by the broker (or not answered): Kafka charged nothing
        elif charge.default_count[index] and version >= 5 and result.num_partitions > 0:
            correction += result.num_partitions - cost
            learned = result.num_partitions
    if all(charge.accepted):
        return Settlement(frame, correction, learned)
    merged.extend(results.rest())
    setattr(message, field_name, merged)
    body = _encode(message, version)
    return Settlement(bytes(frame[:body_offset]) + body, correction, learned)


def plan_charge(request: MutationRequest, costs: list[int], default_count: list[bool],
                accepted: Sequence[bool], throttle_ms: int, counts: PartitionCounts | None) -> MutationCharge:
    """The record a charged request keeps until its answer."""
    return MutationCharge(request, costs, list(accepted), throttle_ms, default_count, counts)


__all__ = [
    "CREATE_PARTITIONS", "CREATE_TOPICS", "DELETE_TOPICS", "LOOKUP_CORRELATION_ID", "MUTATION_APIS",
    "STRICT_SINCE", "THROTTLING_QUOTA_EXCEEDED", "THROTTLING_QUOTA_EXCEEDED_MESSAGE", "MutationCharge",
    "MutationRequest", "MutationTopic", "PartitionCounts", "Settlement", "decode_mutation",
    "estimate_costs", "lookup", "lookup_counts", "lookup_request", "plan_charge", "refusal_response", "route",
    "settle_response", "without_refused",
]
