"""Topic ids to names, learned from the Metadata responses the proxy forwards.

Fetch v13+ names topics by id (KIP-516) while operators name topics in partition throttles. A
client learns a topic's id only from a Metadata response (v10+ carry `TopicId`), and every
Metadata response it gets comes through the proxy, so the proxy learns the same mapping on the
way. A topic id the map does not hold (learned before the proxy started, or evicted) is counted
as a miss; the client's next Metadata response (at least every `metadata.max.age.ms`, 5 minutes
by default) teaches it again.

Read by hand, after the brokers array (`broker_array.py`): the topics array is stepped over
field by field in the order of Kafka's `MetadataResponse.json`, partitions by their sizes,
copying only each topic's name and id.
"""

from __future__ import annotations

from .broker_array import METADATA_FIRST_FLEXIBLE, METADATA_FIRST_RACK, metadata_brokers
from .errors import MalformedBody, MalformedHeader
from .headers import read_uvarint, response_body_offset, skip_tagged_fields

#: Topic ids remembered; past this the oldest learned is forgotten first. Kafka has no bound of
#: its own (a broker's metadata cache holds every topic of the cluster); 100,000 topics is beyond
#: what Kafka clusters run (~18 MB here for 100,000 ids with 30-character names).
MAX_TOPIC_IDS = 100_000

#: MetadataResponse.json: ClusterId from v2, TopicId from v10, LeaderEpoch from v7,
#: OfflineReplicas from v5, topic AuthorizedOperations from v8.
METADATA_FIRST_CLUSTER_ID = 2
METADATA_FIRST_TOPIC_ID = 10
METADATA_FIRST_LEADER_EPOCH = 7
METADATA_FIRST_OFFLINE_REPLICAS = 5
METADATA_FIRST_TOPIC_AUTHORIZED_OPERATIONS = 8
_UUID = 16
#: Kafka's `Uuid.ZERO_UUID`: a topic the broker does not know (an error entry) has it.
ZERO_UUID = bytes(_UUID)


class TopicNames:
    """A bounded map topic id -> name (one per proxy process: clients fetch on other connections)."""

    __slots__ = ("_names", "max_topics", "misses")

    def __init__(self, max_topics: int = MAX_TOPIC_IDS) -> None:
        if max_topics < 1:
            raise ValueError(f"max_topics must be at least 1, got {max_topics}")
        self.max_topics = max_topics
        self._names: dict[bytes, str] = {}
        #: lookups of an id the map did not hold (their partitions went through unthrottled)
        self.misses = 0

    def learn(self, topic_id: bytes, name: str) -> None:
        if len(topic_id) != _UUID or topic_id == ZERO_UUID:
            return
        names = self._names
        if names.get(topic_id) == name:
            return
        names.pop(topic_id, None)  # re-learned: it moves to the young end
        names[topic_id] = name
        if len(names) > self.max_topics:
            del names[next(iter(names))]

    def name(self, topic_id: bytes) -> str | None:
        found = self._names.get(topic_id)
        if found is None:
            self.misses += 1
        return found

    def __len__(self) -> int:
        return len(self._names)


class _FieldError(Exception):
    def __init__(self, field: str, offset: int, problem: str = "runs past the end") -> None:
        super().__init__(f"{field} at offset {offset} {problem}")


def _length(frame: bytes, pos: int, flexible: bool, width: int, field: str) -> tuple[int, int]:
    if flexible:
        try:
            value, end = read_uvarint(frame, pos)
        except MalformedHeader as exc:
            raise _FieldError(field, pos, f"is not a varint ({exc})") from None
        return value - 1, end
    end = pos + width
    if end > len(frame):
        raise _FieldError(field, pos)
    return int.from_bytes(frame[pos:end], "big", signed=True), end


def _tags(frame: bytes, pos: int, field: str) -> int:
    try:
        return skip_tagged_fields(frame, pos)
    except MalformedHeader as exc:
        raise _FieldError(field, pos, f"does not parse ({exc})") from None


def _int32_array(frame: bytes, pos: int, flexible: bool, field: str) -> int:
    count, pos = _length(frame, pos, flexible, 4, field)
    if count < 0:
        raise _FieldError(field, pos, f"is {count}")
    pos += 4 * count
    if pos > len(frame):
        raise _FieldError(field, pos)
    return pos


def learn_metadata_topics(names: TopicNames, frame: bytes, api_version: int) -> int:
    """Learn the topic ids of a Metadata response frame (header included, no size prefix).

    Returns how many topics it learned (named, with a non-zero id; none before v10). Raises
    `MalformedBody` naming the field and offset when the topics array does not add up.
    """
    if api_version < METADATA_FIRST_TOPIC_ID:
        return 0
    flexible = api_version >= METADATA_FIRST_FLEXIBLE
    try:
        start = response_body_offset(frame, 1 if flexible else 0)
    except MalformedHeader as exc:
        raise MalformedBody(f"Metadata v{api_version} response header: {exc}") from None
    pos = metadata_brokers(frame, start, api_version).end
    try:
        return _learn(names, frame, pos, api_version, flexible)
    except _FieldError as exc:
        raise MalformedBody(f"Metadata v{api_version} response of {len(frame)} bytes does not parse: "
                            f"{exc}") from None


def _learn(names: TopicNames, frame: bytes, pos: int, version: int, flexible: bool) -> int:
    size = len(frame)
    if version >= METADATA_FIRST_CLUSTER_ID:
        length, pos = _length(frame, pos, flexible, 2, "cluster id length")
        pos += max(length, 0)
    if version >= METADATA_FIRST_RACK:
        pos += 4  # controller id
    if pos > size:
        raise _FieldError("cluster id and controller id", pos)
    topics, pos = _length(frame, pos, flexible, 4, "topics count")
    if topics > size - pos:
        raise _FieldError("topics count", pos, f"{topics} is more than the bytes left")
    # Per partition: error code, index, leader id (leader epoch).
    fixed = 14 if version >= METADATA_FIRST_LEADER_EPOCH else 10
    offline = version >= METADATA_FIRST_OFFLINE_REPLICAS
    operations = 4 if version >= METADATA_FIRST_TOPIC_AUTHORIZED_OPERATIONS else 0
    learned = 0
    for _ in range(topics):
        length, start = _length(frame, pos + 2, flexible, 2, "topic name length")  # after error code
        end = start + max(length, 0)  # null (v12+) when the request named topics by id
        if length < -1 or end + _UUID + 1 > size:
            raise _FieldError("topic name and id", pos + 2, f"of name length {length} do not fit")
        topic_id = frame[end : end + _UUID]
        if length >= 0 and topic_id != ZERO_UUID:
            names.learn(topic_id, frame[start:end].decode("utf-8", errors="replace"))
            learned += 1
        pos = end + _UUID + 1  # id, is_internal
        partitions, pos = _length(frame, pos, flexible, 4, "partitions count")
        if partitions > size - pos:
            raise _FieldError("partitions count", pos, f"{partitions} is more than the bytes left")
        for _ in range(partitions):
            pos = _int32_array(frame, pos + fixed, flexible, "replica nodes")
            pos = _int32_array(frame, pos, flexible, "isr nodes")
            if offline:
                pos = _int32_array(frame, pos, flexible, "offline replicas")
            if flexible:
                pos = _tags(frame, pos, "partition tagged fields")
        pos += operations
        if flexible:
            pos = _tags(frame, pos, "topic tagged fields")
        elif pos > size:
            raise _FieldError("topic authorized operations", pos)
    return learned


__all__ = ["MAX_TOPIC_IDS", "TopicNames", "learn_metadata_topics"]
