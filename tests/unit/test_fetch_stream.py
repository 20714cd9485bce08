"""Fetch v16+ responses streamed with their NodeEndpoints rewritten (protocol/fetch_stream.py).

Responses are built with kafka-python's FetchResponse classes; what the client would get is read
back with the same classes, which must consume it exactly (its size is announced first).
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.protocol.consumer import FetchResponse

from protocol.errors import MalformedBody, ProtocolError
from protocol.fetch_stream import (
    FETCH_STREAM_VERSIONS,
    PADDING_TAG,
    UNKNOWN_BROKERS_SLACK,
    FetchStream,
    FetchTailReader,
    SlackExceeded,
    fetch_tail,
    node_endpoints_slack,
    rewrite_fetch_response,
    rewrite_tail,
    uvarint_bytes,
)
from protocol.headers import encode_response_header

from .wire import advertise, tagged_section

VERSIONS = list(range(FETCH_STREAM_VERSIONS[0], FETCH_STREAM_VERSIONS[1] + 1))
PROXY_HOST = advertise(0)[0]
HEADER_BYTES = 5  # correlation id, empty header tagged fields
Endpoints = list[tuple[int, str, int, str | None]]


def build(version: int, partitions: list[tuple[int, bytes | None, int]],
          endpoints: list[tuple[int, str, int, str | None]] | None, topics: int = 1) -> bytes:
    """A Fetch response frame (header and body): `partitions` as (error code, records, aborted
    transactions) in each of `topics` topics, and NodeEndpoints as (node id, host, port, rack)."""
    R = FetchResponse[version]
    T = R.FetchableTopicResponse
    P = T.PartitionData
    A = P.AbortedTransaction
    topic_list = []
    for t in range(topics):
        parts = [P(partition_index=i, error_code=error, high_watermark=100 + i, last_stable_offset=90,
                   log_start_offset=0,
                   aborted_transactions=[A(producer_id=7, first_offset=k) for k in range(aborted)] or None,
                   preferred_read_replica=-1, records=records,
                   current_leader=P.LeaderIdAndEpoch(leader_id=2, leader_epoch=5) if error else None)
                 for i, (error, records, aborted) in enumerate(partitions)]
        topic_list.append(T(topic_id=uuid.UUID(int=t + 1), partitions=parts))
    fields: dict[str, Any] = {"throttle_time_ms": 0, "error_code": 0, "session_id": 42,
                              "responses": topic_list}
    if endpoints is not None:
        fields["node_endpoints"] = [R.NodeEndpoint(node_id=n, host=h, port=p, rack=r)
                                    for n, h, p, r in endpoints]
    return encode_response_header(9, 1) + bytes(R(**fields).encode())


def decode_exact(frame: bytes, version: int) -> Any:
    """The response as kafka-python reads it, refusing a byte left over."""
    R = FetchResponse[version]
    decode = R._struct.compiled_decode_from(version, compact=True, tagged=True, data_class=R[None])
    message, pos = decode(memoryview(frame), HEADER_BYTES)
    assert pos == len(frame), f"{len(frame) - pos} bytes left after the response"
    return message


def stream(frame: bytes, slack: int, cuts: list[int]) -> bytes:
    """What the client gets when `frame` arrives cut at `cuts`."""
    s = FetchStream(len(frame), advertise, slack)
    assert s.announced_size == len(frame) + slack
    out = b""
    bounds = [0, *sorted(set(cuts)), len(frame)]
    for a, b in itertools.pairwise(bounds):
        if b > a:
            out += b"".join(bytes(c) for c in s.feed(frame[a:b]))
    assert s.remaining == 0
    return out


def endpoint_addresses(message: Any) -> list[tuple[int, str, int]]:
    return [(e.node_id, e.host, e.port) for e in message.node_endpoints or ()]


def proxied(endpoints: list[tuple[int, str, int, str | None]]) -> list[tuple[int, str, int]]:
    return [(n, *advertise(n)) for n, _h, _p, _r in endpoints]


RECORDS = bytes(range(256)) * 40
SHORT = [(2, "b", 9092, None), (3, "c", 9093, "rack-c")]  # shorter than the proxy's host: grows
LONG = [(2, "broker-2.kafka.internal.example.com", 9092, "r")]  # longer: shrinks


# -- every byte boundary ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("endpoints", [SHORT, LONG, None], ids=["shorter-hosts", "longer-hosts", "none"])
def test_a_cut_at_every_byte_gives_the_same_answer(version: int, endpoints: Any) -> None:
    frame = build(version, [(0, RECORDS[:300], 0), (6, None, 0), (0, RECORDS[:50], 2)], endpoints)
    slack = 40
    whole = stream(frame, slack, [])
    for cut in range(1, len(frame)):
        assert stream(frame, slack, [cut]) == whole, f"cut at {cut}"
    message = decode_exact(whole, version)
    if endpoints is not None:
        assert endpoint_addresses(message) == proxied(endpoints)
    else:
        assert message.node_endpoints in (None, [])
    assert [p.records for p in message.responses[0].partitions] == [RECORDS[:300], None, RECORDS[:50]]


def test_everything_before_the_tail_goes_on_as_it_arrives() -> None:
    frame = build(16, [(0, RECORDS, 0)], SHORT)
    offset, tail = fetch_tail(frame)
    reader = FetchTailReader(len(frame))
    assert reader.feed(frame[: offset - 1]) == frame[: offset - 1]
    assert reader.feed(frame[offset - 1 :]) == frame[offset - 1 : offset]
    assert reader.tail == tail and reader.tail_offset == offset
    assert frame[offset:] == tail


@st.composite
def responses(draw: st.DrawFn) -> tuple[int, bytes, Endpoints | None]:
    version = draw(st.sampled_from(VERSIONS))
    partitions = draw(st.lists(st.tuples(st.sampled_from([0, 6, 74]),
                                         st.one_of(st.none(), st.binary(max_size=300)),
                                         st.integers(0, 3)), min_size=0, max_size=4))
    hosts = st.text(alphabet="abcdefghijklmnopqrstuvwxyz.-0123456789", min_size=1, max_size=40)
    endpoints = draw(st.one_of(st.none(), st.lists(
        st.tuples(st.integers(0, 50), hosts, st.integers(1, 65535), st.one_of(st.none(), hosts)),
        max_size=3, unique_by=lambda e: e[0])))
    return version, build(version, partitions, endpoints, topics=draw(st.integers(1, 2))), endpoints


@settings(max_examples=300, deadline=None)
@given(response=responses(), data=st.data())
def test_streamed_answers_parse_and_name_only_the_proxy(response: tuple[int, bytes, Endpoints | None],
                                                        data: st.DataObject) -> None:
    version, frame, endpoints = response
    growth = sum(max(len(PROXY_HOST) - len(h), 0) for _n, h, _p, _r in endpoints or ())
    slack = growth + data.draw(st.integers(0, 200))
    cuts = data.draw(st.lists(st.integers(1, max(len(frame) - 1, 1)), max_size=8))
    out = stream(frame, slack, cuts)
    assert len(out) == len(frame) + slack
    offset, _tail = fetch_tail(frame)
    assert out[:offset] == frame[:offset], "bytes before the tail were changed"
    message = decode_exact(out, version)
    original = decode_exact(frame, version)
    assert endpoint_addresses(message) == proxied(endpoints or [])
    assert all(e.host == PROXY_HOST for e in message.node_endpoints or ())
    assert [(e.node_id, e.rack) for e in message.node_endpoints or ()] == \
        [(e.node_id, e.rack) for e in original.node_endpoints or ()]
    assert message.responses == original.responses


# -- padding: the residual of the slack --------------------------------------------------------------


def tail_after(frame: bytes, slack: int) -> bytes:
    out = stream(frame, slack, [len(frame) // 2])
    return out[fetch_tail(frame)[0] :]


@pytest.mark.parametrize("version", VERSIONS)
def test_residual_zero_one_and_two(version: int) -> None:
    frame = build(version, [(0, RECORDS[:10], 0)], None)
    assert frame.endswith(b"\x00")
    assert tail_after(frame, 0) == b"\x00", "nothing to rewrite or pad: the same bytes"
    assert tail_after(frame, 1) == b"\x80\x00", "1 byte: the count as a 2-byte varint"
    assert tail_after(frame, 2) == b"\x80\x80\x00", "2 bytes: the count as a 3-byte varint"
    assert tail_after(frame, 3) == b"\x01\xff\x7f\x00", "3 bytes: a padding field of no data"
    for slack in range(0, 300):
        decode_exact(stream(frame, slack, []), version)


def test_residual_of_one_after_a_rewrite() -> None:
    # "b" becomes the proxy's host: the endpoint grows by len(PROXY_HOST) - 1.
    frame = build(17, [(6, None, 0)], [(2, "b", 9092, None)])
    slack = len(PROXY_HOST) - 1 + 1
    out = stream(frame, slack, [])
    tail = out[fetch_tail(frame)[0] :]
    assert tail[:2] == b"\x81\x00", "the count of 1 written in 2 bytes"
    assert endpoint_addresses(decode_exact(out, 17)) == [(2, *advertise(2))]


def test_padding_of_a_size_one_byte_cannot_write_canonically() -> None:
    # 131 bytes of room: tag (2) + size + zeros adds up only with a 2-byte size of 127.
    frame = build(16, [(0, b"x", 0)], None)
    tail = tail_after(frame, 131)
    assert tail == b"\x01\xff\x7f\xff\x00" + bytes(127)
    message = decode_exact(stream(frame, 131, []), 16)
    assert message.unknown_tags == {f"_{PADDING_TAG}": bytes(127)}


def test_unknown_top_level_tags_are_kept_before_the_padding() -> None:
    frame = build(16, [(0, b"x", 0)], None)
    frame = frame[:-1] + tagged_section({5: b"future"})
    out = stream(frame, 10, [])
    message = decode_exact(out, 16)
    assert message.unknown_tags == {"_5": b"future", f"_{PADDING_TAG}": bytes(10 - 3)}


# -- exact rewrites of buffered responses ------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_buffered_rewrite_is_exact(version: int) -> None:
    for endpoints in (SHORT, LONG):
        frame = build(version, [(0, RECORDS, 1)], endpoints)
        out, seen = rewrite_fetch_response(frame, advertise)
        assert seen == {n: (h, p) for n, h, p, _r in endpoints}
        assert endpoint_addresses(decode_exact(out, version)) == proxied(endpoints)
        # Exactly what a broker that knew the proxy's addresses would have sent.
        assert out == build(version, [(0, RECORDS, 1)], [(n, *advertise(n), r) for n, _h, _p, r in endpoints])


def test_buffered_without_endpoints_is_the_same_object() -> None:
    frame = build(18, [(0, RECORDS, 0)], None)
    out, seen = rewrite_fetch_response(frame, advertise)
    assert out is frame and seen == {}


# -- refusals ----------------------------------------------------------------------------------------


def test_a_rewrite_beyond_the_slack_is_refused() -> None:
    frame = build(16, [(6, None, 0)], SHORT)
    growth = sum(len(PROXY_HOST) - len(h) for _n, h, _p, _r in SHORT)
    stream(frame, growth, [])  # fits exactly
    with pytest.raises(SlackExceeded, match=r"more than the \d+ bytes of slack"):
        stream(frame, growth - 1, [])
    assert issubclass(SlackExceeded, ProtocolError)


def test_a_response_that_ends_before_its_tail_is_refused() -> None:
    frame = build(16, [(0, RECORDS[:100], 0)], None)
    offset, _tail = fetch_tail(frame)
    cut = frame[:offset]  # the tagged fields missing
    s = FetchStream(len(cut), advertise, 0)
    with pytest.raises(MalformedBody, match="ends before its top-level tagged fields"):
        s.feed(cut)


def test_records_longer_than_the_response_are_refused_when_read() -> None:
    frame = build(16, [(0, RECORDS[:100], 0)], None)
    at = frame.index(RECORDS[:100])
    size = uvarint_bytes(101)
    assert frame[at - len(size) : at] == size
    bad = frame[: at - len(size)] + uvarint_bytes(10_000) + frame[at:]
    reader = FetchTailReader(len(bad))
    with pytest.raises(MalformedBody, match=r"records of 9999 bytes at offset \d+ run past the end"):
        reader.feed(bad[: at + 10])


@pytest.mark.parametrize("tail, message", [
    (b"\x02\x05\x01\x00", "truncated varint"),  # two fields announced, one there
    (b"\x01\x05\x09abc", "runs past the end"),
    (b"\x00\x00", "1 bytes after the top-level tagged fields"),
    (b"\x01" + uvarint_bytes(PADDING_TAG) + b"\x00", "not below the padding tag"),
    (b"\x01\x00\x02\x02\x00", "node endpoint"),  # one endpoint, cut short
    (b"\xff\xff\xff\xff\xff\x01", "longer than 5 bytes"),
])
def test_malformed_tails_are_refused(tail: bytes, message: str) -> None:
    with pytest.raises(MalformedBody, match=message):
        rewrite_tail(tail, advertise, 10)


def test_a_null_topics_array_is_refused() -> None:
    frame = encode_response_header(1, 1) + bytes(10) + b"\x00" + b"\x00"
    with pytest.raises(MalformedBody, match="responses array is null"):
        FetchTailReader(len(frame)).feed(frame)


def test_an_overlong_varint_in_the_body_is_refused() -> None:
    frame = encode_response_header(1, 1) + bytes(10) + b"\xff" * 6 + b"\x00"
    with pytest.raises(MalformedBody, match="longer than 5 bytes"):
        FetchTailReader(len(frame)).feed(frame)


def test_more_bytes_than_announced_are_refused() -> None:
    frame = build(16, [(0, b"x", 0)], None)
    with pytest.raises(MalformedBody, match="too many"):
        FetchTailReader(len(frame) - 1).feed(frame)


# -- the slack ---------------------------------------------------------------------------------------


def test_slack_covers_each_known_broker_and_one_unknown() -> None:
    proxy_host_bytes = len(PROXY_HOST) + 1
    brokers = {1: ("a", 9092), 2: ("a-very-long-broker-hostname", 9092), 3: ("bb", 9092)}
    expected = (proxy_host_bytes - 2) + 0 + (proxy_host_bytes - 3) + (proxy_host_bytes - 2)
    assert node_endpoints_slack(advertise, brokers) == expected


def test_slack_without_known_brokers_is_the_fixed_allowance() -> None:
    assert node_endpoints_slack(advertise, None) == UNKNOWN_BROKERS_SLACK
    assert node_endpoints_slack(advertise, {}) == UNKNOWN_BROKERS_SLACK


def test_slack_skips_a_broker_no_listener_can_stand_for() -> None:
    brokers = {2**31: ("a", 9092), 1: ("proxy.test", 9092)}
    assert node_endpoints_slack(advertise, brokers) == len(PROXY_HOST) + 1 - 2


def test_any_single_endpoint_of_a_known_broker_fits_the_slack() -> None:
    brokers = {n: (h, p) for n, h, p, _r in SHORT + LONG[:0]}
    slack = node_endpoints_slack(advertise, brokers)
    # the known ones, and one broker not known yet with a one-character host
    endpoints = [*SHORT, (9, "z", 1, None)]
    frame = build(16, [(6, None, 0)], endpoints)
    assert endpoint_addresses(decode_exact(stream(frame, slack, []), 16)) == proxied(endpoints)
