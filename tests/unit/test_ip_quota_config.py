"""KIP-612 `ip` entities in every quota source (the quota file, the admin API, ZooKeeper's layout) and
the client-address keys of `[proxy]`, each refused with a message naming entity, key and value."""

from __future__ import annotations

import ipaddress
import math
from pathlib import Path

import pytest

from config.admin import INVALID_REQUEST, apply_changes, describe, plan_alter
from config.client_addresses import parse_client_addresses
from config.common import SettingsError
from config.config_form import entity_for_path, entity_path, format_value
from config.quotas import QuotaConfigError, load_quota_file, parse_quotas
from config.settings import load_settings
from config.store import render
from protocol.client_quotas import (
    MATCH_DEFAULT,
    MATCH_EXACT,
    MATCH_SPECIFIED,
    AlterEntry,
    AlterQuotas,
    DescribeQuotas,
    FilterComponent,
    QuotaOp,
)
from quotas.entity import DEFAULT, QuotaEntity
from quotas.types import QuotaType

C = QuotaType.CONNECTION_CREATION
P = QuotaType.PRODUCE


def ip(name: str) -> QuotaEntity:
    return QuotaEntity(None, None, name)


def test_the_quota_file_takes_addresses_prefixes_and_the_default_in_canonical_form() -> None:
    table = parse_quotas({"quota": [
        {"ip": "10.1.2.3", "connection_creation_rate": 20},
        {"ip": "10.1.2.0/24", "connection_creation_rate": 50},
        {"ip": "2001:DB8::/32", "connection_creation_rate": 5},
        {"ip": "::ffff:10.9.9.9", "connection_creation_rate": 7},
        {"ip": "<default>", "connection_creation_rate": 100},
        {"user": "alice", "producer_byte_rate": 1024},
    ]})
    assert table == {
        ip("10.1.2.3"): {C: 20.0}, ip("10.1.2.0/24"): {C: 50.0}, ip("2001:db8::/32"): {C: 5.0},
        ip("10.9.9.9"): {C: 7.0}, ip(DEFAULT): {C: 100.0}, QuotaEntity("alice", None): {P: 1024.0},
    }


def test_render_writes_ip_entities_that_read_back_the_same(tmp_path: Path) -> None:
    table = {ip("10.1.2.0/24"): {C: 50.0}, ip(DEFAULT): {C: 3.0}, QuotaEntity("bob", "app"): {P: 10.0}}
    path = tmp_path / "quotas.toml"
    path.write_text(render(table))
    assert 'ip = "10.1.2.0/24"' in path.read_text()
    assert load_quota_file(path) == table


@pytest.mark.parametrize(("entry", "says"), [
    ({"ip": "10.1.2.3", "producer_byte_rate": 1024}, "producer_byte_rate = 1024 is not a quota of ip"),
    ({"user": "u", "connection_creation_rate": 5}, "connection_creation_rate = 5 is not a quota of user"),
    ({"ip": "10.1.2.3", "user": "u", "connection_creation_rate": 5}, "cannot be combined with user"),
    ({"ip": "10.1.2.0/33", "connection_creation_rate": 5}, "'10.1.2.0/33' is not a valid CIDR prefix"),
    ({"ip": "10.1.2.3/24", "connection_creation_rate": 5}, "'10.1.2.3/24' is not a valid CIDR prefix"),
    ({"ip": "kafka.example", "connection_creation_rate": 5}, "'kafka.example' is not an IP address"),
    ({"ip": "10.1.2.3", "connection_creation_rate": 0}, "must be greater than 0"),
    ({"ip": "10.1.2.3", "connection_creation_rate": math.nan}, "must be greater than 0"),
    ({"ip": "10.1.2.3", "connection_creation_rate": 2.5}, "cannot be a fractional value"),
    ({"ip": "10.1.2.3", "connection_creation_rate": "10"}, "must be a number"),
    ({"ip": "10.1.2.3", "connection_creation_rate": 2**31}, "too large for an INT"),
    ({"ip": "", "connection_creation_rate": 1}, "ip = '' must be a non-empty string"),
])
def test_the_quota_file_refuses_bad_ip_entities_naming_them(entry: dict[str, object], says: str) -> None:
    with pytest.raises(QuotaConfigError) as refused:
        parse_quotas({"quota": [entry]})
    assert says in str(refused.value)


def test_the_same_ip_entity_written_two_ways_is_given_twice() -> None:
    with pytest.raises(QuotaConfigError, match=r"ip=10\.0\.0\.1 is given twice"):
        parse_quotas({"quota": [{"ip": "10.0.0.1", "connection_creation_rate": 1},
                                {"ip": "::ffff:10.0.0.1", "connection_creation_rate": 2}]})


def alter(*entries: tuple[tuple[tuple[str, str | None], ...], tuple[QuotaOp, ...]]) -> AlterQuotas:
    return AlterQuotas(tuple(AlterEntry(entity, ops) for entity, ops in entries), validate_only=False)


def test_kafka_configs_entity_type_ips_alters_named_and_default_entities() -> None:
    plan = plan_alter(alter(
        ((("ip", "10.1.2.3"),), (QuotaOp("connection_creation_rate", 10.0, False),)),
        ((("ip", None),), (QuotaOp("connection_creation_rate", 30.0, False),)),
        ((("ip", "10.2.0.0/16"),), (QuotaOp("connection_creation_rate", 4.0, False),)),
    ))
    assert [r.error_code for r in plan.results] == [0, 0, 0]
    table = apply_changes({}, plan.changes)
    assert table == {ip("10.1.2.3"): {C: 10.0}, ip(DEFAULT): {C: 30.0}, ip("10.2.0.0/16"): {C: 4.0}}
    removed = apply_changes(table, plan_alter(alter(
        ((("ip", "10.1.2.3"),), (QuotaOp("connection_creation_rate", 0.0, True),)))).changes)
    assert ip("10.1.2.3") not in removed and removed[ip(DEFAULT)] == {C: 30.0}


TABLE = {
    ip("10.1.2.3"): {C: 10.0}, ip(DEFAULT): {C: 30.0}, ip("10.2.0.0/16"): {C: 4.0},
    QuotaEntity("alice", None): {P: 1024.0}, QuotaEntity(None, DEFAULT): {P: 2048.0},
}


def names(request: DescribeQuotas) -> list[tuple[tuple[str, str | None], ...]]:
    return [entry.entity for entry in describe(TABLE, request)]


def test_describe_matches_ip_components_as_the_broker_does() -> None:
    exact = DescribeQuotas((FilterComponent("ip", MATCH_EXACT, "10.1.2.3"),), strict=False)
    assert names(exact) == [(("ip", "10.1.2.3"),)]
    written_otherwise = DescribeQuotas((FilterComponent("ip", MATCH_EXACT, "::ffff:10.1.2.3"),), strict=False)
    assert names(written_otherwise) == [(("ip", "10.1.2.3"),)]
    default = DescribeQuotas((FilterComponent("ip", MATCH_DEFAULT, None),), strict=False)
    assert names(default) == [(("ip", None),)]
    every_ip = DescribeQuotas((FilterComponent("ip", MATCH_SPECIFIED, None),), strict=False)
    assert sorted(names(every_ip), key=str) == sorted(
        [(("ip", None),), (("ip", "10.1.2.3"),), (("ip", "10.2.0.0/16"),)], key=str)
    users_only = DescribeQuotas((FilterComponent("user", MATCH_SPECIFIED, None),), strict=False)
    assert names(users_only) == [(("user", "alice"),)]
    everything = DescribeQuotas((), strict=False)
    assert len(names(everything)) == len(TABLE)
    entry = describe(TABLE, exact)[0]
    assert entry.values == (("connection_creation_rate", 10.0),)


def test_describe_refuses_an_ip_component_beside_a_user_component() -> None:
    from config.admin import AdminError

    request = DescribeQuotas((FilterComponent("ip", MATCH_SPECIFIED, None),
                              FilterComponent("user", MATCH_SPECIFIED, None)), strict=False)
    with pytest.raises(AdminError) as refused:
        describe(TABLE, request)
    assert refused.value.code == INVALID_REQUEST and "IP filter component" in refused.value.message


@pytest.mark.parametrize(("entity", "path"), [
    (ip("10.1.2.3"), "ips/10.1.2.3"),
    (ip(DEFAULT), "ips/<default>"),
    (ip("2001:db8::1"), "ips/2001:db8::1"),
    (ip("10.2.0.0/16"), "ips/10.2.0.0%2F16"),
])
def test_zookeeper_paths_are_kafkas_for_ips(entity: QuotaEntity, path: str) -> None:
    assert entity_path(entity) == path
    assert entity_for_path(path) == entity


def test_zookeeper_stores_connection_creation_rate_as_kafka_writes_an_int() -> None:
    assert format_value(C, 20.0) == "20"
    with pytest.raises(ValueError):
        entity_for_path("ips/not-an-ip")


def test_client_address_settings_parse_and_refuse_naming_the_key(tmp_path: Path) -> None:
    settings = parse_client_addresses({
        "max_connection_creation_rate": 200, "listener_max_connection_creation_rate": 50,
        "max_connections_per_ip_overrides": "10.0.0.7:500,10.2.0.0/16:20",
        "proxy_protocol": "v1,v2", "proxy_protocol_trusted": ["127.0.0.1/32", "10.0.0.0/8"],
    })
    assert settings.max_connections_per_ip_overrides == {"10.0.0.7": 500, "10.2.0.0/16": 20}
    assert settings.proxy_protocol == frozenset({1, 2})
    assert settings.trusts("10.3.4.5") and settings.trusts("::ffff:127.0.0.1")
    assert not settings.trusts("127.0.0.2")
    assert settings.proxy_protocol_trusted[1] == ipaddress.ip_network("10.0.0.0/8")
    table = parse_client_addresses({"max_connections_per_ip_overrides": {"10.0.0.7": 3}})
    assert table.max_connections_per_ip_overrides == {"10.0.0.7": 3}
    for values, says in [
        ({"max_connection_creation_rate": 0}, "proxy.max_connection_creation_rate = 0"),
        ({"listener_max_connection_creation_rate": 1.5}, "proxy.listener_max_connection_creation_rate = 1.5"),
        ({"max_connections_per_ip_overrides": "10.0.0.7"}, "'10.0.0.7' is not host:count"),
        ({"max_connections_per_ip_overrides": {"10.0.0.7": -1}}, "must be an integer >= 0"),
        ({"proxy_protocol": "v3", "proxy_protocol_trusted": ["10.0.0.0/8"]}, "proxy.proxy_protocol = 'v3'"),
        ({"proxy_protocol": "v2"}, "proxy_protocol_trusted is empty"),
        ({"proxy_protocol": "v2", "proxy_protocol_trusted": ["10.0.0.1/8"]}, "'10.0.0.1/8' is not an"),
        ({"proxy_protocol_trusted": ["10.0.0.0/8"]}, "proxy.proxy_protocol is not"),
    ]:
        with pytest.raises(SettingsError) as refused:
            parse_client_addresses(values)
        assert says in str(refused.value), (values, str(refused.value))
    config = tmp_path / "kthrottle.toml"
    config.write_text('[proxy]\nproxy_protocol = "v2"\nproxy_protocol_trusted = ["127.0.0.1"]\n'
                      "listener_max_connection_creation_rate = 40\n")
    loaded = load_settings(config)
    assert loaded.client_addresses.proxy_protocol == frozenset({2})
    assert loaded.client_addresses.listener_max_connection_creation_rate == 40
