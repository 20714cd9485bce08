"""Shadow mode (quotas/shadow.py): the same arithmetic as enforcing, reported and never applied."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config.admin import plan_alter
from config.config_form import format_value, parse_quota_config
from config.quotas import QuotaConfigError, parse_quotas
from config.settings import SettingsError, load_settings
from protocol.client_quotas import AlterEntry, AlterQuotas, QuotaOp
from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import DEFAULT, QuotaEntity
from quotas.shadow import ShadowLog, ShadowPolicy, validate_shadow
from quotas.types import EntitySetting, QuotaType

ETL = QuotaEntity(None, "etl")
QUOTA = 10_000.0
T0 = 1_000_000


def _engine(*, shadow_entity: bool = False, everything: bool = False) -> QuotaEngine:
    engine = QuotaEngine(EngineConfig(shadow=everything))
    values: dict[QuotaType | EntitySetting, float] = {QuotaType.PRODUCE: QUOTA, QuotaType.FETCH: QUOTA,
                                                      QuotaType.CONTROLLER_MUTATION: 1.0}
    if shadow_entity:
        values[EntitySetting.SHADOW] = 1.0
    engine.set_quotas({ETL: values})
    return engine


def _alter_shadow(value: float) -> AlterQuotas:
    return AlterQuotas((AlterEntry((("client-id", "etl"),), (QuotaOp("shadow", value, False),)),), False)


@pytest.mark.parametrize(("value", "kept"), [(True, 1.0), (False, 0.0), (1, 1.0), (0, 0.0), (1.0, 1.0)])
def test_shadow_is_true_or_false(value: object, kept: float) -> None:
    assert validate_shadow(value, "here") == kept


@pytest.mark.parametrize("value", [2, 0.5, -1, "true", None])
def test_other_shadow_values_are_refused_naming_the_entity_key_and_value(value: object) -> None:
    message = f"quota for client-id=etl: shadow = {value!r} must be true or false (1 or 0)"
    with pytest.raises(QuotaConfigError) as file_error:
        parse_quotas({"quota": [{"client_id": "etl", "shadow": value}]})
    assert str(file_error.value) == message


def test_every_source_sets_shadow_the_same_way() -> None:
    parsed = parse_quotas({"quota": [{"client_id": "etl", "shadow": True}]})
    assert parsed == {ETL: {EntitySetting.SHADOW: 1.0}}
    # ZooKeeper and the quota topic keep Kafka's config form: doubles written as strings
    assert format_value(EntitySetting.SHADOW, 1.0) == "1.0"
    assert parse_quota_config(ETL, {"shadow": "1.0"}) == {EntitySetting.SHADOW: 1.0}
    assert parse_quota_config(ETL, {"shadow": "0.0"}) == {EntitySetting.SHADOW: 0.0}
    with pytest.raises(QuotaConfigError, match=r"shadow = 2\.0 must be true or false"):
        parse_quota_config(ETL, {"shadow": "2"})
    # the admin API: kafka-configs --alter --add-config shadow=1 (a double)
    plan = plan_alter(_alter_shadow(1.0))
    assert plan.results[0].error_message is None and plan.changes == {ETL: {EntitySetting.SHADOW: 1.0}}
    refused = plan_alter(_alter_shadow(3.0))
    assert refused.results[0].error_message == \
        "quota for client-id=etl: shadow = 3.0 must be true or false (1 or 0)"


def test_shadow_is_not_a_setting_of_ip_entities() -> None:
    with pytest.raises(QuotaConfigError, match="shadow = True is not a setting of ip entities"):
        parse_quotas({"quota": [{"ip": "10.0.0.1", "shadow": True}]})


def test_the_proxy_wide_setting_is_a_boolean(tmp_path: Path) -> None:
    path = tmp_path / "kthrottle.toml"
    path.write_text("[proxy]\nshadow = true\n")
    assert load_settings(path).shadow is True
    path.write_text('[proxy]\nshadow = "yes"\n')
    with pytest.raises(SettingsError, match=r"proxy\.shadow = 'yes' must be true or false"):
        load_settings(path)


def test_the_most_specific_entity_that_sets_shadow_decides() -> None:
    policy = ShadowPolicy()
    assert not policy.active and not policy.shadowed("alice", "etl")
    policy.set_entities({QuotaEntity(DEFAULT, None): 1.0, QuotaEntity("alice", "etl"): 0.0,
                         QuotaEntity(None, "batch"): 1.0})
    assert policy.shadowed("bob", "anything"), "user <default> covers every user"
    assert not policy.shadowed("alice", "etl"), "alice's etl is enforced again"
    assert policy.shadowed("alice", "other")
    policy.set_entities({QuotaEntity(None, "batch"): 1.0})
    assert policy.shadowed("bob", "batch") and not policy.shadowed("bob", "anything"), "a change is live"
    assert ShadowPolicy(everything=True).shadowed("anyone", "")
    policy.set_entities({QuotaEntity(None, None, client_id_prefix="etl-"): 1.0})
    assert policy.shadowed("bob", "etl-7") and not policy.shadowed("bob", "et"), "prefixes resolve too"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 30_000)), min_size=1, max_size=80))
def test_shadow_computes_exactly_the_throttles_enforcing_gives(steps: list[tuple[int, int]]) -> None:
    """The same Produce traffic through an enforcing engine and one in shadow: every throttle the
    enforcing one applies, the shadow one reports (shadow_ms) and never applies (throttle_ms 0)."""
    enforced, shadow = _engine(), _engine(shadow_entity=True)
    now = T0
    for gap_ms, size in steps:
        now += gap_ms
        applied = enforced.charge("", "etl", now, produce_bytes=size)
        reported = shadow.charge("", "etl", now, produce_bytes=size)
        assert reported.throttle_ms == 0
        assert reported.shadow_ms == applied.throttle_ms
        assert shadow.hold_ms("", "etl", 0, now) == 0
    bucket = next(iter(shadow.managers[QuotaType.PRODUCE].buckets.values()))
    twin = next(iter(enforced.managers[QuotaType.PRODUCE].buckets.values()))
    assert (bucket.shadow_throttle_count, bucket.shadow_throttle_total_ms) == (twin.throttle_count,
                                                                               twin.throttle_total_ms)
    assert bucket.throttle_count == 0


def test_a_throttled_fetch_keeps_its_records_and_its_charge_in_shadow() -> None:
    enforced, shadow = _engine(), _engine(shadow_entity=True)
    for engine in (enforced, shadow):
        assert engine.fetch_max_bytes("", "etl") == (None if engine is shadow else 100_000)
    applied = enforced.charge("", "etl", T0, fetch_bytes=500_000)
    reported = shadow.charge("", "etl", T0, fetch_bytes=500_000)
    assert applied.throttle_ms > 0 and not applied.deliver_fetch
    assert (reported.throttle_ms, reported.shadow_ms) == (0, applied.throttle_ms)
    # delivered in shadow, so it stays charged: the next fetch would be throttled longer
    assert enforced.charge("", "etl", T0 + 1, fetch_bytes=1).throttle_ms < \
        shadow.charge("", "etl", T0 + 1, fetch_bytes=1).shadow_ms


def test_a_strict_mutation_over_its_quota_goes_ahead_in_shadow() -> None:
    enforced, shadow = _engine(), _engine(shadow_entity=True)
    refused = enforced.charge_mutations("", "etl", [20, 20], True, T0)
    passed = shadow.charge_mutations("", "etl", [20, 20], True, T0)
    assert refused.accepted == (True, False) and refused.throttle_ms > 0
    assert passed.accepted == (True, True) and passed.throttle_ms == 0
    entries, dropped = shadow.shadow_log.take()
    assert [(e.client_id, e.what, e.decisions) for e in entries] == [("etl", "controller_mutation_rate", 1)]
    assert entries[0].largest_ms > 0 and dropped == 0


def test_shadow_throttles_are_reported_apart_in_usage_and_log() -> None:
    from quotas.usage import UsageAccount

    engine = _engine(everything=True)
    engine.usage = UsageAccount(0)
    throttles = [engine.charge("", "etl", T0 + i, produce_bytes=200_000).shadow_ms for i in range(3)]
    usage = engine.usage.take(T0 + 10).entities[("", "etl")]
    assert usage.throttles == {} and usage.shadow_throttles == {QuotaType.PRODUCE: [3, sum(throttles)]}
    entries, _ = engine.shadow_log.take()
    assert [(e.what, e.largest_ms, e.decisions) for e in entries] == \
        [("producer_byte_rate", max(throttles), 3)]
    assert engine.shadow_log.take() == ([], 0), "a take empties the log"


def test_switching_an_entity_to_enforce_is_live() -> None:
    engine = _engine(shadow_entity=True)
    assert engine.charge("", "etl", T0, produce_bytes=500_000).throttle_ms == 0
    engine.set_quotas({ETL: {QuotaType.PRODUCE: QUOTA, EntitySetting.SHADOW: 0.0}})
    assert engine.hold_ms("", "etl", 0, T0 + 1) == 0, "a throttle reported in shadow is never applied"
    verdict = engine.charge("", "etl", T0 + 1, produce_bytes=1)
    assert verdict.throttle_ms > 0 and verdict.shadow_ms == 0, "its history counts: the same arithmetic"


def test_the_shadow_log_is_bounded() -> None:
    log = ShadowLog(max_entries=2)
    for client in ("a", "b", "c", "c"):
        log.add("", client, "producer_byte_rate", 10)
    log.add("", "a", "producer_byte_rate", 30)
    entries, dropped = log.take()
    assert [(e.client_id, e.largest_ms, e.decisions) for e in entries] == [("a", 30, 2), ("b", 10, 1)]
    assert dropped == 2
