"""Property-based tests of the pure protocol layer (issue 10).

Two kinds of property:

- Whatever bytes reach a `ProxyConnection` from either side (random frames, real requests and
  responses with bytes flipped, inserted or deleted and sizes corrupted, hostile size prefixes), in
  any split, interleaved, after any valid start (ApiVersions, SASL), with or without a quota
  policy, every call returns a list of actions or a clean `Close`: never an exception.
- Every body rewrite round-trips: the rewritten frame decodes with kafka-python and differs from
  the original only in the field the rewrite means to change. (Address rewrites have their own
  properties in test_addresses.py.)

Messages are drawn from Kafka's JSON schemas as kafka-python carries them, so every field of every
version is exercised, not only the ones a hand-built example happens to fill in. Examples are
bounded and derandomized so CI runs the same cases every time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kafka.protocol.admin.client_quotas import AlterClientQuotasRequest, DescribeClientQuotasRequest
from kafka.protocol.consumer import FetchRequest, FetchResponse
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest
from kafka.protocol.producer import ProduceRequest
from kafka.protocol.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)
from kafka.record.memory_records import MemoryRecordsBuilder

from protocol.api_versions import clamp_api_versions, offered_range
from protocol.apis import KNOWN_APIS, ApiKey
from protocol.client_quotas import QUOTA_ADMIN_APIS, alter_quotas_response, describe_quotas_response
from protocol.connection import (
    STREAM_MIN_BYTES,
    Action,
    Authenticated,
    BrokersSeen,
    Close,
    Mute,
    ProxyConnection,
    QuotaAdmin,
    Throttled,
    ToBroker,
    ToClient,
)
from protocol.errors import ProtocolError
from protocol.frames import FrameSplitter, frame
from protocol.headers import (
    encode_request_header,
    encode_response_header,
    parse_request_header,
    response_body_offset,
)
from protocol.skim import decode_strict, produce_acks
from protocol.throttling import (
    ThrottleField,
    cap_fetch_bytes,
    empty_fetch_response,
    fetch_max_wait_ms,
    set_throttle,
    throttle_field,
)
from quotas.engine import QuotaEngine
from quotas.entity import DEFAULT, QuotaEntity
from quotas.types import QuotaType

from .wire import advertise

#: Bounded and derandomized: the same examples on every run, the whole file well under 30 s.
#: No "explain" phase: tracing every line while explaining a failure took minutes and GBs here.
ROUND_TRIP = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ = settings(ROUND_TRIP, max_examples=400)

INT32_MAX = 2**31 - 1
#: A small request limit, so hostile sizes just past it are cheap to send.
MAX_REQUEST_BYTES = 4096


# == messages drawn from Kafka's schemas ===========================================================

_INT_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}


def _simple(kind: str, nullable: bool) -> st.SearchStrategy[Any]:
    values: st.SearchStrategy[Any]
    if kind in _INT_BITS:
        bits = _INT_BITS[kind]
        values = st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    elif kind == "uint16":
        values = st.integers(0, 2**16 - 1)
    elif kind == "uint32":
        values = st.integers(0, 2**32 - 1)
    elif kind == "bool":
        values = st.booleans()
    elif kind == "float64":
        values = st.floats(allow_nan=False)
    elif kind == "uuid":
        values = st.uuids()
    elif kind == "bitfield":  # kafka-python's authorized-operations sets
        values = st.none() | st.sets(st.integers(0, 30), max_size=3)
    elif kind == "string":
        values = st.text(max_size=6)
    elif kind == "records":
        values = st.binary(max_size=12) | st.sampled_from(RECORD_BATCHES)
    elif kind == "bytes":
        values = st.binary(max_size=12)
    else:
        raise ValueError(f"no strategy for schema type {kind}")
    return st.none() | values if nullable else values


def _struct_values(struct: Any, version: int, spoiled: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Values for a struct's fields in `version`; each tagged field present or not."""
    tagged = [f for f in struct._fields if f.for_version_q(version) and f.tagged_field_q(version)]
    untagged = struct.untagged_fields(version)
    return st.fixed_dictionaries({f.name: _field(f, version, spoiled) for f in untagged},
                                 optional={f.name: _field(f, version, False) for f in tagged})


#: Types kafka-python writes with a length prefix, and so as null (-1) when given None.
_LENGTH_PREFIXED = frozenset({"string", "bytes", "records"})


def _field(field: Any, version: int, spoiled: bool) -> st.SearchStrategy[Any]:
    nullable = field.nullable_for_version_q(version)
    values: st.SearchStrategy[Any]
    if field.is_struct_array():
        element = field.array_of
        values = st.lists(_struct_values(element, version, spoiled).map(
            lambda v, c=element.data_class: c(**v)), max_size=2)
    elif field.is_array():
        values = st.lists(_simple(field.array_of.type_str, False), max_size=3)
    elif field.is_struct():
        values = _struct_values(field, version, spoiled).map(lambda v, c=field.data_class: c(**v))
        return st.none() | values if nullable else values  # no length prefix to spoil
    else:
        nullable = nullable or (spoiled and field.type_str in _LENGTH_PREFIXED)
        return _simple(field.type_str, nullable)
    return st.none() | values if nullable or spoiled else values


@cache
def message(cls: Any, version: int, spoiled: bool = False) -> st.SearchStrategy[Any]:
    """Any message of `cls` at `version` that Kafka's schema allows, tagged fields included.

    `spoiled`: also null where the schema forbids it (kafka-python writes None as length -1),
    the malformed input a hostile client sends and issue 10 found unhandled.
    """
    return _struct_values(cls._struct, version, spoiled).map(lambda v: cls[version](**v))


def _batch(producer_id: int) -> bytes:
    builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 16,
                                   producer_id=producer_id, producer_epoch=0 if producer_id >= 0 else -1,
                                   base_sequence=0 if producer_id >= 0 else -1)
    builder.append(timestamp=1_700_000_000_000, key=b"k", value=b"v" * 20)
    builder.close()
    return bytes(builder.buffer())


#: Real v2 record batches, so Produce requests also carry producer ids for the producer-id quota.
RECORD_BATCHES = [_batch(4242), _batch(-1), _batch(7) + _batch(8)]


def versions(key: int) -> list[int]:
    """Every version up to the newest the proxy knows, from 0: a client may ignore ApiVersions
    downwards too, and kafka-python still reads the versions Kafka 4 dropped."""
    return list(range(0, KNOWN_APIS[key].max_version + 1))


def body_offset(key: int, version: int, frame_bytes: bytes) -> int:
    return response_body_offset(frame_bytes, KNOWN_APIS[key].response_header_version(version))


def response_frame(key: int, version: int, correlation_id: int, body: bytes) -> bytes:
    return encode_response_header(correlation_id, KNOWN_APIS[key].response_header_version(version)) + body


def decode_response(key: int, version: int, frame_bytes: bytes) -> Any:
    cls = KNOWN_APIS[key].response_class
    return cls.decode(memoryview(frame_bytes)[body_offset(key, version, frame_bytes):], version=version)


def records_of(message_: Any) -> Iterator[Any]:
    for topic in message_.responses or []:
        yield from topic.partitions or []


# == round trips of every rewrite ================================================================

THROTTLED = [(key, version) for key in sorted(KNOWN_APIS) for version in versions(key)
             if throttle_field(key, version) is not ThrottleField.NONE
             # kafka-python reads an ApiVersions error body as v0, so only error 0 round-trips
             and key != ApiKey.API_VERSIONS]
throttle_values = st.integers(-(2**40), 2**40)


def clamped(throttle_ms: int) -> int:
    return min(max(throttle_ms, 0), INT32_MAX)


@ROUND_TRIP
@given(data=st.data(), key_version=st.sampled_from(THROTTLED), throttle_ms=throttle_values,
       correlation_id=st.integers(-(2**31), INT32_MAX))
def test_set_throttle_changes_only_the_throttle(data: st.DataObject, key_version: tuple[int, int],
                                                throttle_ms: int, correlation_id: int) -> None:
    key, version = key_version
    original = data.draw(message(KNOWN_APIS[key].response_class, version))
    raw = response_frame(key, version, correlation_id, bytes(original.encode()))
    offset = body_offset(key, version, raw)
    rewritten = set_throttle(key, version, raw, offset, throttle_ms)
    assert rewritten[:offset] == raw[:offset]  # the header, correlation id included
    expected = decode_response(key, version, raw)
    if throttle_field(key, version) is ThrottleField.FIRST:
        expected.throttle_time_ms = clamped(throttle_ms)
    else:  # re-encoded: a broker's larger throttle is kept
        expected.throttle_time_ms = max(expected.throttle_time_ms, clamped(throttle_ms))
    assert decode_response(key, version, rewritten) == expected


@ROUND_TRIP
@given(data=st.data(), version=st.sampled_from(versions(ApiKey.FETCH)), throttle_ms=throttle_values)
def test_empty_fetch_response_empties_only_records(data: st.DataObject, version: int,
                                                    throttle_ms: int) -> None:
    original = data.draw(message(FetchResponse, version))
    raw = response_frame(ApiKey.FETCH, version, 77, bytes(original.encode()))
    offset = body_offset(ApiKey.FETCH, version, raw)
    emptied = empty_fetch_response(raw, offset, version, throttle_ms)
    assert emptied[:offset] == raw[:offset]
    expected = decode_response(ApiKey.FETCH, version, raw)
    if throttle_field(ApiKey.FETCH, version) is ThrottleField.FIRST:  # v1+; v0 has no field
        expected.throttle_time_ms = clamped(throttle_ms)
    for partition in records_of(expected):
        partition.records = None if partition.records is None else b""
    got = decode_response(ApiKey.FETCH, version, emptied)
    for partition in records_of(got):  # kafka-python may hand records back as a view
        partition.records = None if partition.records is None else bytes(partition.records)
    assert got == expected


@ROUND_TRIP
@given(data=st.data(), version=st.sampled_from(versions(ApiKey.FETCH)), cap=st.integers(1, INT32_MAX),
       client_id=st.none() | st.text(max_size=5))
def test_cap_fetch_bytes_changes_only_the_sizes(data: st.DataObject, version: int, cap: int,
                                                client_id: str | None) -> None:
    original = data.draw(message(FetchRequest, version))
    raw = encode_request_header(ApiKey.FETCH, version, 5, client_id) + bytes(original.encode())
    header = parse_request_header(raw)
    assert fetch_max_wait_ms(raw, header) == original.max_wait_ms
    capped = cap_fetch_bytes(raw, header, cap)
    assert capped[: header.body_offset] == raw[: header.body_offset]
    expected = FetchRequest.decode(memoryview(raw)[header.body_offset:], version=version)
    if version >= 3:  # max_bytes is new in v3; before it only partitions have a size
        expected.max_bytes = min(expected.max_bytes, cap)
        expected.min_bytes = min(expected.min_bytes, expected.max_bytes)
    assert FetchRequest.decode(memoryview(capped)[header.body_offset:], version=version) == expected


def api_versions_response(version: int) -> st.SearchStrategy[Any]:
    entries = st.lists(
        st.builds(lambda key, low, high: ApiVersionsResponse.ApiVersion(api_key=key, min_version=low,
                                                                        max_version=high),
                  st.integers(-5, 80) | st.sampled_from(sorted(QUOTA_ADMIN_APIS)),
                  st.integers(-1, 20), st.integers(-1, 20)),
        max_size=12, unique_by=lambda entry: entry.api_key)
    return message(ApiVersionsResponse, version).flatmap(
        lambda m: entries.map(lambda api_keys: _with(m, error_code=0, api_keys=api_keys)))


def _with(message_: Any, **fields: Any) -> Any:
    for name, value in fields.items():
        setattr(message_, name, value)
    return message_


@ROUND_TRIP
@given(data=st.data(), version=st.sampled_from(versions(ApiKey.API_VERSIONS)))
def test_api_versions_clamp_changes_only_the_ranges(data: st.DataObject, version: int) -> None:
    """Kept keys get the intersection of the broker's and the proxy's ranges, keys the proxy forwards
    opaque the broker's range, the quota admin APIs the proxy's own; features (v3+ tagged fields)
    and the throttle stay as the broker sent them."""
    original = data.draw(api_versions_response(version))
    body = bytes(original.encode())
    clamped_body, dropped = clamp_api_versions(body, version)
    expected_ranges: dict[int, tuple[int, int]] = {}
    for entry in original.api_keys:
        offered = offered_range(entry.api_key)
        if offered is None:
            expected_ranges[entry.api_key] = (entry.min_version, entry.max_version)  # forwarded opaque
            continue
        if entry.api_key in QUOTA_ADMIN_APIS:
            expected_ranges[entry.api_key] = offered  # answered by the proxy, whatever the broker says
            continue
        low, high = max(entry.min_version, offered[0]), min(entry.max_version, offered[1])
        if low <= high:
            expected_ranges[entry.api_key] = (low, high)
    for key in QUOTA_ADMIN_APIS:
        expected_ranges.setdefault(key, offered_range(key) or (0, 0))
    got = ApiVersionsResponse.decode(clamped_body, version=version)
    assert {e.api_key: (e.min_version, e.max_version) for e in got.api_keys} == expected_ranges
    assert len(got.api_keys) == len(expected_ranges)
    assert dropped == len({e.api_key for e in original.api_keys} - set(expected_ranges))
    got.api_keys = original.api_keys = []
    assert got == ApiVersionsResponse.decode(bytes(original.encode()), version=version)


# == any bytes, any split: actions or a clean close ===============================================

ANON = QuotaEntity("ANONYMOUS", None)
#: Quotas so small that nearly every request is throttled: the rewrite paths (throttle patched in,
#: fetch emptied and capped, producer ids read) run on fuzzed input too.
TINY_QUOTAS = {QuotaType.PRODUCE: 1.0, QuotaType.FETCH: 1.0, QuotaType.REQUEST: 0.001,
               QuotaType.PRODUCER_IDS: 0.1}


def new_connection(policy: bool, mode: str) -> ProxyConnection:
    engine: QuotaEngine | None = None
    if policy:
        engine = QuotaEngine()
        engine.set_quotas({ANON: dict(TINY_QUOTAS), QuotaEntity(DEFAULT, None): dict(TINY_QUOTAS)})
    return ProxyConnection(advertise, max_request_bytes=MAX_REQUEST_BYTES, name="fuzz", policy=engine,
                           throttle_mode=mode)  # type: ignore[arg-type]


ACTION_TYPES = (ToBroker, ToClient, Close, BrokersSeen, Authenticated, Mute, Throttled, QuotaAdmin)


@dataclass
class Driver:
    """Feeds a connection and checks every answer: actions of the known kinds, a `Close` only
    last and only once, silence after it, and a memory need covering what is held."""

    conn: ProxyConnection
    now_ms: int = 0
    to_broker: bytes = b""
    admin: QuotaAdmin | None = None

    def check(self, actions: Any, was_closed: bool) -> list[Action]:
        assert isinstance(actions, list)
        assert all(isinstance(a, ACTION_TYPES) for a in actions), actions
        if was_closed:
            assert actions == []
        closes = [a for a in actions if isinstance(a, Close)]
        if closes:
            assert actions[-1] is closes[0] and len(closes) == 1
            assert closes[0].reason and self.conn.closed == closes[0].reason
        for action in actions:
            if isinstance(action, ToBroker | ToClient):
                assert all(isinstance(c, bytes | bytearray | memoryview) for c in action.chunks)
                assert action.delay_ms >= 0
            if isinstance(action, ToBroker):
                self.to_broker += b"".join(action.chunks)
            elif isinstance(action, Mute):
                assert action.ms > 0
            elif isinstance(action, QuotaAdmin):
                self.admin = action
        assert self.conn.request_memory_need >= self.conn.request_bytes_held >= 0
        return actions

    def call(self, method: Callable[..., list[Action]], *args: Any) -> list[Action]:
        was_closed = self.conn.closed is not None
        return self.check(method(*args), was_closed)

    def client(self, data: bytes) -> list[Action]:
        return self.call(self.conn.receive_from_client, data, self.now_ms)

    def broker(self, data: bytes) -> list[Action]:
        return self.call(self.conn.receive_from_broker, data, self.now_ms)

    def resume(self) -> list[Action]:
        return self.call(self.conn.resume, self.now_ms)

    def answer_admin(self) -> list[Action]:
        admin, self.admin = self.admin, None
        if admin is None:
            return []
        if admin.api_key == ApiKey.DESCRIBE_CLIENT_QUOTAS:
            answer = describe_quotas_response(admin.correlation_id, admin.api_version, [])
        else:
            answer = alter_quotas_response(admin.correlation_id, admin.api_version, [])
        return self.call(self.conn.answer_quota_admin, answer, self.now_ms)

    def forwarded_requests(self) -> list[bytes]:
        """Request frames forwarded so far that a broker answers: they parse (raw SASL tokens and
        garbage do not) and are not a Produce with acks=0."""
        found = []
        for raw in FrameSplitter(2**31 - 1).feed(self.to_broker):
            try:
                header = parse_request_header(raw)
                if header.api_key == ApiKey.PRODUCE and produce_acks(raw, header) == 0:
                    continue
            except ProtocolError:
                continue
            found.append(raw)
        return found


# -- what a client sends ---------------------------------------------------------------------------

#: The APIs the proxy reads or rewrites, drawn as real requests (the rest are forwarded opaque).
FUZZED_REQUESTS = [ProduceRequest, FetchRequest, MetadataRequest, ApiVersionsRequest, SaslHandshakeRequest,
                   SaslAuthenticateRequest, DescribeClientQuotasRequest, AlterClientQuotasRequest]

#: Sizes no frame should have, or just past the limits.
HOSTILE_SIZES = [-1, -2, -(2**31), 0, 1, 3, 9, 10, MAX_REQUEST_BYTES, MAX_REQUEST_BYTES + 1, 2**24,
                 INT32_MAX]
#: Values that, written over a length field, make it null, negative or huge.
HOSTILE_FIELDS = [b"\xff\xff", b"\xff\xff\xff\xff", b"\x00", b"\x80\x00", b"\x7f\xff\xff\xff",
                  b"\xff\xff\xff\xff\x0f", b"\x00\x00"]


@st.composite
def real_request(draw: st.DrawFn, classes: tuple[Any, ...] = tuple(FUZZED_REQUESTS)) -> bytes:
    """A request kafka-python encodes, of an API the proxy reads or rewrites."""
    cls = draw(st.sampled_from(classes))
    version = draw(st.sampled_from(versions(cls.API_KEY)))
    msg = draw(message(cls, version))
    client_id = draw(st.none() | st.sampled_from(["c", "producer-1", ""]))
    correlation_id = draw(st.integers(-5, 1000))
    return encode_request_header(cls.API_KEY, version, correlation_id, client_id) + bytes(msg.encode())


@st.composite
def spoiled_request(draw: st.DrawFn) -> bytes:
    """A request of a decoded API with nulls where its schema forbids them."""
    cls = draw(st.sampled_from(FUZZED_REQUESTS))
    version = draw(st.sampled_from(versions(cls.API_KEY)))
    msg = draw(message(cls, version, spoiled=True))
    return encode_request_header(cls.API_KEY, version, draw(st.integers(0, 9)), "c") + bytes(msg.encode())


@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    """`raw` with up to three edits: a bit flipped, bytes inserted or deleted, a cut, or a hostile
    value written over what may be a length field."""
    data = bytearray(raw)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "overwrite"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif kind == "truncate":
            del data[at:]
        else:
            value = draw(st.sampled_from(HOSTILE_FIELDS))
            data[at : at + len(value)] = value
    return bytes(data)


@st.composite
def framed(draw: st.DrawFn, payload: bytes) -> bytes:
    """`payload` with its size prefix: usually true, sometimes hostile or off by a little."""
    size = draw(st.sampled_from(["true", "true", "true", "hostile", "off"]))
    if size == "hostile":
        return draw(st.sampled_from(HOSTILE_SIZES)).to_bytes(4, "big", signed=True) + payload
    if size == "off":
        return max(len(payload) + draw(st.integers(-4, 4)), 0).to_bytes(4, "big") + payload
    return frame(payload)


@st.composite
def random_frame(draw: st.DrawFn) -> bytes:
    """A header-shaped frame: a known api key (often) and any version, then noise."""
    key = draw(st.sampled_from(sorted(KNOWN_APIS)) | st.integers(-(2**15), 2**15 - 1))
    version = draw(st.integers(-2, 20) | st.integers(-(2**15), 2**15 - 1))
    head = key.to_bytes(2, "big", signed=True) + version.to_bytes(2, "big", signed=True)
    return head + draw(st.binary(max_size=40))


client_frame = st.one_of(
    real_request().flatmap(framed),
    spoiled_request().map(frame),
    real_request().flatmap(mutated).flatmap(framed),
    random_frame().flatmap(framed),
    st.binary(max_size=24),  # no framing at all
)


def splits(data: st.DataObject, stream: bytes) -> list[bytes]:
    """`stream` cut at drawn points (none, every byte, anything between)."""
    if not stream:
        return []
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(stream)), max_size=6))))
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds) if b > a]


# -- what a broker answers -------------------------------------------------------------------------


def broker_answer(data: st.DataObject, request_frame: bytes) -> bytes:
    """A response to a forwarded request: schema-valid for its api and version, maybe mutated."""
    header = parse_request_header(request_frame)
    spec = KNOWN_APIS.get(header.api_key)
    if spec is None or not spec.min_version <= header.api_version <= spec.max_version:
        body = data.draw(st.binary(max_size=16))
    else:
        msg = data.draw(message(spec.response_class, header.api_version, spoiled=data.draw(st.booleans())))
        if header.api_key == ApiKey.API_VERSIONS:
            msg.error_code = 0
        first = next(records_of(msg), None) if header.api_key == ApiKey.FETCH else None
        if first is not None and data.draw(st.booleans()):
            first.records = b"\x00" * (STREAM_MIN_BYTES + 10)  # streams through before it is complete
        body = bytes(msg.encode())
    raw = response_frame(header.api_key, max(header.api_version, 0), header.correlation_id, body) \
        if spec is not None else header.correlation_id.to_bytes(4, "big", signed=True) + body
    if data.draw(st.booleans()):
        raw = raw[:4] + data.draw(mutated(raw[4:]))  # keep the correlation id, spoil the rest
    return data.draw(framed(raw))


# -- valid starts ----------------------------------------------------------------------------------


def _api_versions_answer(correlation_id: int) -> bytes:
    ranges = [ApiVersionsResponse.ApiVersion(api_key=k, min_version=s.min_version, max_version=s.max_version)
              for k, s in sorted(KNOWN_APIS.items())]
    body = ApiVersionsResponse(error_code=0, api_keys=ranges, throttle_time_ms=0).encode(version=3)
    return encode_response_header(correlation_id, 0) + bytes(body)


def _request(cls: Any, version: int, correlation_id: int, **fields: Any) -> bytes:
    return encode_request_header(cls.API_KEY, version, correlation_id, "c") + bytes(
        cls[version](**fields).encode())


def _response(cls: Any, version: int, correlation_id: int, **fields: Any) -> bytes:
    return response_frame(cls.API_KEY, version, correlation_id, bytes(cls[version](**fields).encode()))


PLAIN = b"\x00alice\x00secret"
#: (client frame, broker frame) pairs that set a connection up; raw SASL tokens and answers too.
PREFIXES: dict[str, list[tuple[bytes, bytes]]] = {
    "none": [],
    "api-versions": [(_request(ApiVersionsRequest, 3, 1, client_software_name="kp",
                               client_software_version="3"), _api_versions_answer(1))],
    "sasl-v1": [
        (_request(SaslHandshakeRequest, 1, 1, mechanism="PLAIN"),
         _response(SaslHandshakeResponse, 1, 1, error_code=0, mechanisms=["PLAIN"])),
        (_request(SaslAuthenticateRequest, 2, 2, auth_bytes=PLAIN),
         _response(SaslAuthenticateResponse, 2, 2, error_code=0, error_message=None, auth_bytes=b"",
                   session_lifetime_ms=0)),
    ],
    "scram-under-way": [
        (_request(SaslHandshakeRequest, 1, 1, mechanism="SCRAM-SHA-256"),
         _response(SaslHandshakeResponse, 1, 1, error_code=0, mechanisms=["SCRAM-SHA-256"])),
    ],
    "raw-sasl-under-way": [
        (_request(SaslHandshakeRequest, 0, 1, mechanism="PLAIN"),
         _response(SaslHandshakeResponse, 0, 1, error_code=0, mechanisms=["PLAIN"])),
    ],
    "raw-sasl-done": [
        (_request(SaslHandshakeRequest, 0, 1, mechanism="PLAIN"),
         _response(SaslHandshakeResponse, 0, 1, error_code=0, mechanisms=["PLAIN"])),
        (PLAIN, b""),
    ],
}


def start(driver: Driver, prefix: str) -> None:
    for request_frame, answer in PREFIXES[prefix]:
        driver.client(frame(request_frame))
        driver.broker(frame(answer))
    assert driver.conn.closed is None, driver.conn.closed
    driver.to_broker = b""  # answered

# -- the properties --------------------------------------------------------------------------------


def run(data: st.DataObject, driver: Driver, client_stream: bytes, steps: int) -> None:
    """Interleave the client's bytes (in drawn pieces) with broker answers, resumes and admin
    answers, the clock moving forward by drawn amounts."""
    pieces = splits(data, client_stream)
    answered = 0
    for _ in range(steps):
        driver.now_ms += data.draw(st.integers(0, 3000))
        kind = data.draw(st.sampled_from(["client", "client", "broker", "broker", "broker", "resume",
                                          "admin", "noise"]))
        if kind == "client" and pieces:
            driver.client(pieces.pop(0))
        elif kind == "broker":
            requests = driver.forwarded_requests()
            if answered < len(requests):
                driver.broker(broker_answer(data, requests[answered]))
                answered += 1
        elif kind == "noise":
            for piece in splits(data, data.draw(st.binary(max_size=30))):
                driver.broker(piece)
        elif kind == "resume":
            driver.resume()
        elif kind == "admin":
            driver.answer_admin()
    for piece in pieces:
        driver.client(piece)


@FUZZ
@given(data=st.data(), prefix=st.sampled_from(sorted(PREFIXES)), policy=st.booleans(),
       mode=st.sampled_from(["mute", "delay"]), frames=st.lists(client_frame, min_size=1, max_size=4))
def test_any_client_frames_yield_actions_or_a_clean_close(data: st.DataObject, prefix: str, policy: bool,
                                                          mode: str, frames: list[bytes]) -> None:
    driver = Driver(new_connection(policy, mode))
    start(driver, prefix)
    run(data, driver, b"".join(frames), data.draw(st.integers(1, 14)))


@FUZZ
@given(data=st.data(), prefix=st.sampled_from(sorted(PREFIXES)), policy=st.booleans(),
       requests=st.lists(real_request(), min_size=1, max_size=4))
def test_real_requests_and_mutated_answers_yield_actions_or_a_clean_close(
        data: st.DataObject, prefix: str, policy: bool, requests: list[bytes]) -> None:
    """Valid requests, so the broker side gets far: its answers are real responses, often spoiled."""
    driver = Driver(new_connection(policy, "mute"))
    start(driver, prefix)
    run(data, driver, b"".join(frame(r) for r in requests), 3 * len(requests) + 4)


@FUZZ
@given(data=st.data(), mode=st.sampled_from(["mute", "delay"]),
       requests=st.lists(real_request((ProduceRequest, FetchRequest)), min_size=1, max_size=3))
def test_throttled_answers_are_rewritten_or_closed(data: st.DataObject, mode: str,
                                                   requests: list[bytes]) -> None:
    """Over tiny quotas every answer is rewritten (throttle patched in, records emptied, fetch
    sizes capped on the way up): real and spoiled answers alike give actions or a clean close."""
    driver = Driver(new_connection(True, mode))
    run(data, driver, b"".join(frame(r) for r in requests), 4 * len(requests) + 2)


@FUZZ
@given(data=st.data(), prefix=st.sampled_from(sorted(PREFIXES)), policy=st.booleans(),
       stream=st.binary(max_size=200))
def test_any_bytes_from_either_side_yield_actions_or_a_clean_close(
        data: st.DataObject, prefix: str, policy: bool, stream: bytes) -> None:
    driver = Driver(new_connection(policy, "mute"))
    start(driver, prefix)
    for piece in splits(data, stream):
        if data.draw(st.booleans()):
            driver.client(piece)
        else:
            driver.broker(piece)


@FUZZ
@given(data=st.data(), size=st.sampled_from(HOSTILE_SIZES), head=st.binary(max_size=16),
       policy=st.booleans())
def test_hostile_sizes_close_or_wait(data: st.DataObject, size: int, head: bytes, policy: bool) -> None:
    """A size past the limit closes at once, naming it; one within waits with its declared need."""
    driver = Driver(new_connection(policy, "mute"))
    actions: list[Action] = []
    for piece in splits(data, size.to_bytes(4, "big", signed=True) + head):
        actions += driver.client(piece)
    conn = driver.conn
    if size < 0 or size > MAX_REQUEST_BYTES:
        assert conn.closed is not None and str(size) in conn.closed
    elif len(head) < size:  # incomplete: refused from its api key and version, or waited for
        garbage = len(head) >= 4 and (head[0] >= 0x80 or head[2] >= 0x80)  # either one negative
        assert (conn.closed is not None) == garbage, conn.closed
        if garbage:
            assert "is negative" in (conn.closed or "")
        else:
            assert conn.request_memory_need == 4 + size
            assert not conn.established


@settings(ROUND_TRIP, max_examples=60)
@given(raw=real_request())
def test_fuzzed_requests_start_out_valid(raw: bytes) -> None:
    """What the fuzz mutates is real: each drawn request passes the proxy's strict decoding."""
    header = parse_request_header(raw)
    cls = KNOWN_APIS[header.api_key].request_class
    decode_strict(cls, raw, header.body_offset, header.api_version, "drawn request")
