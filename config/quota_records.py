"""Quota changes as records of a compacted Kafka topic, signed with the fleet secret. Pure.

Why a topic: Kafka 4 has no ZooKeeper, and a fleet must agree on its quotas. Kafka Connect and Schema
Registry keep their configuration the same way, in a compacted topic of the cluster they serve.

A record is one entity's whole set of quotas, in Kafka's config form (``config_form``):

- key: the entity's path (``users/alice/clients/app``, ``ips/10.1.0.0%2F16``), UTF-8. Only the
  canonical path is accepted, so compaction keeps exactly one record per entity;
- value: the config document (``{"version":1,"config":{"producer_byte_rate":"1024"}}``), or none
  (a tombstone) when the entity has no quotas left;
- header ``kthrottle-written-at``: the writer's clock, milliseconds since the epoch, 8 bytes;
- header ``kthrottle-mac``: HMAC-SHA256 of the three above, with a key derived from the fleet secret.

One more kind of record shares the topic: key ``capacity`` (no entity path starts so) holds the
fleet's cluster capacity, the keys of a ``[capacity]`` table in the same config form (a tombstone:
none from the topic, the config file's ``[capacity]`` applies).

Why the MAC: anyone allowed to write to the topic could otherwise set any quota. Why the time: a
signed record sent again later (a replay) would bring an old value back, so a record written more
than ``REPLAY_WINDOW_MS`` before the newest one already read is refused. Writers' clocks agree far
better than that; two admins changing one entity at once are both accepted, in the topic's order.

``QuotaLog`` folds records in offset order into a quota table. A record it refuses (forged,
malformed, invalid, replayed) is reported with its offset and reason, and changes nothing: its
entity keeps its last good quotas, as with a bad ZooKeeper node.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from json import JSONDecodeError

from quotas.engine import QuotaTable
from quotas.entity import QuotaEntity
from quotas.types import ConfigKey

from .capacity import capacity_from_config_form
from .common import SettingsError
from .config_form import (
    decode_config,
    encode_config,
    entity_for_path,
    entity_path,
    format_value,
    parse_quota_config,
)
from .quotas import QuotaConfigError

MAC_HEADER = "kthrottle-mac"
WRITTEN_AT_HEADER = "kthrottle-written-at"
#: A record written this long before the newest one read is a replay (5 minutes).
REPLAY_WINDOW_MS = 300_000
_KEY_LABEL = b"kthrottle quota records v1"
#: The key of the capacity record.
CAPACITY_KEY = "capacity"
_MAC_BYTES = hashlib.sha256().digest_size


class Refusal(Enum):
    """Why a record changed nothing; the value is the metric label."""

    FORGED = "forged"  # no MAC, or one the fleet secret did not make
    MALFORMED = "malformed"  # no key, a key that is no canonical entity path, a value that is no document
    INVALID = "invalid"  # a quota Kafka would refuse (a negative rate, a key of another entity type)
    REPLAYED = "replayed"  # signed, but written long before records already read


@dataclass(frozen=True)
class Refused:
    offset: int
    reason: Refusal
    detail: str

    def describe(self) -> str:
        return f"offset {self.offset}: {self.reason.value}: {self.detail}"


@dataclass(frozen=True)
class _Accepted:
    entity: QuotaEntity
    values: dict[ConfigKey, float]
    written_at: int


@dataclass(frozen=True)
class _AcceptedCapacity:
    #: the record's keys and values as written (None: the capacity removed from the topic)
    values: dict[str, str] | None
    written_at: int


@dataclass(frozen=True)
class QuotaRecord:
    """What a writer sends: ``key``, ``value`` (None for a tombstone) and ``headers``."""

    key: bytes
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


def record_key(secret: bytes) -> bytes:
    """The MAC key, derived from the fleet secret apart from the datagrams' own use of it."""
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def _mac(mac_key: bytes, key: bytes, value: bytes | None, written_at: bytes) -> bytes:
    body = b"\x00" if value is None else b"\x01" + value
    message = len(key).to_bytes(4, "big") + key + written_at + body
    return hmac.new(mac_key, message, hashlib.sha256).digest()


def quota_record(entity: QuotaEntity, values: Mapping[ConfigKey, float], mac_key: bytes,
                 written_at_ms: int) -> QuotaRecord:
    """The record that sets ``entity``'s quotas to ``values`` (none left: a tombstone)."""
    value = (encode_config({quota_type.value: format_value(quota_type, number)
                            for quota_type, number in sorted(values.items(), key=lambda kv: kv[0].value)})
             if values else None)
    return _signed(entity_path(entity).encode("utf-8"), value, mac_key, written_at_ms)


def capacity_record(values: Mapping[str, str] | None, mac_key: bytes, written_at_ms: int) -> QuotaRecord:
    """The record that sets the fleet's capacity to ``values`` (a ``[capacity]`` table's keys, as
    strings), checked first; None or nothing left: a tombstone."""
    if values:
        capacity_from_config_form(values)
    value = encode_config(dict(sorted(values.items()))) if values else None
    return _signed(CAPACITY_KEY.encode("utf-8"), value, mac_key, written_at_ms)


def _signed(key: bytes, value: bytes | None, mac_key: bytes, written_at_ms: int) -> QuotaRecord:
    stamp = written_at_ms.to_bytes(8, "big", signed=True)
    mac = _mac(mac_key, key, value, stamp)
    return QuotaRecord(key, value, ((WRITTEN_AT_HEADER, stamp), (MAC_HEADER, mac)))


class QuotaLog:
    """The quota table that a topic's records make, read in offset order from the beginning."""

    def __init__(self, mac_key: bytes, replay_window_ms: int = REPLAY_WINDOW_MS) -> None:
        self._mac_key = mac_key
        self._replay_window_ms = replay_window_ms
        self.entities: QuotaTable = {}
        #: the capacity record's values, checked (None: no capacity in the topic)
        self.capacity: dict[str, str] | None = None
        #: The offset after the last record applied or refused: where reading goes on.
        self.next_offset = 0
        self.newest_written_at_ms: int | None = None
        self.refused: Counter[Refusal] = Counter()

    def table(self) -> QuotaTable:
        return {entity: dict(values) for entity, values in self.entities.items()}

    def apply(self, offset: int, key: bytes | None, value: bytes | None,
              headers: Sequence[tuple[str, bytes | None]]) -> Refused | None:
        """Fold one record in; what refused it, if anything."""
        self.next_offset = max(self.next_offset, offset + 1)
        outcome = self._check(key, value, headers)
        if isinstance(outcome, tuple):
            refusal, detail = outcome
            self.refused[refusal] += 1
            return Refused(offset, refusal, detail)
        if isinstance(outcome, _AcceptedCapacity):
            self.capacity = outcome.values
        elif outcome.values:
            self.entities[outcome.entity] = outcome.values
        else:
            self.entities.pop(outcome.entity, None)
        if self.newest_written_at_ms is None or outcome.written_at > self.newest_written_at_ms:
            self.newest_written_at_ms = outcome.written_at
        return None

    def _check(self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
               ) -> tuple[Refusal, str] | _Accepted | _AcceptedCapacity:
        found = {name: data for name, data in headers if name in (MAC_HEADER, WRITTEN_AT_HEADER)}
        mac, stamp = found.get(MAC_HEADER), found.get(WRITTEN_AT_HEADER)
        if key is None:
            return Refusal.MALFORMED, "no key (every record names its entity)"
        if mac is None or len(mac) != _MAC_BYTES:
            return Refusal.FORGED, f"no {MAC_HEADER} header of {_MAC_BYTES} bytes"
        if stamp is None or len(stamp) != 8:
            return Refusal.FORGED, f"no {WRITTEN_AT_HEADER} header of 8 bytes"
        if not hmac.compare_digest(mac, _mac(self._mac_key, key, value, stamp)):
            return Refusal.FORGED, f"the MAC of {key[:200]!r} was not made with the fleet secret"
        written_at = int.from_bytes(stamp, "big", signed=True)
        try:
            path = key.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Refusal.MALFORMED, f"key {key[:200]!r}: {exc}"
        newest = self.newest_written_at_ms
        if newest is not None and written_at < newest - self._replay_window_ms:
            window = self._replay_window_ms
            return Refusal.REPLAYED, (f"{path} written at {written_at} ms, more than {window} ms before "
                                      f"a record already read ({newest} ms)")
        if path == CAPACITY_KEY:
            return self._check_capacity(value, written_at)
        try:
            entity = entity_for_path(path)
        except ValueError as exc:
            return Refusal.MALFORMED, f"key {key[:200]!r}: {exc}"
        if entity_path(entity) != path:
            return Refusal.MALFORMED, f"key {path!r} is not the canonical path {entity_path(entity)!r}"
        try:
            values = parse_quota_config(entity, decode_config(value))
        except (UnicodeDecodeError, JSONDecodeError, ValueError) as exc:
            if isinstance(exc, QuotaConfigError):
                return Refusal.INVALID, str(exc)
            return Refusal.MALFORMED, f"{path}: the value is not a config document: {exc}"
        return _Accepted(entity, values, written_at)

    @staticmethod
    def _check_capacity(value: bytes | None, written_at: int) -> tuple[Refusal, str] | _AcceptedCapacity:
        if value is None:
            return _AcceptedCapacity(None, written_at)
        try:
            config = decode_config(value)
        except (UnicodeDecodeError, JSONDecodeError, ValueError) as exc:
            return Refusal.MALFORMED, f"{CAPACITY_KEY}: the value is not a config document: {exc}"
        values = {str(k): str(v) for k, v in config.items()}
        try:
            capacity_from_config_form(values)
        except SettingsError as exc:
            return Refusal.INVALID, f"{CAPACITY_KEY}: {exc}"
        return _AcceptedCapacity(values, written_at)
