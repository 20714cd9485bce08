"""Kafka's ZooKeeper layout for quotas (config/zookeeper_layout.py), without a ZooKeeper: the paths
and the change notification Kafka 3.x's ``AdminZkClient`` wrote (tests/integration/test_zookeeper.py
checks the same against a real server)."""

from __future__ import annotations

import pytest

from config.zookeeper_layout import (
    change_notification,
    changes_path,
    client_of_user,
    config_root,
    is_change_notification,
    normalize_chroot,
)


@pytest.mark.parametrize(("chroot", "prefix"), [
    ("", ""), ("/", ""), ("kafka/", "/kafka"), (" /kafka ", "/kafka"), ("/a/b", "/a/b"),
])
def test_a_chroot_becomes_a_prefix_to_join_paths_to(chroot: str, prefix: str) -> None:
    assert normalize_chroot(chroot) == prefix
    assert config_root(normalize_chroot(chroot)) == f"{prefix}/config"


@pytest.mark.parametrize("chroot", ["/a//b", "/a/../b", "./kafka"])
def test_a_chroot_that_is_no_path_is_refused_by_name(chroot: str) -> None:
    with pytest.raises(ValueError, match="ZooKeeper chroot"):
        normalize_chroot(chroot)


def test_a_change_notification_is_kafkas_compact_json_under_config_changes() -> None:
    data = change_notification("users/CN%3Dalice/clients/<default>")
    assert data == b'{"version":2,"entity_path":"users/CN%3Dalice/clients/<default>"}'
    assert changes_path("/kafka/config") == "/kafka/config/changes"
    assert is_change_notification("config_change_0000000007")
    assert not is_change_notification("other")


def test_only_a_user_and_client_entity_has_parents_that_may_go_with_it() -> None:
    assert client_of_user("users/alice/clients/app") == "app"
    assert client_of_user("users/alice") is None
    assert client_of_user("clients/app") is None
    assert client_of_user("ips/10.0.0.1") is None
