"""The pure half of the fleet: one quota over several proxies (issue 11).

Every member decides locally; beside that, members tell each other their *absolute* windowed
rate per bucket (never deltas, so a lost datagram only delays convergence) and each adds the
peers' latest rates to its own before applying Kafka's throttle formula. This module holds
everything about that exchange that needs no socket and no clock of its own:

- the usage datagram: `encode_usage` / `decode_usage`, HMAC-SHA256 signed with the fleet secret,
  at most `MAX_DATAGRAM_BYTES` each, with a per-datagram string table so that one entry costs
  7 bytes plus its share of the names;
- `PeerUsage`: what peers reported, with replay protection per sender and the ageing rule (full
  weight while fresh, then linearly to 0 over one quota window: never a step, which would give a
  dead member's clients a fresh burst); each `ClientQuotaManager` reads its `PeerView` per charge
  (one dict lookup, and one comparison while the peers' reports are fresh);
- `UsageTracker`: what this member must send next (changed entries every sync, all every full sync).

Freshness decides the accuracy. When headroom opens, every member's clients rush into it at once,
and a member sees the others' rush only when they report; so besides the periodic syncs, a bucket
whose rate rose by URGENT_CHANGE_RATIO of its bound asks for an urgent delta report (the engine's
`on_urgent`), and a throttled bucket is listed in every delta while its client is paused (its rate
falls, and peers that kept its old rate would under-admit). With both, three greedy producers on
three members hold one quota as closely as one proxy holds three connections (test_fleet.py).

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
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .types import QuotaType

#: Payload bound: 1,280 bytes is IPv6's minimum MTU; 1,200 leaves room for IP and UDP headers on
#: any path without fragmentation (QUIC's minimum datagram size, RFC 9000 §14, for the same reason).
MAX_DATAGRAM_BYTES = 1200

#: A datagram stamped more than this far from the receiver's wall clock is refused as "stale"
#: (replays of old captures, badly skewed members). Kafka's own equivalent is a timestamp bound on
#: records (`log.message.timestamp.difference.max.ms`); here 10 s, well inside one quota window.
MAX_CLOCK_SKEW_MS = 10_000

#: A peer's entry counts at full weight for this long after its last update: three full syncs
#: (`full_sync_interval_ms` 1000), so two lost full syncs in a row change nothing.
DEFAULT_STALE_AFTER_MS = 3000

#: Peer entries kept at most (all peers and quota types together); past it the least recently
#: updated is evicted. Kafka has no such bound; ~300 bytes each, so 200,000 is about 60 MB.
DEFAULT_MAX_PEER_ENTRIES = 200_000

#: A sender is remembered (its highest sequence number, for replay protection) this long after its
#: last datagram: a captured datagram passes the skew check for at most 2 x MAX_CLOCK_SKEW_MS
#: after it was first received (sender clock ahead by the skew, receiver accepting it the skew late).
SENDER_RETENTION_MS = 2 * MAX_CLOCK_SKEW_MS

#: Shortest fleet secret accepted by `encode_usage`: 128 bits, HMAC's security for SHA-256 keys
#: shorter than the hash (RFC 2104 §3 recommends at least the hash length, 32 bytes).
MIN_SECRET_BYTES = 16

#: A report's rate changes by more than this ratio before it is sent again between full syncs
#: (Pulsar's PIP-82 resource groups suppress below 5 %; the fleet aims at 5 % accuracy, so 1 %).
DEFAULT_CHANGE_RATIO = 0.01

#: A bucket whose local rate has risen by more than this share of its bound since it was last
#: reported asks for an urgent report (`QuotaEngine.attach_fleet(on_urgent=...)`): when headroom
#: opens, every member's clients rush into it at once, and each member sees the others' rush only
#: when they report. With reports every 100 ms only, three greedy producers overshoot and then pay
#: it back in long throttles (tests/unit/test_fleet.py, last 20 s of 30 s, fitted: 0.99-1.10x the
#: quota, 0.98-1.16x with 5 % loss); with urgent reports 0.98-1.03x, as one proxy alone.
URGENT_CHANGE_RATIO = 0.05

#: Urgent reports a member sends at most one per this interval (bounds their traffic to 100
#: delta syncs a second, each only of the entries that changed).
URGENT_MIN_INTERVAL_MS = 10

#: Between full syncs, a charged bucket is listed for a delta sync only when its rate moved by more
#: than this share of its bound since it was last listed: what a peer's decision can be off by
#: (1 % of the bound per member), without resending every small wobble of a bucket far below it.
DELTA_CHANGE_OF_BOUND = 0.01

#: New producer ids a member keeps for its next report at most; past it they are not announced
#: (a peer that sees one of them later counts it again: stricter, never looser). KIP-936 expects
#: new ids to be rare; 10,000 between two syncs is a flood.
MAX_PENDING_PRODUCER_IDS = 10_000

#: Longest fleet name: Kafka's longest topic name (`Topic.MAX_NAME_LENGTH`, 249); a cluster id,
#: the default fleet name, is 22 characters.
MAX_FLEET_NAME_BYTES = 249

#: Work `PeerUsage.expire` does per call by default (entries examined).
EXPIRY_BUDGET = 4096

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
#: name -> (wire name, string-table item), kept across calls: a full sync names every bucket
#: every second, and building the items each time cost a fifth of it. Cleared past the bound.
_NAME_ITEMS: dict[str, tuple[str, bytes]] = {}
_MAX_NAME_ITEMS = 400_000
_FIXED_BYTES = _HEAD.size + _IDS.size + 1 + 2 * _COUNT16.size + _MAC_BYTES
_MIN_DATAGRAM_BYTES = _FIXED_BYTES

#: Stable wire codes of the quota types (never the enum's order).
_QUOTA_CODES: dict[QuotaType, int] = {
    QuotaType.PRODUCE: 0,
    QuotaType.FETCH: 1,
    QuotaType.REQUEST: 2,
    QuotaType.CONTROLLER_MUTATION: 3,
    QuotaType.PRODUCER_IDS: 4,
}
_QUOTAS_BY_CODE: dict[int, QuotaType] = {code: quota for quota, code in _QUOTA_CODES.items()}
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

    quota: QuotaType
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
                 secret: bytes) -> list[bytes]:
    """As many datagrams as needed (seq first_seq, first_seq+1, ...), each HMAC-SHA256 signed.

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
    items = _NAME_ITEMS
    if len(items) > _MAX_NAME_ITEMS:
        items.clear()

    def name(value: str) -> tuple[str, bytes]:
        found = items.get(value)
        if found is None:
            item = _name_item(value)
            found = items[value] = (_DIGEST_PAD + item[1:].hex() if item[0] == _DIGEST_TAG else value, item)
        return found

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


# -- what peers reported ------------------------------------------------------------------------


class _Slot:
    """One peer's latest rate for one bucket."""

    __slots__ = ("key", "rate", "sender", "updated_ms", "view")

    def __init__(self, view: PeerView, key: tuple[str, str], sender: _Sender, rate: float,
                 updated_ms: int) -> None:
        self.view = view
        self.key = key
        self.sender = sender
        self.rate = rate
        self.updated_ms = updated_ms


class PeerReports:
    """Every peer's slot for one bucket, with what the hot path needs precomputed: while no slot
    has aged past `stale_after_ms` (the usual case: peers refresh every full sync), the peers'
    rate is `total`, one comparison away (`ClientQuotaManager.record` reads it inline)."""

    __slots__ = ("fresh_until_ms", "slots", "total")

    def __init__(self, slot: _Slot, stale_after_ms: int) -> None:
        self.slots = [slot]
        self.total = slot.rate
        self.fresh_until_ms = slot.updated_ms + stale_after_ms

    def refresh(self, stale_after_ms: int) -> None:
        slots = self.slots
        self.total = sum(slot.rate for slot in slots)
        self.fresh_until_ms = min(slot.updated_ms for slot in slots) + stale_after_ms


class _Sender:
    """A member incarnation: replay protection and liveness."""

    __slots__ = ("entries", "highest_seq", "id", "last_ms")

    def __init__(self, sender_id: int, seq: int, now_ms: int) -> None:
        self.id = sender_id
        self.highest_seq = seq
        self.last_ms = now_ms
        self.entries = 0


class PeerView:
    """Peers' rates for one quota type: what a `ClientQuotaManager` asks on every recording.

    The manager holds its view, so the hot path costs one dict lookup by its bucket key (no
    enum hashing) and, for a key peers reported, one comparison while every report is fresh,
    else a loop over the peers that reported it.
    """

    __slots__ = ("_peers", "has_digests", "quota", "reports")

    def __init__(self, peers: PeerUsage, quota: QuotaType) -> None:
        self._peers = peers
        self.quota = quota
        #: (user, client-id) in wire form -> the slots of the peers reporting it
        self.reports: dict[tuple[str, str], PeerReports] = {}
        #: whether any key in digest form was ever reported (lookups then map long names)
        self.has_digests = False

    def rate(self, key: tuple[str, str], now_ms: int) -> float:
        """Sum of peers' weighted rates for bucket `key` (user, client-id)."""
        reports = self.reports.get(key)
        if reports is None:
            if not self.has_digests:
                return 0.0
            wire = (wire_name(key[0]), wire_name(key[1]))
            if wire == key:
                return 0.0
            reports = self.reports.get(wire)
            if reports is None:
                return 0.0
        if now_ms <= reports.fresh_until_ms:
            return reports.total
        peers = self._peers
        stale = peers.stale_after_ms
        total = 0.0
        for slot in reports.slots:
            age = now_ms - slot.updated_ms
            if age <= stale:
                total += slot.rate
            else:
                weight = 1.0 - (age - stale) / peers.quota_window_ms
                if weight > 0.0:
                    total += slot.rate * weight
        return total

    def weighted(self, slot: _Slot, now_ms: int) -> float:
        """One slot's rate times its weight (the rule `rate` applies inline)."""
        age = now_ms - slot.updated_ms - self._peers.stale_after_ms
        return slot.rate if age <= 0 else slot.rate * max(0.0, 1.0 - age / self._peers.quota_window_ms)

    def rates(self, now_ms: int) -> dict[tuple[str, str], float]:
        """Every reported bucket with its peers' weighted rate (for metrics; not for the hot path)."""
        return {key: self.rate(key, now_ms) for key in self.reports}

    def __len__(self) -> int:
        return len(self.reports)


class PeerUsage:
    """What peers reported, merged; the engine asks it for the peers' rate of a bucket.

    A report's entry replaces the sender's previous rate for that bucket (absolute state). An
    entry counts at full weight while it is at most `stale_after_ms` old (since its last update,
    on this member's clock), then with weight max(0, 1 - (age - stale_after_ms) / quota_window_ms):
    a dead member, and a bucket a peer stopped reporting, fade out over one quota window rather
    than vanishing. A rate of 0 is removed at once (it weighs nothing either way).
    """

    def __init__(self, quota_window_ms: int, stale_after_ms: int = DEFAULT_STALE_AFTER_MS,
                 max_entries: int = DEFAULT_MAX_PEER_ENTRIES, *, own_sender: int | None = None) -> None:
        if quota_window_ms < 1:
            raise ValueError(f"quota_window_ms must be at least 1, got {quota_window_ms}")
        if stale_after_ms < 0:
            raise ValueError(f"stale_after_ms must not be negative, got {stale_after_ms}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.quota_window_ms = quota_window_ms
        self.stale_after_ms = stale_after_ms
        self.max_entries = max_entries
        #: this member's own incarnation id: its own datagrams (a peer list naming every member,
        #: this one included) are ignored rather than counted twice
        self.own_sender = own_sender
        self._views = {quota: PeerView(self, quota) for quota in QuotaType}
        self._views_by_name = {quota._name_: view for quota, view in self._views.items()}
        #: every slot, least recently updated first (expiry and eviction take from the front)
        self._order: OrderedDict[_Slot, None] = OrderedDict()
        self._senders: dict[int, _Sender] = {}
        #: entries evicted because `max_entries` was reached (their usage dropped early)
        self.evicted = 0

    def view(self, quota: QuotaType) -> PeerView:
        """The view a quota manager keeps (see `PeerView.rate`)."""
        return self._views[quota]

    def accept(self, report: UsageReport, now_ms: int) -> None:
        """Apply a verified report (raises DatagramRejected("replayed") if seq <= the sender's highest)."""
        if report.sender == self.own_sender:
            return
        sender = self._senders.get(report.sender)
        if sender is None:
            sender = self._senders[report.sender] = _Sender(report.sender, report.seq, now_ms)
        elif report.seq <= sender.highest_seq:
            raise DatagramRejected("replayed", f"seq {report.seq} from {report.sender:#x}, "
                                               f"already at {sender.highest_seq}")
        sender.highest_seq = report.seq
        sender.last_ms = now_ms
        order = self._order
        stale_after = self.stale_after_ms
        views = self._views_by_name
        for entry in report.entries:
            quota, user, client_id, rate = entry
            view = views[quota._name_]  # an enum's own hash is a Python call
            key = (user, client_id)
            reports = view.reports.get(key)
            slot = None
            if reports is not None:
                slots = reports.slots
                if len(slots) == 1:
                    # The usual case (the bucket's connections are on one peer): refresh inline,
                    # a full sync passes here once per bucket per second.
                    only = slots[0]
                    if only.sender is sender:
                        if rate > 0.0:
                            only.rate = reports.total = rate
                            only.updated_ms = now_ms
                            reports.fresh_until_ms = now_ms + stale_after
                            order.move_to_end(only)
                        else:
                            self._remove(only)
                        continue
                else:
                    for candidate in slots:
                        if candidate.sender is sender:
                            slot = candidate
                            break
            if slot is not None and reports is not None:
                if rate > 0.0:
                    slot.rate = rate
                    slot.updated_ms = now_ms
                    order.move_to_end(slot)
                    reports.refresh(stale_after)
                else:
                    self._remove(slot)
            elif rate > 0.0:
                if len(order) >= self.max_entries and not self.expire(now_ms, budget=16):
                    self._remove(next(iter(order)))
                    self.evicted += 1
                slot = _Slot(view, key, sender, rate, now_ms)
                reports = view.reports.get(key)  # eviction may have removed it
                if reports is None:
                    view.reports[key] = PeerReports(slot, stale_after)
                else:
                    reports.slots.append(slot)
                    reports.refresh(stale_after)
                order[slot] = None
                sender.entries += 1
                if len(user) > MAX_LITERAL_NAME_BYTES or len(client_id) > MAX_LITERAL_NAME_BYTES:
                    view.has_digests = True

    def _remove(self, slot: _Slot) -> None:
        del self._order[slot]
        by_key = slot.view.reports
        reports = by_key[slot.key]
        reports.slots.remove(slot)
        if reports.slots:
            reports.refresh(self.stale_after_ms)
        else:
            del by_key[slot.key]
        slot.sender.entries -= 1

    def peer_rate(self, quota: QuotaType, user: str, client_id: str, now_ms: int) -> float:
        """Sum over peers of their weighted rates for this bucket key (see `PeerView.rate`)."""
        return self._views[quota].rate((user, client_id), now_ms)

    def sender_rates(self, quota: QuotaType, user: str, client_id: str, now_ms: int) -> dict[int, float]:
        """Each peer's weighted rate for one bucket (introspection: which member brings what)."""
        view = self._views[quota]
        reports = view.reports.get((wire_name(user), wire_name(client_id)))
        slots = reports.slots if reports is not None else []
        return {slot.sender.id: view.weighted(slot, now_ms) for slot in slots}

    def members(self, now_ms: int) -> dict[int, int]:
        """Every sender heard from within SENDER_RETENTION_MS -> ms since its last datagram."""
        return {sender.id: now_ms - sender.last_ms for sender in self._senders.values()
                if now_ms - sender.last_ms < SENDER_RETENTION_MS}

    def expire(self, now_ms: int, budget: int = EXPIRY_BUDGET) -> int:
        """Drop entries whose weight reached 0 (at most `budget` examined); returns how many went.

        Also forgets senders with no entries left once SENDER_RETENTION_MS has passed since their
        last datagram (so a restarted member's old incarnation does not linger).
        """
        limit = self.stale_after_ms + self.quota_window_ms
        order = self._order
        dropped = 0
        while order and dropped < budget:
            slot = next(iter(order))
            if now_ms - slot.updated_ms < limit:
                break
            self._remove(slot)
            dropped += 1
        gone = [sender_id for sender_id, sender in self._senders.items()
                if not sender.entries and now_ms - sender.last_ms >= SENDER_RETENTION_MS]
        for sender_id in gone:
            del self._senders[sender_id]
        return dropped

    def __len__(self) -> int:
        """Peer entries held (all peers and quota types)."""
        return len(self._order)


# -- what to send ---------------------------------------------------------------------------------


class UsageTracker:
    """What this member must send next: changed entries every sync, everything every full sync.

    Compares with what was last *sent*, so slow drift accumulates until it crosses the ratio. A
    rate that went to 0 is sent once; a bucket that disappeared from a full listing (it expired
    locally) is sent once as 0 and forgotten, so peers drop it without waiting for it to age out.
    """

    def __init__(self, change_ratio: float = DEFAULT_CHANGE_RATIO) -> None:
        if not 0.0 <= change_ratio < 1.0:
            raise ValueError(f"change_ratio must be in [0, 1), got {change_ratio}")
        self.change_ratio = change_ratio
        #: (quota name, user, client-id) -> the rate last sent
        self._sent: dict[tuple[str, str, str], float] = {}

    def due(self, current: Iterable[UsageEntry], full: bool) -> list[UsageEntry]:
        """The entries to send now. With `full`, `current` must list every live bucket; without,
        it may list only some (`QuotaEngine.local_usage(now_ms, changed_only=True)`)."""
        ratio = self.change_ratio
        out: list[UsageEntry] = []
        sent = self._sent
        if not full:
            for entry in current:
                quota, user, client_id, rate = entry
                key = (quota._name_, user, client_id)  # an enum's own hash is a Python call
                last = sent.get(key)
                if rate == 0.0:
                    if last:  # went to 0: once
                        out.append(entry)
                        sent[key] = 0.0
                elif last is None or abs(rate - last) > ratio * last:
                    out.append(entry)
                    sent[key] = rate
            return out
        # A full sync: everything with a rate, 0 once for what stopped, and what is no longer
        # listed (its bucket expired) sent as 0 if peers still hold a rate for it, then forgotten.
        listed: dict[tuple[str, str, str], float] = {}
        for entry in current:
            quota, user, client_id, rate = entry
            key = (quota._name_, user, client_id)
            last = sent.pop(key, None)
            if rate != 0.0 or last:
                out.append(entry)
            listed[key] = rate
        for (name, user, client_id), last in sent.items():
            if last:
                out.append(UsageEntry(QuotaType[name], user, client_id, 0.0))
        self._sent = listed
        return out

    def __len__(self) -> int:
        return len(self._sent)
