"""A seeded fuzzer of the Kafka wire protocol, aimed at a running proxy over raw TCP (issue 10).

Why its own module: test_fuzz.py states what must hold (a legitimate producer and consumer see their
exact records, the proxy lives and logs no traceback); this module only makes hostile traffic and
remembers what each connection sent, so that a bad log line can be traced back to its input.

What it sends: real requests built with kafka-python's schema-generated classes (so every field is
where Kafka puts it), then mutated (bytes flipped, inserted, deleted, truncated; size prefixes, header
fields and array lengths corrupted, null arrays included); random frames; hostile sizes; frames split
byte by byte; half frames; valid requests on connections that never read their answers.

Reproducible: connection n of worker w draws everything it sends from `Random(f"{seed}/{w}/{n}")`, so
one seed gives the same connections in the same order; only how many fit in the time differs.

Harmless to the shared session cluster: requests reach real brokers, so an api key the fuzzer makes
is either one of the read-only or data APIs below or one no Kafka version knows. A flipped byte must
never turn into DeleteTopics, IncrementalAlterConfigs or UnregisterBroker against brokers that other
tests use.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka.protocol.admin.client_quotas import AlterClientQuotasRequest, DescribeClientQuotasRequest
from kafka.protocol.consumer import FetchRequest
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    ApiVersionsResponse,
    FindCoordinatorRequest,
    MetadataRequest,
    MetadataResponse,
)
from kafka.protocol.producer import ProduceRequest
from kafka.protocol.sasl import SaslAuthenticateRequest, SaslHandshakeRequest
from kafka.record.memory_records import MemoryRecordsBuilder

from protocol.api_versions import offered_range
from protocol.apis import KNOWN_APIS
from protocol.connection import ProxyConnection, QuotaAdmin
from protocol.frames import DEFAULT_MAX_REQUEST_BYTES, frame
from protocol.headers import encode_request_header, encode_response_header

#: Concurrent fuzzing threads, each opening one connection after another.
WORKERS = 8

#: Connections that sent requests and never read, held open until the fuzz ends (each may make the
#: proxy buffer a Fetch answer: enough to exercise backpressure, few enough not to be issue 4's bench).
MAX_HELD = 24

#: Size prefixes no proxy may act on: negative, the int32 maximum, just above Kafka's default
#: socket.request.max.bytes (100 MiB, the proxy's DEFAULT_MAX_REQUEST_BYTES), 1 GiB.
HOSTILE_SIZES = (-1, -5, -(2**31), 2**31 - 1, DEFAULT_MAX_REQUEST_BYTES + 1, 2**30)

#: How long a hostile-size connection waits for the proxy to close it (it should be at once).
HOSTILE_CLOSE_WAIT_S = 10.0

#: How long the first, valid request of a mutating connection waits for its answer.
ANSWER_WAIT_S = 20.0

#: APIs a fuzzed frame may name: what the fuzzer builds itself, the two the proxy answers itself
#: (AlterClientQuotas is refused: no fuzzing principal is a quota admin), and read-only ones.
#: Any other api key below UNKNOWN_API_KEY_FLOOR is replaced by an unknown one.
HARMLESS_API_KEYS = frozenset({
    0,   # Produce (to the fuzzer's own topic, or to a name that does not exist)
    1,   # Fetch
    2,   # ListOffsets
    3,   # Metadata
    9,   # OffsetFetch
    10,  # FindCoordinator
    15,  # DescribeGroups
    16,  # ListGroups
    17,  # SaslHandshake
    18,  # ApiVersions
    29,  # DescribeAcls
    32,  # DescribeConfigs
    35,  # DescribeLogDirs
    36,  # SaslAuthenticate
    48,  # DescribeClientQuotas
    49,  # AlterClientQuotas
    60,  # DescribeCluster
    61,  # DescribeProducers
    65,  # DescribeTransactions
    66,  # ListTransactions
    75,  # DescribeTopicPartitions
})
UNKNOWN_API_KEY_FLOOR = 1000

#: Int32 array lengths worth trying (null, negative, empty, huge, past the end).
HOSTILE_INT32_LENGTHS = (-1, -2, -(2**31), 0, 2**31 - 1, 2**20, 65_536)
#: Unsigned-varint (compact) array lengths, stored as length + 1: 0 is null, 1 is empty.
HOSTILE_COMPACT_LENGTHS = (0, 1, 2**31, 2**32 - 1, 2**20, 300)

#: Byte patterns an insert mutation likes: lengths of -1 and int32 max, an overlong varint.
INTERESTING_BYTES = (b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00", b"\x80\x80\x80\x80\x80", b"\x00")


# -- real requests -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """What the fuzzer's requests name: a topic of its own, with some records to fetch."""

    topic: str
    topic_id: uuid.UUID
    partitions: int
    group: str = "fuzz-group"


@dataclass(frozen=True, slots=True)
class ArrayField:
    """Where an array's length sits in a sample's payload, found by encoding it as null."""

    path: str
    offset: int
    compact: bool


@dataclass(frozen=True, slots=True)
class Sample:
    """One real request: its header and body (no size prefix) and its arrays' length offsets."""

    label: str
    api_key: int
    api_version: int
    payload: bytes
    arrays: tuple[ArrayField, ...]


def _records() -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 16)
    for i in range(3):
        builder.append(timestamp=1_700_000_000_000 + i, key=b"fuzz-%d" % i, value=b"x" * 40)
    builder.close()
    return bytes(builder.buffer())


#: (version, target, which array path to encode as null) -> a kafka-python request
_Builder = Callable[[int, Target, str | None], Any]


def _api_versions(version: int, _target: Target, _null: str | None) -> Any:
    if version >= 3:
        return ApiVersionsRequest[version](client_software_name="fuzz", client_software_version="1.0")
    return ApiVersionsRequest[version]()


def _metadata(version: int, target: Target, null: str | None) -> Any:
    m = MetadataRequest
    topics = None if null == "topics" else [m.MetadataRequestTopic(topic_id=None, name=target.topic)]
    return m[version](topics=topics, allow_auto_topic_creation=False,
                      include_cluster_authorized_operations=False, include_topic_authorized_operations=False)


_RECORDS = _records()


def _produce(version: int, target: Target, null: str | None) -> Any:
    t = ProduceRequest.TopicProduceData
    parts = None if null == "topic_data[0].partition_data" else [
        t.PartitionProduceData(index=p, records=_RECORDS) for p in range(2)]
    data = None if null == "topic_data" else [
        t(name=target.topic, topic_id=target.topic_id, partition_data=parts)]
    acks = (1, -1, 0)[version % 3]  # acks=0 has no answer: it moves the pipeline's bookkeeping
    return ProduceRequest[version](transactional_id=None, acks=acks, timeout_ms=5000, topic_data=data)


def _fetch(version: int, target: Target, null: str | None) -> Any:
    f = FetchRequest
    parts = None if null == "topics[0].partitions" else [
        f.FetchTopic.FetchPartition(partition=p, current_leader_epoch=-1, fetch_offset=0,
                                    last_fetched_epoch=-1,
                                    log_start_offset=-1, partition_max_bytes=256 * 1024)
        for p in range(target.partitions)]
    topics = None if null == "topics" else [f.FetchTopic(topic=target.topic, topic_id=target.topic_id,
                                                          partitions=parts)]
    forgotten: list[Any] | None = None if null == "forgotten_topics_data" else []
    return f[version](replica_id=-1, max_wait_ms=20, min_bytes=1, max_bytes=1024 * 1024,
                      isolation_level=0, session_id=0, session_epoch=-1, topics=topics,
                      forgotten_topics_data=forgotten, rack_id="")


def _find_coordinator(version: int, target: Target, null: str | None) -> Any:
    keys = None if null == "coordinator_keys" else [target.group]
    return FindCoordinatorRequest[version](key=target.group, key_type=0, coordinator_keys=keys)


def _sasl_handshake(version: int, _target: Target, _null: str | None) -> Any:
    return SaslHandshakeRequest[version](mechanism="PLAIN" if version else "SCRAM-SHA-256")


def _sasl_authenticate(version: int, _target: Target, _null: str | None) -> Any:
    return SaslAuthenticateRequest[version](auth_bytes=b"\x00fuzz\x00not-a-password")


def _describe_client_quotas(version: int, _target: Target, null: str | None) -> Any:
    d = DescribeClientQuotasRequest
    components = None if null == "components" else [
        d.ComponentData(entity_type="client-id", match_type=1, match=None),
        d.ComponentData(entity_type="user", match_type=0, match="fuzz")]
    return d[version](components=components, strict=False)


def _alter_client_quotas(version: int, _target: Target, null: str | None) -> Any:
    a = AlterClientQuotasRequest
    entity = None if null == "entries[0].entity" else [
        a.EntryData.EntityData(entity_type="client-id", entity_name="fuzz")]
    ops = None if null == "entries[0].ops" else [
        a.EntryData.OpData(key="producer_byte_rate", value=1024.0, remove=False)]
    entries = None if null == "entries" else [a.EntryData(entity=entity, ops=ops)]
    return a[version](entries=entries, validate_only=True)


#: api key -> (name, builder, the array paths the builder can make null)
REQUESTS: dict[int, tuple[str, _Builder, tuple[str, ...]]] = {
    18: ("ApiVersions", _api_versions, ()),
    3: ("Metadata", _metadata, ("topics",)),
    0: ("Produce", _produce, ("topic_data", "topic_data[0].partition_data")),
    1: ("Fetch", _fetch, ("topics", "topics[0].partitions", "forgotten_topics_data")),
    10: ("FindCoordinator", _find_coordinator, ("coordinator_keys",)),
    17: ("SaslHandshake", _sasl_handshake, ()),
    36: ("SaslAuthenticate", _sasl_authenticate, ()),
    48: ("DescribeClientQuotas", _describe_client_quotas, ("components",)),
    49: ("AlterClientQuotas", _alter_client_quotas, ("entries", "entries[0].entity", "entries[0].ops")),
}


def _encode(api_key: int, version: int, body: Any, client_id: str = "fuzz", correlation_id: int = 0) -> bytes:
    return encode_request_header(api_key, version, correlation_id, client_id) + bytes(body.encode())


def build_samples(target: Target) -> list[Sample]:
    """Every API above at every version both the proxy and kafka-python know, with its arrays located.

    An array's length is where the encoding with that array null first differs from the normal one
    (an int32 -1 or a compact 0 where the count was).
    """
    samples: list[Sample] = []
    for api_key, (name, build, paths) in REQUESTS.items():
        offered = offered_range(api_key)
        assert offered is not None, f"the proxy offers no version of {name}"
        for version in range(offered[0], offered[1] + 1):
            payload = _encode(api_key, version, build(version, target, None))
            flexible = KNOWN_APIS[api_key].request_header_version(version) >= 2
            arrays: list[ArrayField] = []
            for path in paths:
                nulled = _encode(api_key, version, build(version, target, path))
                if nulled == payload:
                    continue  # the field is not in this version
                offset = next(i for i, (a, b) in enumerate(zip(payload, nulled, strict=False)) if a != b)
                if nulled[offset:offset + (1 if flexible else 4)] != (b"\x00" if flexible else b"\xff" * 4):
                    continue  # not nullable in this version: kafka-python wrote it empty instead
                arrays.append(ArrayField(path, offset, flexible))
            samples.append(Sample(f"{name} v{version}", api_key, version, payload, tuple(arrays)))
    return samples


def topic_id(host: str, port: int, topic: str) -> uuid.UUID:
    """A topic's id, asked with a raw Metadata v12 (confluent-kafka's admin client does not give it)."""
    v12 = MetadataRequest[12]
    request = v12(topics=[v12.MetadataRequestTopic(topic_id=None, name=topic)],
                  allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    with socket.create_connection((host, port), timeout=15) as sock:
        sock.sendall(frame(_encode(3, 12, request, "fuzz-setup", 1)))
        body = _read_frame(sock)
    response = MetadataResponse.decode(body[5:], version=12)  # correlation id + header tags
    (found,) = [t for t in response.topics if t.name == topic]
    assert found.error_code == 0, f"metadata for {topic}: error {found.error_code}"
    return uuid.UUID(str(found.topic_id))


def advertised_versions(host: str, port: int) -> dict[int, tuple[int, int]]:
    """The version range per api key the proxy advertises (the brokers' clamped to its schemas)."""
    with socket.create_connection((host, port), timeout=15) as sock:
        request = ApiVersionsRequest[3](client_software_name="fuzz", client_software_version="1.0")
        sock.sendall(frame(_encode(18, 3, request, "fuzz-setup", 1)))
        body = _read_frame(sock)
    answer = ApiVersionsResponse.decode(body[4:], version=3)  # ApiVersions answers with header v0
    assert answer.error_code == 0, f"ApiVersions error {answer.error_code}"
    return {a.api_key: (a.min_version, a.max_version) for a in answer.api_keys}


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _read_frame(sock: socket.socket) -> bytes:
    return _exactly(sock, struct.unpack(">i", _exactly(sock, 4))[0])


# -- mutations -----------------------------------------------------------------------------------


def _harmless_api_key(payload: bytearray, rng: random.Random) -> str | None:
    """Replace an api key that could change the shared cluster with an unknown one."""
    if len(payload) < 2:
        return None
    key = struct.unpack_from(">h", payload)[0]
    if key in HARMLESS_API_KEYS or key < 0 or key >= UNKNOWN_API_KEY_FLOOR:
        return None
    unknown = rng.randrange(UNKNOWN_API_KEY_FLOOR, 2**15)
    struct.pack_into(">h", payload, 0, unknown)
    return f"api key {key}->{unknown}"


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _uvarint_width(buf: bytes | bytearray, pos: int) -> int:
    width = 1
    while pos + width - 1 < len(buf) and buf[pos + width - 1] & 0x80 and width < 5:
        width += 1
    return width


def _mutate_array(payload: bytearray, array: ArrayField, rng: random.Random) -> tuple[bytearray, str]:
    if array.compact:
        length = rng.choice(HOSTILE_COMPACT_LENGTHS)
        width = _uvarint_width(payload, array.offset)
        payload[array.offset:array.offset + width] = _uvarint(length)
        what = "null" if length == 0 else f"compact length {length}"
    else:
        length = rng.choice(HOSTILE_INT32_LENGTHS)
        struct.pack_into(">i", payload, array.offset, length)
        what = "null" if length == -1 else f"length {length}"
    return payload, f"{array.path}={what}"


def _mutate_header(payload: bytearray, sample: Sample, rng: random.Random) -> str:
    field_ = rng.choice(("version", "client id length", "correlation id"))
    if field_ == "version":
        offered = offered_range(sample.api_key)
        top = offered[1] if offered else 20
        version = rng.choice((-1, -32768, top + 1, 32767, rng.randrange(0, top + 1)))
        struct.pack_into(">h", payload, 2, version)
        return f"api version {version}"
    if field_ == "client id length":
        length = rng.choice((-1, -2, -32768, 32767, struct.unpack_from(">h", payload, 8)[0] + 5))
        struct.pack_into(">h", payload, 8, length)
        return f"client id length {length}"
    cid = rng.randrange(-(2**31), 2**31)
    struct.pack_into(">i", payload, 4, cid)
    return f"correlation id {cid}"


def _mutate_bytes(payload: bytearray, rng: random.Random) -> tuple[bytearray, str]:
    op = rng.choice(("flip", "flip", "insert", "delete", "truncate"))
    if not payload:
        op = "insert"
    if op == "flip":
        spots = sorted(rng.randrange(len(payload)) for _ in range(rng.randint(1, 4)))
        for spot in spots:
            payload[spot] ^= rng.randrange(1, 256)
        return payload, f"flip@{','.join(map(str, spots))}"
    if op == "insert":
        spot = rng.randrange(len(payload) + 1)
        extra = rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 8))
        payload[spot:spot] = extra
        return payload, f"insert@{spot}:{extra.hex()}"
    if op == "delete":
        spot = rng.randrange(len(payload))
        count = rng.randint(1, 8)
        del payload[spot:spot + count]
        return payload, f"delete@{spot}:{count}"
    cut = rng.randrange(len(payload))
    return payload[:cut], f"truncate@{cut}"


def mutate(sample: Sample, rng: random.Random, correlation_id: int, client_id: bytes) -> tuple[str, bytes]:
    """A mutated frame of `sample` (size prefix included) and a label saying what was done."""
    payload = bytearray(sample.payload)
    struct.pack_into(">i", payload, 4, correlation_id)
    # The samples carry client id "fuzz"; give each connection its own (quota entities, log lines).
    payload[8:14] = struct.pack(">h", len(client_id)) + client_id
    shift = len(client_id) - 4
    done: list[str] = []
    if sample.arrays and rng.random() < 0.45:
        array = rng.choice(sample.arrays)
        moved = ArrayField(array.path, array.offset + shift, array.compact)
        payload, what = _mutate_array(payload, moved, rng)
        done.append(what)
    if rng.random() < 0.15:
        done.append(_mutate_header(payload, sample, rng))
    for _ in range(rng.choice((0, 1, 1, 1, 2, 3)) if done else rng.choice((1, 1, 2, 3))):
        payload, what = _mutate_bytes(payload, rng)
        done.append(what)
    guarded = _harmless_api_key(payload, rng)
    if guarded:
        done.append(guarded)
    size = len(payload)
    if rng.random() < 0.12:
        size = rng.choice((size + 1, size - 1, size + rng.randint(2, 64), max(size - rng.randint(2, 64), 0),
                           size + 4096, -1, 0))
        done.append(f"size prefix {size} for {len(payload)} bytes")
    return f"{sample.label} [{'; '.join(done)}]", struct.pack(">i", size) + bytes(payload)


def valid_frame(sample: Sample, correlation_id: int, client_id: bytes) -> bytes:
    payload = bytearray(sample.payload)
    struct.pack_into(">i", payload, 4, correlation_id)
    payload[8:14] = struct.pack(">h", len(client_id)) + client_id
    return frame(bytes(payload))


def random_frame(rng: random.Random) -> tuple[str, bytes]:
    """Bytes that only look like a frame: a random header (harmless api key) and a random body, or
    nothing but random bytes behind a correct size."""
    if rng.random() < 0.3:
        payload = rng.randbytes(rng.choice((0, 1, 4, 9, 10, 11, rng.randint(12, 64))))
        return f"random {len(payload)} bytes", frame(payload)
    if rng.random() < 0.6:
        api_key = rng.choice(sorted(HARMLESS_API_KEYS))
    else:
        api_key = rng.choice((-1, -32768, rng.randrange(UNKNOWN_API_KEY_FLOOR, 2**15)))
    version = rng.choice((-1, 0, 1, 2, 3, 4, 9, 12, 13, 15, 32767, rng.randrange(-(2**15), 2**15)))
    client = rng.choice((b"", b"fuzz-random", rng.randbytes(rng.randint(0, 40)), "ünïcødé-🙂".encode()))
    client_len = len(client) if rng.random() < 0.85 else rng.choice((-1, -7, 32767))
    body_size = min(int(rng.expovariate(1 / 200)), 8192)
    payload = (struct.pack(">hhih", api_key, version, rng.randrange(-(2**31), 2**31), client_len) + client
               + rng.randbytes(body_size))
    return f"random header key={api_key} v{version} client id length {client_len}, {body_size}-byte body", \
        frame(payload)


# -- connections ---------------------------------------------------------------------------------


class ClosedByProxy(Exception):
    """The proxy ended this connection (EOF or reset): what a hostile client should expect."""


@dataclass
class ConnectionRecord:
    """What one fuzzing connection did, kept to explain a log line about it afterwards."""

    name: str
    scenario: str
    port: int
    local_port: int = 0
    bytes_sent: int = 0
    #: (label, bytes) of every frame or piece of one, in the order sent
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    closed_by_proxy: bool = False
    #: something the proxy did that it must not (a wrong answer to a valid request, a hostile
    #: size left open); checked by the tests
    anomaly: str | None = None

    @property
    def frames(self) -> int:
        return len(self.sent)

    def note(self, label: str, data: bytes) -> None:
        self.sent.append((label, data))

    def describe(self, last: int = 6) -> str:
        return "\n      ".join(
            f"{label}: {data[:48].hex()}{'...' if len(data) > 48 else ''} ({len(data)} bytes)"
            for label, data in self.sent[-last:])


@dataclass
class FuzzReport:
    seed: int
    seconds: float
    connections: list[ConnectionRecord]
    scenarios: Counter[str]

    @property
    def frames(self) -> int:
        return sum(c.frames for c in self.connections)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.connections)

    @property
    def closed_by_proxy(self) -> int:
        return sum(c.closed_by_proxy for c in self.connections)

    def summary(self) -> str:
        kinds = ", ".join(f"{name} {count:,}" for name, count in sorted(self.scenarios.items()))
        return (f"fuzz: {self.frames:,} frames ({self.bytes_sent / 1e6:.1f} MB) from "
                f"{len(self.connections):,} connections in {self.seconds:.0f} s, "
                f"{self.closed_by_proxy:,} closed by the proxy, "
                f"seed {self.seed} ({kinds})")

    def by_local_port(self) -> dict[int, ConnectionRecord]:
        return {c.local_port: c for c in self.connections if c.local_port}


class Fuzzer:
    """Threads that open connection after connection to the proxy's ports until the time is up."""

    def __init__(self, seed: int, host: str, ports: list[int], target: Target, seconds: float,
                 advertised: dict[int, tuple[int, int]]) -> None:
        self.seed = seed
        self.host = host
        self.ports = ports
        self.samples = build_samples(target)
        #: what a connection's first request is drawn from: versions the brokers answer, so that
        #: anything but a right answer is the proxy's fault
        self.answerable = [s for s in self.samples if s.api_key in (3, 18)
                           and advertised[s.api_key][0] <= s.api_version <= advertised[s.api_key][1]]
        self.seconds = seconds
        self._deadline = 0.0
        self._records: list[ConnectionRecord] = []
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._scenarios: list[tuple[str, float, Callable[[random.Random, ConnectionRecord, socket.socket],
                                                         None]]] = [
            ("mutated", 45, self._mutated),
            ("random", 15, self._random),
            ("hostile-size", 8, self._hostile_size),
            ("split", 12, self._split),
            ("half-frame", 12, self._half_frame),
            ("never-read", 8, self._never_read),
        ]

    def run(self) -> FuzzReport:
        started = time.monotonic()
        self._deadline = started + self.seconds
        workers = [threading.Thread(target=self._worker, args=(w,), name=f"fuzz-{w}", daemon=True)
                   for w in range(WORKERS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        with self._lock:
            held, self._held = self._held, []
        for sock in held:
            sock.close()
        records = sorted(self._records, key=lambda r: r.name)
        scenarios = Counter(r.scenario for r in records)
        return FuzzReport(self.seed, time.monotonic() - started, records, scenarios)

    def _worker(self, worker: int) -> None:
        n = 0
        while time.monotonic() < self._deadline:
            rng = random.Random(f"{self.seed}/{worker}/{n}")
            names, weights, actions = zip(*self._scenarios, strict=True)
            index = rng.choices(range(len(names)), weights)[0]
            record = ConnectionRecord(f"w{worker}.{n}", names[index], rng.choice(self.ports))
            n += 1
            self._records.append(record)
            try:
                sock = socket.create_connection((self.host, record.port), timeout=ANSWER_WAIT_S)
            except OSError as exc:
                record.anomaly = f"could not connect to port {record.port}: {exc}"
                continue
            keep = False
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                record.local_port = sock.getsockname()[1]
                actions[index](rng, record, sock)
                keep = record.scenario == "never-read"
            except (ClosedByProxy, ConnectionError):
                record.closed_by_proxy = True
            except TimeoutError:
                pass  # the proxy waits for the rest of a frame: fine, the fuzzer moves on
            except Exception as exc:  # a fuzzer bug or a socket error nobody expects: the tests see it
                record.anomaly = f"unexpected {exc!r}"
            finally:
                if not keep:
                    if rng.random() < 0.3:  # leave with a reset instead of a FIN
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()

    # -- what a connection does --

    def _client_id(self, rng: random.Random, record: ConnectionRecord) -> bytes:
        return rng.choice((f"fuzz-{record.name}".encode(), b"fuzz", b"", "fuzz-ünïcødé".encode(),
                           b"fuzz-" + b"x" * rng.randint(100, 2000)))

    def _send(self, sock: socket.socket, record: ConnectionRecord, label: str, data: bytes) -> None:
        record.note(label, data)
        self._raw(sock, record, data)

    def _raw(self, sock: socket.socket, record: ConnectionRecord, data: bytes) -> None:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ClosedByProxy() from exc
        record.bytes_sent += len(data)

    def _drain(self, sock: socket.socket) -> None:
        """Read whatever answers are there, without waiting; EOF means the proxy closed."""
        sock.setblocking(False)
        try:
            while True:
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    return
                if not data:
                    raise ClosedByProxy()
        finally:
            sock.settimeout(ANSWER_WAIT_S)

    def _wait_closed(self, sock: socket.socket, timeout: float) -> bool:
        sock.settimeout(timeout)
        try:
            while sock.recv(1 << 16):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def _mutated(self, rng: random.Random, record: ConnectionRecord, sock: socket.socket) -> None:
        """A valid request whose answer must come back right, then a stream of real and mutated ones."""
        client_id = self._client_id(rng, record)
        first = rng.choice(self.answerable)
        self._send(sock, record, f"{first.label} (valid)", valid_frame(first, 1, client_id))
        try:
            answer = _read_frame(sock)
        except ConnectionError as exc:
            record.anomaly = f"the proxy closed instead of answering a valid {first.label}: {exc}"
            raise ClosedByProxy() from exc
        except TimeoutError:
            record.anomaly = f"no answer to a valid {first.label} within {ANSWER_WAIT_S:.0f} s"
            raise
        if struct.unpack(">i", answer[:4])[0] != 1:
            record.anomaly = f"wrong correlation id answering {first.label}: {answer[:8].hex()}"
        pipelined = rng.random() < 0.3
        batch: list[bytes] = []
        for correlation_id in range(2, 2 + rng.randint(1, 40)):
            sample = rng.choice(self.samples)
            if rng.random() < 0.25:
                label, data = f"{sample.label} (valid)", valid_frame(sample, correlation_id, client_id)
            else:
                label, data = mutate(sample, rng, correlation_id, client_id)
            if pipelined:
                record.note(f"{label}, pipelined", data)
                batch.append(data)
            else:
                self._send(sock, record, label, data)
                self._drain(sock)
        if batch:
            self._raw(sock, record, b"".join(batch))
        if rng.random() < 0.5:
            record.closed_by_proxy = self._wait_closed(sock, 0.3)
        else:
            self._drain(sock)

    def _random(self, rng: random.Random, record: ConnectionRecord, sock: socket.socket) -> None:
        for _ in range(rng.randint(1, 20)):
            label, data = random_frame(rng)
            self._send(sock, record, label, data)
            self._drain(sock)

    def _hostile_size(self, rng: random.Random, record: ConnectionRecord, sock: socket.socket) -> None:
        """A size prefix no proxy may accept (and a few bytes of what could follow): it must close."""
        size = rng.choice(HOSTILE_SIZES)
        tail = rng.choice((b"", valid_frame(rng.choice(self.samples), 1, b"fuzz")[4:20], rng.randbytes(100)))
        self._send(sock, record, f"size prefix {size}", struct.pack(">i", size) + tail)
        if not self._wait_closed(sock, HOSTILE_CLOSE_WAIT_S):
            record.anomaly = f"size prefix {size}: still open after {HOSTILE_CLOSE_WAIT_S:.0f} s"
        else:
            record.closed_by_proxy = True

    def _split(self, rng: random.Random, record: ConnectionRecord, sock: socket.socket) -> None:
        """One to three frames, valid or mutated, in pieces of 1-3 bytes with a pause between."""
        client_id = self._client_id(rng, record)[:64]
        for correlation_id in range(1, rng.randint(2, 4)):
            sample = rng.choice([s for s in self.samples if len(s.payload) < 400])
            if rng.random() < 0.5:
                label, data = f"{sample.label} (valid)", valid_frame(sample, correlation_id, client_id)
            else:
                label, data = mutate(sample, rng, correlation_id, client_id)
            record.note(f"{label}, split byte by byte", data)
            pos = 0
            while pos < len(data):
                piece = data[pos:pos + rng.randint(1, 3)]
                self._raw(sock, record, piece)
                pos += len(piece)
                time.sleep(0.0005)
            self._drain(sock)

    def _half_frame(self, rng: random.Random, record: ConnectionRecord, sock: socket.socket) -> None:
        """Part of a frame, then leave (or a size just at the limit with a body that never comes)."""
        if rng.random() < 0.15:
            body = valid_frame(self.samples[0], 1, b"fuzz")[4:]
            data = struct.pack(">i", DEFAULT_MAX_REQUEST_BYTES) + body
            self._send(sock, record, f"size {DEFAULT_MAX_REQUEST_BYTES} with a {len(body)}-byte body", data)
            return
        whole = valid_frame(rng.choice(self.samples), 1, self._client_id(rng, record))
        cut = rng.randrange(1, len(whole))
        self._send(sock, record, f"first {cut} of {len(whole)} bytes of a frame", whole[:cut])

    def _never_read(self, rng: random.Random, record: ConnectionRecord, sock: socket.socket) -> None:
        """Valid Fetch, Metadata and ApiVersions requests, pipelined, never read; held open till the end."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        with self._lock:
            if len(self._held) >= MAX_HELD:
                record.scenario = "never-read-then-close"
            else:
                self._held.append(sock)
        client_id = self._client_id(rng, record)
        wanted = [s for s in self.samples if s.api_key in (1, 3, 18)]
        frames = [valid_frame(rng.choice(wanted), cid, client_id) for cid in range(1, rng.randint(5, 60))]
        sock.settimeout(2.0)
        try:
            for data in frames:
                self._send(sock, record, "never-read request (valid)", data)
        except TimeoutError:
            pass  # the proxy stopped reading us once our answers backed up: that is right


_CONNECTION = re.compile(r"\b(conn-\d+):? (?:from )?127\.0\.0\.1:(\d+)")


def replay(record: ConnectionRecord) -> tuple[int, str] | None:
    """Feed what a connection sent to the pure protocol layer, as the proxy reads it: the index of
    the frame whose bytes raise, and the exception (a clean close is a `Close` action, never one).

    Quota admin requests get an empty answer so that the requests behind them go on, as in the proxy.
    """
    conn = ProxyConnection(lambda node: ("127.0.0.1", 10_000 + node), name=record.name)
    for index, (_, data) in enumerate(record.sent):
        try:
            actions = conn.receive_from_client(data)
            while any(isinstance(a, QuotaAdmin) for a in actions):
                admin = next(a for a in actions if isinstance(a, QuotaAdmin))
                actions = conn.answer_quota_admin(encode_response_header(admin.correlation_id, 1))
        except Exception as exc:  # what the proxy's I/O layer logs as an internal error
            return index, repr(exc)
        if conn.closed is not None:
            return None
    return None


def _culprit(record: ConnectionRecord) -> str:
    """The input that made a connection fail: from an offline replay, else its last frames."""
    found = replay(record)
    if found is None:
        return f"(an offline replay does not raise) the last frames:\n      {record.describe()}"
    index, exc = found
    label, data = record.sent[index]
    return (f"frame {index + 1} of {record.frames} raises {exc} in an offline replay:\n      {label}: "
            f"{data[:200].hex()}{'...' if len(data) > 200 else ''} ({len(data)} bytes)")


def explain(log: str, report: FuzzReport, markers: tuple[str, ...]) -> list[str]:
    """The log lines containing a marker, grouped by the fuzzing connection they name, each with the
    input that caused it.

    The connection's port comes from the proxy's own lines ("conn-12 from 127.0.0.1:PORT closed: ...").
    When the log summarised those away, every fuzzing connection is replayed offline instead.
    """
    by_port = report.by_local_port()
    lines = log.splitlines()
    ports = {m.group(1): int(m.group(2)) for line in lines for m in _CONNECTION.finditer(line)}
    by_record: dict[str, list[str]] = {}
    records: dict[str, ConnectionRecord] = {}
    unmatched: list[str] = []
    for index, line in enumerate(lines):
        if not any(marker in line for marker in markers):
            continue
        context = line
        if "Traceback" in line:
            # The exception is the traceback's last line; the proxy's message is the line before it.
            end = index + 1
            while end < len(lines) and not lines[end][:4].isdigit():  # up to the next timestamped line
                end += 1
            context = f"{lines[index - 1] if index else ''} / {lines[end - 1].strip()}"
        names = re.findall(r"\bconn-\d+", context)
        record = by_port.get(ports.get(names[0], -1)) if names else None
        if record is None:
            unmatched.append(context)
            continue
        records[record.name] = record
        by_record.setdefault(record.name, []).append(context)
    found = [f"{chr(10).join(contexts)}\n    fuzzer connection {name} ({records[name].scenario}, port "
             f"{records[name].port}): {_culprit(records[name])}" for name, contexts in by_record.items()]
    if unmatched:
        culprits: dict[str, list[str]] = {}
        for record in report.connections:
            result = replay(record)
            if result is not None:
                index, exc = result
                culprits.setdefault(exc, []).append(f"{record.name}: {record.sent[index][0]}: "
                                                    f"{record.sent[index][1][:100].hex()}")
        found.append("\n".join(unmatched) + "\n    (no fuzzing connection named with its port in the log)")
        for exc, inputs in culprits.items():
            found.append(f"offline replay: {len(inputs)} connection(s) raise {exc}, e.g.\n      "
                         + "\n      ".join(inputs[:5]))
    return found
