"""Entity settings (quotas/types.py `EntitySetting`): kept beside an entity's quotas, set through
every quota source, but never a quota. `share` is checked by one rule, with one message, whichever
source sets it."""

from __future__ import annotations

import pytest

from config.admin import apply_changes, plan_alter
from config.config_form import format_value, parse_quota_config
from config.quotas import QuotaConfigError, parse_quotas
from protocol.client_quotas import AlterEntry, AlterQuotas, QuotaOp
from quotas.engine import QuotaEngine
from quotas.entity import QuotaEntity
from quotas.fleet_streams import STREAMS
from quotas.types import CONFIG_KEYS, SETTING_RULES, EntitySetting, QuotaType

GOLD = QuotaEntity(None, "gold")
MESSAGE = "quota for client-id=gold: share = {!r} must be a number > 0"


def _alter_share(value: float, remove: bool = False) -> AlterQuotas:
    return AlterQuotas((AlterEntry((("client-id", "gold"),), (QuotaOp("share", value, remove),)),), False)


def test_share_is_a_setting_not_a_quota() -> None:
    assert "share" not in {quota.value for quota in QuotaType}
    assert CONFIG_KEYS["share"] is EntitySetting.SHARE
    assert EntitySetting.SHARE not in STREAMS, "never exchanged by the fleet"
    assert set(SETTING_RULES) == set(EntitySetting), "every setting has its one rule"


@pytest.mark.parametrize("value", [0, -1.5])
def test_share_is_refused_with_one_message_by_every_source(value: float) -> None:
    expected = MESSAGE.format(float(value))
    # the file: the value as TOML gives it
    with pytest.raises(QuotaConfigError) as file_error:
        parse_quotas({"quota": [{"client_id": "gold", "share": float(value)}]})
    # ZooKeeper and the quota topic: Kafka's config form (strings)
    with pytest.raises(QuotaConfigError) as form_error:
        parse_quota_config(GOLD, {"share": str(float(value))})
    # the admin API: AlterClientQuotas
    plan = plan_alter(_alter_share(float(value)))
    assert str(file_error.value) == str(form_error.value) == plan.results[0].error_message == expected


def test_share_is_stored_described_and_resolved_like_a_quota() -> None:
    table = parse_quotas({"quota": [{"client_id": "gold", "share": 3, "producer_byte_rate": 1000}]})
    assert table == {GOLD: {EntitySetting.SHARE: 3.0, QuotaType.PRODUCE: 1000.0}}
    stored = {"share": format_value(EntitySetting.SHARE, 3.0)}
    assert stored == {"share": "3.0"} and parse_quota_config(GOLD, stored) == {EntitySetting.SHARE: 3.0}
    plan = plan_alter(_alter_share(0.0, remove=True))
    assert apply_changes(table, plan.changes) == {GOLD: {QuotaType.PRODUCE: 1000.0}}
    engine = QuotaEngine()
    engine.set_quotas(table)
    assert engine.settings == {EntitySetting.SHARE: {GOLD: 3.0}, EntitySetting.SHADOW: {}}
    assert engine.quotas_for("", "gold") == {QuotaType.PRODUCE: 1000.0}, "not a quota"
    assert engine.capacity.tenant("u", "gold") == (("", "gold"), 3.0)


def test_share_is_refused_on_ip_entities() -> None:
    with pytest.raises(QuotaConfigError, match="share = 2 is not a setting of ip entities"):
        parse_quotas({"quota": [{"ip": "10.0.0.1", "share": 2}]})
