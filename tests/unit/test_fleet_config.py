"""The `[fleet]` table: every bad value refused at start, with the setting and the value named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from config.fleet import (
    SECRET_ENV,
    FleetSettings,
    offset_for_worker,
    parse_fleet_table,
)
from config.settings import ProxySettings, SettingsError, load_settings
from proxy.supervisor.workers import LOOPBACK_FLEET_NAME, WORKER_ENV, configure_worker
from quotas.fleet import MAX_FLEET_NAME_BYTES, MIN_SECRET_BYTES

SECRET = "s" * 32
ENV = {SECRET_ENV: SECRET}


def parse(table: dict[str, object], environ: dict[str, str] | None = None,
          config_path: Path | None = None) -> FleetSettings:
    return parse_fleet_table(table, config_path, ENV if environ is None else environ)


def refused(table: object, *needles: str, environ: dict[str, str] | None = None,
            config_path: Path | None = None) -> str:
    with pytest.raises(SettingsError) as caught:
        parse_fleet_table(table, config_path, ENV if environ is None else environ)
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_a_minimal_static_fleet() -> None:
    fleet = parse({"listen": "10.0.0.1:9190", "peers": ["10.0.0.2:9190", "10.0.0.3:9190"]})
    assert fleet.listen == ("10.0.0.1", 9190)
    assert fleet.advertised == ("10.0.0.1", 9190)
    assert fleet.secret == SECRET.encode()
    assert fleet.name is None  # the cluster id, read at start
    assert fleet.membership == "static"
    assert fleet.peers == [("10.0.0.2", 9190), ("10.0.0.3", 9190)]
    assert (fleet.sync_interval_ms, fleet.full_sync_interval_ms) == (100, 1000)
    assert fleet.stale_after_ms == 3000


def test_every_setting() -> None:
    fleet = parse({"listen": "0.0.0.0:9190", "advertise": "proxy-a.example:9191", "name": "orders",
                   "membership": "zookeeper", "zookeeper": "zk1:2181", "zookeeper_chroot": "/kafka",
                   "sync_interval_ms": 50, "full_sync_interval_ms": 500})
    assert fleet.advertised == ("proxy-a.example", 9191)
    assert fleet.name == "orders"
    assert (fleet.zookeeper, fleet.zookeeper_chroot) == ("zk1:2181", "/kafka")
    assert fleet.stale_after_ms == 1500


def test_the_secret_file_is_read_relative_to_the_config_and_stripped(tmp_path: Path) -> None:
    (tmp_path / "fleet.secret").write_bytes(b"  " + b"k" * 20 + b"\n")
    fleet = parse({"listen": "127.0.0.1:9190", "secret_file": "fleet.secret"}, environ={},
                  config_path=tmp_path / "kthrottle.toml")
    assert fleet.secret == b"k" * 20


def test_no_secret_names_both_sources() -> None:
    refused({"listen": "127.0.0.1:9190"}, "fleet.secret_file", SECRET_ENV, environ={})


def test_a_short_secret_is_refused_with_its_length(tmp_path: Path) -> None:
    refused({"listen": "127.0.0.1:9190"}, f"${SECRET_ENV}", "15 bytes", str(MIN_SECRET_BYTES),
            environ={SECRET_ENV: "x" * 15})
    (tmp_path / "short").write_text("abc\n")
    refused({"listen": "127.0.0.1:9190", "secret_file": str(tmp_path / "short")}, "fleet.secret_file",
            "3 bytes", environ={})


def test_an_unreadable_secret_file_and_two_secrets_are_refused(tmp_path: Path) -> None:
    refused({"listen": "127.0.0.1:9190", "secret_file": str(tmp_path / "missing")}, "fleet.secret_file",
            "missing", environ={})
    (tmp_path / "s").write_text(SECRET)
    refused({"listen": "127.0.0.1:9190", "secret_file": str(tmp_path / "s")}, "fleet.secret_file",
            SECRET_ENV, "both")


@pytest.mark.parametrize(("table", "needles"), [
    ({}, ("fleet.listen is required",)),
    ({"listen": "nowhere"}, ("fleet.listen", "'nowhere'")),
    ({"listen": "127.0.0.1:70000"}, ("fleet.listen", "70000")),
    ({"listen": "127.0.0.1:0"}, ("fleet.listen", "fixed port")),
    ({"listen": 9190}, ("fleet.listen", "9190")),
    ({"listen": "127.0.0.1:9190", "advertise": "0.0.0.0:9190"}, ("fleet.advertise", "0.0.0.0:9190")),
    ({"listen": "127.0.0.1:9190", "membership": "gossip"}, ("fleet.membership", "'gossip'")),
    ({"listen": "127.0.0.1:9190", "peers": "a:1"}, ("fleet.peers", "'a:1'")),
    ({"listen": "127.0.0.1:9190", "peers": ["a"]}, ("fleet.peers entry", "'a'")),
    ({"listen": "127.0.0.1:9190", "peers": ["0.0.0.0:9190"]}, ("fleet.peers entry", "'0.0.0.0:9190'")),
    ({"listen": "127.0.0.1:9190", "sync_interval_ms": 0}, ("fleet.sync_interval_ms", "0")),
    ({"listen": "127.0.0.1:9190", "sync_interval_ms": True}, ("fleet.sync_interval_ms", "True")),
    ({"listen": "127.0.0.1:9190", "sync_interval_ms": 5}, ("fleet.sync_interval_ms = 5", "10 ms")),
    ({"listen": "127.0.0.1:9190", "sync_interval_ms": 200, "full_sync_interval_ms": 100},
     ("fleet.full_sync_interval_ms = 100", "200")),
    ({"listen": "127.0.0.1:9190", "full_sync_interval_ms": 60_000},
     ("fleet.full_sync_interval_ms = 60000", "10000")),
    ({"listen": "127.0.0.1:9190", "name": ""}, ("fleet.name", "''")),
    ({"listen": "127.0.0.1:9190", "name": "n" * (MAX_FLEET_NAME_BYTES + 1)},
     ("fleet.name", f"{MAX_FLEET_NAME_BYTES + 1} bytes")),
    ({"listen": "127.0.0.1:9190", "zookeeper": "zk:2181"}, ("fleet.zookeeper", '"static"')),
    ({"listen": "127.0.0.1:9190", "membership": "zookeeper", "peers": ["a:1"]},
     ("fleet.peers", "ZooKeeper")),
    ({"listen": "127.0.0.1:9190", "zookeeper_chroot": "kafka/"}, ("fleet.zookeeper_chroot", "'kafka/'")),
    ({"listen": "127.0.0.1:9190", "secret": "inline"}, ("unknown setting fleet.secret",)),
    (["listen"], ("must be a table",)),
])
def test_bad_values_are_refused_naming_the_setting_and_value(table: object, needles: tuple[str, ...]) -> None:
    refused(table, *needles)


def test_zookeeper_membership_takes_the_proxy_ensemble_and_needs_one() -> None:
    fleet = parse({"listen": "127.0.0.1:9190", "membership": "zookeeper"})
    settings = ProxySettings(zookeeper="zk1:2181", zookeeper_chroot="/kafka", fleet=fleet)
    settings.check()
    assert (fleet.zookeeper, fleet.zookeeper_chroot) == ("zk1:2181", "/kafka")
    lonely = ProxySettings(fleet=parse({"listen": "127.0.0.1:9190", "membership": "zookeeper"}))
    with pytest.raises(SettingsError, match=r"proxy\.zookeeper"):
        lonely.check()


def test_zookeeper_membership_needs_an_address_peers_can_reach() -> None:
    settings = ProxySettings(fleet=parse({"listen": "0.0.0.0:9190", "membership": "zookeeper",
                                          "zookeeper": "zk1:2181"}))
    with pytest.raises(SettingsError, match=r"fleet.advertise .*'0.0.0.0:9190'"):
        settings.check()


def test_the_fleet_table_in_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    path = tmp_path / "kthrottle.toml"
    path.write_text('[proxy]\nlisten = "127.0.0.1:9192"\n\n[fleet]\nlisten = "127.0.0.1:9190"\n'
                    'peers = ["127.0.0.2:9190"]\n')
    settings = load_settings(path)
    assert settings.fleet is not None and settings.fleet.peers == [("127.0.0.2", 9190)]
    path.write_text('[fleet]\nlisten = "127.0.0.1:9190"\nsync_interval_ms = -1\n')
    with pytest.raises(SettingsError, match=r"fleet\.sync_interval_ms = -1"):
        load_settings(path)
    path.write_text('[proxy]\nlisten = "127.0.0.1:9192"\n')
    assert load_settings(path).fleet is None


def test_worker_ports_move_up_by_the_index() -> None:
    fleet = parse({"listen": "0.0.0.0:9190", "advertise": "a.example:9290", "name": "n"})
    assert offset_for_worker(fleet, 0) is fleet
    second = offset_for_worker(fleet, 2)
    assert (second.listen, second.advertised) == (("0.0.0.0", 9192), ("a.example", 9292))
    assert (second.secret, second.name) == (fleet.secret, "n")
    with pytest.raises(SettingsError, match="worker 5 would use UDP port 65540"):
        offset_for_worker(parse({"listen": "127.0.0.1:65535"}), 5)


def test_a_worker_shares_the_listeners_and_joins_the_loopback_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    udp = [["127.0.0.1", 40001], ["127.0.0.1", 40002]]
    monkeypatch.setenv(WORKER_ENV, json.dumps({"index": 1, "udp": udp, "fd": 7}))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    settings = ProxySettings(metrics_port=9300)
    assert configure_worker(settings) == 1
    assert settings.reuse_port and settings.metrics_port == 9301
    fleet = settings.fleet
    assert fleet is not None
    assert (fleet.listen, fleet.inherited_fd, fleet.name) == (("127.0.0.1", 40002), 7, LOOPBACK_FLEET_NAME)
    assert fleet.peers == [("127.0.0.1", 40001), ("127.0.0.1", 40002)]
    assert fleet.secret == SECRET.encode()
    # Nothing this worker starts inherits the worker's instructions or the secret.
    assert WORKER_ENV not in os.environ and SECRET_ENV not in os.environ
    assert configure_worker(ProxySettings()) is None  # outside a worker


def test_a_worker_joins_a_configured_static_fleet_beside_its_siblings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = parse({"listen": "10.0.0.1:9190", "peers": ["10.0.0.2:9190"]})
    udp = [["10.0.0.1", 9190], ["10.0.0.1", 9191]]
    monkeypatch.setenv(WORKER_ENV, json.dumps({"index": 1, "udp": udp}))
    settings = ProxySettings(fleet=fleet)
    configure_worker(settings)
    assert settings.fleet is not None
    assert settings.fleet.listen == ("10.0.0.1", 9191)
    assert settings.fleet.peers == [("10.0.0.1", 9190), ("10.0.0.1", 9191), ("10.0.0.2", 9190)]
    assert settings.fleet.inherited_fd is None
