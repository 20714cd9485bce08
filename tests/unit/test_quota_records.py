"""Quota records of the compacted topic (config/quota_records.py): signed, folded in offset order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from config.quota_records import (
    MAC_HEADER,
    REPLAY_WINDOW_MS,
    WRITTEN_AT_HEADER,
    QuotaLog,
    QuotaRecord,
    Refusal,
    quota_record,
    record_key,
)
from quotas.entity import DEFAULT, QuotaEntity
from quotas.types import EntitySetting, QuotaType

KEY = record_key(b"a fleet secret of 32 bytes......")
ALICE = QuotaEntity("alice", "app")
T0 = 1_800_000_000_000


def _apply(log: QuotaLog, offset: int, record: QuotaRecord) -> object:
    return log.apply(offset, record.key, record.value, list(record.headers))


names = st.one_of(st.just(DEFAULT), st.text(min_size=1, max_size=12))
entities = st.one_of(names.map(lambda user: QuotaEntity(user, None)),
                     names.map(lambda client: QuotaEntity(None, client)),
                     st.tuples(names, names).map(lambda both: QuotaEntity(*both)))
rates = st.dictionaries(st.sampled_from([QuotaType.PRODUCE, QuotaType.FETCH]),
                        st.integers(1, 2**40).map(float), max_size=2)
doubles = st.dictionaries(
    st.sampled_from([QuotaType.REQUEST, QuotaType.CONTROLLER_MUTATION, EntitySetting.SHARE]),
    st.floats(1e-3, 1e9, allow_nan=False), max_size=3)


@given(entities, rates, doubles)
def test_what_a_writer_signs_every_member_reads_back(entity: QuotaEntity, byte_rates: dict[QuotaType, float],
                                                     others: dict[QuotaType, float]) -> None:
    values = {**byte_rates, **others}
    log = QuotaLog(KEY)
    assert _apply(log, 7, quota_record(entity, values, KEY, T0)) is None
    assert log.table() == ({entity: values} if values else {})
    assert log.next_offset == 8


def test_ip_entities_and_share_are_records_too() -> None:
    log = QuotaLog(KEY)
    subnet = QuotaEntity(None, None, "10.1.0.0/16")
    record = quota_record(subnet, {QuotaType.CONNECTION_CREATION: 20.0}, KEY, T0)
    assert record.key == b"ips/10.1.0.0%2F16"
    assert _apply(log, 0, record) is None
    gold = quota_record(QuotaEntity(None, "gold"), {EntitySetting.SHARE: 3.0}, KEY, T0)
    assert _apply(log, 1, gold) is None
    assert log.table() == {subnet: {QuotaType.CONNECTION_CREATION: 20.0},
                           QuotaEntity(None, "gold"): {EntitySetting.SHARE: 3.0}}


def test_the_value_is_kafkas_config_form() -> None:
    record = quota_record(ALICE, {QuotaType.PRODUCE: 1024.0, QuotaType.REQUEST: 50.0}, KEY, T0)
    assert record.key == b"users/alice/clients/app"
    assert record.value == b'{"version":1,"config":{"producer_byte_rate":"1024","request_percentage":"50.0"}}'


def test_a_tombstone_removes_the_entity() -> None:
    log = QuotaLog(KEY)
    _apply(log, 0, quota_record(ALICE, {QuotaType.PRODUCE: 1024.0}, KEY, T0))
    tombstone = quota_record(ALICE, {}, KEY, T0 + 1)
    assert tombstone.value is None
    assert _apply(log, 1, tombstone) is None
    assert log.table() == {}


@given(st.integers(0, 10_000), st.sampled_from(["key", "value", MAC_HEADER, WRITTEN_AT_HEADER]))
def test_any_bit_changed_and_the_record_is_refused_as_forged(bit: int, where: str) -> None:
    record = quota_record(ALICE, {QuotaType.PRODUCE: 1024.0}, KEY, T0)

    def flip(data: bytes) -> bytes:
        index = bit % (len(data) * 8)
        return data[: index // 8] + bytes([data[index // 8] ^ (1 << index % 8)]) + data[index // 8 + 1 :]

    assert record.value is not None
    key = flip(record.key) if where == "key" else record.key
    value = flip(record.value) if where == "value" else record.value
    headers = [(name, flip(data) if name == where else data) for name, data in record.headers]
    log = QuotaLog(KEY)
    refused = log.apply(3, key, value, headers)
    assert refused is not None and refused.reason is Refusal.FORGED and refused.offset == 3
    assert log.table() == {} and log.refused[Refusal.FORGED] == 1


def test_another_secret_forges_nothing() -> None:
    log = QuotaLog(KEY)
    stranger = record_key(b"not the fleet's secret, 32 bytes")
    refused = _apply(log, 0, quota_record(ALICE, {QuotaType.PRODUCE: 1.0}, stranger, T0))
    assert refused is not None and refused.reason is Refusal.FORGED  # type: ignore[attr-defined]
    unsigned = log.apply(1, b"users/alice", b'{"version":1,"config":{"producer_byte_rate":"1"}}', [])
    assert unsigned is not None and unsigned.reason is Refusal.FORGED
    assert "kthrottle-mac" in unsigned.describe()


def test_a_replayed_old_record_does_not_bring_its_value_back() -> None:
    log = QuotaLog(KEY)
    old = quota_record(ALICE, {QuotaType.PRODUCE: 100.0}, KEY, T0)
    _apply(log, 0, old)
    _apply(log, 1, quota_record(ALICE, {QuotaType.PRODUCE: 200.0}, KEY, T0 + REPLAY_WINDOW_MS + 1))
    refused = _apply(log, 2, old)
    assert refused is not None and refused.reason is Refusal.REPLAYED  # type: ignore[attr-defined]
    assert log.table() == {ALICE: {QuotaType.PRODUCE: 200.0}}


def test_two_admins_at_once_the_topics_order_decides_whatever_their_clocks() -> None:
    log = QuotaLog(KEY)
    _apply(log, 0, quota_record(ALICE, {QuotaType.PRODUCE: 100.0}, KEY, T0 + 900))
    assert _apply(log, 1, quota_record(ALICE, {QuotaType.PRODUCE: 200.0}, KEY, T0)) is None  # a slower clock
    assert log.table() == {ALICE: {QuotaType.PRODUCE: 200.0}}


def test_an_invalid_quota_keeps_the_entitys_last_good_values() -> None:
    log = QuotaLog(KEY)
    _apply(log, 0, quota_record(ALICE, {QuotaType.PRODUCE: 100.0}, KEY, T0))
    bad = quota_record(ALICE, {QuotaType.PRODUCE: -5.0}, KEY, T0 + 1)
    refused = _apply(log, 1, bad)
    assert refused is not None and refused.reason is Refusal.INVALID  # type: ignore[attr-defined]
    assert "producer_byte_rate" in refused.detail  # type: ignore[attr-defined]
    assert log.table() == {ALICE: {QuotaType.PRODUCE: 100.0}}


def test_a_second_spelling_of_one_entity_is_malformed() -> None:
    """Compaction keeps a record per key: two keys for one entity would both survive."""
    log = QuotaLog(KEY)
    record = quota_record(QuotaEntity("alice", None), {QuotaType.PRODUCE: 1.0}, KEY, T0)
    respelled = b"users/%61lice"
    from config.quota_records import _mac  # the writer's own signing, over the other spelling
    stamp = dict(record.headers)[WRITTEN_AT_HEADER]
    headers = [(WRITTEN_AT_HEADER, stamp), (MAC_HEADER, _mac(KEY, respelled, record.value, stamp))]
    refused = log.apply(0, respelled, record.value, headers)
    assert refused is not None and refused.reason is Refusal.MALFORMED
    assert "canonical" in refused.detail


@given(st.one_of(st.none(), st.binary(max_size=64)), st.one_of(st.none(), st.binary(max_size=64)),
       st.lists(st.tuples(st.sampled_from([MAC_HEADER, WRITTEN_AT_HEADER, "x"]),
                          st.one_of(st.none(), st.binary(max_size=40))), max_size=4))
def test_any_bytes_are_refused_with_a_reason_never_an_exception(
        key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes | None]]) -> None:
    log = QuotaLog(KEY)
    refused = log.apply(5, key, value, headers)
    assert refused is not None and refused.offset == 5 and refused.detail
    assert log.table() == {} and log.next_offset == 6


# -- the capacity record ---------------------------------------------------------------------------


def test_the_capacity_record_is_its_own_kind_beside_the_entities() -> None:
    from config.quota_records import CAPACITY_KEY, capacity_record

    log = QuotaLog(KEY)
    assert _apply(log, 0, quota_record(ALICE, {QuotaType.PRODUCE: 1024.0}, KEY, T0)) is None
    record = capacity_record({"produce_byte_rate": "500000", "adaptive": "true"}, KEY, T0 + 1)
    assert record.key == CAPACITY_KEY.encode()
    assert _apply(log, 1, record) is None
    assert log.capacity == {"adaptive": "true", "produce_byte_rate": "500000"}
    assert log.table() == {ALICE: {QuotaType.PRODUCE: 1024.0}}  # no entity made of it
    assert _apply(log, 2, capacity_record(None, KEY, T0 + 2)) is None  # a tombstone
    assert log.capacity is None


def test_a_bad_or_forged_capacity_record_changes_nothing() -> None:
    import json

    from config.quota_records import CAPACITY_KEY, _signed, capacity_record

    log = QuotaLog(KEY)
    assert _apply(log, 0, capacity_record({"produce_byte_rate": "500000"}, KEY, T0)) is None
    invalid = _signed(CAPACITY_KEY.encode(), json.dumps(
        {"version": 1, "config": {"produce_byte_rate": "-5"}}).encode(), KEY, T0 + 1)
    refused = _apply(log, 1, invalid)
    assert refused is not None and refused.reason is Refusal.INVALID and "produce_byte_rate" in refused.detail
    other = record_key(b"another secret of 32 bytes......")
    forged = capacity_record({"produce_byte_rate": "1"}, other, T0 + 2)
    refused = _apply(log, 2, forged)
    assert refused is not None and refused.reason is Refusal.FORGED
    assert log.capacity == {"produce_byte_rate": "500000"}


def test_a_capacity_a_table_would_refuse_is_not_written() -> None:
    import pytest

    from config.common import SettingsError
    from config.quota_records import capacity_record

    for values in ({"adaptive": "yes"}, {"produce_byte_rate": "fast"}, {"min_fraction": "0.5"}):
        with pytest.raises(SettingsError):
            capacity_record(values, KEY, T0)
