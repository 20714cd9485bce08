"""The fleet's usage datagram: encoding, HMAC-SHA256 signing, verification and parsing.

Kept apart from the merged view (fleet.py) because it is the one part that speaks bytes: peers
exchange their absolute windowed rates per bucket in datagrams of at most `MAX_DATAGRAM_BYTES`,
with a per-datagram string table so that one entry costs 7 bytes plus its share of the names.
A member keeps one `NameItems` for its reports, so a full sync that names every bucket every
second does not rebuild their string-table items each time.

Wire format (version 1, all integers big-endian, the MAC last)::

    version u8 | flags u8 (bit 0: full sync) | fleet length u8 | fleet (UTF-8)
    sender u64 | seq u64 | sent_unix_ms u64
    string count u8 | strings: tag u8, then tag bytes of UTF-8 (tag <= 254)
                                        or a 16-byte SHA-256 prefix (tag 255: a long name)
    entry count u16 | entries: quota u8 | user index u8 | client-id index u8 | rate float32
    producer-id count u16 | producer ids: user index u8 | producer id i64
    HMAC-SHA256 of everything before it (32 bytes)

A name that does not fit a literal (more than 254 UTF-8 bytes, or not encodable as UTF-8)
travels as a digest and is keyed everywhere by `wire_name(name)`, a string that no literal name
can equal (it is 255 bytes long): so a client with a 2,000-byte client id is still held to one
fleet-wide quota, nothing is refused, and no two names can be confused by truncation. Peers learn
the producer ids of such a user under the digest only, so there they count once more (stricter).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .fleet_streams import STREAMS
from .types import UsageKind

#: Payload bound: 1,280 bytes is IPv6's minimum MTU; 1,200 leaves room for IP and UDP headers on
#: any path without fragmentation (QUIC's minimum datagram size, RFC 9000 §14, for the same reason).
MAX_DATAGRAM_BYTES = 1200

#: A datagram stamped more than this far from the receiver's wall clock is refused as "stale"
#: (replays of old captures, badly skewed members). Kafka's own equivalent is a timestamp bound on
#: records (`log.message.timestamp.difference.max.ms`); here 10 s, well inside one quota window.
MAX_CLOCK_SKEW_MS = 10_000

#: Shortest fleet secret accepted by `encode_usage`: 128 bits, HMAC's security for SHA-256 keys
#: shorter than the hash (RFC 2104 §3 recommends at least the hash length, 32 bytes).
MIN_SECRET_BYTES = 16

#: Longest fleet name: Kafka's longest topic name (`Topic.MAX_NAME_LENGTH`, 249); a cluster id,
#: the default fleet name, is 22 characters.
MAX_FLEET_NAME_BYTES = 249

#: Wire format version (the first byte).
VERSION = 1

#: Longest name sent literally; longer ones travel as a digest (tag 255).
MAX_LITERAL_NAME_BYTES = 254
_DIGEST_TAG = 255
_DIGEST_BYTES = 16
#: `wire_name` of a long name: 255 characters, so it can never equal a literal name (<= 254 bytes).
_DIGEST_PAD = "\x00" * (MAX_LITERAL_NAME_BYTES + 1 - 2 * _DIGEST_BYTES)

_MAC_BYTES = 32
_FULL_FLAG = 0x01
_HEAD = struct.Struct("!BBB")  # version, flags, fleet name length
_IDS = struct.Struct("!QQQ")  # sender, seq, sent_unix_ms
_COUNT16 = struct.Struct("!H")
_ENTRY = struct.Struct("!BBBf")  # quota, user index, client-id index, rate (float32)
_PID = struct.Struct("!Bq")  # user index, producer id
_MAX_STRINGS = 255  # string indices are one byte
_MAX_U64 = 2**64 - 1
_FLOAT32_MAX = 3.4028234663852886e38
#: Bytes of a datagram beside its fleet name, strings, entries and producer ids.
_FIXED_BYTES = _HEAD.size + _IDS.size + 1 + 2 * _COUNT16.size + _MAC_BYTES
_MIN_DATAGRAM_BYTES = _FIXED_BYTES

#: Stable wire codes of the streams (fleet_streams.py declares them with their kinds).
_QUOTA_CODES: dict[UsageKind, int] = {stream: declared.code for stream, declared in STREAMS.items()}
_QUOTAS_BY_CODE: dict[int, UsageKind] = {code: quota for quota, code in _QUOTA_CODES.items()}
_QUOTA_CODES_BY_NAME: dict[str, int] = {quota.name: code for quota, code in _QUOTA_CODES.items()}

#: Reasons a datagram is dropped (the label of kthrottle_fleet_datagrams_rejected_total).
REJECT_REASONS = ("malformed", "bad_mac", "replayed", "stale", "other_fleet")


class DatagramRejected(ValueError):
    """A datagram that must not be applied; `reason` is one of `REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class UsageEntry(NamedTuple):
    """One bucket's own windowed rate on one member (units per second, as `WindowedRate.measure`).

    A tuple, not a frozen dataclass: a full sync makes one per live bucket every second, and a
    frozen dataclass costs four times as much to build (0.55 us against 0.15 us).
    """

    quota: UsageKind
    user: str
    client_id: str
    rate: float


@dataclass(frozen=True, slots=True)
class UsageReport:
    """One verified datagram. Names are `wire_name`s (the names themselves unless very long)."""

    fleet: str
    sender: int
    seq: int
    sent_unix_ms: int
    full: bool
    entries: tuple[UsageEntry, ...]
    new_producer_ids: tuple[tuple[str, int], ...]


# -- names ------------------------------------------------------------------------------------


def _digest_name(raw: bytes) -> str:
    return _DIGEST_PAD + hashlib.sha256(raw).digest()[:_DIGEST_BYTES].hex()


def wire_name(name: str) -> str:
    """The key a name has in the fleet: itself when it fits a literal, else its digest form."""
    if name.isascii() and len(name) <= MAX_LITERAL_NAME_BYTES:
        return name
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: hash what there is
        return _digest_name(name.encode("utf-8", "surrogatepass"))
    return name if len(raw) <= MAX_LITERAL_NAME_BYTES else _digest_name(raw)


def _name_item(name: str) -> bytes:
    """A name as a string-table item: tag (length or 255) and payload."""
    if name.isascii() and len(name) <= MAX_LITERAL_NAME_BYTES:
        return bytes((len(name),)) + name.encode("ascii")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogatepass")
    else:
        if len(raw) <= MAX_LITERAL_NAME_BYTES:
            return bytes((len(raw),)) + raw
    return bytes((_DIGEST_TAG,)) + hashlib.sha256(raw).digest()[:_DIGEST_BYTES]


class NameItems:
    """name -> (wire name, string-table item), kept by one sender across its reports.

    A full sync names every bucket every second, and building the items each time cost a fifth of
    it. Cleared when it grows past `max_items` (names of buckets long gone would pile up).
    """

    __slots__ = ("items", "max_items")

    #: Twice the buckets one member tracks at most (quota types x `max_quota_buckets`, 50,000).
    DEFAULT_MAX_ITEMS = 400_000

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.items: dict[str, tuple[str, bytes]] = {}
        self.max_items = max_items

    def item(self, name: str) -> tuple[str, bytes]:
        found = self.items.get(name)
        if found is None:
            item = _name_item(name)
            wire = _DIGEST_PAD + item[1:].hex() if item[0] == _DIGEST_TAG else name
            found = self.items[name] = (wire, item)
        return found


# -- encoding ---------------------------------------------------------------------------------


class _Datagram:
    """One datagram being filled: its string table, entries and producer ids, and its size."""

    __slots__ = ("entries", "pids", "size", "strings", "table")

    def __init__(self, fixed: int) -> None:
        self.table: dict[str, int] = {}
        self.strings: list[bytes] = []
        self.entries: list[bytes] = []
        self.pids: list[bytes] = []
        self.size = fixed

    def _index(self, name: str, item: bytes) -> int:
        index = self.table.get(name)
        if index is None:
            index = self.table[name] = len(self.strings)
            self.strings.append(item)
        return index

    def add_pid(self, user: tuple[str, bytes], pid: int) -> bool:
        """Add one new producer id if it fits; False: start a new datagram."""
        extra, slots = (0, 0) if user[0] in self.table else (len(user[1]), 1)
        size = self.size + extra + _PID.size
        if size > MAX_DATAGRAM_BYTES or len(self.strings) + slots > _MAX_STRINGS:
            return False
        self.pids.append(_PID.pack(self._index(*user), pid))
        self.size = size
        return True

    def seal(self, head: bytes, ids: bytes, secret: bytes) -> bytes:
        body = b"".join((head, ids, bytes((len(self.strings),)), *self.strings,
                         _COUNT16.pack(len(self.entries)), *self.entries,
                         _COUNT16.pack(len(self.pids)), *self.pids))
        return body + hmac.new(secret, body, hashlib.sha256).digest()


def encode_usage(fleet: str, sender: int, first_seq: int, sent_unix_ms: int, full: bool,
                 entries: Sequence[UsageEntry], new_producer_ids: Sequence[tuple[str, int]],
                 secret: bytes, names: NameItems | None = None) -> list[bytes]:
    """As many datagrams as needed (seq first_seq, first_seq+1, ...), each HMAC-SHA256 signed.

    `names` is the sender's NameItems, kept across calls (None: a fresh one, for one-off calls).
    Entries of one bucket (user, client-id) travel together, in the order the bucket first appears.
    Always at least one: with nothing to send, one empty datagram still tells peers this member
    is alive. Every datagram is at most MAX_DATAGRAM_BYTES, and every entry fits one (a long name
    travels as a 16-byte digest). Raises ValueError for a bad argument (it names the value): a
    fleet name over MAX_FLEET_NAME_BYTES, a secret under MIN_SECRET_BYTES, an id, sequence number
    or time outside 0..2**64-1, a rate that is NaN, infinite or beyond float32; a negative rate (a
    rounding remainder of an un-recorded fetch) is sent as 0.
    """
    fleet_raw = fleet.encode("utf-8")
    if len(fleet_raw) > MAX_FLEET_NAME_BYTES:
        raise ValueError(f"fleet name is {len(fleet_raw)} bytes, more than {MAX_FLEET_NAME_BYTES}: {fleet!r}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"fleet secret is {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed")
    for what, value in (("sender", sender), ("first_seq", first_seq), ("sent_unix_ms", sent_unix_ms)):
        if not 0 <= value <= _MAX_U64:
            raise ValueError(f"{what} must be in 0..2**64-1, got {value}")
    head = _HEAD.pack(VERSION, _FULL_FLAG if full else 0, len(fleet_raw)) + fleet_raw
    fixed = _FIXED_BYTES + len(fleet_raw)
    names = NameItems() if names is None else names
    items = names.items
    if len(items) > names.max_items:
        items.clear()
    name = names.item

    # A bucket's quota types side by side, so its names are written once a datagram (the engine
    # lists one quota type after another). First-seen order otherwise. One quota type (the usual
    # full sync of a producer- or consumer-only fleet) needs no regrouping.
    ordered: Iterable[UsageEntry] = entries
    if len({entry[0] for entry in entries}) > 1:
        grouped: dict[tuple[str, str], list[UsageEntry]] = {}
        for entry in entries:
            key = (entry[1], entry[2])
            same = grouped.get(key)
            if same is None:
                grouped[key] = [entry]
            else:
                same.append(entry)
        ordered = [entry for same in grouped.values() for entry in same]
    # The datagram being filled is held in locals, not a _Datagram: a full sync of 100,000
    # buckets passes here 100,000 times a second (method calls cost a third of the time).
    datagram = _Datagram(fixed)
    datagrams = [datagram]
    table, strings, packed, size = datagram.table, datagram.strings, datagram.entries, fixed
    pack = _ENTRY.pack
    entry_size = _ENTRY.size
    isfinite = math.isfinite
    codes = _QUOTA_CODES_BY_NAME
    for entry in ordered:
        quota, user_name, client_name, rate = entry
        if not (rate <= _FLOAT32_MAX and isfinite(rate)):
            raise ValueError(f"rate of {entry} cannot be sent (finite float32 only)")
        if rate < 0.0:
            rate = 0.0
        code = codes[quota._name_]  # an enum's own hash is a Python call
        user_key, user_item = items.get(user_name) or name(user_name)
        client_key, client_item = items.get(client_name) or name(client_name)
        user_index = table.get(user_key)
        client_index = table.get(client_key)
        extra = 0 if user_index is not None else len(user_item)
        new = 0 if user_index is not None else 1
        if client_index is None and client_key != user_key:
            extra += len(client_item)
            new += 1
        if size + extra + entry_size > MAX_DATAGRAM_BYTES or len(strings) + new > _MAX_STRINGS:
            datagram.size = size
            datagram = _Datagram(fixed)
            datagrams.append(datagram)
            table, strings, packed, size = datagram.table, datagram.strings, datagram.entries, fixed
            user_index = client_index = None
            extra = len(user_item) + (len(client_item) if client_key != user_key else 0)
        if user_index is None:
            user_index = table[user_key] = len(strings)
            strings.append(user_item)
        if client_index is None:
            client_index = table.get(client_key)
            if client_index is None:
                client_index = table[client_key] = len(strings)
                strings.append(client_item)
        packed.append(pack(code, user_index, client_index, rate))
        size += extra + entry_size
    datagram.size = size
    for user_name, pid in new_producer_ids:
        if not -(2**63) <= pid < 2**63:
            raise ValueError(f"producer id {pid} of {user_name!r} is not a 64-bit integer")
        user = name(user_name)
        if not datagram.add_pid(user, pid):
            datagram = _Datagram(fixed)
            datagrams.append(datagram)
            if not datagram.add_pid(user, pid):  # pragma: no cover - by the bounds
                raise AssertionError(f"one producer id does not fit an empty datagram: {user_name!r}")
    if first_seq + len(datagrams) - 1 > _MAX_U64:
        raise ValueError(f"sequence numbers from {first_seq} run past 2**64-1")
    return [filled.seal(head, _IDS.pack(sender, first_seq + n, sent_unix_ms), secret)
            for n, filled in enumerate(datagrams)]


# -- decoding ---------------------------------------------------------------------------------


def _malformed(detail: str) -> DatagramRejected:
    return DatagramRejected("malformed", detail)


def decode_usage(datagram: bytes, secret: bytes, fleet: str, now_unix_ms: int) -> UsageReport:
    """Verify (hmac.compare_digest) then parse; raises DatagramRejected(reason), never anything else.

    The MAC is checked before anything but the size and version is read, so an unauthenticated
    datagram is never parsed; every length, count and index is checked against what is left.
    """
    if not isinstance(datagram, bytes | bytearray | memoryview):
        raise _malformed(f"not bytes: {type(datagram).__name__}")
    data = bytes(datagram)
    size = len(data)
    if size < _MIN_DATAGRAM_BYTES or size > MAX_DATAGRAM_BYTES:
        raise _malformed(f"{size} bytes, not in {_MIN_DATAGRAM_BYTES}..{MAX_DATAGRAM_BYTES}")
    if data[0] != VERSION:
        raise _malformed(f"version {data[0]}, expected {VERSION}")
    body, mac = data[:-_MAC_BYTES], data[-_MAC_BYTES:]
    try:
        expected = hmac.new(secret, body, hashlib.sha256).digest()
    except TypeError as e:  # a secret that is not bytes: nothing can be verified with it
        raise DatagramRejected("bad_mac", "unusable secret") from e
    if not hmac.compare_digest(mac, expected):
        raise DatagramRejected("bad_mac")
    try:
        return _parse(body, fleet, now_unix_ms)
    except (struct.error, IndexError, KeyError, UnicodeDecodeError) as e:
        raise _malformed(f"{type(e).__name__}: {e}") from e


def _parse(body: bytes, fleet: str, now_unix_ms: int) -> UsageReport:
    _, flags, fleet_len = _HEAD.unpack_from(body, 0)
    pos = _HEAD.size
    if flags & ~_FULL_FLAG:
        raise _malformed(f"unknown flags {flags:#x}")
    if pos + fleet_len > len(body):
        raise _malformed("fleet name runs past the end")
    their_fleet = body[pos:pos + fleet_len].decode("utf-8")
    pos += fleet_len
    if their_fleet != fleet:
        raise DatagramRejected("other_fleet", f"{their_fleet!r}, this member is in {fleet!r}")
    sender, seq, sent_unix_ms = _IDS.unpack_from(body, pos)
    pos += _IDS.size
    if abs(now_unix_ms - sent_unix_ms) > MAX_CLOCK_SKEW_MS:
        raise DatagramRejected("stale", f"sent at {sent_unix_ms}, now {now_unix_ms}")
    strings: list[str] = []
    for _ in range(body[pos]):
        pos += 1
        tag = body[pos]
        if tag == _DIGEST_TAG:
            raw = body[pos + 1:pos + 1 + _DIGEST_BYTES]
            if len(raw) != _DIGEST_BYTES:
                raise _malformed("a name digest runs past the end")
            strings.append(_DIGEST_PAD + raw.hex())
            pos += _DIGEST_BYTES
        else:
            raw = body[pos + 1:pos + 1 + tag]
            if len(raw) != tag:
                raise _malformed("a name runs past the end")
            strings.append(raw.decode("utf-8"))
            pos += tag
    pos += 1
    (count,) = _COUNT16.unpack_from(body, pos)
    pos += _COUNT16.size
    if pos + count * _ENTRY.size > len(body):
        raise _malformed(f"{count} entries run past the end")
    entries = []
    for code, user, client, rate in _ENTRY.iter_unpack(body[pos:pos + count * _ENTRY.size]):
        if not 0.0 <= rate <= _FLOAT32_MAX:  # NaN, infinities and negative rates
            raise _malformed(f"rate {rate}")
        quota = _QUOTAS_BY_CODE.get(code)
        if quota is None:
            raise _malformed(f"unknown quota code {code}")
        entries.append(UsageEntry(quota, strings[user], strings[client], rate))
    pos += count * _ENTRY.size
    (count,) = _COUNT16.unpack_from(body, pos)
    pos += _COUNT16.size
    if pos + count * _PID.size != len(body):
        raise _malformed(f"{count} producer ids and {len(body) - pos} bytes left")
    pids = tuple((strings[user], pid) for user, pid in _PID.iter_unpack(body[pos:]))
    return UsageReport(their_fleet, sender, seq, sent_unix_ms, bool(flags & _FULL_FLAG),
                       tuple(entries), pids)
