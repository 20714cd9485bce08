"""Topic ids to names, learned from the Metadata responses the proxy forwards.

Fetch v13+ names topics by id (KIP-516) while operators name topics in partition throttles. A
client learns a topic's id only from a Metadata response (v10+ carry `TopicId`), and every
Metadata response it gets comes through the proxy, so the proxy learns the same mapping on the
way, for the topics it needs: the throttled ones. A throttled topic whose id the proxy has not
seen in a Metadata response since it started (or since the throttle was added) is not throttled
in Fetch v13+ responses until the client's next Metadata response names it (clients refresh at
least every `metadata.max.age.ms` / `topic.metadata.refresh.interval.ms`, 5 minutes by default).

Read by hand, after the brokers array (`broker_array.py`): the topics array is stepped over in
the order of Kafka's `MetadataResponse.json`, partitions by their sizes, copying only the names
and ids of wanted topics. Stepping costs about a microsecond per partition, so a response in
which no wanted name occurs at all (a C-speed substring test) is not walked, and a walk stops
once every wanted name that occurs has been found.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from .broker_array import (
    METADATA_FIRST_FLEXIBLE,
    METADATA_FIRST_RACK,
    FieldError,
    field_error,
    metadata_brokers,
    read_length,
    skip_tagged,
)
from .errors import MalformedBody, MalformedHeader
from .headers import response_body_offset

#: Topic ids remembered; past this the oldest learned is forgotten first. Kafka has no bound of
#: its own (a broker's metadata cache holds every topic of the cluster). Only throttled topics are
#: learned (at most `MAX_PARTITION_THROTTLES` = 1000 topics, each with a new id whenever it is
#: deleted and created again), so this is only a backstop: ~2 MB at most.
MAX_TOPIC_IDS = 10_000

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

    __slots__ = ("_names", "max_topics")

    def __init__(self, max_topics: int = MAX_TOPIC_IDS) -> None:
        if max_topics < 1:
            raise ValueError(f"max_topics must be at least 1, got {max_topics}")
        self.max_topics = max_topics
        self._names: dict[bytes, str] = {}

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
        return self._names.get(topic_id)

    def unknown(self, topics: Iterable[str]) -> list[str]:
        """Those of `topics` no id is known for (their Fetch v13+ partitions cannot be matched)."""
        known = set(self._names.values())
        return sorted(topic for topic in topics if topic not in known)

    def __len__(self) -> int:
        return len(self._names)


def _int32_array(frame: bytes, pos: int, flexible: bool, field: str) -> int:
    count, pos = read_length(frame, pos, flexible, 4, field)
    if count < 0:
        raise field_error(field, pos, f"is {count}")
    pos += 4 * count
    if pos > len(frame):
        raise field_error(field, pos)
    return pos


def _skip_partition(frame: bytes, pos: int, fixed: int, flexible: bool, offline: bool) -> int:
    """Position after one partition entry, field by field (errors name the field and offset)."""
    pos = _int32_array(frame, pos + fixed, flexible, "replica nodes")
    pos = _int32_array(frame, pos, flexible, "isr nodes")
    if offline:
        pos = _int32_array(frame, pos, flexible, "offline replicas")
    if flexible:
        pos = skip_tagged(frame, pos, "partition")
    return pos


def learn_metadata_topics(names: TopicNames, frame: bytes, api_version: int, wanted: Collection[str]) -> int:
    """Learn the ids of the `wanted` topics in a Metadata response frame (header included, no size
    prefix), e.g. `PartitionThrottles.topics`.

    Returns how many it learned (none before v10, which carry no ids). Raises `MalformedBody`
    naming the field and offset when the part of the topics array it reads does not add up.
    """
    if api_version < METADATA_FIRST_TOPIC_ID or not wanted:
        return 0
    encoded = {topic.encode("utf-8") for topic in wanted}
    present = sum(1 for topic in encoded if topic in frame)
    if not present:
        return 0
    flexible = api_version >= METADATA_FIRST_FLEXIBLE
    try:
        start = response_body_offset(frame, 1 if flexible else 0)
    except MalformedHeader as exc:
        raise MalformedBody(f"Metadata v{api_version} response header: {exc}") from None
    pos = metadata_brokers(frame, start, api_version).end
    try:
        return _learn(names, frame, pos, api_version, flexible, encoded, present)
    except FieldError as exc:
        raise MalformedBody(f"Metadata v{api_version} response of {len(frame)} bytes does not parse: "
                            f"{exc}") from None


def _learn(names: TopicNames, frame: bytes, pos: int, version: int, flexible: bool, wanted: set[bytes],
           present: int) -> int:
    """Walk the topics array until the `present` wanted names occurring in the frame are found.

    `present` may count a name that only occurs inside another topic's name; the walk then runs
    to the end of the array, which costs time, never a wrong answer.
    """
    size = len(frame)
    if version >= METADATA_FIRST_CLUSTER_ID:
        length, pos = read_length(frame, pos, flexible, 2, "cluster id length")
        pos += max(length, 0)
    if version >= METADATA_FIRST_RACK:
        pos += 4  # controller id
    if pos > size:
        raise field_error("cluster id and controller id", pos)
    topics, pos = read_length(frame, pos, flexible, 4, "topics count")
    if topics > size - pos:
        raise field_error("topics count", pos, f"{topics} is more than the bytes left")
    # Per partition: error code, index, leader id (leader epoch).
    fixed = 14 if version >= METADATA_FIRST_LEADER_EPOCH else 10
    offline = version >= METADATA_FIRST_OFFLINE_REPLICAS
    operations = 4 if version >= METADATA_FIRST_TOPIC_AUTHORIZED_OPERATIONS else 0
    found: set[bytes] = set()
    learned = 0
    for _ in range(topics):
        length, start = read_length(frame, pos + 2, flexible, 2, "topic name length")  # after error code
        end = start + max(length, 0)  # null (v12+) when the request named topics by id
        if length < -1 or end + _UUID + 1 > size:
            raise field_error("topic name and id", pos + 2, f"of name length {length} do not fit")
        raw = frame[start:end]
        if length >= 0 and raw in wanted:
            topic_id = frame[end : end + _UUID]
            if topic_id != ZERO_UUID:  # an error entry (unknown topic) has no id
                names.learn(topic_id, raw.decode("utf-8"))
                learned += 1
            found.add(raw)
            if len(found) == present:
                return learned
        pos = end + _UUID + 1  # id, is_internal
        partitions, pos = read_length(frame, pos, flexible, 4, "partitions count")
        if partitions > size - pos:
            raise field_error("partitions count", pos, f"{partitions} is more than the bytes left")
        if flexible and offline:
            for _ in range(partitions):
                # Inline: three compact int32 arrays (count + 1, then 4 bytes each) and an empty
                # tag section; anything else (a null or two-byte count, tags, too few bytes) is
                # stepped again field by field, which names what is wrong.
                p = pos + fixed
                try:
                    first = frame[p]
                    p += 4 * first - 3
                    second = frame[p]
                    p += 4 * second - 3
                    third = frame[p]
                    p += 4 * third - 3
                    tags = frame[p]
                except IndexError:
                    first = 0
                if 0 < first < 0x80 and 0 < second < 0x80 and 0 < third < 0x80 and tags == 0:
                    pos = p + 1
                else:
                    pos = _skip_partition(frame, pos, fixed, flexible, offline)
        else:
            for _ in range(partitions):
                pos = _skip_partition(frame, pos, fixed, flexible, offline)
        pos += operations
        if flexible:
            pos = skip_tagged(frame, pos, "topic")
        elif pos > size:
            raise field_error("topic authorized operations", pos)
    return learned


__all__ = ["MAX_TOPIC_IDS", "TopicNames", "learn_metadata_topics"]
