"""What a read of the quota znodes means (config/zookeeper_tree.py), without a ZooKeeper: the rules
tests/integration/test_zookeeper.py checks end to end, one at a time."""

from __future__ import annotations

import logging

import pytest

from config.config_form import encode_config
from config.zookeeper_tree import QuotaTree, altered_config
from quotas.entity import QuotaEntity
from quotas.types import QuotaType

PRODUCE = QuotaType.PRODUCE
FETCH = QuotaType.FETCH
ETL = QuotaEntity(None, "etl")


def _tree() -> QuotaTree:
    return QuotaTree("zk:2181", "/config")


def test_each_entity_node_becomes_its_quotas() -> None:
    table = _tree().table({"clients/etl": encode_config({"producer_byte_rate": "1000.0"}),
                           "users/alice/clients/<default>": encode_config({"consumer_byte_rate": "50.0"}),
                           "users/alice": b""}, {})
    assert table == {ETL: {PRODUCE: 1000.0}, QuotaEntity("alice", "<default>"): {FETCH: 50.0}}


def test_invalid_data_keeps_the_last_good_quotas_and_names_the_entity_once(
        caplog: pytest.LogCaptureFixture) -> None:
    tree = _tree()
    good = tree.table({"clients/etl": encode_config({"producer_byte_rate": "1000.0"})}, {})
    bad = {"clients/etl": encode_config({"producer_byte_rate": "-5"})}
    with caplog.at_level(logging.ERROR, logger="kthrottle.config.zookeeper"):
        assert tree.table(bad, good) == good
        assert tree.table(bad, good) == good  # the same data again: not reported again
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 1, errors
    assert "client-id=etl" in errors[0] and "producer_byte_rate" in errors[0] and "keeping" in errors[0]


def test_invalid_data_for_a_new_entity_gives_it_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="kthrottle.config.zookeeper"):
        assert _tree().table({"clients/etl": b"not json"}, {}) == {}
    assert "not Kafka's config JSON" in caplog.text and "no last good quotas" in caplog.text


def test_a_node_that_disappears_takes_its_entity_out() -> None:
    tree = _tree()
    last = tree.table({"clients/etl": encode_config({"producer_byte_rate": "1000.0"})}, {})
    assert tree.table({}, last) == {}


def test_a_path_outside_the_layout_is_ignored_and_the_rest_still_read(
        caplog: pytest.LogCaptureFixture) -> None:
    nodes = {"users/a/b/c/d": b"", "clients/etl": encode_config({"producer_byte_rate": "9.0"})}
    with caplog.at_level(logging.ERROR, logger="kthrottle.config.zookeeper"):
        table = _tree().table(nodes, {})
    assert table == {ETL: {PRODUCE: 9.0}}
    assert "users/a/b/c/d" in caplog.text


def test_an_entity_named_twice_keeps_its_canonical_node() -> None:
    # "etl%2Dx" and "etl-x" both desanitize to client id etl-x; Kafka writes only the canonical form
    table = _tree().table({"clients/etl-x": encode_config({"producer_byte_rate": "1.0"}),
                           "clients/etl%2Dx": encode_config({"producer_byte_rate": "2.0"})}, {})
    assert table == {QuotaEntity(None, "etl-x"): {PRODUCE: 1.0}}


def test_an_alteration_keeps_other_keys_and_removes_what_is_none() -> None:
    data = encode_config({"producer_byte_rate": "1.0", "SCRAM-SHA-256": "salt=..."})
    ops = {PRODUCE: None, FETCH: 2e7, QuotaType.REQUEST: 12.5}
    config = altered_config(data, ops, "/config/clients/etl", "zk")
    assert config == {"SCRAM-SHA-256": "salt=...", "consumer_byte_rate": "20000000",
                      "request_percentage": "12.5"}


def test_an_alteration_overwrites_data_that_is_no_config(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kthrottle.config.zookeeper"):
        assert altered_config(b"\xff", {PRODUCE: 5.0}, "/config/clients/etl", "zk") == {
            "producer_byte_rate": "5"}
    assert "/config/clients/etl holds invalid data" in caplog.text
