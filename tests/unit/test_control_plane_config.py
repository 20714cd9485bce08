"""`[proxy] quota_store` and the `[control_plane]` table: every bad value refused at start, named."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.cluster_login import ClusterLogin, client_configs, parse_login
from config.control_plane import DEFAULT_TOPIC, SASL_PASSWORD_ENV, parse_control_plane_table
from config.fleet import SECRET_ENV
from config.settings import SettingsError, load_settings

FLEET = '[fleet]\nlisten = "127.0.0.1:9190"\n'


def settings_from(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv(SECRET_ENV, "s" * 32)
    path = tmp_path / "kthrottle.toml"
    path.write_text(text)
    return load_settings(path)


def test_the_store_defaults_to_the_file_or_zookeeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_from(tmp_path, "[proxy]\n", monkeypatch).quota_store == "file"  # type: ignore[attr-defined]
    with_zk = settings_from(tmp_path, '[proxy]\nzookeeper = "zk:2181"\n', monkeypatch)
    assert with_zk.quota_store == "zookeeper"  # type: ignore[attr-defined]


def test_the_kafka_store_with_a_fleet_and_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_from(tmp_path, '[proxy]\nquota_store = "kafka"\n' + FLEET
                             + '[control_plane]\nquota_topic = "q.t"\n', monkeypatch)
    assert settings.quota_store == "kafka"  # type: ignore[attr-defined]
    assert settings.control_plane.quota_topic == "q.t"  # type: ignore[attr-defined]
    plain = settings_from(tmp_path, '[proxy]\nquota_store = "kafka"\n' + FLEET, monkeypatch)
    assert plain.control_plane.quota_topic == DEFAULT_TOPIC  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "needle"), [
    ('[proxy]\nquota_store = "etcd"\n',
     "proxy.quota_store = 'etcd' must be \"file\", \"zookeeper\", \"kafka\""),
    ('[proxy]\nquota_store = "kafka"\n', "signs its records with the fleet secret"),
    ('[proxy]\nquota_store = "zookeeper"\n', "needs proxy.zookeeper"),
    ('[proxy]\nquota_store = "kafka"\nzookeeper = "zk:2181"\n' + FLEET, "quotas live in one place"),
    ('[proxy]\nquota_store = "kafka"\n' + FLEET + '[control_plane]\nquota_topic = "a/b"\n',
     "control_plane.quota_topic = 'a/b' is not a Kafka topic name"),
    ('[proxy]\nquota_store = "kafka"\n' + FLEET + '[control_plane]\npartitions = 3\n',
     "unknown setting control_plane.partitions"),
])
def test_bad_settings_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                needle: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_from(tmp_path, text, monkeypatch)
    assert needle in str(caught.value), str(caught.value)


def test_the_login_keys() -> None:
    table = {"sasl_mechanism": "SCRAM-SHA-512", "sasl_username": " kt ", "sasl_password": "pw"}
    assert parse_control_plane_table(table, {}).login == ClusterLogin("SCRAM-SHA-512", "kt", "pw")
    from_env = parse_control_plane_table({"sasl_mechanism": "PLAIN", "sasl_username": "kt"},
                                       {SASL_PASSWORD_ENV: "secret"})
    assert from_env.login.password == "secret"


@pytest.mark.parametrize(("values", "needle"), [
    ({"sasl_mechanism": "GSSAPI"}, "t.sasl_mechanism = 'GSSAPI' must be one of"),
    ({"sasl_mechanism": "PLAIN"}, "needs t.sasl_username"),
    ({"sasl_mechanism": "PLAIN", "sasl_username": "u"}, "needs t.sasl_password or $ENV"),
    ({"sasl_username": "u"}, "t.sasl_mechanism is not"),
    ({"sasl_mechanism": "PLAIN", "sasl_username": ""}, "t.sasl_username = '' must be a non-empty string"),
])
def test_bad_logins_are_named(values: dict[str, object], needle: str) -> None:
    with pytest.raises(SettingsError) as caught:
        parse_login("t", values, "ENV", {})
    assert needle in str(caught.value), str(caught.value)


def test_client_configs_follow_tls_and_login() -> None:
    plain = client_configs([("::1", 9092), ("kafka", 9093)], None, ClusterLogin(), "kt")
    assert plain["bootstrap_servers"] == ["[::1]:9092", "kafka:9093"]
    assert plain["security_protocol"] == "PLAINTEXT" and "sasl_mechanism" not in plain
    sasl = client_configs([("kafka", 9093)], None, ClusterLogin("PLAIN", "u", "p"), "kt",
                          request_timeout_ms=5)
    assert (sasl["security_protocol"], sasl["sasl_plain_username"], sasl["request_timeout_ms"]) == (
        "SASL_PLAINTEXT", "u", 5)
