"""FrameSplitter: the only place that buffers partial data, in both directions."""

from __future__ import annotations

import itertools
import random

import pytest

from protocol.errors import FrameSizeError, ProtocolError
from protocol.frames import DEFAULT_MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, FrameSplitter, frame

PAYLOADS = [b"first frame", b"", b"x" * 300, bytes(range(256)), b"last"]
STREAM = b"".join(frame(p) for p in PAYLOADS)


def test_frame_prefixes_big_endian_size() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"
    assert frame(b"y" * 258)[:4] == b"\x00\x00\x01\x02"


def test_several_frames_in_one_chunk() -> None:
    splitter = FrameSplitter(1000)
    assert splitter.feed(STREAM) == PAYLOADS
    assert splitter.buffered == 0


def test_byte_by_byte_feed_yields_each_frame_exactly_once() -> None:
    splitter = FrameSplitter(1000)
    got: list[bytes] = []
    completed_at: list[int] = []
    for i in range(len(STREAM)):
        out = splitter.feed(STREAM[i : i + 1])
        got += out
        if out:
            completed_at.append(i)
    assert got == PAYLOADS
    assert splitter.buffered == 0
    # Each frame completes on its own last byte, not earlier and not later.
    ends = []
    pos = 0
    for payload in PAYLOADS:
        pos += 4 + len(payload)
        ends.append(pos - 1)
    assert completed_at == ends


@pytest.mark.parametrize("cuts", [
    [1], [3], [4], [5], [15], [16], [17], [2, 5, 9, 40, 41, 500], [10, 19, 20, 21, 330, 600],
])
def test_arbitrary_chunk_boundaries(cuts: list[int]) -> None:
    splitter = FrameSplitter(1000)
    bounds = [0, *cuts, len(STREAM)]
    got: list[bytes] = []
    for start, end in itertools.pairwise(bounds):
        got += splitter.feed(STREAM[start:end])
    assert got == PAYLOADS


def test_partial_frame_is_buffered_until_complete() -> None:
    splitter = FrameSplitter(1000)
    assert splitter.feed(frame(b"hello")[:6]) == []
    assert splitter.buffered == 6
    assert splitter.feed(b"llo" + frame(b"next")[:2]) == [b"hello"]
    assert splitter.buffered == 2
    assert splitter.feed(frame(b"next")[2:]) == [b"next"]
    assert splitter.buffered == 0


def test_zero_size_frame_is_legal() -> None:
    splitter = FrameSplitter(10)
    assert splitter.feed(b"\x00\x00\x00\x00") == [b""]
    assert splitter.feed(b"\x00\x00\x00\x00\x00\x00\x00\x01z") == [b"", b"z"]


def test_frames_are_bytes_not_views_of_the_buffer() -> None:
    splitter = FrameSplitter(100)
    (first,) = splitter.feed(frame(b"abc"))
    splitter.feed(frame(b"XYZ"))
    assert first == b"abc"
    assert type(first) is bytes


def test_negative_size_raises_naming_the_size() -> None:
    splitter = FrameSplitter(1000, "request")
    with pytest.raises(FrameSizeError, match=r"request size -1 is outside 0\.\.1000"):
        splitter.feed(b"\xff\xff\xff\xff")


def test_large_negative_size_named() -> None:
    with pytest.raises(FrameSizeError, match="-2147483648"):
        FrameSplitter(1000).feed(b"\x80\x00\x00\x00")


def test_oversize_raises_naming_the_size_and_limit() -> None:
    splitter = FrameSplitter(1000, "response")
    with pytest.raises(FrameSizeError, match=r"response size 1001 is outside 0\.\.1000 bytes"):
        splitter.feed((1001).to_bytes(4, "big"))


def test_size_equal_to_limit_is_accepted() -> None:
    splitter = FrameSplitter(8)
    assert splitter.feed(frame(b"12345678")) == [b"12345678"]


def test_oversize_detected_once_the_prefix_completes_across_chunks() -> None:
    splitter = FrameSplitter(100)
    assert splitter.feed(b"\x01") == []
    with pytest.raises(FrameSizeError, match="size 16777216"):
        splitter.feed(b"\x00\x00\x00")


def test_oversize_after_valid_frame_in_same_chunk_raises() -> None:
    splitter = FrameSplitter(10)
    with pytest.raises(FrameSizeError) as info:
        splitter.feed(frame(b"ok") + (11).to_bytes(4, "big"))
    assert "11" in str(info.value)


def test_frame_size_error_is_a_protocol_error() -> None:
    assert issubclass(FrameSizeError, ProtocolError)


def test_limits() -> None:
    assert DEFAULT_MAX_REQUEST_BYTES == 100 * 1024 * 1024  # Kafka's socket.request.max.bytes
    assert MAX_RESPONSE_BYTES == 2**31 - 1


def test_random_chunking_of_large_and_small_frames() -> None:
    """Large frames arrive over many reads, with the next frames' bytes behind them in the last one."""
    rng = random.Random(7)
    payloads = [rng.randbytes(rng.choice([0, 1, 3, 100, 70_000, 300_000])) for _ in range(60)]
    stream = b"".join(frame(p) for p in payloads)
    for _ in range(20):
        splitter = FrameSplitter(DEFAULT_MAX_REQUEST_BYTES)
        got: list[bytes] = []
        pos = 0
        while pos < len(stream):
            step = rng.choice([1, 2, 5, 4096, 65_536, 262_144])
            got += splitter.feed(stream[pos : pos + step])
            pos += step
        assert got == payloads
        assert splitter.buffered == 0


def test_declared_size_of_an_incomplete_head_frame() -> None:
    splitter = FrameSplitter(1000)
    assert splitter.declared_size is None
    splitter.feed(b"\x00\x00")
    assert splitter.declared_size is None  # the prefix is not complete
    splitter.feed(b"\x01\x2c" + b"ab")
    assert splitter.declared_size == 300
    splitter.feed(b"x" * 298)
    assert splitter.declared_size is None  # complete and handed out: nothing is held
    splitter.feed(frame(b"whole") + b"\x00\x00\x00\x07abc")
    assert (splitter.declared_size, splitter.buffered) == (7, 7)


def test_declared_size_after_the_prefix_arrives_byte_by_byte() -> None:
    splitter = FrameSplitter(1000)
    for byte in (500).to_bytes(4, "big"):
        assert splitter.declared_size is None
        splitter.feed(bytes([byte]))
    assert splitter.declared_size == 500
