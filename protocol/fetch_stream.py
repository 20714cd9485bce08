"""Fetch v16+ responses streamed to the client with their KIP-951 NodeEndpoints rewritten.

A Fetch v16+ response may end with NodeEndpoints, a top-level tagged field naming the real
(host, port) of the new leaders of partitions answered NOT_LEADER_OR_FOLLOWER or
FENCED_LEADER_EPOCH. It comes after every record, and a large response goes to the client as it
arrives (the size prefix first), so the proxy cannot buffer the whole response to rewrite it
without losing what keeps consume throughput near a direct connection.

How it streams anyway:

- `FetchTailReader` follows the response's structure as its bytes pass (header, topics,
  partitions, aborted transactions, tagged fields) and steps over each partition's records by
  their length, never copying them. Everything before the top-level tagged fields goes on at
  once; only that tail (a few bytes, or one short array) is held back.
- The size the client is told is the broker's size plus a slack fixed before the first byte
  goes out (`node_endpoints_slack`): the most the rewrite can add, from each known broker's
  proxy-versus-real host length, plus room for one broker the proxy has not seen yet.
- `rewrite_tail` puts proxy addresses into NodeEndpoints and fills what the rewrite left of
  the slack with an unknown tagged field of zeros (`PADDING_TAG`), which Kafka's generated
  readers, librdkafka and kafka-python step over. One or two bytes too few for a field are
  absorbed by writing the tag count as a longer varint (0x81 0x00 for 1): Kafka's
  `ByteUtils.readUnsignedVarint`, librdkafka's `rd_slice_read_uvarint` and kafka-python read
  any varint of up to 5 bytes, canonical or not.
- A rewrite that would not fit the slack (a new broker with a much shorter real host) is never
  sent as a wrong frame: `SlackExceeded` closes the connection, and the client reconnects.

Responses below the streaming threshold are buffered and rewritten exactly, with no slack
(`rewrite_fetch_response`). The layout follows Kafka 4.3.1's `FetchResponse.json`, identical in
v16, v17 and v18 (v17 and v18 change only the request). Anything that does not add up raises
`MalformedBody` naming the field and offset.
"""

from __future__ import annotations

from collections.abc import Mapping

from .broker_array import Address, Advertise, FieldError, encode_address, read_brokers, read_uvarint_field
from .errors import MalformedBody, ProtocolError

#: The Fetch versions whose layout this reader knows: NodeEndpoints appear in v16 (KIP-951); v17
#: (KIP-853) and v18 (KIP-1166) leave the response as it is. The proxy offers no newer version.
FETCH_STREAM_VERSIONS = (16, 18)
#: FetchResponse.json: "NodeEndpoints", "tag": 0, "taggedVersions": "16+".
NODE_ENDPOINTS_TAG = 0
#: The tag of the padding field. Tags must ascend within a section, and a tag a later Kafka gives
#: a real field would make clients read the zeros as that field, so it is far above any tag a
#: Kafka response schema uses (single digits): the largest that fits a 2-byte varint.
PADDING_TAG = 0x3FFF
_PADDING_TAG_BYTES = b"\xff\x7f"
#: The fewest bytes a broker's host takes in a NodeEndpoint: a compact string of one character
#: (Kafka refuses an empty advertised host). Bounds the growth for a broker not yet known.
MIN_HOST_BYTES = 2
#: Slack when the connection is not told which brokers exist: room for this many bytes of growth
#: (four endpoints whose proxy host is 64 bytes longer than the broker's).
UNKNOWN_BROKERS_SLACK = 256
#: Kafka's varints hold an int32: at most 5 bytes (`ByteUtils.readUnsignedVarint` throws after 5).
MAX_VARINT_BYTES = 5
#: The most bytes one parsing step needs (a partition's fixed 30 bytes and its aborted
#: transactions count are the largest): bytes of a step cut by a chunk boundary are carried.
STEP_MAX_BYTES = 40
#: Fixed-width parts of the layout.
_HEADER_FIXED = 4  # correlation id
_BODY_FIXED = 10  # throttle time, error code, session id
_TOPIC_ID = 16
_PARTITION_FIXED = 30  # index, error code, high watermark, last stable offset, log start offset
_ABORTED_FIXED = 16  # producer id, first offset
_PREFERRED_REPLICA = 4
#: A partition whose first this many bytes are at hand is read in one go: its fixed fields, an
#: empty aborted transactions count, preferred read replica, records length (at most 5 bytes).
_PARTITION_FAST_BYTES = _PARTITION_FIXED + 1 + _PREFERRED_REPLICA + MAX_VARINT_BYTES

# Reader stages.
_HEADER, _BODY, _NEXT_TOPIC, _TOPIC, _NEXT_PARTITION, _PARTITION, _NEXT_ABORTED, _RECORDS, \
    _TAGS, _TAG, _TAIL = range(11)


class SlackExceeded(ProtocolError):
    """The rewritten NodeEndpoints do not fit the size already announced to the client."""


def _uvarint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int] | None:
    """An unsigned varint at `pos`, or None when `end` comes first (the step waits for bytes)."""
    if pos < end and buf[pos] < 0x80:  # one byte: nearly every count
        return buf[pos], pos + 1
    value = shift = 0
    for index in range(pos, min(end, pos + MAX_VARINT_BYTES)):
        byte = buf[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    if end - pos >= MAX_VARINT_BYTES:
        raise MalformedBody(f"Fetch response: varint longer than {MAX_VARINT_BYTES} bytes")
    return None


def uvarint_bytes(value: int, width: int = 0) -> bytes:
    """`value` as an unsigned varint of at least `width` bytes (wider than needed is legal)."""
    out = bytearray()
    while value >= 0x80 or len(out) + 1 < width:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    if len(out) > MAX_VARINT_BYTES:
        raise ValueError(f"varint of {len(out)} bytes")
    return bytes(out)


class FetchTailReader:
    """Follows a Fetch v16+ response (header and body) as it arrives, to find its tail.

    `feed` returns what of each chunk lies before the top-level tagged fields; the rest is
    held in `tail` once the last byte (`size` in all) has come.
    """

    __slots__ = ("_aborted", "_after", "_base", "_carry", "_left", "_partitions", "_skip", "_stage",
                 "_tags", "_tail", "_topics", "size", "tail_offset")

    def __init__(self, size: int) -> None:
        self.size = size
        #: bytes of the response not fed yet
        self._left = size
        #: offset in the response of the next byte `_run` reads (the start of `_carry` if any)
        self._base = 0
        self._carry = b""
        self._skip = 0
        self._stage = _HEADER
        self._after = _BODY
        self._topics = self._partitions = self._aborted = self._tags = 0
        self._tail: list[bytes | memoryview] = []
        #: where the top-level tagged fields begin, once known
        self.tail_offset: int | None = None

    @property
    def left(self) -> int:
        """Bytes of the response still to come."""
        return self._left

    @property
    def complete(self) -> bool:
        return self._left == 0

    @property
    def tail(self) -> bytes:
        """The top-level tagged fields, once the response is complete."""
        if self._left or self.tail_offset is None or not self._tail:
            raise MalformedBody(
                f"Fetch response of {self.size} bytes ends before its top-level tagged fields")
        return b"".join(self._tail)

    def feed(self, data: bytes | memoryview) -> bytes | memoryview:
        """The part of `data` (the next bytes of the response) that may go to the client now."""
        end = len(data)
        if end <= self._skip and end < self._left:  # inside one partition's records: most chunks
            self._skip -= end
            self._base += end
            self._left -= end
            return data
        if end > self._left:
            raise MalformedBody(f"Fetch response of {self.size} bytes fed {end - self._left} bytes too many")
        self._left -= end
        if self._stage == _TAIL:
            self._tail.append(data)
            return b""
        pos = 0
        while pos < end and self._stage != _TAIL:
            if self._skip:
                take = min(self._skip, end - pos)
                self._skip -= take
                self._base += take
                pos += take
            elif self._carry:
                carry = self._carry
                extra = bytes(data[pos : pos + STEP_MAX_BYTES])
                self._carry = b""
                stop = self._run(carry + extra, 0)
                if stop == 0:  # the step still lacks bytes, which happens only when `data` ran out
                    self._carry = carry + extra
                    pos += len(extra)
                    if pos < end:
                        raise MalformedBody("Fetch response: a parsing step needs more than "
                                            f"{STEP_MAX_BYTES} bytes")  # a bug, not the broker's
                else:  # the carried step is complete, so the stop lies in `extra`
                    pos += stop - len(carry)
            else:
                pos = self._run(data, pos)
                if self._stage != _TAIL and not self._skip and pos < end:
                    self._carry = bytes(data[pos:end])  # a step cut by the chunk's end
                    pos = end
        if self._stage == _TAIL:
            if self.tail_offset is None:
                self.tail_offset = self._base
            if pos < end:
                self._tail.append(data[pos:])
                return data[:pos]
        if not self._left and self._stage != _TAIL:
            raise MalformedBody(
                f"Fetch response of {self.size} bytes ends before its top-level tagged fields")
        return data

    def _run(self, buf: bytes | memoryview, pos: int) -> int:
        """Read whole steps of `buf` from `pos`; where it stopped (a step start, or `len(buf)`).

        State changes only once a step's bytes are all there, so a step cut short is read again
        from its start with the next bytes. `_base` follows `pos` (offsets in errors).
        """
        end = len(buf)
        stage = self._stage
        start = pos
        try:
            while True:
                if stage == _NEXT_PARTITION and self._partitions and end - pos >= _PARTITION_FAST_BYTES \
                        and buf[pos + _PARTITION_FIXED] <= 1:
                    # The common partition, read in one go: no aborted transactions (null or
                    # empty), its head all in `buf`. The steps below read any other.
                    p = pos + _PARTITION_FIXED + 1 + _PREFERRED_REPLICA
                    byte = buf[p]
                    length = byte & 0x7F
                    shift = 7
                    while byte & 0x80:
                        if shift > 28:
                            raise FieldError(f"varint longer than {MAX_VARINT_BYTES} bytes at offset "
                                             f"{self._base + p - start}")
                        p += 1
                        byte = buf[p]
                        length |= (byte & 0x7F) << shift
                        shift += 7
                    p += 1
                    records = max(length - 1, 0)  # null (0) or length + 1
                    self._partitions -= 1
                    tags = p + records
                    if tags < end and buf[tags] == 0:  # no tagged fields: nearly always
                        pos = tags + 1
                        continue
                    stage, self._after = _TAGS, _NEXT_PARTITION
                    if not self._skip_bytes(records, buf, p, end, start, "records"):
                        pos = end
                        break
                    pos = tags
                    continue
                if stage == _TAIL:
                    break
                if stage == _TAG:
                    if not self._tags:
                        stage = self._after
                        continue
                    tag = _uvarint(buf, pos, end)
                    if tag is None:
                        break
                    size = _uvarint(buf, tag[1], end)
                    if size is None:
                        break
                    self._tags -= 1
                    pos = size[1]
                    if not self._skip_bytes(size[0], buf, pos, end, start, "tagged field"):
                        pos = end
                        break
                    pos += size[0]
                elif stage == _TAGS:
                    count = _uvarint(buf, pos, end)
                    if count is None:
                        break
                    self._tags, pos = count
                    stage = _TAG
                elif stage == _NEXT_PARTITION:
                    if not self._partitions:
                        stage, self._after = _TAGS, _NEXT_TOPIC
                        continue
                    self._partitions -= 1
                    stage = _PARTITION
                elif stage == _PARTITION:
                    aborted = _uvarint(buf, pos + _PARTITION_FIXED, end) if end - pos > _PARTITION_FIXED \
                        else None
                    if aborted is None:
                        break
                    self._aborted = max(aborted[0] - 1, 0)  # null (0) or count + 1
                    pos = aborted[1]
                    stage = _NEXT_ABORTED
                elif stage == _NEXT_ABORTED:
                    if not self._aborted:
                        stage = _RECORDS
                        continue
                    if end - pos < _ABORTED_FIXED:
                        break
                    self._aborted -= 1
                    pos += _ABORTED_FIXED
                    stage, self._after = _TAGS, _NEXT_ABORTED
                elif stage == _RECORDS:
                    prefix = _uvarint(buf, pos + _PREFERRED_REPLICA, end) if end - pos > _PREFERRED_REPLICA \
                        else None
                    if prefix is None:
                        break
                    pos = prefix[1]
                    stage, self._after = _TAGS, _NEXT_PARTITION
                    records = max(prefix[0] - 1, 0)  # null (0) or length + 1
                    if not self._skip_bytes(records, buf, pos, end, start, "records"):
                        pos = end
                        break
                    pos += records
                elif stage == _NEXT_TOPIC:
                    if not self._topics:
                        stage = _TAIL
                        break
                    self._topics -= 1
                    stage = _TOPIC
                elif stage == _TOPIC:
                    count = _uvarint(buf, pos + _TOPIC_ID, end) if end - pos > _TOPIC_ID else None
                    if count is None:
                        break
                    if count[0] == 0:
                        raise FieldError(f"partitions array is null at offset {self._base + pos - start}")
                    self._partitions, pos = count[0] - 1, count[1]
                    stage = _NEXT_PARTITION
                elif stage == _BODY:
                    count = _uvarint(buf, pos + _BODY_FIXED, end) if end - pos > _BODY_FIXED else None
                    if count is None:
                        break
                    if count[0] == 0:
                        raise FieldError(f"responses array is null at offset {self._base + pos - start}")
                    self._topics, pos = count[0] - 1, count[1]
                    stage = _NEXT_TOPIC
                else:  # _HEADER
                    if end - pos < _HEADER_FIXED:
                        break
                    pos += _HEADER_FIXED
                    stage, self._after = _TAGS, _BODY
        except FieldError as exc:
            raise MalformedBody(f"Fetch response of {self.size} bytes does not parse: {exc}") from None
        self._stage = stage
        self._base += pos - start
        return pos

    def _skip_bytes(self, length: int, buf: bytes | memoryview, pos: int, end: int, start: int,
                    what: str) -> bool:
        """Step over `length` bytes at `pos`; False when they go past `end` (the rest is skipped
        as the next chunks arrive)."""
        at = self._base + pos - start  # offset in the response
        if at + length > self.size:
            raise FieldError(f"{what} of {length} bytes at offset {at} run past the end of the response")
        if length <= end - pos:
            return True
        self._skip = length - (end - pos)
        return False


# -- the tail ----------------------------------------------------------------------------------------


def _splice_endpoints(data: bytes, advertise: Advertise, seen: dict[int, Address]) -> bytes:
    """NodeEndpoints' value (a compact array) with each real (host, port) replaced by the proxy's."""
    endpoints = read_brokers(data, 0, True, rack=True, is_fenced=False, array="node endpoints",
                             entry="node endpoint")
    if endpoints.end != len(data):
        raise FieldError(f"{len(data) - endpoints.end} bytes after the node endpoints array")
    pieces: list[bytes] = []
    copied = 0
    for endpoint in endpoints.brokers:
        if endpoint.node_id < 0 or not endpoint.host:
            continue  # a placeholder: nothing to rewrite
        seen[endpoint.node_id] = (endpoint.host, endpoint.port)
        host, port = advertise(endpoint.node_id)
        pieces += (data[copied : endpoint.address_start], encode_address(host, port, True))
        copied = endpoint.address_end
    pieces.append(data[copied:])
    return b"".join(pieces)


def rewrite_tail(tail: bytes, advertise: Advertise,
                 slack: int | None = None) -> tuple[bytes, dict[int, Address]]:
    """The top-level tagged fields with proxy addresses in NodeEndpoints; the real addresses seen.

    With `slack`, exactly that many bytes longer than `tail` (the size already announced);
    without, as long as the rewrite makes them. Other tagged fields are kept as they are, in their
    order. With nothing to rewrite and nothing to pad, `tail` itself comes back.
    """
    seen: dict[int, Address] = {}
    try:
        count, pos = read_uvarint_field(tail, 0, "tagged field count")
        if count > len(tail) - pos:  # each field takes at least 2 bytes
            raise FieldError(f"{count} tagged fields in {len(tail) - pos} bytes")
        fields: list[tuple[int, bytes]] = []
        for _ in range(count):
            tag, pos = read_uvarint_field(tail, pos, "tag")
            size, pos = read_uvarint_field(tail, pos, f"tag {tag} size")
            if pos + size > len(tail):
                raise FieldError(f"tag {tag} of {size} bytes at offset {pos} runs past the end")
            value = tail[pos : pos + size]
            pos += size
            if tag >= PADDING_TAG:
                raise FieldError(f"tag {tag} is not below the padding tag {PADDING_TAG}")
            if tag == NODE_ENDPOINTS_TAG:
                value = _splice_endpoints(value, advertise, seen)
            fields.append((tag, value))
        if pos != len(tail):
            raise FieldError(f"{len(tail) - pos} bytes after the top-level tagged fields")
    except FieldError as exc:
        raise MalformedBody(f"Fetch response's top-level tagged fields do not parse: {exc}") from None
    if not seen and not slack:
        return tail, seen
    body = b"".join(uvarint_bytes(tag) + uvarint_bytes(len(value)) + value for tag, value in fields)
    if slack is None:
        return uvarint_bytes(count) + body, seen
    need = len(tail) + slack - len(uvarint_bytes(count)) - len(body)
    if need < 0:
        raise SlackExceeded(
            f"Fetch response's NodeEndpoints grew by {slack + (-need)} bytes with proxy addresses, more "
            f"than the {slack} bytes of slack announced in its size ({sorted(seen)} named); closing rather "
            "than sending a wrong frame")
    return _pad(count, body, need), seen


def _pad(count: int, body: bytes, need: int) -> bytes:
    """The tagged-field section of `count` fields `body`, `need` bytes longer than canonical."""
    counted = uvarint_bytes(count)
    # A padding field: its tag, its size, zeros; the count goes up by one.
    room = need - (len(uvarint_bytes(count + 1)) - len(counted)) - len(_PADDING_TAG_BYTES)
    for width in range(1, MAX_VARINT_BYTES):
        zeros = room - width
        if 0 <= zeros < 1 << (7 * width):
            return (uvarint_bytes(count + 1) + body + _PADDING_TAG_BYTES + uvarint_bytes(zeros, width)
                    + bytes(zeros))
    if len(counted) + need <= MAX_VARINT_BYTES:  # 0 to 2 bytes: a longer count
        return uvarint_bytes(count, len(counted) + need) + body
    raise SlackExceeded(f"Fetch response's tagged fields cannot take {need} bytes of padding")


def node_endpoints_slack(advertise: Advertise, brokers: Mapping[int, Address] | None) -> int:
    """Bytes a streamed Fetch v16+ response may grow by when its NodeEndpoints are rewritten.

    NodeEndpoints name each broker at most once (node id is the map key), so the growth is at
    most the sum of each known broker's proxy host length over its real one, plus one broker not
    known yet with a one-character host. Ports keep their 4 bytes.
    """
    if not brokers:
        return UNKNOWN_BROKERS_SLACK
    growth = 0
    longest = 0
    for node_id, (host, _port) in brokers.items():
        try:
            proxy_host = advertise(node_id)[0]
        except ProtocolError:
            continue  # no listener can stand for it: a rewrite naming it closes the connection
        proxy_bytes = len(encode_address(proxy_host, 0, True))
        longest = max(longest, proxy_bytes)
        growth += max(proxy_bytes - len(encode_address(host, 0, True)), 0)
    return growth + max(longest - 4 - MIN_HOST_BYTES, 0)


class FetchStream:
    """One Fetch v16+ response streamed to the client with its NodeEndpoints rewritten.

    `announced_size` is what the client is told (the broker's size plus `slack`); `feed` takes
    the response's bytes (header first, no size prefix) and returns the chunks to send now; the
    rewritten tail comes with the last chunk, and `discovered` then holds the real addresses seen.
    """

    __slots__ = ("_advertise", "_reader", "announced_size", "discovered", "slack")

    def __init__(self, size: int, advertise: Advertise, slack: int) -> None:
        self._reader = FetchTailReader(size)
        self._advertise = advertise
        self.slack = slack
        self.announced_size = size + slack
        self.discovered: dict[int, Address] = {}

    @property
    def remaining(self) -> int:
        return self._reader.left

    def feed(self, data: bytes) -> list[bytes]:
        head = self._reader.feed(data)
        if head is data and self._reader.left:  # all of it goes on now: most chunks
            return [data]
        chunks = [bytes(head)] if head else []  # bytes of bytes: the same object, no copy
        if self._reader.complete:
            tail, self.discovered = rewrite_tail(self._reader.tail, self._advertise, self.slack)
            chunks.append(tail)
        return chunks


def fetch_tail(frame: bytes) -> tuple[int, bytes]:
    """Where a whole Fetch v16+ response's (header and body) top-level tagged fields begin, and them."""
    reader = FetchTailReader(len(frame))
    reader.feed(memoryview(frame))  # the head is not needed: a view costs no copy
    tail = reader.tail
    assert reader.tail_offset is not None  # set once `tail` did not raise
    return reader.tail_offset, tail


def rewrite_fetch_response(frame: bytes, advertise: Advertise) -> tuple[bytes, dict[int, Address]]:
    """A whole Fetch v16+ response (header and body) with proxy addresses in NodeEndpoints, exact.

    Returns the very same bytes when there is nothing to rewrite.
    """
    offset, tail = fetch_tail(frame)
    new_tail, seen = rewrite_tail(tail, advertise)
    if not seen:
        return frame, seen
    return frame[:offset] + new_tail, seen


__all__ = [
    "FETCH_STREAM_VERSIONS", "PADDING_TAG", "FetchStream", "FetchTailReader", "SlackExceeded", "fetch_tail",
    "node_endpoints_slack", "rewrite_fetch_response", "rewrite_tail", "uvarint_bytes",
]
